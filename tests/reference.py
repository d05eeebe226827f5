"""An attention reference written for the tests, independent of the sim's kernel:
explicit loops over batch and heads, float64, softmax over the valid keys only."""

from __future__ import annotations

import math

import torch


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """One BNSD decode layer: query [B, N, 1, D], key/value [B, Nkv, S, D]."""
    b_, n_, _, d_ = query.shape
    n_kv = key.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for b in range(b_):
        n = lengths[b]
        if n == 0:
            continue
        for h in range(n_):
            kv_h = h // (n_ // n_kv)
            k = key[b, kv_h, :n].double()
            v = value[b, kv_h, :n].double()
            scores = (query[b, h].double() @ k.T) / math.sqrt(d_)
            out[b, h] = torch.softmax(scores, dim=-1) @ v
    return out.to(query.dtype)


def decode_stack(
    query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[int]
) -> torch.Tensor:
    """Layers in sequence: layer l+1 attends from layer l's output (stored in query dtype)."""
    x = query
    for k, v in zip(keys, values, strict=True):
        x = decode_attention(x, k, v, lengths)
    return x
