"""Sampling inside the captured graph: greedy, and temperature / top-k / top-p with a
per-row seed, reproducible.

Every row samples with the Gumbel-max trick: ``argmax(logits / T + g)`` over the tokens
that top-k and top-p keep, where ``g = -log(-log(u))`` is noise that a counter-based
hash computes from (row seed, position of the token being sampled, token id). So a
sequence sampled with the same seed gives the same tokens whichever batch, bucket,
row or graph instance it runs in, on every replay, and no random number generator
state lives on the device (a captured RNG would replay the same numbers, or need its
offset patched each step). Rows with temperature 0 take the argmax of the logits
(ties: the lowest token id, as ``torch.argmax`` and transformers' greedy search).

The order is vLLM's: temperature, then top-k, then top-p (over what top-k kept). A
``top_k`` of 0 keeps every token, a ``top_p`` of 1 likewise.

The hash: 32-bit values mixed with xor-shifts and multiplications by constants below
2^31, so every product of the int64 arithmetic stays below 2^63 (no overflow on any
device), then 24 bits become ``u`` in (0, 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .base import StepError

M32 = 0xFFFFFFFF
_K1, _K2 = 0x7FEB352D, 0x446CA68B  # odd multipliers below 2^31


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 tensors holding values in 0..2^32-1."""
    x = x ^ (x >> 16)
    x = (x * _K1) & M32
    x = x ^ (x >> 15)
    x = (x * _K2) & M32
    return x ^ (x >> 16)


def seed32(seed: int) -> int:
    """A row's seed (any int64) folded to the 32 bits the hash takes."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    return (s ^ (s >> 32)) & M32


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: torch.Tensor) -> torch.Tensor:
    """float32 [B, V] Gumbel noise of (seed [B], position [B], token id [V]), all int64."""
    row = mix32(mix32(seeds) ^ positions)
    h = mix32(row[:, None] ^ vocab[None, :])
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)
    return -torch.log(-torch.log(u))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    vocab: torch.Tensor,
) -> torch.Tensor:
    """int64 [B]: one token per row of float32 ``logits`` [B, V]; ``temperature``,
    ``top_p`` float32 [B], ``top_k``, ``seeds``, ``positions`` int64 [B], ``vocab`` the
    int64 token ids 0..V-1 (a static device tensor: no arange inside a capture)."""
    greedy = torch.argmax(logits, dim=-1)
    sampling = temperature > 0
    t = torch.where(sampling, temperature, torch.ones_like(temperature))
    scaled = logits / t[:, None]
    ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    keep_k = torch.where(top_k > 0, top_k, torch.full_like(top_k, logits.shape[-1]))
    ordered = ordered.masked_fill(vocab[None, :] >= keep_k[:, None], float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the better tokens
    ordered = ordered.masked_fill(before > top_p[:, None], float("-inf"))
    noise = torch.gather(gumbel_noise(seeds, positions, vocab), 1, order)
    pick = torch.argmax(ordered + noise, dim=-1, keepdim=True)
    drawn = torch.gather(order, 1, pick)[:, 0]
    return torch.where(sampling, drawn, greedy)


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


def sampling_tensors(
    params: Mapping[str, Any], batch: int, where: str, vocab: int, per_row: bool = True
) -> dict[str, torch.Tensor]:
    """The host tensors of a request's sampling parameters (lists of ``batch`` values,
    or with ``per_row`` False single values), defaults filled in; StepError naming the
    parameter otherwise."""
    temp, top_k, top_p, seed = sampling_values(params, batch, where, vocab, per_row)
    return {
        "temperature": torch.tensor(temp, dtype=torch.float32),
        "top_k": torch.tensor(top_k, dtype=torch.int64),
        "top_p": torch.tensor(top_p, dtype=torch.float32),
        "seed": torch.tensor(seed, dtype=torch.int64),
    }


def sampling_values(
    params: Mapping[str, Any], batch: int, where: str, vocab: int, per_row: bool = True
) -> tuple[list[float], list[int], list[float], list[int]]:
    """:func:`sampling_tensors`' values as lists (temperature, top_k, top_p, the seeds
    hashed to 32 bits), each in the range the sampler takes: a temperature below
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
    return temps, ks, ps, [seed32(s) for s in seed]
