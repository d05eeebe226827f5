"""What the sim's ``npu_fused_infer_attention_score`` refuses in dense calls, each error
naming the argument, and its shape-level helpers (meta tensors, ``_infer_output``,
``_get_max_workspace``). Called as the op on NPU tensors."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from dense_reference import make_qkv, to_layout
from npusim import SimUsageError, torch_npu
from npusim.fia_args import AttentionArgumentError

OP = "npu_fused_infer_attention_score"
F16, BOOL = torch.float16, torch.bool

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


def _call(call: dict[str, Any]) -> None:
    """The op on NPU copies of the call's tensors (query, key, value positional)."""
    on_npu = {k: v.npu() if isinstance(v, torch.Tensor) else v for k, v in call.items()}
    q, k, v = on_npu.pop("query"), on_npu.pop("key"), on_npu.pop("value")
    torch_npu.npu_fused_infer_attention_score(q, k, v, **on_npu)


Mutation = Callable[[dict[str, Any]], None]


def _with(**changes: object) -> Mutation:
    def apply(call: dict[str, Any]) -> None:
        call.update(changes)

    return apply


def _single_query(call: dict[str, Any]) -> None:
    call["query"] = call["query"][:, :, :1]


def _retype(name: str, dtype: torch.dtype) -> Mutation:
    def apply(call: dict[str, Any]) -> None:
        call[name] = call[name].to(dtype)

    return apply


def _slice(name: str, index: tuple[int | slice, ...]) -> Mutation:
    def apply(call: dict[str, Any]) -> None:
        call[name] = call[name][index].contiguous()

    return apply


def _single_query_with(**changes: object) -> Mutation:
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


def _bsh_three_heads(call: dict[str, Any]) -> None:
    for name in ("query", "key", "value"):
        call[name] = to_layout(call[name], "BSH")
    call.update(input_layout="BSH", num_heads=3, num_key_value_heads=1)


def _tnd_without_lengths(call: dict[str, Any]) -> None:
    for name in ("query", "key", "value"):
        t = call[name]  # BNSD -> TND, the batches one after another
        call[name] = t.permute(0, 2, 1, 3).reshape(-1, t.shape[1], t.shape[3])
    call["input_layout"] = "TND"


# Each pattern follows "npu_fused_infer_attention_score: ", so it starts with the
# argument the error names.
DOCUMENTED = "which torch_npu 2.14 on an Atlas A2 does not accept"
ERROR_CASES: dict[str, tuple[Mutation, str]] = {
    "layout_tnd_without_lengths": (_tnd_without_lengths, "actual_seq_lengths: is required"),
    "layout_unknown": (_with(input_layout="SBH"), "input_layout: unknown layout 'SBH'"),
    "layout_bnsd_bsnd_single_query": (
        _single_query_with(input_layout="BNSD_BSND"),
        "input_layout: BNSD_BSND",
    ),
    "layout_bnsd_nbsd_single_query_without_rope": (
        _single_query_with(input_layout="BNSD_NBSD"),
        "input_layout: BNSD_NBSD",
    ),
    "sparse_mode_3_without_mask": (_with(sparse_mode=3), "atten_mask: sparse_mode 3 needs"),
    "sparse_mode_3_full_mask": (
        _with(sparse_mode=3, atten_mask=torch.zeros(4, 8, dtype=BOOL)),
        r"atten_mask: sparse_mode 3 takes the optimised \(2048, 2048\)",
    ),
    "sparse_mode_9": (_with(sparse_mode=9), "sparse_mode: 9 is not supported"),
    "inner_precise_4": (_with(inner_precise=4), "inner_precise"),
    "inner_precise_neg": (_with(inner_precise=-1), "inner_precise"),
    "block_table_without_block_size": (
        _with(block_table=torch.zeros(3, 4, dtype=torch.int32)),
        "block_size: page attention",
    ),
    "antiquant_mode": (_with(antiquant_mode=1), "antiquant_mode is not implemented"),
    "quant_scale2": (_with(quant_scale2=torch.ones(1)), "quant_scale2 is not implemented"),
    "key_shared_prefix": (
        _with(key_shared_prefix=torch.ones(1, 2, 8, 16, dtype=F16)),
        "key_shared_prefix is not implemented",
    ),
    "query_int8": (_retype("query", torch.int8), "query: dtype"),
    "key_dtype": (_retype("key", torch.bfloat16), "key: dtype"),
    "value_dtype": (_retype("value", torch.bfloat16), "value: dtype"),
    "num_heads_axis": (_with(num_heads=2, num_key_value_heads=1), "num_heads: num_heads"),
    "num_heads_zero": (_with(num_heads=0), "num_heads"),
    "kv_heads_not_divisor": (_with(num_key_value_heads=3), "num_key_value_heads: num_heads"),
    "kv_heads_vs_key_axis": (_with(num_key_value_heads=4), "num_key_value_heads: the N axis"),
    "kv_heads_default_vs_key_axis": (_with(num_key_value_heads=0), "num_key_value_heads"),
    "gqa_ratio_over_64": (_big_gqa, "num_key_value_heads: .* exceeds 64"),
    "bsh_hidden_not_divisible": (_bsh_three_heads, "query: hidden size .* num_heads"),
    "query_rank": (_slice("query", (0,)), "query: layout BNSD expects a 4-D"),
    "key_batch": (_slice("key", (slice(0, 2),)), "key: batch size"),
    "value_batch": (_slice("value", (slice(0, 1),)), "value: batch size"),
    "value_seq": (_slice("value", (slice(None), slice(None), slice(0, 5))), "value: sequence"),
    "key_head_dim": (
        _slice("key", (slice(None), slice(None), slice(None), slice(0, 8))),
        "key: head dim",
    ),
    "value_heads": (_slice("value", (slice(None), slice(0, 1))), "value: N axis"),
    "kv_lengths_count": (_with(actual_seq_lengths_kv=[8, 8]), "actual_seq_lengths_kv: has 2"),
    "kv_lengths_empty": (_with(actual_seq_lengths_kv=[]), "actual_seq_lengths_kv: has 0"),
    "kv_length_too_big": (
        _with(actual_seq_lengths_kv=[8, 9, 8]),
        "actual_seq_lengths_kv: .* batch 1",
    ),
    "kv_length_negative": (_with(actual_seq_lengths_kv=[-1]), "actual_seq_lengths_kv: .* batch 0"),
    "q_length_too_big": (_with(actual_seq_lengths=[4, 4, 5]), "actual_seq_lengths: .* batch 2"),
    "q_lengths_count": (_with(actual_seq_lengths=[1, 2]), "actual_seq_lengths: has 2"),
    "pse_shape": (_with(pse_shift=torch.zeros(3, 2, 4, 8, dtype=F16)), "pse_shift: shape"),
    "pse_batch": (_with(pse_shift=torch.zeros(2, 4, 4, 8, dtype=F16)), "pse_shift: shape"),
    "pse_too_short": (_with(pse_shift=torch.zeros(1, 4, 4, 7, dtype=F16)), "pse_shift: shape"),
    "pse_dtype": (
        _with(pse_shift=torch.zeros(1, 4, 4, 8, dtype=torch.bfloat16)),
        "pse_shift: dtype",
    ),
    # refused by the op-support table (the wheel's documentation), before planning
    "mask_dtype": (_with(atten_mask=torch.zeros(4, 8)), f"atten_mask is float32, {DOCUMENTED}"),
    "mask_heads": (_with(atten_mask=torch.zeros(3, 4, 4, 8, dtype=BOOL)), "atten_mask: shape"),
    "mask_too_small": (_with(atten_mask=torch.zeros(3, 8, dtype=BOOL)), "atten_mask: shape"),
    "mask_rank": (_with(atten_mask=torch.zeros(8, dtype=BOOL)), "atten_mask: shape"),
    "mask_batch": (_with(atten_mask=torch.zeros(2, 4, 8, dtype=BOOL)), "atten_mask: shape"),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_invalid_arguments_are_refused_naming_the_argument(case: str) -> None:
    mutate, pattern = ERROR_CASES[case]
    call = _base()
    mutate(call)
    with pytest.raises(SimUsageError, match=f"^{OP}: {pattern}") as info:
        _call(call)
    if "is not implemented" not in pattern and DOCUMENTED not in pattern:  # planning refused
        assert isinstance(info.value.__cause__, AttentionArgumentError)


# Arguments of a type the schema does not take: torch's schema matching refuses them
# (naming the argument) before the op runs.
SCHEMA_CASES: dict[str, tuple[Mutation, str]] = {
    "kv_lengths_not_list": (_with(actual_seq_lengths_kv=8), "actual_seq_lengths_kv"),
    "kv_lengths_float": (_with(actual_seq_lengths_kv=[8.0]), "actual_seq_lengths_kv"),
    "q_lengths_not_int_incremental": (
        _single_query_with(actual_seq_lengths=["29"]),
        "actual_seq_lengths",
    ),
    "scale_type": (_with(scale="1"), "scale"),
    "unknown_keyword": (_with(unsupported={"block_table": None}), "unsupported"),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_CASES))
def test_arguments_the_schema_does_not_take(case: str) -> None:
    mutate, name = SCHEMA_CASES[case]
    call = _base()
    mutate(call)
    with pytest.raises(RuntimeError, match=f"argument '{name}'"):
        _call(call)


def test_attention_argument_error_is_a_value_error() -> None:
    assert issubclass(AttentionArgumentError, ValueError)


# --------------------------------------------------------------------------- shape level


def test_meta_tensors_are_checked_at_shape_level() -> None:
    """The op's meta kernel validates shapes, dtypes and lengths without tensor data."""
    meta = torch.device("meta")
    q = torch.empty(2, 4, 3, 16, dtype=torch.float16, device=meta)
    k = torch.empty(2, 2, 9, 16, dtype=torch.float16, device=meta)
    mask = torch.empty(2, 1, 3, 9, dtype=torch.bool, device=meta)
    fia = torch.ops.npu.npu_fused_infer_attention_score
    out, lse = fia(
        q, k, k, atten_mask=mask, actual_seq_lengths=[3], actual_seq_lengths_kv=[9, 8],
        num_heads=4, input_layout="BNSD", num_key_value_heads=2, softmax_lse_flag=True,
    )  # fmt: skip
    assert out.device == meta and tuple(out.shape) == (2, 4, 3, 16)
    assert tuple(lse.shape) == (2, 4, 3, 1) and lse.dtype == torch.float32
    with pytest.raises(SimUsageError, match=f"^{OP}: num_heads"):
        fia(q, k, k, num_heads=8, input_layout="BNSD", num_key_value_heads=2)


def test_infer_output_and_workspace() -> None:
    q = torch.empty(2, 3, 64, dtype=torch.float16).npu()
    k = torch.empty(2, 9, 32, dtype=torch.float16).npu()
    v = torch.empty(2, 9, 16, dtype=torch.float16).npu()
    kw: dict[str, Any] = dict(num_heads=4, input_layout="BSH", num_key_value_heads=2)
    o, lse = torch_npu._npu_fused_infer_attention_score_infer_output(
        q, v, softmax_lse_flag=True, **kw
    )
    assert (tuple(o.shape), tuple(lse.shape)) == ((2, 3, 32), (2, 4, 3, 1))
    assert o.dtype == torch.float16 and lse.dtype == torch.float32
    get = torch_npu._npu_fused_infer_attention_score_get_max_workspace
    ws = get(q, k, k, **kw)
    assert ws.dtype == torch.uint8 and ws.device == q.device
    assert ws.numel() >= 64 * 1024
    assert ws.numel() == get(q, k, k, **kw).numel()
    big_q = torch.empty(8, 3, 64, dtype=torch.float16).npu()
    big_k = torch.empty(8, 900, 32, dtype=torch.float16).npu()
    assert get(big_q, big_k, big_k, **kw).numel() > ws.numel()


# --------------------------------------------------------------------------- v2, paged attention


@pytest.mark.parametrize(
    ("changes", "pattern"),
    [
        ({"num_query_heads": 8}, "num_query_heads: num_query_heads"),
        ({"actual_seq_kvlen": [9]}, "actual_seq_kvlen: value 9"),
        ({"actual_seq_qlen": [1, 2]}, "actual_seq_qlen: has 2"),
    ],
)
def test_v2_errors_name_v2_arguments(changes: dict[str, Any], pattern: str) -> None:
    """v2 is planned under v1's names; its errors still name the arguments v2 takes."""
    call = _base()
    q, k, v = (call.pop(name).npu() for name in ("query", "key", "value"))
    kw = {"num_query_heads": 4, "num_key_value_heads": 2, "input_layout": "BNSD", **changes}
    with pytest.raises(
        SimUsageError, match=f"^npu_fused_infer_attention_score_v2: {pattern}"
    ) as info:
        torch_npu.npu_fused_infer_attention_score_v2(q, k, v, **kw)
    assert not re.search(
        r"\b(num_heads|actual_seq_lengths|actual_seq_lengths_kv)\b", str(info.value)
    )
    with pytest.raises(SimUsageError, match=r"^_npu_fused_infer_attention_score_v2_infer_output: "
                       "num_query_heads"):  # fmt: skip
        torch_npu._npu_fused_infer_attention_score_v2_infer_output(
            q, v, num_query_heads=8, input_layout="BNSD"
        )


def test_paged_attention_errors_name_context_lens() -> None:
    b, n, d, bs = 2, 4, 16, 16
    cache = torch.zeros(8, bs, n, d, dtype=F16).npu()
    table = torch.zeros(b, 2, dtype=torch.int32).npu()
    with pytest.raises(SimUsageError, match=r"^_npu_paged_attention: context_lens: value 40"):
        torch_npu._npu_paged_attention(
            query=torch.zeros(b, n, d, dtype=F16).npu(), key_cache=cache, value_cache=cache,
            num_kv_heads=n, num_heads=n, scale_value=0.25, block_table=table,
            context_lens=torch.tensor([40, 3], dtype=torch.int32),
            out=torch.zeros(b, n, d, dtype=F16).npu(),
        )  # fmt: skip
