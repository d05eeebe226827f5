"""Dense (non-paged) BNSD/BSND/BSH calls of the sim's ``npu_fused_infer_attention_score``,
run as the op on NPU tensors, against the loop-based float64 reference of
tests/dense_reference.py: layouts, GQA, per-batch lengths, the incremental branch,
pse_shift, masks and sparse modes 0/1, softmax_lse, dtypes and input handling."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from dense_reference import (
    LAYOUTS,
    SCALE,
    assert_matches,
    fia,
    make_qkv,
    random_mask,
    reference,
    run,
    to_layout,
)
from npusim import SimUsageError, extensions, torch_npu

# --------------------------------------------------------------------------- layouts / GQA


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sq", [1, 5])
def test_layout_matches_reference(layout: str, sq: int) -> None:
    q, k, v = make_qkv(2, 4, 4, sq, 9, 16)
    out, _ = run(q, k, v, layout)
    assert out.dtype == torch.float16
    assert_matches(out, reference(q, k, v)[0], torch.float16)


def test_layouts_give_equal_results() -> None:
    q, k, v = make_qkv(2, 4, 2, 3, 11, 16, seed=1)
    outs = [run(q, k, v, layout, actual_seq_lengths_kv=[7, 11])[0] for layout in LAYOUTS]
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], atol=0, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gqa_8_heads_2_kv_heads(layout: str) -> None:
    q, k, v = make_qkv(2, 8, 2, 1, 20, 16, seed=2)
    out, _ = run(q, k, v, layout)
    assert_matches(out, reference(q, k, v)[0], torch.float16)
    # Same as full MHA with each kv head repeated for its group of 4 query heads.
    k_rep, v_rep = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    mha, _ = run(q, k_rep, v_rep, layout)
    torch.testing.assert_close(out, mha, atol=0, rtol=0)


@pytest.mark.usefixtures("float32_attention")
def test_num_key_value_heads_zero_means_num_heads() -> None:
    q, k, v = make_qkv(1, 4, 4, 2, 6, 8, dtype=torch.float32)
    a, _ = fia(q, k, v, num_heads=4, input_layout="BNSD", scale=SCALE)
    b, _ = fia(q, k, v, num_heads=4, num_key_value_heads=4, input_layout="BNSD", scale=SCALE)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert_matches(a, reference(q, k, v)[0], torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_value_head_dim_differs_from_key(layout: str) -> None:
    q, k, v = make_qkv(2, 4, 2, 3, 7, 16, dv=8, seed=3)
    out, _ = run(q, k, v, layout)
    assert out.shape == (2, 4, 3, 8)
    assert_matches(out, reference(q, k, v)[0], torch.float16)


@pytest.mark.parametrize(
    ("layout", "shape"), [("BNSD", (2, 4, 3, 8)), ("BSND", (2, 3, 4, 8)), ("BSH", (2, 3, 32))]
)
def test_output_layout_shapes(layout: str, shape: tuple[int, ...]) -> None:
    q, k, v = (to_layout(t, layout).npu() for t in make_qkv(2, 4, 2, 3, 7, 16, dv=8))
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout=layout)
    out, lse = torch_npu.npu_fused_infer_attention_score(q, k, v, **kw)
    assert tuple(out.shape) == shape and out.is_contiguous() and out.device == q.device
    assert tuple(lse.shape) == (1,)
    o, lse_ = torch_npu._npu_fused_infer_attention_score_infer_output(q, v, **kw)
    assert (tuple(o.shape), tuple(lse_.shape)) == (shape, (1,))


# --------------------------------------------------------------------------- sequence lengths


def test_per_batch_kv_lengths_including_zero() -> None:
    q, k, v = make_qkv(3, 4, 2, 1, 12, 16, seed=4)
    lens = [5, 0, 12]
    out, lse = run(q, k, v, "BSH", actual_seq_lengths_kv=lens, softmax_lse_flag=True)
    ref_out, ref_lse = reference(q, k, v, kv_lens=lens)
    assert_matches(out, ref_out, torch.float16)
    assert torch.count_nonzero(out[1]) == 0
    assert torch.count_nonzero(lse[1]) == 0
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def test_kv_lengths_beyond_length_do_not_matter() -> None:
    q, k, v = make_qkv(2, 2, 2, 1, 10, 8, seed=5)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 6:] = 100.0
    v2[:, :, 6:] = -100.0
    a, _ = run(q, k, v, actual_seq_lengths_kv=[6])
    b, _ = run(q, k2, v2, actual_seq_lengths_kv=[6])
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_kv_length_list_of_one_broadcasts_and_longer_list_is_truncated() -> None:
    q, k, v = make_qkv(3, 2, 2, 2, 10, 8, seed=6)
    single, _ = run(q, k, v, actual_seq_lengths_kv=[7])
    repeated, _ = run(q, k, v, actual_seq_lengths_kv=[7, 7, 7])
    torch.testing.assert_close(single, repeated, atol=0, rtol=0)
    assert_matches(single, reference(q, k, v, kv_lens=[7, 7, 7])[0], torch.float16)

    longer, _ = run(q, k, v, actual_seq_lengths_kv=(4, 9, 3, 10, 1))
    exact, _ = run(q, k, v, actual_seq_lengths_kv=[4, 9, 3])
    torch.testing.assert_close(longer, exact, atol=0, rtol=0)
    assert_matches(longer, reference(q, k, v, kv_lens=[4, 9, 3])[0], torch.float16)


def test_incremental_branch_ignores_query_lengths() -> None:
    # Mirrors the upstream torch_npu test: Sq == 1 with [29] and [100] gives identical results.
    q, k, v = make_qkv(1, 4, 4, 1, 64, 16, seed=7)
    a, _ = run(q, k, v, "BSH", actual_seq_lengths=[29])
    b, _ = run(q, k, v, "BSH", actual_seq_lengths=[100])
    c, _ = run(q, k, v, "BSH")
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(a, c, atol=0, rtol=0)
    assert torch.count_nonzero(a) > 0


def test_incremental_branch_ignores_sparse_mode_and_tokens() -> None:
    """At query S 1 sparse_mode and pre/next_tokens are "invalid" (ignored); a mask
    still applies."""
    q, k, v = make_qkv(2, 4, 2, 1, 12, 16, seed=25)
    masked = random_mask(2, 1, 12, seed=26)
    plain, _ = run(q, k, v, "BSND", atten_mask=masked)
    odd, _ = run(q, k, v, "BSND", atten_mask=masked, sparse_mode=1, pre_tokens=0, next_tokens=0)
    torch.testing.assert_close(plain, odd, atol=0, rtol=0)
    assert_matches(plain, reference(q, k, v, masked=masked)[0], torch.float16)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prompt_branch_query_lengths_zero_rows(layout: str) -> None:
    q, k, v = make_qkv(2, 4, 2, 6, 8, 16, seed=8)
    q_lens = [4, 6]
    out, lse = run(q, k, v, layout, actual_seq_lengths=q_lens, softmax_lse_flag=True)
    ref_out, ref_lse = reference(q, k, v, q_lens=q_lens)
    assert_matches(out, ref_out, torch.float16)
    assert torch.count_nonzero(out[0, :, 4:]) == 0
    assert torch.count_nonzero(lse[0, :, 4:]) == 0
    assert torch.count_nonzero(out[1, :, 4:]) > 0
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def test_zero_kv_sequence_gives_zeros() -> None:
    q, k, v = make_qkv(2, 2, 2, 3, 0, 8)
    out, lse = run(q, k, v, softmax_lse_flag=True)
    assert out.shape == (2, 2, 3, 8)
    assert torch.count_nonzero(out) == 0
    assert torch.count_nonzero(lse) == 0


# --------------------------------------------------------------------------- pse / mask


@pytest.mark.parametrize("pse_batch", [2, 1])
def test_pse_shift(pse_batch: int) -> None:
    q, k, v = make_qkv(2, 4, 2, 3, 9, 16, seed=9)
    gen = torch.Generator().manual_seed(10)
    pse = torch.randn(pse_batch, 4, 3, 9, generator=gen).to(torch.float16)
    out, lse = run(q, k, v, "BSND", pse_shift=pse, softmax_lse_flag=True)
    ref_out, ref_lse = reference(q, k, v, pse=pse)
    assert_matches(out, ref_out, torch.float16)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
    plain, _ = run(q, k, v, "BSND")
    assert not torch.equal(out, plain)


def test_pse_shift_padded_trailing_dims_are_sliced() -> None:
    q, k, v = make_qkv(1, 2, 2, 3, 9, 8, seed=11)
    gen = torch.Generator().manual_seed(12)
    padded = torch.randn(1, 2, 16, 32, generator=gen).to(torch.float16)
    a, _ = run(q, k, v, pse_shift=padded)
    b, _ = run(q, k, v, pse_shift=padded[:, :, :3, :9].contiguous())
    torch.testing.assert_close(a, b, atol=0, rtol=0)


MASK_FORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # each maps a per-batch (B, Sq, Skv) bool mask to an accepted input shape
    "B_1_Sq_Skv_bool": lambda m: m.unsqueeze(1),
    "B_Sq_Skv_uint8": lambda m: m.to(torch.uint8),
    "B_1_Sq_Skv_int8_padded": lambda m: torch.nn.functional.pad(
        m.unsqueeze(1).to(torch.int8), (0, 32 - m.shape[2], 0, 16 - m.shape[1]), value=1
    ),
}


@pytest.mark.parametrize("form", sorted(MASK_FORMS))
@pytest.mark.parametrize("sq", [1, 4])
def test_atten_mask_per_batch_forms(form: str, sq: int) -> None:
    q, k, v = make_qkv(2, 4, 2, sq, 10, 16, seed=13)
    masked = random_mask(2, sq, 10, seed=14)
    out, lse = run(q, k, v, "BSH", atten_mask=MASK_FORMS[form](masked), softmax_lse_flag=True)
    ref_out, ref_lse = reference(q, k, v, masked=masked)
    assert_matches(out, ref_out, torch.float16)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def test_atten_mask_shared_2d_sparse_mode_1_ignores_tokens() -> None:
    q, k, v = make_qkv(2, 2, 2, 5, 5, 8, seed=15)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(diagonal=1)
    out, _ = run(q, k, v, atten_mask=causal, sparse_mode=1)
    assert_matches(out, reference(q, k, v, masked=causal.expand(2, 5, 5))[0], torch.float16)
    # sparse_mode 1 (allMask) applies the mask only; pre_tokens / next_tokens are ignored
    same, _ = run(q, k, v, atten_mask=causal, sparse_mode=1, pre_tokens=1, next_tokens=0)
    torch.testing.assert_close(out, same, atol=0, rtol=0)
    # so is mode 0 with the default (INT32_MAX) tokens
    default, _ = run(q, k, v, atten_mask=causal)
    torch.testing.assert_close(out, default, atol=0, rtol=0)


def test_sparse_mode_0_with_a_mask_keeps_the_token_band() -> None:
    """The document: with a mask, mode 0 computes only what lies between pre_tokens and
    next_tokens (``i - pre_tokens <= j <= i + next_tokens``), on top of the mask."""
    q, k, v = make_qkv(2, 2, 2, 6, 8, 8, seed=27)
    masked = random_mask(2, 6, 8, seed=28)
    i, j = torch.arange(6).reshape(6, 1), torch.arange(8).reshape(1, 8)
    band = (j >= i - 1) & (j <= i + 2)
    out, lse = run(q, k, v, atten_mask=masked, pre_tokens=1, next_tokens=2, softmax_lse_flag=True)
    ref_out, ref_lse = reference(q, k, v, masked=masked | ~band)
    assert_matches(out, ref_out, torch.float16)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def test_atten_mask_batch_by_kv_for_single_query() -> None:
    q, k, v = make_qkv(3, 2, 1, 1, 12, 8, seed=16)
    masked = random_mask(3, 1, 12, seed=17)
    out, _ = run(q, k, v, atten_mask=masked[:, 0, :])  # (B, Skv)
    assert_matches(out, reference(q, k, v, masked=masked)[0], torch.float16)


def test_fully_masked_row_gives_zeros_not_nan() -> None:
    q, k, v = make_qkv(2, 2, 2, 3, 6, 8, seed=18)
    masked = torch.zeros(2, 3, 6, dtype=torch.bool)
    masked[0, 1, :] = True
    masked[1, :, 4:] = True
    out, lse = run(q, k, v, atten_mask=masked, softmax_lse_flag=True)
    assert not torch.isnan(out).any()
    assert not torch.isnan(lse).any()
    assert torch.count_nonzero(out[0, :, 1]) == 0
    assert torch.count_nonzero(lse[0, :, 1]) == 0
    ref_out, ref_lse = reference(q, k, v, masked=masked)
    assert_matches(out, ref_out, torch.float16)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- lse / dtypes


@pytest.mark.usefixtures("float32_attention")
def test_softmax_lse_with_flag_matches_logsumexp() -> None:
    q, k, v = make_qkv(2, 4, 2, 3, 9, 16, dtype=torch.float32, seed=19)
    out, lse = run(q, k, v, "BSND", softmax_lse_flag=True, actual_seq_lengths_kv=[9, 5])
    assert lse.dtype == torch.float32
    assert lse.shape == (2, 4, 3, 1)
    ref_out, ref_lse = reference(q, k, v, kv_lens=[9, 5])
    assert_matches(out, ref_out, torch.float32)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_softmax_lse_without_flag_is_single_zero() -> None:
    q, k, v = make_qkv(2, 4, 2, 3, 9, 16)
    _, lse = run(q, k, v)
    assert lse.dtype == torch.float32
    assert lse.shape == (1,)
    assert lse.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes(dtype: torch.dtype) -> None:
    """float16 and bfloat16 as the NPU takes them; float32 with the sim's extension."""
    q, k, v = make_qkv(2, 4, 2, 3, 9, 16, dtype=dtype, seed=20)
    with extensions.enabled(*(["float32_attention"] if dtype == torch.float32 else [])):
        out, _ = run(q, k, v, "BSH", actual_seq_lengths_kv=[9, 4])
    assert out.dtype == dtype
    assert_matches(out, reference(q, k, v, kv_lens=[9, 4])[0], dtype)


def test_decode_sized_batch() -> None:
    q, k, v = make_qkv(8, 8, 8, 1, 256, 64, seed=21)
    lens = [256, 1, 17, 128, 255, 64, 0, 200]
    out, _ = run(q, k, v, "BSH", scale=0.125, actual_seq_lengths_kv=lens)
    assert_matches(out, reference(q, k, v, scale=0.125, kv_lens=lens)[0], torch.float16)


# --------------------------------------------------------------------------- input handling


@pytest.mark.usefixtures("float32_attention")
def test_inputs_are_not_modified() -> None:
    q, k, v = make_qkv(2, 4, 2, 3, 9, 16, dtype=torch.float32, seed=22)
    pse = torch.randn(1, 4, 3, 9)
    mask = random_mask(2, 3, 9, seed=23).unsqueeze(1)
    originals = [t.clone() for t in (q, k, v, pse, mask)]
    on_npu = [t.npu() for t in (q, k, v, pse, mask)]
    torch_npu.npu_fused_infer_attention_score(
        *on_npu[:3], pse_shift=on_npu[3], atten_mask=on_npu[4], actual_seq_lengths=[2, 3],
        actual_seq_lengths_kv=[9, 6], num_heads=4, num_key_value_heads=2, input_layout="BNSD",
        softmax_lse_flag=True,
    )  # fmt: skip
    for before, after in zip(originals, on_npu, strict=True):
        assert torch.equal(before, after.cpu())


def test_non_contiguous_inputs_are_refused_naming_the_argument() -> None:
    """The wheel's documentation: query, key and value do not support non-contiguous
    tensors (a BNSD tensor viewed as BSND through a transpose, a strided slice)."""
    q, k, v = make_qkv(2, 4, 2, 3, 9, 16, seed=24)
    q_nc, k_nc, v_nc = (t.npu().transpose(1, 2) for t in (q, k, v))
    assert not q_nc.is_contiguous()
    kw = dict(num_heads=4, num_key_value_heads=2, scale=SCALE)
    with pytest.raises(SimUsageError, match=r"^npu_fused_infer_attention_score: query is not "
                       r"contiguous .*does not support non-contiguous tensors"):  # fmt: skip
        torch_npu.npu_fused_infer_attention_score(q_nc, k_nc, v_nc, input_layout="BSND", **kw)
    big_q = torch.randn(2, 6, 64).to(torch.float16).npu()
    k_bsh, v_bsh = to_layout(k, "BSH").npu(), to_layout(v, "BSH").npu()
    with pytest.raises(SimUsageError, match="value is not contiguous"):
        torch_npu.npu_fused_infer_attention_score(big_q[:, ::2].contiguous(), k_bsh,
                                                  v_bsh[:, ::2], **kw)  # fmt: skip
    out, _ = torch_npu.npu_fused_infer_attention_score(big_q[:, ::2].contiguous(), k_bsh,
                                                       v_bsh, **kw)  # fmt: skip
    assert out.shape == (2, 3, 64)


def test_unimplemented_arguments_at_their_defaults_are_accepted() -> None:
    q, k, v = make_qkv(1, 2, 2, 1, 4, 8)
    defaults: dict[str, object] = {
        "block_table": None,
        "quant_scale2": None,
        "antiquant_scale": None,
        "key_shared_prefix": None,
        "block_size": 0,
        "antiquant_mode": 0,
        "key_antiquant_mode": 0,
        "value_antiquant_mode": 0,
    }
    a, _ = run(q, k, v, **defaults)
    b, _ = run(q, k, v)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("layout", ["TND", "TND_NTD"])
def test_tnd_rows_and_softmax_lse_per_batch(layout: str) -> None:
    """TND packs the batches' rows one after another (cumulative ends); attention_out
    and softmax_lse come back in rows too, a padded row past the last end as zeros."""
    n, nkv, d, q_lens, kv_lens = 4, 2, 16, [3, 2], [5, 4]
    t, t_kv = sum(q_lens) + 1, sum(kv_lens)
    gen = torch.Generator().manual_seed(29)
    q = torch.randn(t, n, d, generator=gen).to(torch.float16)
    k, v = (torch.randn(t_kv, nkv, d, generator=gen).to(torch.float16) for _ in range(2))
    out, lse = fia(
        q, k, v, actual_seq_lengths=[3, 5], actual_seq_lengths_kv=[5, 9], num_heads=n,
        num_key_value_heads=nkv, input_layout=layout, scale=SCALE, softmax_lse_flag=True,
    )  # fmt: skip
    rows = out if layout == "TND" else out.permute(1, 0, 2)  # NTD -> TND
    assert rows.shape == (t, n, d) and lse.shape == (t, n, 1)
    qs = ks = 0
    for ql, kl in zip(q_lens, kv_lens, strict=True):
        bnsd = [x.transpose(0, 1).unsqueeze(0) for x in (q[qs : qs + ql], k[ks : ks + kl],
                                                          v[ks : ks + kl])]  # fmt: skip
        ref_out, ref_lse = reference(*bnsd)
        assert_matches(rows[qs : qs + ql].transpose(0, 1), ref_out[0], torch.float16)
        torch.testing.assert_close(lse[qs : qs + ql].transpose(0, 1).double(), ref_lse[0],
                                   atol=1e-4, rtol=1e-4)  # fmt: skip
        qs, ks = qs + ql, ks + kl
    assert torch.count_nonzero(rows[-1]) == 0 and torch.count_nonzero(lse[-1]) == 0
