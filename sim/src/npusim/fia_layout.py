"""Shape-level planning of one ``npu_fused_infer_attention_score`` call.

:func:`plan` validates a call's tensors' shapes, its lengths and its scalar
arguments against the op-plugin document ``torch_npu-npu_fused_infer_attention_score.md``
(repository Ascend/op-plugin) and returns a :class:`Plan`: everything the kernel
(:mod:`fia_kernel`) needs except tensor data. Plans depend on shapes and on the
length lists only, so callers cache them; nothing here reads a device tensor. The
length lists' rules are :func:`lengths`, which a plan runs against its shapes' :class:`Room`
and a call that differs from a planned one only in its lengths runs alone.

A call that breaks a rule raises :class:`~.fia_args.AttentionArgumentError` naming
the argument (:mod:`fia_args` reads the arguments); the registered ops
(:mod:`fia_ops`) turn it into a :class:`SimUsageError`. The rules followed:

* Dense BSH/BSND/BNSD: ``D = H / N``; ``num_heads`` equals query's N axis (BSND/BNSD) or
  divides H (BSH). ``num_key_value_heads`` 0 means ``num_heads``; it divides
  ``num_heads``, the ratio is at most 64 (not with MLA of query D 512, whose section takes
  query N 128 over KV_N 1), and it equals key's N axis. key and value
  shapes match except value's D, which is attention_out's D.
* dtypes: query float16/bfloat16 (float32 is the sim's extension); key, value and
  pse_shift take query's dtype; atten_mask is bool/int8/uint8 (nonzero: do not attend).
* ``actual_seq_lengths`` / ``actual_seq_lengths_kv`` (not TND): one entry applies to
  every batch, a longer list gives its first B entries, each in [0, S]. At query S 1
  (the incremental branch) ``actual_seq_lengths`` is ignored but for its type.
* ``pse_shift``: (B|1, N, Q_S, KV_S); its last two dims may be padded (larger).
* Full masks: (Q_S, KV_S), (B|1, Q_S, KV_S), (B|1, 1, Q_S, KV_S), and at Q_S 1 also
  (B, KV_S); the last two dims may be padded.
* Layouts: the input part is BSH, BSND, BNSD, TND or NTD; an ``_`` suffix names the
  output layout (BNSD_BSND, BSH_NBSD, BSND_NBSD, BNSD_NBSD, TND_NTD, NTD_TND).
* TND/NTD: ``actual_seq_lengths`` is required and holds cumulative query ends (its
  length is the batch); without ``block_table`` ``actual_seq_lengths_kv`` holds
  cumulative key ends too, with ``block_table`` it holds per-batch lengths.
* Paged KV (``block_table`` given): ``block_size`` > 0; key/value are caches of shape
  (blocknum, blocksize, H) or, for BNSD/TND queries, (blocknum, KV_N, blocksize, D), of
  one shape ("key和value的shape需保证一致"; ATB's ``_npu_paged_attention`` lets value's D
  differ, see :mod:`paged_attention`); ``block_table`` is int32 [B, >= maxBlockNumPerSeq];
  ``actual_seq_lengths_kv`` is required; blocknum must cover the blocks all batches need.
  Without ``block_table`` a ``block_size`` is ignored (its default 0 means "no page
  attention"; vllm-ascend's prefill passes the cache's block size to a dense call).
* MLA: ``query_rope`` and ``key_rope`` together; query D 512 (paged with a block_size a
  multiple of 16 up to 1024, query N 1/2/4/8/16/32/64/128, KV_N 1, rope D 64, no
  softmax_lse, Q_S 1..16, sparse 0 without mask at Q_S 1, sparse 3 with mask above; the
  ``*_NBSD`` layouts at any of those Q_S, a one-token query included: the MLA section
  lists them without the general "Q_S 2..16" of the layout table, and vllm-ascend's MLA
  decode calls ``BNSD_NBSD`` with Q_S 1) or query D 128 (TND/NTD_TND, not paged, bfloat16).
* sparse_mode 0..4: 0 and 1 take a full mask, 2/3/4 an optimised (2048, 2048) mask;
  TND layouts take only 0 without a mask, or 3 or 4 with one (4: pre_tokens >= -q_len,
  next_tokens >= -kv_len, pre + next >= 0 per batch; vllm-ascend's sliding window).
  At query S 1 (the incremental branch, IFA) sparse_mode and pre/next tokens are "无效"
  (no effect) but for the mask: 3 and 4 keep the optimised mask (IFA's tiling: "when
  sparse = 3/4, atten_mask tensor shape must be [2048, 2048]"), which aligned
  bottom-right lets the one query row see every key; with 0, 1 or 2 the mask is a full
  mask, (B, KV_S) when 2-D.
* ``learnable_sink`` (v2): bfloat16 (Q_N,), TND or NTD_TND, value D up to 128.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .fia_args import check_int, cumulative, fail, int_list, out_shape, per_batch, split_layout

INT32_MAX = 2147483647
OPT_MASK = 2048
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
_WORKSPACE_BASE = 64 * 1024
_WORKSPACE_ALIGN = 512
_MLA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)


Lens = tuple[int, ...]


@dataclass(frozen=True)
class Room:
    """What a call's shapes fix that its length lists are checked against (not TND/NTD,
    whose cumulative query lengths set the batch)."""

    batch: int
    q_seq: int
    incremental: bool  # query S 1: actual_seq_lengths is read for its type only
    kv_limit: int  # key positions per batch: the key's S, or the block table's reach
    paged: bool
    blocks: int  # the paged caches' blocknum
    block_size: int


def lengths(room: Room, q_arg: object, kv_arg: object) -> tuple[Lens, Lens, int]:
    """The rules of ``actual_seq_lengths`` and ``actual_seq_lengths_kv`` (not TND/NTD):
    (q_lens, kv_lens, block_table columns read). The plan's own length checks, and all
    a call needs checked again once a call equal to it but for the lengths passed."""
    q = int_list("actual_seq_lengths", q_arg)
    if room.incremental:
        q_lens: Lens = (room.q_seq,) * room.batch
    else:
        q_lens = per_batch("actual_seq_lengths", q, room.batch, room.q_seq)
    return (q_lens, *kv_lengths(room, kv_arg))


def kv_lengths(room: Room, kv_arg: object) -> tuple[Lens, int]:
    """(kv_lens, block_table columns read) of ``actual_seq_lengths_kv`` (per batch)."""
    kv = int_list("actual_seq_lengths_kv", kv_arg)
    if not room.paged:
        return per_batch("actual_seq_lengths_kv", kv, room.batch, room.kv_limit), 0
    if kv is None:
        raise fail("actual_seq_lengths_kv", "is required with page attention")
    kv_lens = per_batch("actual_seq_lengths_kv", kv, room.batch, room.kv_limit)
    per_seq = [-(-x // room.block_size) for x in kv_lens]
    if sum(per_seq) > room.blocks:
        raise fail("key", f"blocknum {room.blocks} is smaller than the {sum(per_seq)} blocks "
                   "the batches' actual_seq_lengths_kv need")  # fmt: skip
    return kv_lens, max(per_seq, default=0)


@dataclass(frozen=True)
class Plan:
    """A validated call: logical sizes and per-batch lengths, no tensor data."""

    layout_in: str
    layout_out: str
    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # query/key D without rope
    rope_dim: int  # 0 without MLA rope
    value_dim: int
    q_seq: int  # padded per-batch query rows (S, or the longest TND batch)
    kv_seq: int  # key positions the kernel builds per batch
    q_total: int  # T of a TND/NTD query (0 otherwise)
    q_lens: tuple[int, ...]
    q_starts: tuple[int, ...]  # TND row of each batch's first query (0 otherwise)
    kv_lens: tuple[int, ...]
    kv_starts: tuple[int, ...]  # TND row of each batch's first key (non-paged TND)
    paged: bool
    block_size: int
    kv_cache_bnsd: bool  # paged caches laid out (blocknum, KV_N, blocksize, D)
    blocks_needed: int  # block_table columns the kernel reads
    incremental: bool  # IFA branch: sparse_mode, pre/next tokens and q lengths ignored
    sparse_mode: int
    pre_tokens: int
    next_tokens: int
    mask: bool
    pse: bool
    softmax_lse: bool
    kv_capacity: int = 0  # key positions the shapes hold per batch (all of them for TND)
    # What the lengths are checked against, when they decide nothing but q_lens, kv_lens
    # and blocks_needed: a call equal in everything else needs only lengths(room, ...).
    room: Room | None = None

    def out_shape(self) -> tuple[int, ...]:
        return out_shape(self.layout_out, self.batch, self.num_heads, self.q_seq,
                         self.value_dim, self.q_total)  # fmt: skip

    def lse_shape(self) -> tuple[int, ...]:
        if not self.softmax_lse:
            return (1,)
        if self.layout_out in ("TND", "NTD"):
            return (self.q_total, self.num_heads, 1)
        return (self.batch, self.num_heads, self.q_seq, 1)

    def workspace_bytes(self) -> int:
        """Scores and probabilities in float32 per head over the longest lengths the
        shapes allow (not the call's lengths), plus a fixed system part: torch_npu sizes
        the workspace once, by ``_get_max_workspace`` on the captured arguments, and
        updates to any lengths the shapes hold reuse it (lmdeploy captures with a kv
        length of 1)."""
        if self.layout_in in ("TND", "NTD"):
            return workspace_bytes(self.num_heads, (self.q_total,), (self.kv_capacity,))
        cap = max(self.kv_capacity, self.kv_seq)
        return workspace_bytes(self.num_heads, (self.q_seq,) * self.batch, (cap,) * self.batch)


def workspace_bytes(num_heads: int, q_lens: Sequence[int], kv_lens: Sequence[int]) -> int:
    """See :meth:`Plan.workspace_bytes`."""
    rows = sum(q * -(-kv // 128) * 128 for q, kv in zip(q_lens, kv_lens, strict=True))
    total = _WORKSPACE_BASE + 2 * 4 * num_heads * rows
    return -(-total // _WORKSPACE_ALIGN) * _WORKSPACE_ALIGN


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise fail(name, f"expected a torch.Tensor, got {type(t).__name__}")
    return t


def _heads(num_heads: object, num_key_value_heads: object) -> tuple[int, int]:
    n = check_int("num_heads", num_heads, 1)
    nkv = check_int("num_key_value_heads", num_key_value_heads, 0) or n
    if n % nkv:
        raise fail("num_key_value_heads",
                   f"num_heads ({n}) must be divisible by num_key_value_heads ({nkv})")  # fmt: skip
    return n, nkv


def query_dims(q: torch.Tensor, layout: str, n: int, name: str = "query") -> tuple[int, int, int]:
    """(B or T, S, D) of a query-like tensor; B is 0 for TND/NTD."""
    rank = 3 if layout in ("BSH", "TND", "NTD") else 4
    if q.dim() != rank:
        raise fail(name, f"layout {layout} expects a {rank}-D tensor, got {tuple(q.shape)}")
    s = tuple(q.shape)
    if layout == "BSH":
        if s[2] % n:
            raise fail(name, f"hidden size {s[2]} is not divisible by num_heads ({n})")
        return s[0], s[1], s[2] // n
    if layout == "BSND":
        qn, dims = s[2], (s[0], s[1], s[3])
    elif layout == "BNSD":
        qn, dims = s[1], (s[0], s[2], s[3])
    elif layout == "TND":
        qn, dims = s[1], (s[0], 0, s[2])
    else:  # NTD
        qn, dims = s[0], (s[1], 0, s[2])
    if qn != n:
        raise fail("num_heads", f"num_heads ({n}) must equal the N axis of {name} ({qn}) for "
                   f"layout {layout}")  # fmt: skip
    return dims


def _kv_dense(key: torch.Tensor, value: torch.Tensor, layout: str, b: int, nkv: int,
              ) -> tuple[int, int, int]:  # fmt: skip
    """(S_kv or T_kv, D, D_v) of non-paged key/value."""
    rank = 3 if layout in ("BSH", "TND", "NTD") else 4
    for name, t in (("key", key), ("value", value)):
        if t.dim() != rank:
            raise fail(name, f"layout {layout} expects a {rank}-D tensor, got {tuple(t.shape)}")
    ks, vs = tuple(key.shape), tuple(value.shape)
    if layout == "BSH":
        kb, skv, dk, vb, vskv, dv, kn = ks[0], ks[1], ks[2] // nkv, vs[0], vs[1], vs[2] // nkv, nkv
        if ks[2] % nkv or vs[2] % nkv:
            raise fail("key", f"hidden size is not divisible by num_key_value_heads ({nkv})")
    elif layout in ("TND", "NTD"):
        ti, ni = (0, 1) if layout == "TND" else (1, 0)
        kb, skv, dk, kn = b, ks[ti], ks[2], ks[ni]
        vb, vskv, dv = b, vs[ti], vs[2]
    else:
        bi, ni, si = (0, 1, 2) if layout == "BNSD" else (0, 2, 1)
        kb, kn, skv, dk = ks[bi], ks[ni], ks[si], ks[3]
        vb, vskv, dv = vs[bi], vs[si], vs[3]
        if vs[ni] != kn:
            raise fail("value", f"N axis ({vs[ni]}) must equal key's N axis ({kn})")
    if kn != nkv:
        raise fail("num_key_value_heads", f"the N axis of key ({kn}) must equal "
                   f"num_key_value_heads ({nkv}; 0 is num_heads) for layout {layout}")  # fmt: skip
    if kb != b:
        raise fail("key", f"batch size {kb} differs from query's batch size {b}")
    if vb != b:
        raise fail("value", f"batch size {vb} differs from query's batch size {b}")
    if vskv != skv:
        raise fail("value", f"sequence length {vskv} differs from key's sequence length {skv}")
    return skv, dk, dv


def _kv_paged(key: torch.Tensor, value: torch.Tensor, layout: str, nkv: int, block_size: int,
              value_d_free: bool = False) -> tuple[int, int, bool, int]:  # fmt: skip
    """(blocknum, D_k, cache is (blocknum, KV_N, blocksize, D), D_v) of paged caches;
    ``value_d_free``: value's last axis may differ from key's (ATB PagedAttention)."""
    ks, vs = tuple(key.shape), tuple(value.shape)
    if ks[:-1] != vs[:-1] or (ks[-1] != vs[-1] and not value_d_free):
        raise fail("value", f"paged key and value caches must have the same shape, got "
                   f"{ks} and {vs}")  # fmt: skip
    s = ks
    if key.dim() == 3:
        nb, bs, h = s
        if h % nkv:
            raise fail("key", f"cache hidden size {h} is not divisible by num_key_value_heads "
                       f"({nkv})")  # fmt: skip
        d, bnsd = h // nkv, False
    elif key.dim() == 4:
        if layout not in ("BNSD", "TND", "NTD"):
            raise fail("key", f"a (blocknum, KV_N, blocksize, D) cache needs a BNSD or TND query "
                       f"(layout {layout} takes (blocknum, blocksize, H) only)")  # fmt: skip
        nb, kn, bs, d = s
        if kn != nkv:
            raise fail("num_key_value_heads", f"the N axis of the key cache ({kn}) must equal "
                       f"num_key_value_heads ({nkv})")  # fmt: skip
        bnsd = True
    else:
        raise fail("key", f"a paged cache is (blocknum, blocksize, H) or (blocknum, KV_N, "
                   f"blocksize, D), got {s}")  # fmt: skip
    if bs != block_size:
        raise fail("block_size", f"{block_size} differs from the caches' block axis ({bs})")
    if bnsd:
        return nb, d, bnsd, vs[-1]
    if vs[-1] % nkv:
        raise fail("value", f"cache hidden size {vs[-1]} is not divisible by "
                   f"num_key_value_heads ({nkv})")  # fmt: skip
    return nb, d, bnsd, vs[-1] // nkv


def _check_block_size(block_size: int, q_seq: int, mla512: bool, tnd: bool) -> None:
    if mla512:
        if block_size % 16 or not 16 <= block_size <= 1024:
            raise fail("block_size", f"MLA with query D 512 takes a multiple of 16 up to 1024, "
                       f"got {block_size}")  # fmt: skip
    elif q_seq == 1 and not tnd:
        if block_size % 16:
            raise fail("block_size", f"must be a multiple of 16 for float16/bfloat16 caches, "
                       f"got {block_size}")  # fmt: skip
    elif block_size % 128 or not 128 <= block_size <= 512:
        raise fail("block_size", f"page attention with a query S above 1 takes a multiple of 128 "
                   f"in [128, 512], got {block_size}")  # fmt: skip


def _check_mask(mask: torch.Tensor, mode: int, b: int, sq: int, skv: int,
                incremental: bool = False) -> None:  # fmt: skip
    """``mode``: the sparse mode whose mask rules apply (0 for a full mask)."""
    if mask.dtype not in _MASK_DTYPES:
        raise fail("atten_mask", f"dtype {mask.dtype} is not bool, int8 or uint8")
    s = tuple(mask.shape)
    if incremental and len(s) == 2 and mode not in (3, 4) and s[0] != b:
        # IFA's tiling: "batchSize of atten_mask must be equal to batchSize of query"
        raise fail("atten_mask", f"at query S 1 (the incremental branch) a 2-D mask is (B, KV_S) "
                   f"with B={b}, got {s}: its batch must equal the query's; only sparse_mode 3 "
                   "and 4 take the optimised (2048, 2048) mask there")  # fmt: skip
    if mode in (2, 3, 4):
        if s not in ((OPT_MASK, OPT_MASK), (1, OPT_MASK, OPT_MASK), (1, 1, OPT_MASK, OPT_MASK)):
            raise fail("atten_mask", f"sparse_mode {mode} takes the optimised (2048, 2048), "
                       f"(1, 2048, 2048) or (1, 1, 2048, 2048) mask, got {s}")  # fmt: skip
        return
    ok = {
        2: len(s) == 2 and s[1] >= skv and ((sq == 1 and s[0] == b) or s[0] >= sq),
        3: len(s) == 3 and s[0] in (b, 1) and s[1] >= sq and s[2] >= skv,
        4: len(s) == 4 and s[0] in (b, 1) and s[1] == 1 and s[2] >= sq and s[3] >= skv,
    }.get(len(s), False)
    if not ok:
        raise fail("atten_mask", f"shape {s} is not (Q_S, KV_S), (B|1, Q_S, KV_S) or "
                   f"(B|1, 1, Q_S, KV_S) with B={b}, Q_S>={sq}, KV_S>={skv}")  # fmt: skip


def _check_sparse(a: dict[str, Any], mode: int, tnd: bool, incremental: bool) -> None:
    mask = a.get("atten_mask")
    if not 0 <= mode <= 4:
        raise fail("sparse_mode", f"{mode} is not supported (documented: 0..4; 5..8 are reserved)")
    if incremental:
        return
    if tnd and not ((mode == 0 and mask is None) or (mode in (3, 4) and mask is not None)):
        raise fail("sparse_mode", "the TND/NTD layouts take sparse_mode 0 without atten_mask, or "
                   f"sparse_mode 3 or 4 with it (got {mode}, atten_mask "
                   f"{'given' if mask is not None else 'None'})")  # fmt: skip
    if mode in (1, 2, 3, 4) and mask is None:
        raise fail("atten_mask", f"sparse_mode {mode} needs atten_mask")


def _rope(a: dict[str, Any], layout: str, q: torch.Tensor, paged: bool, n: int, nkv: int,
          d: int, q_lens: Sequence[int]) -> int:  # fmt: skip
    qr, kr = a.get("query_rope"), a.get("key_rope")
    if qr is None and kr is None:
        return 0
    if qr is None or kr is None:
        raise fail("query_rope" if qr is None else "key_rope",
                   "query_rope and key_rope are given together or not at all")  # fmt: skip
    qr, kr, key = _tensor("query_rope", qr), _tensor("key_rope", kr), a["key"]
    if qr.dtype != q.dtype or kr.dtype != key.dtype:
        raise fail("query_rope", "query_rope/key_rope must have the dtypes of query/key")
    rd = qr.shape[-1] // n if layout == "BSH" else qr.shape[-1]
    if rd != 64:
        raise fail("query_rope", f"the rope D must be 64, got {rd}")
    if tuple(qr.shape[:-1]) != tuple(q.shape[:-1]):
        raise fail("query_rope", f"shape {tuple(qr.shape)} must match query's "
                   f"{tuple(q.shape)} except D")  # fmt: skip
    kd = kr.shape[-1] // (nkv if key.dim() == 3 and (paged or layout == "BSH") else 1)
    if kd != 64 or tuple(kr.shape[:-1]) != tuple(key.shape[:-1]):
        raise fail("key_rope", f"shape {tuple(kr.shape)} must match key's {tuple(key.shape)} "
                   "with a rope D of 64")  # fmt: skip
    if d == 512:
        if not paged:
            raise fail("block_table", "MLA with query D 512 needs page attention")
        if nkv != 1 or n not in _MLA_HEADS:
            raise fail("num_heads", f"MLA with query D 512 takes query N 1/2/4/8/16/32/64/128 "
                       f"and key N 1, got {n} and {nkv}")  # fmt: skip
        if any(not 1 <= s <= 16 for s in q_lens):
            raise fail("query", "MLA with query D 512 takes a query S of 1..16 per batch")
        if a.get("softmax_lse_flag"):
            raise fail("softmax_lse_flag", "not supported with MLA rope inputs of query D 512")
        if layout in ("NTD",):
            raise fail("input_layout", "MLA with query D 512 does not take NTD_TND")
    elif d == 128:
        if layout not in ("TND", "NTD") or paged or q.dtype != torch.bfloat16:
            raise fail("query_rope", "MLA with query D 128 takes TND/NTD_TND, bfloat16, and no "
                       "page attention")  # fmt: skip
    else:
        raise fail("query_rope", f"MLA takes a query D of 512 or 128, got {d}")
    return 64


def _check_sink(sink: object, layout_in: str, layout_out: str, n: int, dv: int) -> None:
    """v2's ``learnable_sink``: "数据类型支持bfloat16 ... shape输入为(Q_N,)", and its
    constraints "仅支持TND、NTD_TND; 仅支持value的d小于等于128"."""
    if sink is None:
        return
    t = _tensor("learnable_sink", sink)
    if t.dtype != torch.bfloat16:
        raise fail("learnable_sink", f"dtype {t.dtype} is not bfloat16 (the only dtype the "
                   "document allows)")  # fmt: skip
    if tuple(t.shape) != (n,):
        raise fail("learnable_sink", f"shape {tuple(t.shape)} is not (Q_N,) = ({n},)")
    if (layout_in, layout_out) not in (("TND", "TND"), ("NTD", "TND")):
        got = layout_in if layout_in == layout_out else f"{layout_in}_{layout_out}"
        raise fail("learnable_sink", f"is supported with the TND and NTD_TND layouts only, got "
                   f"{got}")  # fmt: skip
    if dv > 128:
        raise fail("learnable_sink", f"is supported with a value D up to 128, got {dv}")


def plan(a: dict[str, Any]) -> Plan:
    """Validate the (v1-named) arguments of one call; raise AttentionArgumentError."""
    layout_in, layout_out = split_layout(a.get("input_layout", "BSH"))
    n, nkv = _heads(a.get("num_heads", 1), a.get("num_key_value_heads", 0))
    q, key = _tensor("query", a["query"]), _tensor("key", a["key"])
    value = _tensor("value", a["value"])
    if q.dtype not in _DTYPES:
        raise fail("query", f"dtype {q.dtype} is not float16, bfloat16 or float32")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != q.dtype:
            raise fail(name, f"dtype {t.dtype} differs from query's dtype {q.dtype}")
    tnd = layout_in in ("TND", "NTD")
    b_or_t, sq, d = query_dims(q, layout_in, n)
    q_total, q_starts = 0, tuple[int, ...]()
    if tnd:  # the cumulative query ends set the batch: no Room, checked here
        q_total = b_or_t
        q_arg = int_list("actual_seq_lengths", a.get("actual_seq_lengths"))
        q_lens, q_starts = cumulative("actual_seq_lengths", q_arg, q_total)
        b, sq = len(q_lens), max(q_lens)
    else:
        b = b_or_t
    incremental = not tnd and sq == 1
    block_table = a.get("block_table")
    paged = block_table is not None
    block_size = check_int("block_size", a.get("block_size", 0), 0)
    kv_starts: tuple[int, ...] = ()
    blocks_needed, bnsd_cache = 0, False
    room: Room | None = None
    if paged:
        bt = _tensor("block_table", block_table)
        if bt.dtype != torch.int32 or bt.dim() != 2:
            raise fail("block_table", f"must be a 2-D int32 tensor, got {bt.dtype} "
                       f"{tuple(bt.shape)}")  # fmt: skip
        if bt.shape[0] != b:
            raise fail("block_table", f"has {bt.shape[0]} rows; the first dim must equal the "
                       f"batch ({b})")  # fmt: skip
        if block_size <= 0:
            raise fail("block_size", "page attention (block_table given) needs block_size > 0")
        nb, dk, bnsd_cache, dv = _kv_paged(key, value, layout_in, nkv, block_size,
                                           bool(a.get("value_d_free")))  # fmt: skip
        kv_capacity = bt.shape[1] * block_size
        room = Room(b, sq, incremental, kv_capacity, True, nb, block_size)
        if tnd:
            kv_lens, blocks_needed = kv_lengths(room, a.get("actual_seq_lengths_kv"))
        else:
            q_lens, kv_lens, blocks_needed = lengths(room, a.get("actual_seq_lengths"),
                                                     a.get("actual_seq_lengths_kv"))  # fmt: skip
        skv = pse_kv = blocks_needed * block_size
    else:
        block_size = 0  # ignored without block_table
        skv_total, dk, dv = _kv_dense(key, value, layout_in, b, nkv)
        kv_capacity = skv = pse_kv = skv_total
        if tnd:
            kv_arg = int_list("actual_seq_lengths_kv", a.get("actual_seq_lengths_kv"))
            kv_lens, kv_starts = cumulative("actual_seq_lengths_kv", kv_arg, skv_total)
            if len(kv_lens) != b:
                raise fail("actual_seq_lengths_kv", f"has {len(kv_lens)} entries; the TND batch "
                           f"is {b}")  # fmt: skip
            skv = pse_kv = max(kv_lens)
        else:
            room = Room(b, sq, incremental, skv_total, False, 0, 0)
            q_lens, kv_lens, _ = lengths(room, a.get("actual_seq_lengths"),
                                         a.get("actual_seq_lengths_kv"))  # fmt: skip
    if dk != d:
        raise fail("key", f"head dim {dk} differs from query's head dim {d}")
    rope = _rope(a, layout_in, q, paged, n, nkv, d, q_lens)
    if paged:
        _check_block_size(block_size, sq, d == 512 and rope > 0, tnd)
    mla512 = rope > 0 and d == 512
    if n // nkv > 64 and not mla512:  # the MLA section takes query N 128 over key N 1
        raise fail("num_key_value_heads", f"num_heads / num_key_value_heads = {n // nkv} "
                   "exceeds 64")  # fmt: skip
    if layout_out == "NBSD" and not (1 if mla512 else 2) <= sq <= 16:
        raise fail("input_layout", f"{a['input_layout']} takes a query S of 2..16 (1..16 with "
                   f"MLA rope inputs of query D 512), got {sq}")  # fmt: skip
    if layout_in == "BNSD" and layout_out == "BSND" and sq == 1:
        raise fail("input_layout", "BNSD_BSND takes a query S above 1")
    mode = check_int("sparse_mode", a.get("sparse_mode", 0))
    if rope and d == 512:
        incremental = False
        want = (0, False) if sq == 1 else (3, True)
        if (mode, a.get("atten_mask") is not None) != want:
            raise fail("sparse_mode", f"MLA with query D 512 at query S {sq} takes sparse_mode "
                       f"{want[0]} {'with' if want[1] else 'without'} atten_mask")  # fmt: skip
    _check_sparse(a, mode, tnd, incremental)
    pre = check_int("pre_tokens", a.get("pre_tokens", INT32_MAX))
    nxt = check_int("next_tokens", a.get("next_tokens", INT32_MAX))
    mask = a.get("atten_mask")
    if mask is not None:
        # At query S 1 (IFA) sparse_mode 3 and 4 keep the optimised mask, whose
        # bottom-right causal row is the one query's (every key); 0/1/2 take a full mask.
        optimised = mode in ((3, 4) if incremental else (2, 3, 4))
        _check_mask(_tensor("atten_mask", mask), mode if optimised else 0, b, sq, pse_kv,
                    incremental)  # fmt: skip
    pse = a.get("pse_shift")
    if pse is not None:
        p = _tensor("pse_shift", pse)
        if tnd:
            raise fail("pse_shift", "is not supported with the TND/NTD layouts")
        if p.dtype != q.dtype:
            raise fail("pse_shift", f"dtype {p.dtype} differs from query's dtype {q.dtype}")
        ps = tuple(p.shape)
        if not (len(ps) == 4 and ps[0] in (b, 1) and ps[1] == n and ps[2] >= sq
                and ps[3] >= pse_kv):  # fmt: skip
            raise fail("pse_shift", f"shape {ps} is not (B|1, N, Q_S, KV_S) with B={b}, N={n}, "
                       f"Q_S>={sq}, KV_S>={pse_kv}")  # fmt: skip
    if tnd and mode == 4:  # the TND section: "preTokens >= -actual_seq_qlen, nextTokens >=
        # -actual_seq_kvlen, preTokens + nextTokens >= 0"
        for b_, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
            if pre < -ql or nxt < -kl or pre + nxt < 0:
                raise fail("pre_tokens", f"sparse_mode 4 with TND needs pre_tokens >= "
                           f"-actual_seq_lengths, next_tokens >= -actual_seq_lengths_kv and "
                           f"pre_tokens + next_tokens >= 0; batch {b_} has {pre}, {nxt}, "
                           f"lengths {ql} and {kl}")  # fmt: skip
    _check_sink(a.get("learnable_sink"), layout_in, layout_out, n, dv)
    precise = check_int("inner_precise", a.get("inner_precise", 0))
    if not 0 <= precise <= 3:
        raise fail("inner_precise", f"must be 0, 1, 2 or 3, got {precise}")
    lse = a.get("softmax_lse_flag", False)
    if not isinstance(lse, bool):
        raise fail("softmax_lse_flag", f"expected a bool, got {type(lse).__name__}")
    return Plan(
        layout_in, layout_out, b, n, nkv, d, rope, dv, sq, skv, q_total, tuple(q_lens),
        tuple(q_starts), tuple(kv_lens), kv_starts, paged, block_size, bnsd_cache,
        blocks_needed, incremental, mode, pre, nxt, mask is not None, pse is not None, lse,
        kv_capacity,
        # The lengths decide nothing else (see Room) unless MLA rope reads the query
        # lengths or a paged cache's mask or shift is checked against their blocks.
        None if tnd or rope or (paged and (mask is not None or pse is not None)) else room,
    )  # fmt: skip
