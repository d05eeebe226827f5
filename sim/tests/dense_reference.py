"""A dense attention reference for the sim's FIA tests, independent of its kernel:
explicit loops over batch, head and query row in float64 on BNSD data. And
:func:`run`, which calls ``torch_npu.npu_fused_infer_attention_score`` on NPU
tensors converted from BNSD to a layout and brings the result back to BNSD."""

from __future__ import annotations

from typing import Any

import torch
from npusim import torch_npu

LAYOUTS = ("BNSD", "BSND", "BSH")
SCALE = 0.25


def make_qkv(
    b: int,
    n: int,
    nkv: int,
    sq: int,
    skv: int,
    d: int,
    dv: int | None = None,
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random CPU query/key/value in BNSD order."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, sq, d, generator=gen).to(dtype)
    k = torch.randn(b, nkv, skv, d, generator=gen).to(dtype)
    v = torch.randn(b, nkv, skv, d if dv is None else dv, generator=gen).to(dtype)
    return q, k, v


def to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A BNSD tensor in ``layout`` (contiguous)."""
    if layout == "BNSD":
        return x.contiguous()
    bsnd = x.permute(0, 2, 1, 3).contiguous()
    if layout == "BSND":
        return bsnd
    b, s, n, d = bsnd.shape
    return bsnd.reshape(b, s, n * d)


def from_layout(x: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """A ``layout`` tensor back in BNSD."""
    if layout == "BNSD":
        return x
    if layout == "BSH":
        b, s, h = x.shape
        x = x.reshape(b, s, heads, h // heads)
    return x.permute(0, 2, 1, 3)


def npu(x: Any) -> Any:
    return x.npu() if isinstance(x, torch.Tensor) else x


def fia(*tensors: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The op on NPU copies of CPU arguments; (attention_out, softmax_lse) on the CPU."""
    out, lse = torch_npu.npu_fused_infer_attention_score(
        *(npu(t) for t in tensors), **{k: npu(v) for k, v in kwargs.items()}
    )
    return out.cpu(), lse.cpu()


def run(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "BNSD", **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The op with BNSD data converted to ``layout``; attention_out back in BNSD."""
    n, nkv = q.shape[1], k.shape[1]
    kwargs.setdefault("scale", SCALE)
    out, lse = fia(
        to_layout(q, layout), to_layout(k, layout), to_layout(v, layout),
        num_heads=n, num_key_value_heads=nkv, input_layout=layout, **kwargs,
    )  # fmt: skip
    return from_layout(out, layout, n), lse


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float = SCALE,
    kv_lens: list[int] | None = None,
    q_lens: list[int] | None = None,
    pse: torch.Tensor | None = None,
    masked: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop-based float64 attention on BNSD data.

    ``pse`` is (B or 1, N, Sq, Skv); ``masked`` is a bool (B, Sq, Skv) "do not attend" tensor.
    Returns out (B, N, Sq, Dv) and lse (B, N, Sq, 1); rows with nothing to attend are 0.
    """
    b_, n_, sq, _ = q.shape
    nkv, skv, dv = v.shape[1], v.shape[2], v.shape[3]
    group = n_ // nkv
    kv_lens = kv_lens if kv_lens is not None else [skv] * b_
    q_lens = q_lens if q_lens is not None else [sq] * b_
    out = torch.zeros(b_, n_, sq, dv, dtype=torch.float64)
    lse = torch.zeros(b_, n_, sq, 1, dtype=torch.float64)
    for b in range(b_):
        lq, lk = q_lens[b], kv_lens[b]
        if lk == 0 or lq == 0:
            continue
        for h in range(n_):
            kvh = h // group
            qs = q[b, h, :lq].double()
            ks = k[b, kvh, :lk].double()
            vs = v[b, kvh, :lk].double()
            scores = scale * (qs @ ks.T)
            if pse is not None:
                scores = scores + pse[min(b, pse.shape[0] - 1), h, :lq, :lk].double()
            if masked is not None:
                scores = scores.masked_fill(masked[b, :lq, :lk], float("-inf"))
            for i in range(lq):
                row = scores[i]
                if torch.isinf(row).all():
                    continue  # fully masked row: zeros
                out[b, h, i] = torch.softmax(row, dim=-1) @ vs
                lse[b, h, i, 0] = torch.logsumexp(row, dim=-1)
    return out, lse


def tolerance(dtype: torch.dtype) -> float:
    """atol == rtol suited to the output dtype (inputs are already rounded to it)."""
    if dtype == torch.float16:
        return 3e-3
    if dtype == torch.bfloat16:
        return 2e-2
    return 1e-5


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = tolerance(dtype)
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol)


def random_mask(b: int, sq: int, skv: int, seed: int) -> torch.Tensor:
    """A bool (B, Sq, Skv) "do not attend" mask that leaves key 0 to every row."""
    gen = torch.Generator().manual_seed(seed)
    masked = torch.rand(b, sq, skv, generator=gen) < 0.4
    masked[..., 0] = False
    return masked
