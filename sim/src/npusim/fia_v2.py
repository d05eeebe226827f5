"""``npu_fused_infer_attention_score_v2`` of torch_npu 2.14 and its workspace and
output helpers, registered as ``torch.ops.npu.*`` with the wheel's schemas.

v2 is v1 with other names (``num_query_heads``, ``softmax_scale``, ``actual_seq_qlen``,
``actual_seq_kvlen``, ``return_softmax_lse``) and its quantisation arguments; the sim maps
the names and runs v1's planning and kernel, ``learnable_sink`` (attention sinks, gpt-oss;
:func:`.fia_layout.plan` checks it, :func:`.fia_kernel.compute` adds it to each row's
softmax) included. Quantisation arguments and the ``*_dtype`` overrides are refused
unless left at their defaults.
"""

from __future__ import annotations

from typing import Any

import torch

from .fia_layout import Plan
from .fia_ops import Kernels, Signature, inferred_outputs, planned, refuse
from .npugraph_handler import TensorListOutHandler, register_npu_graph_handler, specs_for
from .tensor import PATCHABLE_OPS, register_host_op

NAME = "npu_fused_infer_attention_score_v2"
WORKSPACE_GETTER = "torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace"
_DTYPES = ("query_dtype", "key_dtype", "value_dtype", "query_rope_dtype", "key_rope_dtype",
           "key_shared_prefix_dtype", "value_shared_prefix_dtype", "dequant_scale_query_dtype",
           "dequant_scale_key_dtype", "dequant_scale_value_dtype",
           "dequant_scale_key_rope_dtype", "out_dtype")  # fmt: skip
_QUANT = ("dequant_scale_query", "dequant_scale_key", "dequant_offset_key",
          "dequant_scale_value", "dequant_offset_value", "dequant_scale_key_rope",
          "quant_scale_out", "quant_offset_out", "quant_scale_p",
          "query_quant_mode", "key_quant_mode", "value_quant_mode")  # fmt: skip
_V1_NAMES = {"num_query_heads": "num_heads", "softmax_scale": "scale",
             "actual_seq_qlen": "actual_seq_lengths", "actual_seq_kvlen": "actual_seq_lengths_kv",
             "return_softmax_lse": "softmax_lse_flag"}  # fmt: skip
_V2_NAMES = {v1: v2 for v2, v1 in _V1_NAMES.items()}  # what errors name

_ARGS = (
    "Tensor query, Tensor key, Tensor value, *, Tensor? query_rope=None, Tensor? key_rope=None, "
    "Tensor? pse_shift=None, Tensor? atten_mask=None, SymInt[]? actual_seq_qlen=None, "
    "SymInt[]? actual_seq_kvlen=None, Tensor? block_table=None, "
    "Tensor? dequant_scale_query=None, Tensor? dequant_scale_key=None, "
    "Tensor? dequant_offset_key=None, Tensor? dequant_scale_value=None, "
    "Tensor? dequant_offset_value=None, Tensor? dequant_scale_key_rope=None, "
    "Tensor? quant_scale_out=None, Tensor? quant_offset_out=None, Tensor? quant_scale_p=None, "
    "Tensor? learnable_sink=None, int num_query_heads=1, int num_key_value_heads=0, "
    "float softmax_scale=1.0, int pre_tokens=2147483647, int next_tokens=2147483647, "
    'str input_layout="BSH", int sparse_mode=0, int block_size=0, int query_quant_mode=0, '
    "int key_quant_mode=0, int value_quant_mode=0, int inner_precise=0, "
    "bool return_softmax_lse=False, int? query_dtype=None, int? key_dtype=None, "
    "int? value_dtype=None, int? query_rope_dtype=None, int? key_rope_dtype=None, "
    "int? key_shared_prefix_dtype=None, int? value_shared_prefix_dtype=None, "
    "int? dequant_scale_query_dtype=None, int? dequant_scale_key_dtype=None, "
    "int? dequant_scale_value_dtype=None, int? dequant_scale_key_rope_dtype=None, "
    "int? out_dtype=None"
)

_lib = torch.library.Library("npu", "FRAGMENT")
_lib.define(f"{NAME}({_ARGS}) -> (Tensor, Tensor)")
_lib.define(f"{NAME}.out({_ARGS}, Tensor? workspace=None, Tensor(a!)[] out) -> (Tensor, Tensor)")
_lib.define(f"_{NAME}_get_max_workspace({_ARGS}) -> Tensor")
_lib.define(
    f"_{NAME}_infer_output(Tensor query, Tensor value, *, int? query_dtype=None, "
    'int? value_dtype=None, str input_layout="BSH", Tensor? quant_scale_out=None, '
    "Tensor? block_table=None, int num_query_heads=1, int num_key_value_heads=0, "
    "bool return_softmax_lse=False, Tensor? query_rope=None, int? out_dtype=None) "
    "-> (Tensor, Tensor)"
)
fused_infer_attention_score_v2 = getattr(torch.ops.npu, NAME)
_SIGNATURE = Signature(NAME, fused_infer_attention_score_v2.out._schema)
_INFER = Signature(
    f"_{NAME}_infer_output", getattr(torch.ops.npu, f"_{NAME}_infer_output").default._schema
)


def _v1(b: dict[str, Any]) -> dict[str, Any]:
    refuse(NAME, b, (*_QUANT, *_DTYPES))
    return {_V1_NAMES.get(k, k): v for k, v in b.items()}


def _plan(b: dict[str, Any]) -> Plan:
    return planned(NAME, _v1(b), _V2_NAMES)


_KERNELS = Kernels(NAME, _SIGNATURE.bind, _v1, WORKSPACE_GETTER, _V2_NAMES)
_lib.impl(NAME, _KERNELS.cpu, "CPU")
_lib.impl(NAME, _KERNELS.meta, "Meta")
_lib.impl(f"{NAME}.out", _KERNELS.out_cpu, "CPU")
_lib.impl(f"{NAME}.out", _KERNELS.out_meta, "Meta")
PATCHABLE_OPS.update({fused_infer_attention_score_v2.default, fused_infer_attention_score_v2.out})


def get_max_workspace(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``_npu_fused_infer_attention_score_v2_get_max_workspace`` (host-side)."""
    b = _SIGNATURE.bind(args, kwargs)
    return torch.empty(_plan(b).workspace_bytes(), dtype=torch.uint8, device=b["query"].device)


def infer_output(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """``_npu_fused_infer_attention_score_v2_infer_output``: empty (attention_out, lse)."""
    b = _INFER.bind(args, kwargs)
    refuse(_INFER.op_name, b, ("quant_scale_out", "query_dtype", "value_dtype", "out_dtype"))
    return inferred_outputs(_INFER.op_name, b["query"], b["value"], _v1(b), _V2_NAMES)


register_host_op(
    getattr(torch.ops.npu, f"_{NAME}_get_max_workspace").default,
    lambda func, args, kwargs: get_max_workspace(*args, **kwargs),
)
register_host_op(
    getattr(torch.ops.npu, f"_{NAME}_infer_output").default,
    lambda func, args, kwargs: infer_output(*args, **kwargs),
)


@register_npu_graph_handler([
    "npu_fused_infer_attention_score_v2",
    "npu_fused_infer_attention_score_v2.default",
    "npu_fused_infer_attention_score_v2.out",
])  # fmt: skip
class IFAv2DefaultHandler(TensorListOutHandler):
    """torch_npu's ``_IFAv2DefaultHandler`` (``_npugraph_handlers/ifa_handler.py``)."""

    UPDATE_SPECS = specs_for(
        "npu_fused_infer_attention_score_v2",
        [("arg", 7, "actual_seq_qlen"), ("arg", 8, "actual_seq_kvlen")],
    )

    @classmethod
    def prepare_capture(cls, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        out_op = fused_infer_attention_score_v2.out
        if func is out_op:
            return func, args, kwargs
        kwargs = dict(kwargs)
        kwargs["workspace"] = get_max_workspace(*args, **kwargs)
        keys = ("query_dtype", "value_dtype", "input_layout", "quant_scale_out", "block_table",
                "num_query_heads", "num_key_value_heads", "return_softmax_lse", "query_rope",
                "out_dtype")  # fmt: skip
        o, lse = infer_output(args[0], args[2], **{k: kwargs[k] for k in keys if k in kwargs})
        kwargs["out"] = [o, lse]
        return out_op, args, kwargs
