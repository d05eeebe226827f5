"""The demo's model part: a continuous-batching generation loop over a tiny Llama served
by the ``model`` program, decoding ahead, a share of its sequences checked against
transformers' eager ``generate``.

Per device, a scheduler as a serving engine runs one (docs/models.md; the loop is the load
test's, :mod:`graphlane.client.scheduler`): sequences arrive
with prompts of different lengths, each gets the cache blocks it needs and joins the
batch with a ``prefill`` that names its ``sequence_id``; every decode step has one row
per live sequence, each row's token ``-1`` ("the token this sequence sampled in its
previous step", fed on the device), so the scheduler sends step N+1 before step N's
reply is back, keeping ``window`` requests in flight; a sequence that has all its tokens
leaves and its blocks go to the next. The weights are the program's seeded random ones
(:func:`graphlane.hf_model.random_weights`), loaded into transformers
for the check: greedy tokens must be the same, token for token (float32).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from typing import Any

from graphlane.client import Client
from graphlane.client.scheduler import GenerationLoop, ModelShape, Request
from graphlane.loadtest import generation

#: The tiny Llama (the keys of a config.json) and how the demo's daemon serves it.
ARCHITECTURE: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip
SEED, INIT_STD = 0, 0.3  # wider than 0.02: greedy tokens then rarely hinge on a near tie
BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 128, 16, 2
PROGRAM_TOML = f"""\
[[programs]]
name = "model"
random = {{ {", ".join(f"{k} = {v!r}".replace("'", '"') for k, v in ARCHITECTURE.items())} }}
seed = {SEED}
init_std = {INIT_STD}
dtype = "float32"
block_size = {BLOCK_SIZE}
num_blocks = {NUM_BLOCKS}
max_blocks_per_seq = {MAX_BLOCKS}
buckets = [1, 2, 4, 8]
"""


SHAPE = ModelShape(BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS, (1, 2, 4, 8),
                   int(ARCHITECTURE["vocab_size"]), "float32")  # fmt: skip


def _sequences(device: int, count: int) -> list[Request]:
    rng = random.Random(1000 + device)
    vocab = int(ARCHITECTURE["vocab_size"])
    return [
        Request(device * 1000 + i, [rng.randrange(vocab) for _ in range(rng.randint(1, 120))],
                rng.randint(16, 48))
        for i in range(count)
    ]  # fmt: skip


async def generate(client: Client, device: int, seqs: list[Request], window: int = 3) -> int:
    """Run ``seqs`` to completion on ``device``, continuously batched and decoding ahead
    (:class:`graphlane.client.scheduler.GenerationLoop`, the load test's loop); each
    request's tokens land in its ``out``. Returns the number of decode steps; raises
    when a request failed."""
    loop = GenerationLoop(client, "model", device, SHAPE, window=window)
    for s in seqs:
        loop.arrive(s)
    loop.close()
    await loop.run()
    failed = sorted({str(s.failed) for s in seqs if s.failed is not None})
    if failed:
        raise RuntimeError(f"device {device}: requests failed with {', '.join(failed)}")
    return loop.steps


def reference_model(seed: int = SEED) -> Any:
    """The served model (weights of ``seed``) in transformers; None when transformers is
    not installed."""
    described = {"random": ARCHITECTURE, "seed": seed, "init_std": INIT_STD, "dtype": "float32"}
    try:
        return generation.reference_model(described)
    except ValueError:
        return None


async def run_model(
    endpoint: str, devices: int, verify: float, per_device: int = 24, seed: int = SEED
) -> Mapping[str, Any]:
    """The model part of the demo: ``per_device`` sequences on each device at once; a
    ``verify`` share of them checked. Returns its summary (``wrong`` > 0: a wrong token)."""
    work = {d: _sequences(d, per_device) for d in range(devices)}
    async with Client(endpoint, timeout=120) as c:
        t0 = time.perf_counter()
        steps = await asyncio.gather(*(generate(c, d, seqs) for d, seqs in work.items()))
        elapsed = time.perf_counter() - t0
    seqs = [s for ss in work.values() for s in ss]
    tokens = sum(len(s.out) for s in seqs)
    checked = wrong = 0
    model = reference_model(seed) if verify > 0 else None
    if model is not None:
        rng, judge = random.Random(7), generation.Judge(model)  # the load test's check
        for s in seqs:
            if rng.random() < verify or s is seqs[0]:
                checked += 1
                found, at = judge(s.prompt, s.out)
                if found == generation.DIFFER:
                    wrong += 1
                    print(f"  WRONG: sequence {s.rid}, from token {at}: {s.out[at or 0]}")
    return {
        "sequences": len(seqs),
        "steps": sum(steps),
        "tokens": tokens,
        "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "checked": checked,
        "wrong": wrong,
        "reference": model is not None or verify == 0,
    }


def print_model_summary(r: Mapping[str, Any]) -> None:
    print(
        f"  model: {r['sequences']} sequences, {r['tokens']} tokens in {r['steps']} decode "
        f"steps, {r['elapsed_s']:.1f} s: {r['tokens_per_s']:.0f} tokens/s (decoding ahead)"
    )
    if not r["reference"]:
        print("  tokens not checked: transformers is not installed (pip install 'graphlane[test]')")
    else:
        print(
            f"  {r['checked']} sequences checked against transformers' generate: "
            + ("every token right" if not r["wrong"] else f"{r['wrong']} WRONG")
        )


__all__ = ["PROGRAM_TOML", "generate", "print_model_summary", "run_model"]
