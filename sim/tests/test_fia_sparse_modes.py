"""Every ``sparse_mode`` of ``npu_fused_infer_attention_score`` at every query length,
in every layout, paged and not, against plain torch built from the op document's words
(torch_npu 2.14 ``_op_plugin_docs.py``), not from the sim's kernel:

- 0 defaultMask: without a mask no masking (pre/next tokens ignored); with a full mask,
  the mask and the band ``i - pre_tokens <= j <= i + next_tokens``;
- 1 allMask: the full mask alone;
- 2 leftUpCausal: ``j <= i`` (the optimised 2048x2048 mask);
- 3 rightDownCausal: the lower triangle split at the bottom-right corner, ``j <= i +
  kv_len - q_len`` per batch;
- 4 band: pre/next tokens counted from that bottom-right diagonal.

At query S 1 (the incremental branch) sparse_mode and pre/next tokens have no effect
("Q_S为1时该参数无效"): a full mask (modes 0, 1) applies, and the optimised mask of
modes 3 and 4 lets the one query row, aligned bottom-right, see every key: a causal
decode, which the field writes as BSND + sparse_mode 3 + the 2048 mask (vllm-ascend's
attention backends pass the same mask and mode to prefill and decode). TND takes
sparse_mode 0 without a mask, or 3 or 4 with one.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from npusim import torch_npu
from npusim.errors import SimUsageError

B, N, NKV, D = 2, 4, 2, 16
COMPRESSED = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
PRE, NEXT = 3, 1
MODES = ("0-none", "0-mask", "1", "2", "3", "4")
LAYOUTS = ("BSH", "BSND", "BNSD")


def _keep(mode: str, i: int, j: int, q_len: int, kv_len: int, full: torch.Tensor | None,
          incremental: bool) -> bool:  # fmt: skip
    """The document's definition of the mode: may query row i attend key j."""
    if j >= kv_len or i >= q_len:
        return False
    shift = kv_len - q_len  # the bottom-right alignment
    if incremental:  # sparse_mode and pre/next tokens have no effect; a full mask does
        return mode not in ("0-mask", "1") or not bool(full[i, j])  # type: ignore[index]
    if mode == "0-none":
        return True
    if mode == "0-mask":
        return not bool(full[i, j]) and i - PRE <= j <= i + NEXT  # type: ignore[index]
    if mode == "1":
        return not bool(full[i, j])  # type: ignore[index]
    if mode == "2":
        return j <= i
    if mode == "3":
        return j <= i + shift
    return i + shift - PRE <= j <= i + shift + NEXT  # "4"


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: list[int],
               kv_lens: list[int], mode: str, full: torch.Tensor | None, scale: float,
               incremental: bool) -> torch.Tensor:  # fmt: skip
    """[B, N, S, D] float64 from [B, N|KV_N, S, D] inputs: each row's softmax over the
    keys :func:`_keep` lets it see; rows without a key (past the query length) are zeros."""
    out = torch.zeros(q.shape[0], N, q.shape[2], D, dtype=torch.float64)
    for b in range(q.shape[0]):
        m = None if full is None else full[b, 0]
        for i in range(q_lens[b]):
            keys = [j for j in range(kv_lens[b])
                    if _keep(mode, i, j, q_lens[b], kv_lens[b], m, incremental)]  # fmt: skip
            kh = k[b, :, keys].double().repeat_interleave(N // NKV, dim=0)  # [N, L, D]
            vh = v[b, :, keys].double().repeat_interleave(N // NKV, dim=0)
            s = torch.einsum("nld,nd->nl", kh, q[b, :, i].double()) * scale
            out[b, :, i] = torch.einsum("nl,nld->nd", torch.softmax(s, dim=-1), vh)
    return out


def _to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, N, S, D] to a layout."""
    if layout == "BNSD":
        return x.contiguous()
    bsnd = x.permute(0, 2, 1, 3).contiguous()
    return bsnd if layout == "BSND" else bsnd.reshape(x.shape[0], x.shape[2], -1)


def _from_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return x
    if layout == "BSH":
        x = x.reshape(x.shape[0], x.shape[1], N, D)
    return x.permute(0, 2, 1, 3)


def _paged(kv: tuple[torch.Tensor, torch.Tensor], kv_lens: list[int], bs: int,
           g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(blocknum, blocksize, H) caches holding [B, KV_N, S, D] key and value, and their
    block table (blocks in a random order, one spare)."""
    batch, seq = kv[0].shape[0], kv[0].shape[2]
    per = -(-seq // bs)
    nb = batch * per + 1
    table = torch.randperm(nb, generator=g)[: batch * per].reshape(batch, per)
    caches = []
    for x in kv:
        cache = torch.zeros(nb, bs, NKV * D, dtype=x.dtype)
        rows = x.permute(0, 2, 1, 3).reshape(batch, seq, NKV * D)
        for b in range(batch):
            for pos in range(kv_lens[b]):
                cache[table[b, pos // bs], pos % bs] = rows[b, pos]
        caches.append(cache)
    return caches[0], caches[1], table.int()


def _case(mode: str, q_seq: int, layout: str, paged: bool) -> None:
    g = torch.Generator().manual_seed(hash((mode, q_seq, layout, paged)) % 1000)
    incremental = q_seq == 1
    bs = 16 if incremental else 128
    kv_seq = 24 if not paged else (40 if incremental else 2 * bs)
    q_seq = kv_seq if q_seq < 0 else q_seq
    q_lens = [q_seq, max(q_seq - 1, 1)]
    kv_lens = [kv_seq, kv_seq - 3]
    if q_seq == kv_seq:  # "equal to kv": each batch's query as long as its keys
        q_lens = kv_lens[:]
    q = torch.randn(B, N, q_seq, D, generator=g).half()
    k = torch.randn(B, NKV, kv_seq, D, generator=g).half()
    v = torch.randn(B, NKV, kv_seq, D, generator=g).half()
    scale = 1 / math.sqrt(D)
    full = None
    kw: dict[str, Any] = dict(num_heads=N, num_key_value_heads=NKV, scale=scale,
                              input_layout=layout, actual_seq_lengths=q_lens,
                              actual_seq_lengths_kv=kv_lens)  # fmt: skip
    if mode in ("0-mask", "1"):
        width = -(-kv_seq // bs) * bs if paged else kv_seq  # a paged mask spans the blocks
        full = torch.rand(B, 1, q_seq, width, generator=g) < 0.3
        full[:, :, torch.arange(q_seq), torch.arange(q_seq) % kv_seq] = False  # a key a row
        kw.update(atten_mask=full.npu(), sparse_mode=int(mode[0]))
        if mode == "0-mask":
            kw.update(pre_tokens=PRE, next_tokens=NEXT)
    elif mode != "0-none":
        kw.update(atten_mask=COMPRESSED.npu(), sparse_mode=int(mode))
        if mode == "4":
            kw.update(pre_tokens=PRE, next_tokens=NEXT)
    if paged:
        kc, vc, table = _paged((k, v), kv_lens, bs, g)
        key, value = kc.npu(), vc.npu()
        kw.update(block_table=table.npu(), block_size=bs)
    else:
        key, value = _to_layout(k, layout).npu(), _to_layout(v, layout).npu()
    out, _ = torch_npu.npu_fused_infer_attention_score(_to_layout(q, layout).npu(), key,
                                                       value, **kw)  # fmt: skip
    got = _from_layout(out.cpu(), layout).double()
    want = _reference(q, k, v, q_lens, kv_lens, mode, full, scale, incremental)
    torch.testing.assert_close(got, want, atol=3e-3, rtol=3e-3)


# sparse_mode 2 at query S 1: test_leftup_causal_mask_at_one_query_is_refused
CASES = [(m, q) for m in MODES for q in (1, 5, -1) if (m, q) != ("2", 1)]


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("mode", "q_seq"), CASES, ids=[f"{m}-{'q_eq_kv' if q < 0 else f'q{q}'}" for m, q in CASES]
)
def test_sparse_mode_matches_the_documented_definition(mode: str, q_seq: int, layout: str,
                                                       paged: bool) -> None:  # fmt: skip
    _case(mode, q_seq, layout, paged)


def test_causal_decode_bsnd_sees_every_key() -> None:
    """The issue's case: BSND, sparse_mode 3, the 2048 mask, a one-token query; against
    torch's own scaled_dot_product_attention over all keys."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, s, 4, 16, generator=g).half() for s in (1, 64, 64))
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q.npu(), k.npu(), v.npu(), atten_mask=COMPRESSED.npu(), sparse_mode=3, num_heads=4,
        input_layout="BSND", scale=0.25,
    )  # fmt: skip
    want = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().transpose(1, 2) for t in (q, k, v)), scale=0.25
    ).transpose(1, 2)
    torch.testing.assert_close(out.cpu().float(), want, atol=2e-3, rtol=2e-3)


def test_leftup_causal_mask_at_one_query_is_refused() -> None:
    """At query S 1, IFA reads a 2-D mask as (B, KV_S) unless the mode is 3 or 4."""
    q, k = torch.zeros(2, 1, 4, 16).half().npu(), torch.zeros(2, 8, 4, 16).half().npu()
    with pytest.raises(SimUsageError, match=r"atten_mask: at query S 1 .* \(B, KV_S\)"):
        torch_npu.npu_fused_infer_attention_score(
            q, k, k, atten_mask=COMPRESSED.npu(), sparse_mode=2, num_heads=4,
            input_layout="BSND",
        )  # fmt: skip


def _tnd_case(mode: str, paged: bool) -> None:
    g = torch.Generator().manual_seed(11)
    bs = 128
    q_lens, kv_lens = [3, 1], [7, 130] if paged else [7, 5]
    kv_seq = max(kv_lens)
    q = torch.randn(B, N, max(q_lens), D, generator=g).half()
    k = torch.randn(B, NKV, kv_seq, D, generator=g).half()
    v = torch.randn(B, NKV, kv_seq, D, generator=g).half()

    def rows(x: torch.Tensor, lens: list[int]) -> torch.Tensor:  # [B, N, S, D] -> [T, N, D]
        return torch.cat([x[b, :, : lens[b]].transpose(0, 1) for b in range(B)])

    ends = [sum(q_lens[: i + 1]) for i in range(B)]
    kw: dict[str, Any] = dict(num_heads=N, num_key_value_heads=NKV, scale=0.25,
                              input_layout="TND", actual_seq_lengths=ends)  # fmt: skip
    if mode in ("3", "4"):  # 4: vllm-ascend's sliding window over TND
        kw.update(atten_mask=COMPRESSED.npu(), sparse_mode=int(mode))
        if mode == "4":
            kw.update(pre_tokens=PRE, next_tokens=NEXT)
    if paged:
        kc, vc, table = _paged((k, v), kv_lens, bs, g)
        key, value = kc.npu(), vc.npu()
        kw.update(block_table=table.npu(), block_size=bs, actual_seq_lengths_kv=kv_lens)
    else:
        key, value = rows(k, kv_lens).npu(), rows(v, kv_lens).npu()
        kw.update(actual_seq_lengths_kv=[sum(kv_lens[: i + 1]) for i in range(B)])
    out, _ = torch_npu.npu_fused_infer_attention_score(rows(q, q_lens).npu(), key, value, **kw)
    want = _reference(q, k, v, q_lens, kv_lens, "0-none" if mode == "0" else mode, None,
                      0.25, False)  # fmt: skip
    torch.testing.assert_close(out.cpu().double(), rows(want, q_lens), atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
@pytest.mark.parametrize("mode", ["0", "3", "4"])
def test_tnd_sparse_modes(mode: str, paged: bool) -> None:
    _tnd_case(mode, paged)


@pytest.mark.parametrize("mode", [1, 2])
def test_tnd_refuses_other_modes_in_the_documents_words(mode: str) -> None:
    q = torch.zeros(4, N, D).half().npu()
    mask = (COMPRESSED if mode != 1 else torch.zeros(1, 4, 4, dtype=torch.bool)).npu()
    with pytest.raises(SimUsageError, match="TND/NTD layouts take sparse_mode 0 without"):
        torch_npu.npu_fused_infer_attention_score(
            q, q, q, atten_mask=mask, sparse_mode=mode, num_heads=N, input_layout="TND",
            actual_seq_lengths=[4], actual_seq_lengths_kv=[4],
        )  # fmt: skip
