"""Device ops of the simulated NPU, registered as ``torch.ops.npu.*`` like torch_npu's.

``npu_fused_infer_attention_score`` keeps torch_npu's positional order
(query, key, value, pse_shift, atten_mask, actual_seq_lengths = argument 5,
actual_seq_lengths_kv = argument 6, ...; the order of the op-plugin document
``torch_npu-npu_fused_infer_attention_score.md``), so that torch_npu's graph
handlers, which patch arguments 5 and 6 by position, work unchanged. The
``.out`` overload adds ``workspace`` and writes ``out=[attention_out,
softmax_lse]``. Both are single device ops, so a graph captures each call as
one task that a task-group update can patch. The math is in
:mod:`attention_kernel`.
"""

from __future__ import annotations

from typing import Any

import torch

from . import attention_kernel as K
from .errors import SimUsageError
from .opcall import HOST_CHECKS, PATCHABLE_OPS, RememberedCheck

_TENSOR_OPTIONALS = [
    "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2", "quant_offset2",
    "antiquant_scale", "antiquant_offset", "block_table", "query_padding_size",
    "kv_padding_size", "key_antiquant_scale", "key_antiquant_offset",
    "value_antiquant_scale", "value_antiquant_offset", "key_shared_prefix",
    "value_shared_prefix",
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
    ("bool", "softmax_lse_flag", False),
    ("int", "key_antiquant_mode", 0),
    ("int", "value_antiquant_mode", 0),
]

# Parameter names in schema order (positional binding of the dispatcher's args).
PARAMS: list[str] = (
    ["query", "key", "value", "pse_shift", "atten_mask", "actual_seq_lengths",
     "actual_seq_lengths_kv"]
    + _TENSOR_OPTIONALS
    + ["actual_shared_prefix_len"]
    + _ROPE
    + [name for _, name, _ in _SCALARS]
)  # fmt: skip
DEFAULTS: dict[str, Any] = {name: d for _, name, d in _SCALARS}


def _schema_args() -> str:
    parts = ["Tensor query", "Tensor key", "Tensor value", "Tensor? pse_shift=None",
             "Tensor? atten_mask=None", "SymInt[]? actual_seq_lengths=None",
             "SymInt[]? actual_seq_lengths_kv=None"]  # fmt: skip
    parts += [f"Tensor? {n}=None" for n in _TENSOR_OPTIONALS]
    parts += ["SymInt[]? actual_shared_prefix_len=None"]
    parts += [f"Tensor? {n}=None" for n in _ROPE]
    for typ, name, default in _SCALARS:
        d = f'"{default}"' if typ == "str" else str(default)
        parts.append(f"{typ} {name}={d}")
    return ", ".join(parts)


_NAMES: list[str] = [*PARAMS, "workspace"]
_KNOWN = frozenset([*_NAMES, "out"])


def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Name every argument of a call (positional by schema order, then keywords)."""
    if len(args) > len(_NAMES):
        raise SimUsageError("npu_fused_infer_attention_score: too many positional arguments")
    bound: dict[str, Any] = dict(DEFAULTS)
    bound.update(zip(_NAMES, args, strict=False))
    if not _KNOWN.issuperset(kwargs):
        unknown = next(name for name in kwargs if name not in _KNOWN)
        raise SimUsageError(f"npu_fused_infer_attention_score got an unknown argument {unknown!r}")
    bound.update(kwargs)
    return bound


def _unsupported(b: dict[str, Any]) -> dict[str, Any]:
    names = [*_TENSOR_OPTIONALS, "actual_shared_prefix_len", *_ROPE, "block_size",
             "antiquant_mode", "key_antiquant_mode", "value_antiquant_mode"]  # fmt: skip
    return {n: b.get(n) for n in names}


def _check(b: dict[str, Any]) -> Any:
    try:
        return K.check_arguments(
            b["query"], b["key"], b["value"], b.get("pse_shift"), b.get("atten_mask"),
            b.get("actual_seq_lengths"), b.get("actual_seq_lengths_kv"),
            num_heads=b["num_heads"], input_layout=b["input_layout"],
            num_key_value_heads=b["num_key_value_heads"], sparse_mode=b["sparse_mode"],
            unsupported=_unsupported(b),
        )  # fmt: skip
    except K.AttentionArgumentError as exc:
        raise SimUsageError(f"npu_fused_infer_attention_score: {exc}") from exc


def _shapes(b: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return K.output_shapes(
        b["query"], b["value"], num_heads=b["num_heads"], input_layout=b["input_layout"],
        num_key_value_heads=b["num_key_value_heads"], softmax_lse_flag=b["softmax_lse_flag"],
    )  # fmt: skip


def _compute(b: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return K.fused_infer_attention(
        b["query"], b["key"], b["value"], b.get("pse_shift"), b.get("atten_mask"),
        b.get("actual_seq_lengths"), b.get("actual_seq_lengths_kv"),
        num_heads=b["num_heads"], scale=b["scale"], pre_tokens=b["pre_tokens"],
        next_tokens=b["next_tokens"], input_layout=b["input_layout"],
        num_key_value_heads=b["num_key_value_heads"], sparse_mode=b["sparse_mode"],
        inner_precise=b["inner_precise"], softmax_lse_flag=b["softmax_lse_flag"],
        unsupported=_unsupported(b),
    )  # fmt: skip


def _check_out(b: dict[str, Any]) -> list[torch.Tensor]:
    out = b.get("out")
    if not isinstance(out, (list, tuple)) or len(out) != 2:
        raise SimUsageError(
            "npu_fused_infer_attention_score.out needs out=[attention_out, softmax_lse]"
        )
    o_shape, lse_shape = _shapes(b)
    if tuple(out[0].shape) != o_shape or out[0].dtype != b["query"].dtype:
        raise SimUsageError(
            f"npu_fused_infer_attention_score.out: attention_out must be {list(o_shape)} "
            f"{b['query'].dtype}, got {list(out[0].shape)} {out[0].dtype}"
        )
    if b["softmax_lse_flag"] and tuple(out[1].shape) != lse_shape:
        raise SimUsageError(
            f"npu_fused_infer_attention_score.out: softmax_lse must be {list(lse_shape)}, "
            f"got {list(out[1].shape)}"
        )
    return list(out)


def refuse_real_torch_npu() -> None:
    """The real torch_npu owns ``torch.npu`` and the ``npu`` op namespace: the simulated
    NPU cannot share a process with it."""
    if hasattr(torch, "npu") and not getattr(torch.npu, "__graphlane_sim__", False):
        raise RuntimeError(
            "torch.npu already exists (is the real torch_npu imported?); the simulated "
            "NPU cannot be set up in the same process"
        )


# ---------------------------------------------------------------- kernels
def _fia_cpu(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    b = bind(args, kwargs)
    return _compute(b)


def _fia_meta(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    b = bind(args, kwargs)
    _check(b)
    o_shape, lse_shape = _shapes(b)
    q = b["query"]
    return (
        torch.empty(o_shape, dtype=q.dtype, device=q.device),
        torch.empty(lse_shape, dtype=torch.float32, device=q.device),
    )


def _fia_out_cpu(*args: Any, **kwargs: Any) -> None:
    b = bind(args, kwargs)
    out = b["out"]
    o, lse = _compute(b)
    out[0].copy_(o)
    if b["softmax_lse_flag"]:
        out[1].copy_(lse)
    else:
        out[1].zero_()


def _fia_out_meta(*args: Any, **kwargs: Any) -> None:
    b = bind(args, kwargs)
    _check(b)
    _check_out(b)


# ---------------------------------------------------------------- issue-time checks
# A task-group patch re-issues the captured call with new lengths and everything else
# as captured. The arguments' checks read the lengths' values and, of everything else,
# only shapes, strides, dtypes and values (attention_kernel.check_arguments); so once
# a call passed them, a call equal to it in all of that needs only its lengths checked.
def _fia_out_full_check(*args: Any, **kwargs: Any) -> Any:
    b = bind(args, kwargs)
    dims = _check(b)
    _check_out(b)
    return dims


def _fia_lengths_check(dims: Any, lengths: list[Any]) -> None:
    try:
        K.check_lengths(lengths[0], lengths[1], dims)
    except K.AttentionArgumentError as exc:
        raise SimUsageError(f"npu_fused_infer_attention_score: {exc}") from exc


_fia_out_check = RememberedCheck(
    _fia_out_full_check,
    _fia_lengths_check,
    varying=("actual_seq_lengths", "actual_seq_lengths_kv"),
    positions=(5, 6),
)


refuse_real_torch_npu()  # before defining torch.ops.npu.*, which it would own
_lib = torch.library.Library("npu", "DEF")
_ARGS = _schema_args()
_lib.define(f"npu_fused_infer_attention_score({_ARGS}) -> (Tensor, Tensor)")
_lib.define(
    f"npu_fused_infer_attention_score.out({_ARGS}, Tensor? workspace=None, *, "
    "Tensor(a!)[] out) -> ()"
)
_lib.impl("npu_fused_infer_attention_score", _fia_cpu, "CPU")
_lib.impl("npu_fused_infer_attention_score", _fia_meta, "Meta")
_lib.impl("npu_fused_infer_attention_score.out", _fia_out_cpu, "CPU")
_lib.impl("npu_fused_infer_attention_score.out", _fia_out_meta, "Meta")

fused_infer_attention_score = torch.ops.npu.npu_fused_infer_attention_score
PATCHABLE_OPS.update({fused_infer_attention_score.default, fused_infer_attention_score.out})
HOST_CHECKS[fused_infer_attention_score.default] = _fia_meta
HOST_CHECKS[fused_infer_attention_score.out] = _fia_out_check


# ---------------------------------------------------------------- helpers of torch_npu
def get_max_workspace(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch_npu._npu_fused_infer_attention_score_get_max_workspace``: a workspace tensor."""
    b = bind(args, kwargs)
    _check(b)
    n = K.workspace_bytes(
        b["query"], b["key"], num_heads=b["num_heads"], input_layout=b["input_layout"],
        num_key_value_heads=b["num_key_value_heads"],
    )  # fmt: skip
    return torch.empty(n, dtype=torch.uint8, device=b["query"].device)


def infer_output(query: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> tuple[Any, Any]:
    """``torch_npu._npu_fused_infer_attention_score_infer_output``: empty output tensors."""
    o_shape, lse_shape = K.output_shapes(
        query, value, num_heads=kwargs.get("num_heads", 1),
        input_layout=kwargs.get("input_layout", "BSH"),
        num_key_value_heads=kwargs.get("num_key_value_heads", 0),
        softmax_lse_flag=kwargs.get("softmax_lse_flag", False),
    )  # fmt: skip
    return (
        torch.empty(o_shape, dtype=query.dtype, device=query.device),
        torch.empty(lse_shape, dtype=torch.float32, device=query.device),
    )
