"""``torch_npu._npu_flash_attention_qlens`` (ATB SelfAttention, PREFIX_ENCODER): sglang's
prefill over a paged KV cache on Atlas A2 (its Ascend backend's default for head dims up to
128), with the wheel's schema.

    _npu_flash_attention_qlens(query [Tq, N * D] or [Tq, N, D], key_cache/value_cache
        [blocks, block_size, KV_N, D], block_table int32 [B, max_blocks], mask, seq_len
        int32 host [B], context_lens int32 host [B], num_kv_heads, num_heads, scale_value,
        out [Tq, N * Dv] or [Tq, N, Dv]) -> ()

Batch b's ``seq_len[b]`` query tokens (packed one batch after another) are the last tokens
of its ``context_lens[b]`` cached ones (the new tokens are in the cache already: sglang
writes them with ``_npu_reshape_and_cache`` first); each attends causally, aligned to the
bottom right, to the cache rows the block table names (op-plugin SelfAttentionQlensAtb.cpp:
PREFIX_ENCODER, a compressed upper-triangular mask). ``mask`` is ATB's compressed triangle
(sglang passes [128, 128] of the query's dtype): its shape and dtype are checked, the causal
pattern is derived from the positions. ``seq_len`` and ``context_lens`` are host tensors
read when the op is issued, as the ATB dispatch reads them.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import SimUsageError
from .fia_ops import Signature
from .streams import current_stream
from .tensor import issue, register_host_op

NAME = "_npu_flash_attention_qlens"
_lib = torch.library.Library("npu", "FRAGMENT")
_lib.define(
    f"{NAME}(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
    "Tensor mask, Tensor seq_len, Tensor context_lens, int num_kv_heads, int num_heads, "
    "float scale_value, Tensor(a!) out) -> ()"
)
flash_attention_qlens = getattr(torch.ops.npu, NAME)
_SIGNATURE = Signature(NAME, flash_attention_qlens.default._schema)


def _refuse(message: str) -> SimUsageError:
    return SimUsageError(f"torch_npu.{NAME}: {message}")


def _lengths(name: str, t: Any, batch: int) -> list[int]:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise _refuse(f"{name} must be a host (CPU) int32 tensor, as the ATB op reads it when "
                      "issued")  # fmt: skip
    if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != batch:
        raise _refuse(f"{name} must be int32 [batch={batch}], got {t.dtype} {list(t.shape)}")
    return [int(v) for v in t.tolist()]


def _check(b: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The call's shapes, dtypes and lengths; returns (query lengths, context lengths)."""
    q, kc, vc, bt, out = b["query"], b["key_cache"], b["value_cache"], b["block_table"], b["out"]
    n, nkv = b["num_heads"], b["num_kv_heads"]
    if n <= 0 or nkv <= 0 or n % nkv:
        raise _refuse(f"num_heads {n} must be a positive multiple of num_kv_heads {nkv}")
    if kc.dim() != 4 or vc.dim() != 4 or kc.shape[:3] != vc.shape[:3] or kc.shape[2] != nkv:
        raise _refuse(f"key_cache/value_cache must be [blocks, block_size, num_kv_heads={nkv}, "
                      f"D], got {list(kc.shape)} and {list(vc.shape)}")  # fmt: skip
    d, dv = kc.shape[3], vc.shape[3]
    if list(q.shape[1:]) not in ([n * d], [n, d]):
        raise _refuse(f"query must be [tokens, num_heads * D = {n * d}] or [tokens, {n}, {d}], "
                      f"got {list(q.shape)}")  # fmt: skip
    want = [q.shape[0], n * dv] if q.dim() == 2 else [q.shape[0], n, dv]
    if list(out.shape) != want or out.dtype != q.dtype:
        raise _refuse(f"out must be {want} {q.dtype}, got {list(out.shape)} {out.dtype}")
    for name, t in (("key_cache", kc), ("value_cache", vc)):
        if t.dtype != q.dtype:
            raise _refuse(f"{name} is {t.dtype} but must have query's dtype {q.dtype}")
    mask = b["mask"]
    if mask.dim() != 2 or mask.shape[0] != mask.shape[1] or mask.dtype != q.dtype:
        raise _refuse(f"mask must be ATB's compressed causal triangle, a square 2-D tensor of "
                      f"query's dtype (sglang's is [128, 128]), got {mask.dtype} "
                      f"{list(mask.shape)}")  # fmt: skip
    if bt.dtype != torch.int32 or bt.dim() != 2:
        raise _refuse(f"block_table must be int32 [batch, max_blocks], got {bt.dtype} "
                      f"{list(bt.shape)}")  # fmt: skip
    batch = bt.shape[0]
    q_lens = _lengths("seq_len", b["seq_len"], batch)
    kv_lens = _lengths("context_lens", b["context_lens"], batch)
    if sum(q_lens) != q.shape[0]:
        raise _refuse(f"seq_len sums to {sum(q_lens)} but query has {q.shape[0]} tokens")
    capacity = bt.shape[1] * kc.shape[1]
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if not 0 < ql <= kl <= capacity:
            raise _refuse(f"batch {i}: need 0 < seq_len ({ql}) <= context_lens ({kl}) <= the "
                          f"block table's {capacity} slots")  # fmt: skip
    return q_lens, kv_lens


def _cpu(*args: Any, **kwargs: Any) -> None:
    b = _SIGNATURE.bind(args, kwargs)
    q, kc, vc, bt, out = b["query"], b["key_cache"], b["value_cache"], b["block_table"], b["out"]
    n, nkv, scale = b["num_heads"], b["num_kv_heads"], b["scale_value"]
    d, dv, bs = kc.shape[3], vc.shape[3], kc.shape[1]
    q_lens, kv_lens = [int(v) for v in b["seq_len"]], [int(v) for v in b["context_lens"]]
    queries = q.float().reshape(q.shape[0], n, d)
    result = torch.zeros(q.shape[0], n, dv)
    start = 0
    for row, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        blocks = bt[row, : (kl + bs - 1) // bs].long()
        if int(blocks.min()) < 0 or int(blocks.max()) >= kc.shape[0]:
            raise IndexError(f"{NAME}: block_table row {row} names a block outside the cache")
        keys = kc[blocks].reshape(-1, nkv, d)[:kl].float().repeat_interleave(n // nkv, 1)
        values = vc[blocks].reshape(-1, nkv, dv)[:kl].float().repeat_interleave(n // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", queries[start : start + ql], keys) * scale
        # query i is context position kl - ql + i: it sees keys up to and including it
        seen = torch.arange(kl)[None, :] <= (kl - ql + torch.arange(ql))[:, None]
        scores = scores.masked_fill(~seen, float("-inf"))
        result[start : start + ql] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        start += ql
    out.copy_(result.reshape(out.shape).to(out.dtype))


def _meta(*args: Any, **kwargs: Any) -> None:
    return None  # checked at issue (:func:`_issue`), where the host lengths are read


_lib.impl(NAME, _cpu, "CPU")
_lib.impl(NAME, _meta, "Meta")


def _issue(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Check the call with its host lengths, then issue the device op with copies of them
    (what the ATB dispatch read, whatever the host writes into the tensors later)."""
    b = _SIGNATURE.bind(args, kwargs)
    _check(b)
    b["seq_len"], b["context_lens"] = b["seq_len"].clone(), b["context_lens"].clone()
    index = b["query"].device.index or 0
    return issue(current_stream(index), func, (), b, index)


register_host_op(flash_attention_qlens.default, _issue)
