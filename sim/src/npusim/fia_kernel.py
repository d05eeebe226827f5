"""CPU kernel of ``npu_fused_infer_attention_score`` over a validated :class:`Plan`.

Every layout is brought to padded BNSD float32 (query [B, N, S, D(+rope)], key/value
[B, KV_N, S_kv, D]), paged caches are gathered through ``block_table``, a boolean
"keep" tensor [B, 1, S, S_kv] combines the lengths, the sparse mode and the user mask,
and the result goes back to the output layout. Semantics and the choices made where
the op-plugin document is silent:

* Rows without a key to attend (every key masked, kv length 0, or beyond the query
  length) give zeros in ``attention_out`` and 0 in ``softmax_lse``: no NaN.
* sparse_mode 0 with a mask applies it and the band ``i - pre_tokens <= j <= i +
  next_tokens``; 1 applies the mask only; 2 is the causal mask aligned top-left
  (``j <= i``); 3 aligned bottom-right per batch (``j <= i + kv_len - q_len``); 4 is the
  band aligned bottom-right. For 2/3/4 the optimised 2048x2048 mask is checked for its
  shape only; the sim derives the mask from positions instead of reading its data.
* In the incremental branch (query S 1, no rope, not TND) sparse_mode, pre/next tokens
  and actual_seq_lengths are ignored, as documented; a full mask (sparse_mode 0, 1, 2)
  still applies, the optimised mask of sparse_mode 3 or 4 does not: the one query row,
  aligned bottom-right, sees every key (a causal decode).
* MLA: scores are ``query . key + query_rope . key_rope``; ``value`` is the latent.
* ``learnable_sink`` (v2): head h's sink logit joins the denominator of each of its rows'
  softmax (unscaled, as gpt-oss's reference appends it to the scaled scores) and adds no
  value; ``softmax_lse`` includes it (a row without keys has the sink as its lse).
* block_table entries that a batch reads must name an existing block: on the hardware
  they are not checked; the sim raises instead of reading another block.
"""

from __future__ import annotations

from typing import Any

import torch

from .fia_args import fail, out_shape
from .fia_layout import Plan


def _dense_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    t = t.to(torch.float32)
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.permute(0, 2, 1, 3)
    b, s, h = t.shape  # BSH
    return t.reshape(b, s, heads, h // heads).permute(0, 2, 1, 3)


def _tnd_rows(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A TND/NTD tensor as float32 [T, N, D]."""
    t = t.to(torch.float32)
    return t if layout == "TND" else t.permute(1, 0, 2)


def _pad_batches(rows: torch.Tensor, lens: tuple[int, ...], starts: tuple[int, ...],
                 width: int) -> torch.Tensor:  # fmt: skip
    """[T, N, D] rows split per batch into zero-padded [B, N, width, D]."""
    out = rows.new_zeros(len(lens), rows.shape[1], width, rows.shape[2])
    for i, (n, s) in enumerate(zip(lens, starts, strict=True)):
        out[i, :, :n] = rows[s : s + n].transpose(0, 1)
    return out


def _query(p: Plan, t: torch.Tensor, heads: int) -> torch.Tensor:
    if p.layout_in in ("TND", "NTD"):
        return _pad_batches(_tnd_rows(t, p.layout_in), p.q_lens, p.q_starts, p.q_seq)
    return _dense_bnsd(t, p.layout_in, heads)


def _paged(p: Plan, cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Gather [B, KV_N, blocks_needed * block_size, D] from a paged cache."""
    nb = cache.shape[0]
    ids = block_table[:, : p.blocks_needed].to(torch.int64)
    for b, kv in enumerate(p.kv_lens):
        used = ids[b, : -(-kv // p.block_size)]
        bad = (used < 0) | (used >= nb)
        if bool(bad.any()):
            raise fail("block_table", f"batch {b} reads block {int(used[bad][0])}, outside the "
                       f"cache's {nb} blocks")  # fmt: skip
    ids = ids.clamp(0, max(nb - 1, 0))  # blocks past a batch's length are never attended
    c = cache.to(torch.float32)
    if not p.kv_cache_bnsd:  # (nb, bs, H) -> (nb, KV_N, bs, D)
        c = c.reshape(nb, p.block_size, p.num_kv_heads, -1).permute(0, 2, 1, 3)
    g = c[ids]  # [B, blocks, KV_N, bs, D]
    b, nblk, nkv, bs, d = g.shape
    return g.permute(0, 2, 1, 3, 4).reshape(b, nkv, nblk * bs, d)


def _kv(p: Plan, t: torch.Tensor, block_table: torch.Tensor | None) -> torch.Tensor:
    if p.paged:
        assert block_table is not None
        return _paged(p, t, block_table)
    if p.layout_in in ("TND", "NTD"):
        return _pad_batches(_tnd_rows(t, p.layout_in), p.kv_lens, p.kv_starts, p.kv_seq)
    return _dense_bnsd(t, p.layout_in, p.num_kv_heads)


def _user_mask(mask: torch.Tensor, p: Plan) -> torch.Tensor:
    """Boolean "do not attend" [B|1, 1, S, S_kv] from a full mask."""
    sq, skv = p.q_seq, p.kv_seq
    s = tuple(mask.shape)
    if len(s) == 2:
        if sq == 1 and s[0] == p.batch and s[0] != 1:
            m = mask[:, :skv].reshape(s[0], 1, 1, skv)
        else:
            m = mask[:sq, :skv].reshape(1, 1, sq, skv)
    elif len(s) == 3:
        m = mask[:, :sq, :skv].unsqueeze(1)
    else:
        m = mask[:, :, :sq, :skv]
    return m != 0


def keep_matrix(p: Plan, mask: torch.Tensor | None) -> torch.Tensor:
    """[B, 1, S, S_kv]: query row i of batch b may attend key j."""
    b, sq, skv = p.batch, p.q_seq, p.kv_seq
    kv = torch.tensor(p.kv_lens, dtype=torch.int64).reshape(b, 1, 1, 1)
    ql = torch.tensor(p.q_lens, dtype=torch.int64).reshape(b, 1, 1, 1)
    j = torch.arange(skv, dtype=torch.int64).reshape(1, 1, 1, skv)
    i = torch.arange(sq, dtype=torch.int64).reshape(1, 1, sq, 1)
    keep = (j < kv) & (i < ql)
    if p.incremental:
        if mask is None or p.sparse_mode in (3, 4):
            return keep
        return keep & ~_user_mask(mask, p)
    shift = kv - ql  # bottom-right alignment
    mode = p.sparse_mode
    if mode == 0 and mask is not None:
        keep = keep & ~_user_mask(mask, p) & (j >= i - p.pre_tokens) & (j <= i + p.next_tokens)
    elif mode == 1:
        assert mask is not None
        keep = keep & ~_user_mask(mask, p)
    elif mode == 2:
        keep = keep & (j <= i)
    elif mode == 3:
        keep = keep & (j <= i + shift)
    elif mode == 4:
        keep = keep & (j >= i + shift - p.pre_tokens) & (j <= i + shift + p.next_tokens)
    return keep


def _unpad_batches(x: torch.Tensor, p: Plan) -> torch.Tensor:
    """Padded per-batch [B, N, S, X] back to TND rows [T, N, X] (the inverse of
    :func:`_pad_batches`; rows past the last batch's end stay zero)."""
    out = x.new_zeros(p.q_total, p.num_heads, x.shape[-1])
    for b, (n, s) in enumerate(zip(p.q_lens, p.q_starts, strict=True)):
        out[s : s + n] = x[b, :, :n].transpose(0, 1)
    return out


def _to_layout(o: torch.Tensor, p: Plan, dtype: torch.dtype) -> torch.Tensor:
    """[B, N, S, Dv] float32 to the output layout."""
    lay = p.layout_out
    if lay in ("TND", "NTD"):
        out = _unpad_batches(o, p)
        out = out if lay == "TND" else out.permute(1, 0, 2)
    elif lay == "BNSD":
        out = o
    elif lay == "BSND":
        out = o.permute(0, 2, 1, 3)
    elif lay == "NBSD":
        out = o.permute(1, 0, 2, 3)
    else:
        out = o.permute(0, 2, 1, 3).reshape(p.batch, p.q_seq, -1)
    assert tuple(out.shape) == out_shape(lay, p.batch, p.num_heads, p.q_seq, p.value_dim,
                                         p.q_total)  # fmt: skip
    return out.to(dtype).contiguous()


def _lse_layout(lse: torch.Tensor, p: Plan) -> torch.Tensor:
    if not p.softmax_lse:
        return torch.zeros(1, dtype=torch.float32)
    if p.layout_out in ("TND", "NTD"):
        return _unpad_batches(lse, p)
    return lse


def compute(p: Plan, a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(attention_out, softmax_lse)`` of a planned call over CPU tensors."""
    q = _query(p, a["query"], p.num_heads)
    k = _kv(p, a["key"], a.get("block_table"))
    v = _kv(p, a["value"], a.get("block_table"))
    if p.rope_dim:
        q = torch.cat([q, _query(p, a["query_rope"], p.num_heads)], dim=-1)
        k = torch.cat([k, _kv(p, a["key_rope"], a.get("block_table"))], dim=-1)
    b, n, nkv, sq, skv = p.batch, p.num_heads, p.num_kv_heads, p.q_seq, p.kv_seq
    group = n // nkv
    keep = keep_matrix(p, a.get("atten_mask"))
    scores = torch.matmul(q.reshape(b, nkv, group, sq, -1), k.unsqueeze(2).transpose(-1, -2))
    scores = scores.reshape(b, n, sq, skv) * float(a.get("scale", 1.0))
    pse = a.get("pse_shift")
    if pse is not None:
        scores = scores + pse[:, :, :sq, :skv].to(torch.float32)
    scores = scores.masked_fill(~keep, float("-inf"))
    if skv == 0:
        row_max = torch.zeros(b, n, sq, 1)
    else:
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    sink = a.get("learnable_sink")
    if sink is not None:  # a per-head logit in every row's softmax that gives no value
        sink = sink.to(torch.float32).reshape(1, n, 1, 1)
        row_max = torch.maximum(row_max, sink)
    e = torch.exp(scores - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - row_max)
    has = denom > 0
    safe = torch.where(has, denom, torch.ones_like(denom))
    probs = e / safe
    o = torch.matmul(probs.reshape(b, nkv, group, sq, skv), v.unsqueeze(2)).reshape(b, n, sq, -1)
    lse = torch.where(has, torch.log(safe) + row_max, torch.zeros_like(denom))
    return _to_layout(o, p, a["query"].dtype), _lse_layout(lse, p)
