"""Tests for graphlane.sim.attention_kernel against a loop-based float64 reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from graphlane.sim.attention_kernel import (
    AttentionArgumentError,
    check_arguments,
    fused_infer_attention,
    output_shapes,
    workspace_bytes,
)

LAYOUTS = ("BNSD", "BSND", "BSH")
SCALE = 0.25

# --------------------------------------------------------------------------- helpers


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
    """Random query/key/value in BNSD order."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, sq, d, generator=gen).to(dtype)
    k = torch.randn(b, nkv, skv, d, generator=gen).to(dtype)
    v = torch.randn(b, nkv, skv, d if dv is None else dv, generator=gen).to(dtype)
    return q, k, v


def to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Convert a BNSD tensor to ``layout`` (contiguous)."""
    if layout == "BNSD":
        return x.contiguous()
    bsnd = x.permute(0, 2, 1, 3).contiguous()
    if layout == "BSND":
        return bsnd
    b, s, n, d = bsnd.shape
    return bsnd.reshape(b, s, n * d)


def from_layout(x: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """Convert a ``layout`` tensor back to BNSD."""
    if layout == "BNSD":
        return x
    if layout == "BSH":
        b, s, h = x.shape
        x = x.reshape(b, s, heads, h // heads)
    return x.permute(0, 2, 1, 3)


def run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: str = "BNSD",
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Call the kernel with BNSD data converted to ``layout``; return the output in BNSD."""
    n, nkv = q.shape[1], k.shape[1]
    kwargs.setdefault("scale", SCALE)
    out, lse = fused_infer_attention(
        to_layout(q, layout),
        to_layout(k, layout),
        to_layout(v, layout),
        num_heads=n,
        num_key_value_heads=nkv,
        input_layout=layout,
        **kwargs,
    )
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


def test_num_key_value_heads_zero_means_num_heads() -> None:
    q, k, v = make_qkv(1, 4, 4, 2, 6, 8, dtype=torch.float32)
    a, _ = fused_infer_attention(q, k, v, num_heads=4, input_layout="BNSD", scale=SCALE)
    b, _ = fused_infer_attention(
        q, k, v, num_heads=4, num_key_value_heads=4, input_layout="BNSD", scale=SCALE
    )
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert_matches(a, reference(q, k, v)[0], torch.float32)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_value_head_dim_differs_from_key(layout: str) -> None:
    q, k, v = make_qkv(2, 4, 2, 3, 7, 16, dv=8, seed=3)
    out, _ = run(q, k, v, layout)
    assert out.shape == (2, 4, 3, 8)
    assert_matches(out, reference(q, k, v)[0], torch.float16)


def test_output_layout_shapes() -> None:
    q, k, v = make_qkv(2, 4, 2, 3, 7, 16, dv=8)
    for layout, shape in (("BNSD", (2, 4, 3, 8)), ("BSND", (2, 3, 4, 8)), ("BSH", (2, 3, 32))):
        out, _ = fused_infer_attention(
            to_layout(q, layout),
            to_layout(k, layout),
            to_layout(v, layout),
            num_heads=4,
            num_key_value_heads=2,
            input_layout=layout,
        )
        assert tuple(out.shape) == shape
        assert out.is_contiguous()
        expected = output_shapes(
            to_layout(q, layout),
            to_layout(v, layout),
            num_heads=4,
            input_layout=layout,
            num_key_value_heads=2,
        )
        assert expected == (shape, (1,))


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


def _random_mask(b: int, sq: int, skv: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    masked = torch.rand(b, sq, skv, generator=gen) < 0.4
    masked[..., 0] = False  # keep every row attendable
    return masked


MaskBuilder = Callable[[torch.Tensor], torch.Tensor]

MASK_FORMS: dict[str, MaskBuilder] = {
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
    masked = _random_mask(2, sq, 10, seed=14)
    out, lse = run(q, k, v, "BSH", atten_mask=MASK_FORMS[form](masked), softmax_lse_flag=True)
    ref_out, ref_lse = reference(q, k, v, masked=masked)
    assert_matches(out, ref_out, torch.float16)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def test_atten_mask_shared_2d() -> None:
    q, k, v = make_qkv(2, 2, 2, 5, 5, 8, seed=15)
    causal = torch.ones(5, 5, dtype=torch.bool).triu(diagonal=1)
    out, _ = run(q, k, v, atten_mask=causal, sparse_mode=1)
    assert_matches(out, reference(q, k, v, masked=causal.expand(2, 5, 5))[0], torch.float16)
    # pre_tokens / next_tokens are ignored in sparse modes 0 and 1
    same, _ = run(q, k, v, atten_mask=causal, pre_tokens=1, next_tokens=0)
    torch.testing.assert_close(out, same, atol=0, rtol=0)


def test_atten_mask_batch_by_kv_for_single_query() -> None:
    q, k, v = make_qkv(3, 2, 1, 1, 12, 8, seed=16)
    masked = _random_mask(3, 1, 12, seed=17)
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
    q, k, v = make_qkv(2, 4, 2, 3, 9, 16, dtype=dtype, seed=20)
    out, _ = run(q, k, v, "BSH", actual_seq_lengths_kv=[9, 4])
    assert out.dtype == dtype
    assert_matches(out, reference(q, k, v, kv_lens=[9, 4])[0], dtype)


def test_decode_sized_batch() -> None:
    q, k, v = make_qkv(8, 8, 8, 1, 256, 64, seed=21)
    lens = [256, 1, 17, 128, 255, 64, 0, 200]
    out, _ = run(q, k, v, "BSH", scale=0.125, actual_seq_lengths_kv=lens)
    assert_matches(out, reference(q, k, v, scale=0.125, kv_lens=lens)[0], torch.float16)


# --------------------------------------------------------------------------- input handling


def test_inputs_are_not_modified() -> None:
    q, k, v = make_qkv(2, 4, 2, 3, 9, 16, dtype=torch.float32, seed=22)
    pse = torch.randn(1, 4, 3, 9)
    mask = _random_mask(2, 3, 9, seed=23).unsqueeze(1)
    originals = [t.clone() for t in (q, k, v, pse, mask)]
    fused_infer_attention(
        q,
        k,
        v,
        pse,
        mask,
        [2, 3],
        [9, 6],
        num_heads=4,
        num_key_value_heads=2,
        input_layout="BNSD",
        softmax_lse_flag=True,
    )
    for before, after in zip(originals, (q, k, v, pse, mask), strict=True):
        assert torch.equal(before, after)


def test_non_contiguous_inputs() -> None:
    q, k, v = make_qkv(2, 4, 2, 3, 9, 16, seed=24)
    # BNSD tensors viewed as BSND via a transpose are non-contiguous.
    q_nc, k_nc, v_nc = (t.transpose(1, 2) for t in (q, k, v))
    assert not q_nc.is_contiguous()
    out_nc, _ = fused_infer_attention(
        q_nc, k_nc, v_nc, num_heads=4, num_key_value_heads=2, input_layout="BSND", scale=SCALE
    )
    out, _ = run(q, k, v, "BSND")
    torch.testing.assert_close(out_nc.permute(0, 2, 1, 3), out, atol=0, rtol=0)
    # A strided slice along S for BSH.
    big_q = torch.randn(2, 6, 64).to(torch.float16)
    out_slice, _ = fused_infer_attention(
        big_q[:, ::2],
        to_layout(k, "BSH"),
        to_layout(v, "BSH"),
        num_heads=4,
        num_key_value_heads=2,
        scale=SCALE,
    )
    out_copy, _ = fused_infer_attention(
        big_q[:, ::2].contiguous(),
        to_layout(k, "BSH"),
        to_layout(v, "BSH"),
        num_heads=4,
        num_key_value_heads=2,
        scale=SCALE,
    )
    torch.testing.assert_close(out_slice, out_copy, atol=0, rtol=0)


def test_unsupported_defaults_are_accepted() -> None:
    q, k, v = make_qkv(1, 2, 2, 1, 4, 8)
    unsupported: dict[str, object] = {
        "block_table": None,
        "quant_scale2": None,
        "block_size": 0,
        "antiquant_mode": 0,
        "key_antiquant_mode": 0,
        "value_antiquant_mode": 0,
    }
    a, _ = run(q, k, v, unsupported=unsupported)
    b, _ = run(q, k, v)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_check_arguments_is_shape_level() -> None:
    meta = torch.device("meta")
    q = torch.empty(2, 4, 3, 16, dtype=torch.float16, device=meta)
    k = torch.empty(2, 2, 9, 16, dtype=torch.float16, device=meta)
    mask = torch.empty(2, 1, 3, 9, dtype=torch.bool, device=meta)
    check_arguments(
        q, k, k, None, mask, [3], [9, 8], num_heads=4, input_layout="BNSD", num_key_value_heads=2
    )
    with pytest.raises(AttentionArgumentError, match="num_heads"):
        check_arguments(q, k, k, num_heads=8, input_layout="BNSD", num_key_value_heads=2)


def test_output_shapes_and_workspace() -> None:
    q = torch.empty(2, 3, 64, dtype=torch.float16)
    k = torch.empty(2, 9, 32, dtype=torch.float16)
    v = torch.empty(2, 9, 16, dtype=torch.float16)
    shapes = output_shapes(
        q, v, num_heads=4, input_layout="BSH", num_key_value_heads=2, softmax_lse_flag=True
    )
    assert shapes == ((2, 3, 32), (2, 4, 3, 1))
    size = workspace_bytes(q, k, num_heads=4, input_layout="BSH", num_key_value_heads=2)
    assert isinstance(size, int)
    assert size >= 64 * 1024
    assert size == workspace_bytes(q, k, num_heads=4, input_layout="BSH", num_key_value_heads=2)
    bigger = workspace_bytes(
        torch.empty(8, 3, 64),
        torch.empty(8, 900, 32),
        num_heads=4,
        input_layout="BSH",
        num_key_value_heads=2,
    )
    assert bigger > size


# --------------------------------------------------------------------------- errors

# Base call: BNSD, B=3, N=4, Nkv=2, Sq=4, Skv=8, D=16, float16.


def _base() -> dict[str, Any]:
    q, k, v = make_qkv(3, 4, 2, 4, 8, 16)
    return {
        "query": q,
        "key": k,
        "value": v,
        "num_heads": 4,
        "num_key_value_heads": 2,
        "input_layout": "BNSD",
    }


def _with(**changes: object) -> Callable[[dict[str, Any]], None]:
    def apply(call: dict[str, Any]) -> None:
        call.update(changes)

    return apply


def _single_query(call: dict[str, Any]) -> None:
    call["query"] = call["query"][:, :, :1]


def _retype(name: str, dtype: torch.dtype) -> Callable[[dict[str, Any]], None]:
    def apply(call: dict[str, Any]) -> None:
        call[name] = call[name].to(dtype)

    return apply


def _reshape_kv(name: str, index: tuple[int | slice, ...]) -> Callable[[dict[str, Any]], None]:
    def apply(call: dict[str, Any]) -> None:
        call[name] = call[name][index]

    return apply


def _single_query_with(**changes: object) -> Callable[[dict[str, Any]], None]:
    def apply(call: dict[str, Any]) -> None:
        _single_query(call)
        call.update(changes)

    return apply


def _big_gqa(call: dict[str, Any]) -> None:
    call["query"] = torch.zeros(1, 128, 1, 2, dtype=torch.float16)
    call["key"] = torch.zeros(1, 1, 4, 2, dtype=torch.float16)
    call["value"] = torch.zeros(1, 1, 4, 2, dtype=torch.float16)
    call["num_heads"] = 128
    call["num_key_value_heads"] = 1


def _bsh(call: dict[str, Any]) -> None:
    for name in ("query", "key", "value"):
        call[name] = to_layout(call[name], "BSH")
    call["input_layout"] = "BSH"


def _bsh_three_heads(call: dict[str, Any]) -> None:
    _bsh(call)
    call.update(num_heads=3, num_key_value_heads=1)


BLOCK_TABLE = torch.zeros(3, 4, dtype=torch.int32)

ERROR_CASES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "layout_tnd": (_with(input_layout="TND"), "input_layout.*TND.*not implemented"),
    "layout_unknown": (_with(input_layout="SBH"), "input_layout"),
    "sparse_mode_3": (_with(sparse_mode=3), "sparse_mode"),
    "sparse_mode_9": (_with(sparse_mode=9), "sparse_mode"),
    "inner_precise_4": (_with(inner_precise=4), "inner_precise"),
    "inner_precise_neg": (_with(inner_precise=-1), "inner_precise"),
    "block_table": (
        _with(unsupported={"block_table": BLOCK_TABLE}),
        "graphlane's simulated NPU does not implement block_table",
    ),
    "antiquant_mode": (
        _with(unsupported={"antiquant_mode": 1}),
        "does not implement antiquant_mode",
    ),
    "quant_scale2": (
        _with(unsupported={"quant_scale2": torch.ones(1)}),
        "does not implement quant_scale2",
    ),
    "unsupported_not_dict": (_with(unsupported=[("block_table", None)]), "unsupported"),
    "query_int8": (_retype("query", torch.int8), "query"),
    "key_dtype": (_retype("key", torch.bfloat16), "key"),
    "value_dtype": (_retype("value", torch.float32), "value"),
    "num_heads_axis": (_with(num_heads=2, num_key_value_heads=1), "num_heads"),
    "num_heads_zero": (_with(num_heads=0), "num_heads"),
    "kv_heads_not_divisor": (_with(num_key_value_heads=3), "num_key_value_heads"),
    "kv_heads_vs_key_axis": (_with(num_key_value_heads=4), "num_key_value_heads"),
    "kv_heads_default_vs_key_axis": (_with(num_key_value_heads=0), "num_key_value_heads"),
    "gqa_ratio_over_64": (_big_gqa, "num_key_value_heads"),
    "bsh_hidden_not_divisible": (_bsh_three_heads, "query.*num_heads"),
    "query_rank": (_reshape_kv("query", (0,)), "query"),
    "key_batch": (_reshape_kv("key", (slice(0, 2),)), "key"),
    "value_batch": (_reshape_kv("value", (slice(0, 1),)), "value"),
    "value_seq": (_reshape_kv("value", (slice(None), slice(None), slice(0, 5))), "value"),
    "key_head_dim": (
        _reshape_kv("key", (slice(None), slice(None), slice(None), slice(0, 8))),
        "key",
    ),
    "value_heads": (_reshape_kv("value", (slice(None), slice(0, 1))), "value"),
    "kv_lengths_count": (_with(actual_seq_lengths_kv=[8, 8]), "actual_seq_lengths_kv"),
    "kv_lengths_empty": (_with(actual_seq_lengths_kv=[]), "actual_seq_lengths_kv"),
    "kv_length_too_big": (
        _with(actual_seq_lengths_kv=[8, 9, 8]),
        "actual_seq_lengths_kv.*batch 1",
    ),
    "kv_length_negative": (
        _with(actual_seq_lengths_kv=[-1]),
        "actual_seq_lengths_kv.*batch 0",
    ),
    "kv_lengths_not_list": (_with(actual_seq_lengths_kv=8), "actual_seq_lengths_kv"),
    "kv_lengths_float": (_with(actual_seq_lengths_kv=[8.0]), "actual_seq_lengths_kv"),
    "q_length_too_big": (_with(actual_seq_lengths=[4, 4, 5]), "actual_seq_lengths.*batch 2"),
    "q_lengths_count": (_with(actual_seq_lengths=[1, 2]), "actual_seq_lengths"),
    "q_lengths_not_int_incremental": (
        _single_query_with(actual_seq_lengths=["29"]),
        "actual_seq_lengths",
    ),
    "pse_shape": (_with(pse_shift=torch.zeros(3, 2, 4, 8, dtype=torch.float16)), "pse_shift"),
    "pse_batch": (_with(pse_shift=torch.zeros(2, 4, 4, 8, dtype=torch.float16)), "pse_shift"),
    "pse_too_short": (_with(pse_shift=torch.zeros(1, 4, 4, 7, dtype=torch.float16)), "pse_shift"),
    "pse_dtype": (_with(pse_shift=torch.zeros(1, 4, 4, 8, dtype=torch.float32)), "pse_shift"),
    "mask_dtype": (_with(atten_mask=torch.zeros(4, 8)), "atten_mask"),
    "mask_heads": (_with(atten_mask=torch.zeros(3, 4, 4, 8, dtype=torch.bool)), "atten_mask"),
    "mask_too_small": (_with(atten_mask=torch.zeros(3, 8, dtype=torch.bool)), "atten_mask"),
    "mask_rank": (_with(atten_mask=torch.zeros(8, dtype=torch.bool)), "atten_mask"),
    "mask_batch": (_with(atten_mask=torch.zeros(2, 4, 8, dtype=torch.bool)), "atten_mask"),
    "scale_type": (_with(scale="1"), "scale"),
    "lse_flag_type": (_with(softmax_lse_flag=1), "softmax_lse_flag"),
    "direct_arg_in_unsupported": (_with(unsupported={"num_heads": 4}), "num_heads"),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_invalid_arguments_raise(case: str) -> None:
    mutate, pattern = ERROR_CASES[case]
    call = _base()
    mutate(call)
    with pytest.raises(AttentionArgumentError, match=pattern):
        fused_infer_attention(**call)


def test_error_is_value_error() -> None:
    assert issubclass(AttentionArgumentError, ValueError)
