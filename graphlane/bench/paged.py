"""The paged program's figures: what a decode step costs on the wire, and how fast
pipelined paged decode runs through a real daemon on the timed sim.

- **request bytes per step** at three context lengths: the encoded request of a
  ``paged_attention`` decode step of batch :data:`BATCH` (every frame, as the client
  sends it; the block table as wide as the longest context needs, as a config
  serving it would have) next to an ``attention`` step that carries the same context as
  key/value. The paged step carries one token per sequence, so it does not grow
  with the context; the attention step grows linearly.
- **pipelined paged decode**: ``graphlane serve`` in a child process with the timed
  sim and a :data:`LAYERS`-layer ``paged_attention`` program; :data:`WINDOW` decode
  steps in flight, each with its new tokens, slot mapping and block table and KV
  lengths that change every step (every layer is patched), against a daemon with
  ``pipeline = false`` (serial) measured in alternation. Each captured layer
  replays :data:`TASKS_PER_LAYER` tasks (the key and value cache writes and FIA),
  each charged ``task_us``, so the limit is
  1 / (layers x max(patch_us, TASKS_PER_LAYER x task_us)); the profile is chosen
  balanced against that (1500 us of patch, 3 x 500 us of replay per layer).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import torch

from graphlane.client import Client
from graphlane.protocol import ops
from graphlane.protocol.wire import encode_request

from .daemon import BenchDaemon

LAYERS = 4
BATCH = 4
WINDOW = 8
TASKS_PER_LAYER = 3
PATCH_US, TASK_US = 1500.0, 500.0
CONTEXTS = (128, 1024, 4096)
SHAPE = {"num_heads": 8, "num_kv_heads": 2, "head_dim": 64}
PROGRAM = {"name": "paged_attention", "layers": LAYERS, "num_heads": 4, "num_kv_heads": 2,
           "head_dim": 16, "block_size": 128, "num_blocks": 2 * BATCH,
           "max_blocks_per_seq": 2, "buckets": [BATCH]}  # fmt: skip


def _frames_bytes(op: str, body: Any) -> int:
    return sum(len(memoryview(f)) for f in encode_request(1, op, body))


def request_bytes(contexts: tuple[int, ...] = CONTEXTS) -> list[dict[str, Any]]:
    """Encoded bytes of one decode step of BATCH sequences at each context length:
    paged (block size 128, the new token only) against attention (the whole KV)."""
    h, kvh, d = SHAPE["num_heads"], SHAPE["num_kv_heads"], SHAPE["head_dim"]
    out = []
    blocks = -(-max(contexts) // 128)  # max_blocks_per_seq: the config's, whatever the length
    for ctx in contexts:
        paged = ops.Step("paged_attention", 0, {"actual_seq_lengths_kv": [ctx] * BATCH}, {
            "query": torch.zeros(BATCH, h, d, dtype=torch.float16),
            "key": torch.zeros(LAYERS, BATCH, kvh, d, dtype=torch.float16),
            "value": torch.zeros(LAYERS, BATCH, kvh, d, dtype=torch.float16),
            "slot_mapping": torch.zeros(BATCH, dtype=torch.int64),
            "block_table": torch.zeros(BATCH, blocks, dtype=torch.int32),
        }, ["out"], BATCH, 30000, 0)  # fmt: skip
        kv = torch.zeros(LAYERS, BATCH, kvh, ctx, d, dtype=torch.float16)
        dense = ops.Step("attention", 0, {"actual_seq_lengths_kv": [ctx] * BATCH}, {
            "query": torch.zeros(BATCH, h, 1, d, dtype=torch.float16), "key": kv, "value": kv,
        }, ["out"], BATCH, 30000)  # fmt: skip
        out.append({"context": ctx, "paged_bytes": _frames_bytes("step", paged),
                    "attention_bytes": _frames_bytes("step", dense)})  # fmt: skip
    return out


def _step_inputs(i: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Step i: BATCH sequences, sequence r in blocks 2r and 2r+1, its length cycling
    through 1..256 (a new length every step: every layer is patched)."""
    c = PROGRAM
    bs = int(c["block_size"])  # type: ignore[call-overload]
    lengths = [1 + (i + 37 * r) % (2 * bs) for r in range(BATCH)]
    table = torch.tensor([[2 * r, 2 * r + 1] for r in range(BATCH)], dtype=torch.int32)
    slots = torch.tensor([table[r, (n - 1) // bs] * bs + (n - 1) % bs
                          for r, n in enumerate(lengths)], dtype=torch.int64)  # fmt: skip
    kv = (LAYERS, BATCH, int(c["num_kv_heads"]), int(c["head_dim"]))  # type: ignore[call-overload]
    inputs = {
        "query": torch.randn(BATCH, int(c["num_heads"]), int(c["head_dim"])).half(),  # type: ignore[call-overload]
        "key": torch.randn(kv).half(),
        "value": torch.randn(kv).half(),
        "slot_mapping": slots,
        "block_table": table,
    }
    return {"actual_seq_lengths_kv": lengths}, inputs


_POOL = 64  # distinct steps, made before measuring


async def _rate(c: Client, steps: list[Any], n: int) -> float:
    left = n

    async def caller() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            params, inputs = steps[left % len(steps)]
            await c.step("paged_attention", 0, params, inputs, ["out"])

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(WINDOW)))
    return n / (time.perf_counter() - t0)


async def _measure(pipelined: str, serial: str, n: int, reps: int) -> dict[str, float]:
    steps = [_step_inputs(i) for i in range(_POOL)]
    async with Client(pipelined, timeout=120) as p, Client(serial, timeout=120) as s:
        await _rate(s, steps, 2 * WINDOW)  # warm up
        await _rate(p, steps, 2 * WINDOW)
        rates: dict[str, list[float]] = {"pipelined": [], "serial": []}
        for _ in range(reps):
            rates["pipelined"].append(await _rate(p, steps, n))
            rates["serial"].append(await _rate(s, steps, n))
    return {k: statistics.median(v) for k, v in rates.items()}


def pipeline(steps: int = 60, reps: int = 3) -> dict[str, Any]:
    """Pipelined and serial paged decode steps/s on the timed sim, and the limit."""
    sim = {"mode": "timed", "patch_us": PATCH_US, "task_us": TASK_US}
    daemons = [BenchDaemon(PROGRAM, sim=sim)]
    try:
        daemons.append(BenchDaemon(PROGRAM, sim=sim, settings={"pipeline": False}))
        f = asyncio.run(_measure(daemons[0].endpoint, daemons[1].endpoint, steps, reps))
    finally:
        for d in daemons:
            d.close()
    limit = 1e6 / (LAYERS * max(PATCH_US, TASKS_PER_LAYER * TASK_US))
    return {
        "patch_us": PATCH_US,
        "task_us": TASK_US,
        "tasks_per_layer": TASKS_PER_LAYER,
        "layers": LAYERS,
        "batch": BATCH,
        "window": WINDOW,
        "limit_steps_s": round(limit, 1),
        "serial_steps_s": round(f["serial"], 1),
        "pipelined_steps_s": round(f["pipelined"], 1),
        "pipelined_vs_limit": round(f["pipelined"] / limit, 3),
        "pipelined_vs_serial": round(f["pipelined"] / f["serial"], 3) if f["serial"] else 0.0,
    }


def format_paged(r: dict[str, Any]) -> list[str]:
    lines = [
        f"request bytes per decode step (batch {BATCH}, {LAYERS} layers, 8 heads / 2 KV "
        "heads x 64, float16; attention carrying the same KV beside it):"
    ]
    for row in r["request_bytes"]:
        lines.append(f"  context {row['context']:>5}: paged {row['paged_bytes']:>7} B   "
                     f"attention {row['attention_bytes']:>10} B")  # fmt: skip
    p = r["pipeline"]
    lines += [
        f"paged decode through a daemon (timed sim, {p['layers']} layers, patch "
        f"{p['patch_us']:g} us, {p['tasks_per_layer']} x {p['task_us']:g} us of replay per "
        f"layer, {p['window']} steps in flight):",
        f"  limit {p['limit_steps_s']:.1f} steps/s, serial {p['serial_steps_s']:.1f}, "
        f"pipelined {p['pipelined_steps_s']:.1f} ({p['pipelined_vs_limit']:.2f} of the limit, "
        f"{p['pipelined_vs_serial']:.2f}x serial)",
    ]
    return lines
