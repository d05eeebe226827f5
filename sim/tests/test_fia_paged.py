"""Paged KV, TND, causal masks, GQA and MLA of the sim's FIA (v1 and v2) and
``_npu_paged_attention``, against a reference written here with plain torch loops
(no code of the sim's kernel): per batch and head, gather the sequence's keys block by
block through the block table, softmax over the allowed keys, weight the values.
"""

from __future__ import annotations

import math

import pytest
import torch
from npusim import SimUsageError, UpdateKeyIgnoredWarning, torch_npu

G = torch.Generator().manual_seed(7)


def rand(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(*shape, generator=G, dtype=torch.float32).to(dtype)


def ref_attend(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, allowed: list[bool],
               scale: float) -> torch.Tensor:  # fmt: skip
    """One query row [D] against keys [S, D] / values [S, Dv], float64."""
    out = torch.zeros(vs.shape[-1], dtype=torch.float64)
    idx = [j for j, ok in enumerate(allowed) if ok]
    if not idx:
        return out
    s = torch.stack([q.double() @ ks[j].double() for j in idx]) * scale
    p = torch.softmax(s, dim=0)
    for w, j in zip(p, idx, strict=True):
        out += w * vs[j].double()
    return out


def gather(cache: torch.Tensor, table: torch.Tensor, b: int, n: int, bs: int) -> torch.Tensor:
    """The first n positions of batch b from a (blocks, bs, KV_N, D) cache, block by block."""
    rows = []
    for pos in range(n):
        rows.append(cache[int(table[b, pos // bs]), pos % bs])
    return torch.stack(rows) if rows else cache.new_zeros(0, *cache.shape[2:])


def caches(nb: int, bs: int, nkv: int, d: int, dv: int | None = None):
    return rand(nb, bs, nkv, d), rand(nb, bs, nkv, dv or d)


def shuffled_table(batch: int, per_seq: int, nb: int) -> torch.Tensor:
    perm = torch.randperm(nb, generator=G)[: batch * per_seq]
    return perm.reshape(batch, per_seq).to(torch.int32)


# ============================================================ decode, paged, GQA
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
def test_paged_decode_gqa_crossing_block_boundaries(layout: str) -> None:
    b, n, nkv, d, bs, per_seq, nb = 3, 8, 2, 16, 16, 4, 16
    kc, vc = caches(nb, bs, nkv, d)
    table = shuffled_table(b, per_seq, nb)
    lens = [17, 33, 64]  # one past a block, two blocks and a bit, exactly full
    q = rand(b, n, d)
    shaped = {"BSH": q.reshape(b, 1, n * d), "BSND": q.reshape(b, 1, n, d),
              "BNSD": q.reshape(b, n, 1, d)}[layout]  # fmt: skip
    kv = (kc.reshape(nb, bs, nkv * d), vc.reshape(nb, bs, nkv * d))
    if layout == "BNSD":  # the (blocknum, KV_N, blocksize, D) cache layout
        kv = (kc.permute(0, 2, 1, 3).contiguous(), vc.permute(0, 2, 1, 3).contiguous())
    out, _ = torch_npu.npu_fused_infer_attention_score(
        shaped.npu(), kv[0].npu(), kv[1].npu(), block_table=table.npu(), block_size=bs,
        actual_seq_lengths_kv=lens, num_heads=n, num_key_value_heads=nkv, input_layout=layout,
        scale=1 / math.sqrt(d),
    )  # fmt: skip
    got = out.cpu().reshape(b, n, d)  # S is 1: every layout flattens to [B, N, D]
    for i in range(b):
        ks, vs = gather(kc, table, i, lens[i], bs), gather(vc, table, i, lens[i], bs)
        for h in range(n):
            want = ref_attend(q[i, h], ks[:, h // (n // nkv)], vs[:, h // (n // nkv)],
                              [True] * lens[i], 1 / math.sqrt(d))  # fmt: skip
            torch.testing.assert_close(got[i, h].double(), want, atol=2e-3, rtol=2e-3)


# ============================================================ TND, paged, causal (vllm-ascend)
def test_tnd_paged_causal_prefill_with_cumulative_query_ends() -> None:
    n, nkv, d, bs, nb = 4, 2, 16, 128, 6
    q_lens, kv_lens = [3, 1, 5], [130, 7, 200]  # chunked prefill: kv includes the new tokens
    ends = [sum(q_lens[: i + 1]) for i in range(3)]
    t = ends[-1] + 2  # padded T: rows past the last end come back zero
    kc, vc = caches(nb, bs, nkv, d)
    table = torch.tensor([[4, 1], [0, 5], [2, 3]], dtype=torch.int32)
    q = rand(t, n, d)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q.npu(), kc.reshape(nb, bs, -1).npu(), vc.reshape(nb, bs, -1).npu(),
        atten_mask=mask.npu(), block_table=table.npu(), input_layout="TND", block_size=bs,
        actual_seq_lengths=ends, actual_seq_lengths_kv=kv_lens, num_heads=n,
        num_key_value_heads=nkv, scale=0.25, sparse_mode=3,
    )  # fmt: skip
    got = out.cpu()
    assert got.shape == (t, n, d)
    start = 0
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        ks, vs = gather(kc, table, i, kl, bs), gather(vc, table, i, kl, bs)
        for r in range(ql):
            allowed = [j <= r + kl - ql for j in range(kl)]  # causal, aligned bottom-right
            for h in range(n):
                want = ref_attend(q[start + r, h], ks[:, h // 2], vs[:, h // 2], allowed, 0.25)
                torch.testing.assert_close(got[start + r, h].double(), want, atol=2e-3, rtol=2e-3)
        start += ql
    assert torch.count_nonzero(got[ends[-1] :]) == 0


def test_sparse_mode_2_is_causal_aligned_top_left() -> None:
    b, n, s, skv, d = 1, 2, 4, 6, 8
    q, k, v = rand(b, n, s, d), rand(b, n, skv, d), rand(b, n, skv, d)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q.npu(), k.npu(), v.npu(), atten_mask=mask.npu(), num_heads=n, input_layout="BNSD",
        sparse_mode=2,
    )  # fmt: skip
    for i in range(s):
        want = ref_attend(q[0, 1, i], k[0, 1], v[0, 1], [j <= i for j in range(skv)], 1.0)
        torch.testing.assert_close(out.cpu()[0, 1, i].double(), want, atol=2e-3, rtol=2e-3)


# ============================================================ MLA (query D 512, latent KV)
def test_mla_decode_paged_latent_kv_with_rope() -> None:
    b, n, d, rd, bs, nb = 2, 32, 512, 64, 16, 8
    latent, rope = rand(nb, bs, 1, d), rand(nb, bs, 1, rd)
    table = shuffled_table(b, 3, nb)
    lens = [20, 41]
    q, qr = rand(b, 1, n, d), rand(b, 1, n, rd)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q.npu(), latent.reshape(nb, bs, d).npu(), latent.reshape(nb, bs, d).npu(),
        query_rope=qr.npu(), key_rope=rope.reshape(nb, bs, rd).npu(), block_table=table.npu(),
        block_size=bs, actual_seq_lengths_kv=lens, num_heads=n, num_key_value_heads=1,
        input_layout="BSND", scale=0.05,
    )  # fmt: skip
    for i in range(b):
        kl = gather(latent, table, i, lens[i], bs)[:, 0]
        kr = gather(rope, table, i, lens[i], bs)[:, 0]
        keys = torch.cat([kl, kr], dim=-1)
        for h in (0, 17, 31):
            qq = torch.cat([q[i, 0, h], qr[i, 0, h]])
            want = ref_attend(qq, keys, kl, [True] * lens[i], 0.05)
            torch.testing.assert_close(out.cpu()[i, 0, h].double(), want, atol=3e-3, rtol=3e-3)


def test_mla_refuses_what_the_document_excludes() -> None:
    q = rand(1, 1, 32, 512).npu()
    latent = rand(4, 16, 512).npu()
    with pytest.raises(SimUsageError, match="page attention"):
        torch_npu.npu_fused_infer_attention_score(
            q, rand(1, 16, 1, 512).npu(), rand(1, 16, 1, 512).npu(),
            query_rope=rand(1, 1, 32, 64).npu(), key_rope=rand(1, 16, 1, 64).npu(),
            num_heads=32, num_key_value_heads=1, input_layout="BSND",
        )  # fmt: skip
    with pytest.raises(SimUsageError, match="together"):
        torch_npu.npu_fused_infer_attention_score(
            q, latent, latent, query_rope=rand(1, 1, 32, 64).npu(),
            block_table=torch.zeros(1, 4, dtype=torch.int32).npu(), block_size=16,
            actual_seq_lengths_kv=[8], num_heads=32, num_key_value_heads=1, input_layout="BSND",
        )  # fmt: skip


# ============================================================ v2 and _npu_paged_attention
def test_v2_matches_v1_with_its_own_names() -> None:
    b, n, d, bs, nb = 2, 4, 16, 16, 8
    kc, vc = caches(nb, bs, 4, d)
    table = shuffled_table(b, 2, nb).npu()
    q = rand(b, 1, n * d).npu()
    k, v = kc.reshape(nb, bs, -1).npu(), vc.reshape(nb, bs, -1).npu()
    o1, lse1 = torch_npu.npu_fused_infer_attention_score(
        q, k, v, block_table=table, block_size=bs, actual_seq_lengths_kv=[5, 30], num_heads=n,
        softmax_lse_flag=True, scale=0.3,
    )  # fmt: skip
    o2, lse2 = torch_npu.npu_fused_infer_attention_score_v2(
        q, k, v, block_table=table, block_size=bs, actual_seq_kvlen=[5, 30], num_query_heads=n,
        return_softmax_lse=True, softmax_scale=0.3,
    )  # fmt: skip
    assert torch.equal(o1.cpu(), o2.cpu()) and torch.equal(lse1.cpu(), lse2.cpu())


def test_npu_paged_attention_against_the_reference() -> None:
    b, n, nkv, d, bs, nb = 3, 8, 4, 16, 16, 12
    kc, vc = caches(nb, bs, nkv, d)
    table = shuffled_table(b, 3, nb)
    lens = torch.tensor([1, 16, 40], dtype=torch.int32)
    q = rand(b, n, d)
    out = torch.empty(b, n, d, dtype=torch.float16).npu()
    torch_npu._npu_paged_attention(
        query=q.npu(), key_cache=kc.npu(), value_cache=vc.npu(), num_kv_heads=nkv, num_heads=n,
        scale_value=0.25, block_table=table.npu(), context_lens=lens, out=out,
    )  # fmt: skip
    for i in range(b):
        ks, vs = gather(kc, table, i, int(lens[i]), bs), gather(vc, table, i, int(lens[i]), bs)
        for h in range(n):
            want = ref_attend(q[i, h], ks[:, h // 2], vs[:, h // 2], [True] * int(lens[i]), 0.25)
            torch.testing.assert_close(out.cpu()[i, h].double(), want, atol=2e-3, rtol=2e-3)


# ============================================================ API facts of torch_npu 2.14
def test_arguments_after_value_are_keyword_only() -> None:
    q = rand(1, 2, 1, 8).npu()
    with pytest.raises((TypeError, RuntimeError, SimUsageError)):
        torch_npu.npu_fused_infer_attention_score(q, q, q, None, None, [1], [1])


def test_out_returns_attention_out_and_softmax_lse() -> None:
    q = rand(1, 2, 1, 8).npu()
    o, lse = torch.empty_like(q), torch.empty(1, 2, 1, 1, dtype=torch.float32).npu()
    got = torch_npu.npu_fused_infer_attention_score.out(
        q, q, q, num_heads=2, input_layout="BNSD", softmax_lse_flag=True, out=[o, lse]
    )
    assert got[0] is o and got[1] is lse


def test_workspace_too_small_or_of_the_wrong_dtype() -> None:
    n, d, s = 2, 8, 512
    q, kv = rand(1, n, 1, d).npu(), rand(1, n, s, d).npu()
    kw = dict(num_heads=n, input_layout="BNSD")
    ws = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
        q, kv, kv, actual_seq_lengths_kv=[64], **kw
    )
    o, lse = torch.empty_like(q), torch.empty(1, dtype=torch.float32).npu()
    with pytest.raises(SimUsageError, match="workspace holds 1 bytes"):
        torch_npu.npu_fused_infer_attention_score.out(
            q, kv, kv, actual_seq_lengths_kv=[64], out=[o, lse],
            workspace=torch.empty(1, dtype=torch.uint8).npu(), **kw,
        )  # fmt: skip
    with pytest.raises(SimUsageError, match="uint8"):
        torch_npu.npu_fused_infer_attention_score.out(
            q, kv, kv, actual_seq_lengths_kv=[64], workspace=ws.to(torch.float32), out=[o, lse],
            **kw,
        )  # fmt: skip


def test_update_of_a_key_the_capture_did_not_pass_is_dropped_and_warned() -> None:
    """On the NPU the replay silently attends over the whole padded KV."""
    n, d, s = 2, 8, 32
    q, kv = rand(1, n, 1, d).npu(), rand(1, n, s, d).npu()
    kw = dict(num_heads=n, input_layout="BNSD")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        out, _ = torch_npu.npu_fused_infer_attention_score(q, kv, kv, **kw)
    with pytest.warns(UpdateKeyIgnoredWarning, match="actual_seq_lengths_kv"):
        g.update(cpu_update_input=[{"actual_seq_lengths_kv": [4]}])
    g.replay()
    full, _ = torch_npu.npu_fused_infer_attention_score(q, kv, kv, **kw)
    assert torch.equal(out.cpu(), full.cpu())


def test_paged_attention_context_lens_update_by_auto_dispatch() -> None:
    b, n, d, bs, nb = 2, 4, 16, 16, 8
    kc, vc = caches(nb, bs, n, d)
    table = shuffled_table(b, 3, nb).npu()
    q, kc, vc = rand(b, n, d).npu(), kc.npu(), vc.npu()
    out = torch.empty(b, n, d, dtype=torch.float16).npu()
    args = dict(query=q, key_cache=kc, value_cache=vc, num_kv_heads=n, num_heads=n,
                scale_value=0.25, block_table=table, out=out)  # fmt: skip
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        torch_npu._npu_paged_attention(context_lens=torch.tensor([48, 48], dtype=torch.int32),
                                       **args)  # fmt: skip
    for lens in ([3, 17], [33, 1], [48, 20]):
        g.update(cpu_update_input=[{"context_lens": torch.tensor(lens, dtype=torch.int32)}])
        g.replay()
        want = torch.empty_like(out)
        torch_npu._npu_paged_attention(context_lens=torch.tensor(lens, dtype=torch.int32),
                                       **{**args, "out": want})  # fmt: skip
        assert torch.equal(out.cpu(), want.cpu())


def test_missing_names_exist_and_behave() -> None:
    s = torch.npu.Stream()
    torch.npu.set_stream_limit(s, 8, 16)
    assert torch.npu.get_stream_limit(s) == {"cube_core_num": 8, "vector_core_num": 16}
    torch.npu.reset_stream_limit(s)
    with pytest.raises(AssertionError):
        torch.npu.get_stream_limit(None)
    assert torch_npu._C._NPUTaskGroupHandle is not None
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).npu()
    assert torch_npu.get_npu_format(x) == torch_npu.Format.ND == 2
    storage = torch_npu._C._construct_storage_from_data_pointer(x.data_ptr(), x.device, 48)
    meta = {"size": (2, 4), "stride": (4, 1), "storage_offset": 4, "dtype": torch.float32,
            "data_ptr": storage.data_ptr()}  # fmt: skip
    y = torch_npu._C._construct_NPU_Tensor_From_Storage_And_Metadata(meta, storage)
    assert torch.equal(y.cpu(), x.cpu()[1:])
    g = torch.npu.NPUGraph()
    assert g.graph_dispatch_mode.graph_dispatch_records == []
    assert hasattr(torch.ops.npu._npu_fused_infer_attention_score_get_max_workspace, "default")
    double = torch.npu.make_graphed_callables(lambda t: t * 2, (x,))
    assert torch.equal(double(torch.ones(3, 4).npu()).cpu(), torch.full((3, 4), 2.0))
