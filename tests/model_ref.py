"""Tiny Llama-family models for the ``model`` program's tests, with transformers as the
reference (no hub: configs built here, weights seeded, saved with save_pretrained), and
a continuous-batching scheduler that drives any ``step``/``prefill`` pair.

The weights are drawn wider than transformers' initialisation (std 0.02 makes a tiny
model's logits nearly flat, so greedy decoding would hinge on rounding-level ties; at
std 0.3 the top two logits are usually well apart, and the tests compare tokens)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip


def tiny_model(kind: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A transformers model: ``llama`` (GQA, llama3 rope scaling, untied), ``qwen2``
    (q/k/v bias, tied embeddings) or ``mistral`` (no sliding window), seeded."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**TINY, sliding_window=None))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.to(dtype).eval()


def save(model: Any, directory: Path) -> str:
    model.save_pretrained(directory)
    return str(directory)


def reference(model: Any, prompt: list[int], new: int) -> list[int]:
    """transformers' eager greedy ``generate``: the ``new`` tokens after ``prompt``."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return out[0, len(prompt) :].tolist()


@dataclass
class Sequence:
    sid: int
    prompt: list[int]
    joins: int  # the step at which it is prefilled
    blocks: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.out)


Prefill = Callable[[list[int], list[int]], int]  # (tokens, block table) -> first token
Step = Callable[[list[int], list[int], list[list[int]]], list[int]]


def run_batching(
    seqs: list[Sequence], new: int, block_size: int, num_blocks: int, max_blocks: int,
    prefill: Prefill, step: Step, shuffle_seed: int = 0,
) -> dict[int, list[int]]:  # fmt: skip
    """Continuous batching: each sequence is prefilled at its ``joins`` step, decodes
    until it has ``new`` tokens and leaves, its blocks freed for the next; the rows of
    every step are shuffled (a row's place must not matter). Returns tokens by sid."""
    free = list(range(num_blocks))
    rng = random.Random(shuffle_seed)
    active: list[Sequence] = []
    waiting = sorted(seqs, key=lambda s: s.joins)
    t = 0
    while waiting or active:
        while waiting and waiting[0].joins <= t:
            s = waiting.pop(0)
            need = -(-(len(s.prompt) + new) // block_size)
            s.blocks = [free.pop(rng.randrange(len(free))) for _ in range(need)]
            s.out.append(prefill(s.prompt, _table(s, max_blocks)))
            active.append(s)
        rows = [s for s in active if len(s.out) < new]
        rng.shuffle(rows)
        if rows:
            tokens = step(
                [s.out[-1] for s in rows], [s.length for s in rows],
                [_table(s, max_blocks) for s in rows],
            )  # fmt: skip
            for s, tok in zip(rows, tokens, strict=True):
                s.out.append(tok)
        for s in [s for s in active if len(s.out) >= new]:
            active.remove(s)
            free += s.blocks
        t += 1
    return {s.sid: s.out for s in seqs}


def _table(s: Sequence, max_blocks: int) -> list[int]:
    return s.blocks + [0] * (max_blocks - len(s.blocks))


async def run_ahead(
    client: Any, program: str, seqs: list[Sequence], new: int, block_size: int,
    num_blocks: int, max_blocks: int, window: int = 3, shuffle_seed: int = 0, device: int = 0,
    first_block: int = 0,
) -> dict[int, list[int]]:  # fmt: skip
    """Continuous batching as :func:`run_batching` (the same joins, leaves and row
    shuffles), decoding ahead: every row is fed the token its sequence sampled in its
    previous step (token -1, ``sequence_id`` the sid), prefills and steps are sent without
    waiting for a reply, up to ``window`` requests in flight; its blocks are
    ``first_block`` onwards. Returns tokens by sid."""
    free = list(range(first_block, first_block + num_blocks))
    rng = random.Random(shuffle_seed)
    inflight: list[asyncio.Task[Any]] = []
    replies: list[tuple[asyncio.Task[Any], list[Sequence]]] = []
    issued = {s.sid: 0 for s in seqs}  # tokens asked for so far
    active: list[Sequence] = []
    waiting = sorted(seqs, key=lambda s: s.joins)

    async def send(coro: Any, rows: list[Sequence]) -> None:
        while len(inflight) >= window:
            await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
            inflight[:] = [t for t in inflight if not t.done()]
        task = asyncio.create_task(coro)  # tasks start in order: requests go in order
        await asyncio.sleep(0)  # let it send
        inflight.append(task)
        replies.append((task, rows))

    t = 0
    while waiting or active:
        while waiting and waiting[0].joins <= t:
            s = waiting.pop(0)
            need = -(-(len(s.prompt) + new) // block_size)
            s.blocks = [free.pop(rng.randrange(len(free))) for _ in range(need)]
            params = {"sequence_id": s.sid}
            await send(client.prefill(program, device, s.prompt, _table(s, max_blocks),
                                      params=params), [s])  # fmt: skip
            issued[s.sid] = 1
            active.append(s)
        rows = [s for s in active if issued[s.sid] < new]
        rng.shuffle(rows)
        if rows:
            lengths = [len(s.prompt) + issued[s.sid] for s in rows]
            params = {"actual_seq_lengths_kv": lengths, "sequence_id": [s.sid for s in rows]}
            inputs = {
                "tokens": torch.full((len(rows),), -1),
                "block_table": torch.tensor([_table(s, max_blocks) for s in rows],
                                            dtype=torch.int32),
            }  # fmt: skip
            await send(client.step(program, device, params, inputs, outputs=["tokens"]), rows)
            for s in rows:
                issued[s.sid] += 1
        for s in [s for s in active if issued[s.sid] >= new]:
            active.remove(s)
            free += s.blocks  # its last step runs before any later prefill writes them
        t += 1
    done = await asyncio.gather(*(task for task, _ in replies), return_exceptions=True)
    for r in done:
        if isinstance(r, BaseException):  # the first failure, in the order sent
            raise r
    for r, (_, rows) in zip(done, replies, strict=True):
        tokens = r.outputs["tokens"].tolist()
        for s, tok in zip(rows, tokens, strict=True):
            s.out.append(tok)
    return {s.sid: s.out for s in seqs}
