"""Sampling on the device: greedy, and temperature / top-k / top-p with a per-row seed,
reproducible, from ops that run on the NPU's AI cores.

Greedy is one ``argmax`` (in the decode graph itself). A row that samples draws with the
Gumbel-max trick: ``argmax(logits / T + g)`` over the tokens top-k and top-p keep, where
``g = -log(-log(u))`` and ``u`` is a counter-based hash of (the row's two 32-bit keys,
token id). The keys are a hash of (row seed, position of the token being sampled) that
the host computes per row (:func:`row_keys`), so a sequence sampled with the same seed
gives the same tokens whichever batch, bucket, row or graph instance it runs in, on
every replay; no generator state lives on the device (a captured generator would replay
the same numbers, or need its offset patched each step).

The device half of the hash is int32 multiplications and xors with the row keys (no
shifts: a right shift is ``aclnnRightShift``, an AI CPU kernel, and int64 arithmetic
doubles the bytes), then the top 24 bits become ``u`` through a float conversion,
clamped strictly inside (0, 1) so that ``g`` is always finite and a token that top-k or
top-p removed (-inf) is never drawn.

Where every sampling row keeps at most :data:`CANDIDATES` tokens (``top_k`` in
1..CANDIDATES: the largest k of torch_npu's ``npu_top_k_top_p``), the draw runs over
``topk(logits, CANDIDATES)`` and no sort of the vocabulary happens
(:func:`sample_candidates`); otherwise over the sorted vocabulary
(:func:`sample_vocabulary`). Both draw the same token for a row (same kept set, same
noise per token id), so which one a batch needs does not change a row's tokens.

The order is vLLM's: temperature, then top-k, then top-p (over what top-k kept). A
``top_k`` of 0 keeps every token, a ``top_p`` of 1 likewise; a ``top_k`` of 1 is
greedy, ties to the lowest token id included.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .base import StepError

M32, M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF
_K1, _K2, _K3 = 0x2C1B3C6D, 0x297A2D39, 0x7FEB352D  # odd int32 multipliers
CANDIDATES = 1024
U_MIN, U_MAX = 2.0**-33, 1.0 - 2.0**-24  # (0, 1): the largest float32 below 1 is U_MAX


def _int32(x: int) -> int:
    x &= M32
    return x - (1 << 32) if x >= 1 << 31 else x


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def row_keys(seed: int, position: int) -> tuple[int, int]:
    """A row's two int32 keys (host): a hash of its seed (any integer) and the position
    of the token it samples."""
    z = _splitmix64(_splitmix64(seed & M64) ^ (position & M64))
    return _int32(z), _int32(z >> 32)


def token_codes(vocab: int) -> torch.Tensor:
    """int32 [vocab]: each token id times an odd constant (mod 2**32), the static first
    round of the per-token hash (computed once, on the host)."""
    ids = torch.arange(vocab, dtype=torch.int64) * _K1
    return ((ids + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)


def uniform(keys: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """float32 [B, N] strictly inside (0, 1): the hash of each row's ``keys`` int32
    [B, 2] and ``codes`` int32 [B, N] (:func:`token_codes` of the tokens)."""
    x = (codes ^ keys[:, :1]) * _K2
    x = (x ^ keys[:, 1:]) * _K3
    u = x.to(torch.float32) * 2.0**-32 + 0.5
    return u.clamp_(U_MIN, U_MAX)


def _draw(
    scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, rank: torch.Tensor,
    noise_u: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The index (into the descending ``scaled`` [B, N]) that the Gumbel-max draw picks
    among what top-k (``rank`` >= k removed; k 0: none) and top-p keep."""
    keep_k = torch.where(top_k > 0, top_k, torch.full_like(top_k, scaled.shape[-1]))
    scaled = scaled.masked_fill(rank[None, :] >= keep_k[:, None], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the better tokens
    scaled = scaled.masked_fill(before > top_p[:, None], float("-inf"))
    return torch.argmax(scaled - torch.log(-torch.log(noise_u)), dim=-1, keepdim=True)


def sample_candidates(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
    top_p: torch.Tensor, keys: torch.Tensor, codes: torch.Tensor, rank: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """int64 [B]: each row's draw among its ``CANDIDATES`` best tokens (every row's
    ``top_k`` in 1..CANDIDATES). ``logits`` float32 [B, V]; ``temperature`` (> 0),
    ``top_p`` float32 [B]; ``top_k`` int32 [B]; ``keys`` int32 [B, 2]; ``codes``
    :func:`token_codes` [V]; ``rank`` int32 0..CANDIDATES-1 (static: no arange in a
    capture)."""
    best, ids = torch.topk(logits, rank.shape[0], dim=-1)  # descending
    scaled = best / temperature[:, None]
    u = uniform(keys, torch.gather(codes.expand(ids.shape[0], -1), 1, ids))
    return torch.gather(ids, 1, _draw(scaled, top_k, top_p, rank, u))[:, 0]


def sample_vocabulary(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
    top_p: torch.Tensor, keys: torch.Tensor, codes: torch.Tensor, rank: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """int64 [B]: each row's draw over the whole vocabulary (any ``top_k``), as
    :func:`sample_candidates` with ``rank`` 0..V-1."""
    scaled, order = torch.sort(logits / temperature[:, None], dim=-1, descending=True,
                               stable=True)  # fmt: skip
    u = uniform(keys, torch.gather(codes.expand(order.shape[0], -1), 1, order))
    return torch.gather(order, 1, _draw(scaled, top_k, top_p, rank, u))[:, 0]


def sample(
    logits: torch.Tensor, greedy: torch.Tensor, temperature: torch.Tensor,
    top_k: torch.Tensor, top_p: torch.Tensor, keys: torch.Tensor, codes: torch.Tensor,
    rank: torch.Tensor, candidates: bool,
) -> torch.Tensor:  # fmt: skip
    """int64 [B]: ``greedy`` (the argmax of ``logits``) where a row is greedy (temperature
    0, or top_k 1), else its draw (``candidates``: :func:`sample_candidates`, which needs
    every sampling row's top_k in 1..CANDIDATES; else :func:`sample_vocabulary`)."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    draw = sample_candidates if candidates else sample_vocabulary
    drawn = draw(logits, t, top_k, top_p, keys, codes, rank)
    return torch.where((temperature > 0) & (top_k != 1), drawn, greedy)


def needs(temperature: Sequence[float], top_k: Sequence[int]) -> str | None:
    """Which draw a batch needs: None (every row greedy), ``"candidates"`` or
    ``"vocabulary"``."""
    sampled = [k for t, k in zip(temperature, top_k, strict=True) if t > 0 and k != 1]
    if not sampled:
        return None
    return "candidates" if all(0 < k <= CANDIDATES for k in sampled) else "vocabulary"


MIN_TEMPERATURE = 0.01
"""A temperature in (0, MIN_TEMPERATURE) samples at MIN_TEMPERATURE (vLLM raises it
likewise): dividing float32 logits by less can overflow them to inf."""

PARAMS = {
    "temperature": f"per row, a finite number >= 0 (0: greedy, the default; below "
    f"{MIN_TEMPERATURE}: {MIN_TEMPERATURE})",
    "top_k": "per row, an integer >= 0 (0: off, the default; vocab_size or more: off)",
    "top_p": "per row, in (0, 1] (1: off, the default)",
    "seed": "per row, an integer: the same seed samples the same tokens",
}


def sampling_values(
    params: Mapping[str, Any], batch: int, where: str, vocab: int, per_row: bool = True
) -> tuple[list[float], list[int], list[float], list[int]]:
    """A request's sampling parameters as lists (temperature, top_k, top_p, seed: lists
    of ``batch`` values, or with ``per_row`` False single values), defaults filled in,
    each in the range the sampler takes: a temperature below
    :data:`MIN_TEMPERATURE` raised to it, a ``top_k`` of ``vocab`` or more made 0 (off).
    A value out of its documented range is a StepError naming it, never a device error."""

    def values(key: str, default: Any) -> Sequence[Any]:
        v = params.get(key, default if per_row else default[0])
        if not per_row:
            v = [v]
        if not isinstance(v, list | tuple) or len(v) != batch:
            raise StepError(f"{where}.{key}", f"must be a list of {batch} values (one per row)")
        return v

    temp = values("temperature", [0.0] * batch)
    top_k = values("top_k", [0] * batch)
    top_p = values("top_p", [1.0] * batch)
    seed = values("seed", [0] * batch)
    temps, ks, ps = [], [], []
    for i in range(batch):
        at = f"[{i}]" if per_row else ""
        t, k, p, s = temp[i], top_k[i], top_p[i], seed[i]
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < math.inf:
            raise StepError(f"{where}.temperature{at}", f"{t!r} is not a finite number >= 0")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise StepError(f"{where}.top_k{at}", f"{k!r} is not an integer >= 0")
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1:
            raise StepError(f"{where}.top_p{at}", f"{p!r} is not a number in (0, 1]")
        if isinstance(s, bool) or not isinstance(s, int):
            raise StepError(f"{where}.seed{at}", f"{s!r} is not an integer")
        temps.append(float(max(t, MIN_TEMPERATURE)) if t > 0 else 0.0)
        ks.append(k if k < vocab else 0)
        ps.append(float(p))
    return temps, ks, ps, list(seed)
