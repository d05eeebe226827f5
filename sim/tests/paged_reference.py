"""A small paged-KV decoder and its reference, for the field call-sequence tests.

The decoder is what a serving stack captures for decode: per layer, project the hidden
state to q/k/v, write the new token's k/v into a paged cache at its slot, attend over the
cache through a block table (fused infer attention), project back. ``RefDecoder`` computes
the same thing in float64 with plain loops and index arithmetic (no code of the sim's
kernel): the cache is a flat array of slots, a sequence's position p lives in slot
``table[b, p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

B, N, NKV, D = 3, 4, 2, 16  # batch, query heads, kv heads (GQA), head dim
H, HKV = N * D, NKV * D
BS, NB, MAXB = 16, 16, 4  # block size, blocks in the cache, blocks per sequence
LAYERS = 2
SCALE = 1 / math.sqrt(D)


@dataclass
class Weights:
    wq: list[torch.Tensor]
    wk: list[torch.Tensor]
    wv: list[torch.Tensor]
    wo: list[torch.Tensor]
    kc: list[torch.Tensor]  # initial caches, (NB, BS, HKV)
    vc: list[torch.Tensor]


def make_weights(seed: int) -> Weights:
    g = torch.Generator().manual_seed(seed)

    def w(i: int, o: int) -> list[torch.Tensor]:
        return [(torch.randn(i, o, generator=g) / math.sqrt(i)).half() for _ in range(LAYERS)]

    def cache() -> list[torch.Tensor]:
        return [torch.randn(NB, BS, HKV, generator=g).half() for _ in range(LAYERS)]

    return Weights(w(H, H), w(H, HKV), w(H, HKV), w(H, H), cache(), cache())


@dataclass
class StepInput:
    x: torch.Tensor  # [B, H] float16, the new tokens' hidden states
    table: torch.Tensor  # [B, MAXB] int32
    lens: list[int]  # kv lengths including the new token
    slots: torch.Tensor  # [B] int64, the new token's slot

    @staticmethod
    def make(seed: int, table: torch.Tensor | None = None, lens: list[int] | None = None):
        g = torch.Generator().manual_seed(seed)
        if table is None:
            table = torch.randperm(NB, generator=g)[: B * MAXB].reshape(B, MAXB).int()
        if lens is None:
            lens = torch.randint(1, MAXB * BS + 1, (B,), generator=g).tolist()
        slots = [int(table[b, (n - 1) // BS]) * BS + (n - 1) % BS for b, n in enumerate(lens)]
        x = torch.randn(B, H, generator=g).half()
        return StepInput(x, table, lens, torch.tensor(slots, dtype=torch.int64))


class RefDecoder:
    def __init__(self, w: Weights) -> None:
        self.w = w
        self.k = [c.double().reshape(NB * BS, NKV, D).clone() for c in w.kc]
        self.v = [c.double().reshape(NB * BS, NKV, D).clone() for c in w.vc]

    def forward(self, inp: StepInput) -> torch.Tensor:
        x = inp.x.double()
        for layer in range(LAYERS):
            q = (x @ self.w.wq[layer].double()).reshape(B, N, D)
            k = (x @ self.w.wk[layer].double()).reshape(B, NKV, D)
            v = (x @ self.w.wv[layer].double()).reshape(B, NKV, D)
            for b in range(B):
                self.k[layer][int(inp.slots[b])] = k[b]
                self.v[layer][int(inp.slots[b])] = v[b]
            out = torch.zeros(B, N, D, dtype=torch.float64)
            for b in range(B):
                slots = [int(inp.table[b, p // BS]) * BS + p % BS for p in range(inp.lens[b])]
                for h in range(N):
                    kvh = h // (N // NKV)
                    scores = torch.stack([q[b, h] @ self.k[layer][s, kvh] for s in slots])
                    p = torch.softmax(scores * SCALE, dim=0)
                    for weight, s in zip(p, slots, strict=True):
                        out[b, h] += weight * self.v[layer][s, kvh]
            x = out.reshape(B, H) @ self.w.wo[layer].double()
        return x


def assert_close(got: torch.Tensor, want: torch.Tensor, what: object) -> None:
    """Within what float16 storage of the activations and caches accounts for."""
    torch.testing.assert_close(
        got.double(), want, atol=2e-2, rtol=2e-2, msg=lambda m: f"{what}: {m}"
    )


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: list[bool],
           scale: float) -> tuple[torch.Tensor, float]:  # fmt: skip
    """One query row [D] over keys [S, D] / values [S, Dv]: (output, log-sum-exp of the
    scaled scores of the allowed keys); zeros and +inf when no key is allowed."""
    out = torch.zeros(values.shape[-1], dtype=torch.float64)
    idx = [j for j, ok in enumerate(allowed) if ok]
    if not idx:
        return out, math.inf
    scores = torch.stack([q.double() @ keys[j].double() for j in idx]) * scale
    for w, j in zip(torch.softmax(scores, dim=0), idx, strict=True):
        out += w * values[j].double()
    return out, float(torch.logsumexp(scores, dim=0))


def gather_positions(cache: torch.Tensor, table: torch.Tensor, b: int, n: int,
                     block_size: int) -> torch.Tensor:  # fmt: skip
    """Positions 0..n-1 of sequence b from a (blocks, block_size, ...) cache, read block by
    block through the block table."""
    rows = [cache[int(table[b, p // block_size]), p % block_size] for p in range(n)]
    return torch.stack(rows) if rows else cache.new_zeros(0, *cache.shape[2:])
