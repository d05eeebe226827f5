"""``npu_fused_infer_attention_score`` of torch_npu 2.14, registered as ``torch.ops.npu.*``.

The schemas are torch_npu's (checked against the wheel by sim/tests/test_npu_schemas.py):
query, key and value are positional, every other argument is keyword-only; the
``.out`` overload adds ``workspace`` and ``out=[attention_out, softmax_lse]`` and returns
``(attention_out, softmax_lse)``. Both are single device ops, so a graph captures each call
as one task that a task-group update can patch. Shapes and lengths are validated by
:mod:`fia_layout` at issue time; the math is in :mod:`fia_kernel`.
"""

from __future__ import annotations

from typing import Any

import torch

from .fia_layout import Plan
from .fia_ops import Kernels, Signature, inferred_outputs, planned, refuse
from .opcall import HOST_CHECKS, PATCHABLE_OPS, RememberedCheck
from .tensor import register_host_op

_TENSOR_OPTIONALS = [
    "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2", "quant_offset2",
    "antiquant_scale", "antiquant_offset", "key_antiquant_scale", "key_antiquant_offset",
    "value_antiquant_scale", "value_antiquant_offset", "block_table", "query_padding_size",
    "kv_padding_size", "key_shared_prefix", "value_shared_prefix",
]  # fmt: skip
_ROPE = ["query_rope", "key_rope", "key_rope_antiquant_scale"]
_SCALARS: list[tuple[str, str, Any]] = [
    ("int", "num_heads", 1),
    ("float", "scale", 1.0),
    ("int", "pre_tokens", 2147483647),
    ("int", "next_tokens", 2147483647),
    ("str", "input_layout", "BSH"),
    ("int", "num_key_value_heads", 0),
    ("int", "sparse_mode", 0),
    ("int", "inner_precise", 0),
    ("int", "block_size", 0),
    ("int", "antiquant_mode", 0),
    ("int", "key_antiquant_mode", 0),
    ("int", "value_antiquant_mode", 0),
    ("bool", "softmax_lse_flag", False),
]
# Implemented elsewhere or refused: quantisation, left padding, shared prefixes.
UNSUPPORTED = (
    *[n for n in _TENSOR_OPTIONALS if n != "block_table"], "actual_shared_prefix_len",
    "key_rope_antiquant_scale", "antiquant_mode", "key_antiquant_mode", "value_antiquant_mode",
)  # fmt: skip
NAME = "npu_fused_infer_attention_score"
WORKSPACE_GETTER = "torch_npu._npu_fused_infer_attention_score_get_max_workspace"


def _schema_args() -> str:
    """torch_npu 2.14's argument list: every argument after ``value`` is keyword-only."""
    parts = ["Tensor query", "Tensor key", "Tensor value", "*", "Tensor? pse_shift=None",
             "Tensor? atten_mask=None", "SymInt[]? actual_seq_lengths=None",
             "SymInt[]? actual_seq_lengths_kv=None"]  # fmt: skip
    parts += [f"Tensor? {n}=None" for n in _TENSOR_OPTIONALS]
    parts += ["SymInt[]? actual_shared_prefix_len=None"]
    parts += [f"Tensor? {n}=None" for n in _ROPE]
    for typ, name, default in _SCALARS:
        d = f'"{default}"' if typ == "str" else str(default)
        parts.append(f"{typ} {name}={d}")
    return ", ".join(parts)


def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Name every argument of a call (query, key, value positional; the rest keywords)."""
    return _SIGNATURE.bind(args, kwargs)


def _v1(b: dict[str, Any]) -> dict[str, Any]:
    """A bound call as planning reads it, once what the sim does not implement is refused."""
    refuse(NAME, b, UNSUPPORTED)
    return b


def _plan(b: dict[str, Any]) -> Plan:
    return planned(NAME, _v1(b))


def refuse_real_torch_npu() -> None:
    """The real torch_npu owns ``torch.npu`` and the ``npu`` op namespace: the simulated
    NPU cannot share a process with it."""
    if hasattr(torch, "npu") and not getattr(torch.npu, "__graphlane_sim__", False):
        raise RuntimeError(
            "torch.npu already exists (is the real torch_npu imported?); the simulated "
            "NPU cannot be set up in the same process"
        )


# ---------------------------------------------------------------- kernels
_KERNELS = Kernels(NAME, bind, _v1, WORKSPACE_GETTER)


refuse_real_torch_npu()  # before defining torch.ops.npu.*, which it would own
_lib = torch.library.Library("npu", "DEF")
_ARGS = _schema_args()
_lib.define(f"npu_fused_infer_attention_score({_ARGS}) -> (Tensor, Tensor)")
# torch_npu declares ``Tensor[] out`` without a write annotation; the sim needs
# ``(a!)`` to know what the op writes (see sim/tests/test_npu_schemas.py).
_lib.define(
    f"npu_fused_infer_attention_score.out({_ARGS}, Tensor? workspace=None, "
    "Tensor(a!)[] out) -> (Tensor, Tensor)"
)
_lib.define(f"_npu_fused_infer_attention_score_get_max_workspace({_ARGS}) -> Tensor")
_lib.define(
    "_npu_fused_infer_attention_score_infer_output(Tensor query, Tensor value, *, "
    'str input_layout="BSH", Tensor? quant_scale2=None, Tensor? block_table=None, '
    "int num_heads=1, int num_key_value_heads=0, bool softmax_lse_flag=False, "
    "Tensor? query_rope=None) -> (Tensor, Tensor)"
)
_lib.impl("npu_fused_infer_attention_score", _KERNELS.cpu, "CPU")
_lib.impl("npu_fused_infer_attention_score", _KERNELS.meta, "Meta")
_lib.impl("npu_fused_infer_attention_score.out", _KERNELS.out_cpu, "CPU")
_lib.impl("npu_fused_infer_attention_score.out", _KERNELS.out_meta, "Meta")

fused_infer_attention_score = torch.ops.npu.npu_fused_infer_attention_score
_SIGNATURE = Signature(NAME, fused_infer_attention_score.out._schema)
PATCHABLE_OPS.update({fused_infer_attention_score.default, fused_infer_attention_score.out})
# Issue-time checks without torch's dispatcher: the meta functions, on the CPU arguments.
HOST_CHECKS[fused_infer_attention_score.default] = _KERNELS.meta
# The .out op's check is remembered: a patch that changes only lengths rechecks those
# (with the plan's own length checks: Kernels.out_recheck).
HOST_CHECKS[fused_infer_attention_score.out] = RememberedCheck(
    _KERNELS.out_check, _KERNELS.out_recheck, ("actual_seq_lengths", "actual_seq_lengths_kv")
)


# ---------------------------------------------------------------- helpers of torch_npu
def get_max_workspace(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``_npu_fused_infer_attention_score_get_max_workspace``: a uint8 workspace sized for
    the call's shapes and lengths (a host computation and an allocation: no device work)."""
    b = bind(args, kwargs)
    n = _plan(b).workspace_bytes()
    return torch.empty(n, dtype=torch.uint8, device=b["query"].device)


_INFER = Signature(
    "_npu_fused_infer_attention_score_infer_output",
    torch.ops.npu._npu_fused_infer_attention_score_infer_output.default._schema,
)


def infer_output(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """``_npu_fused_infer_attention_score_infer_output``: empty (attention_out, softmax_lse)."""
    b = _INFER.bind(args, kwargs)
    refuse(_INFER.op_name, b, ("quant_scale2",))
    return inferred_outputs(_INFER.op_name, b["query"], b["value"], b)


register_host_op(
    torch.ops.npu._npu_fused_infer_attention_score_get_max_workspace.default,
    lambda func, args, kwargs: get_max_workspace(*args, **kwargs),
)
register_host_op(
    torch.ops.npu._npu_fused_infer_attention_score_infer_output.default,
    lambda func, args, kwargs: infer_output(*args, **kwargs),
)
