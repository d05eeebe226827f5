"""``torch_npu._npu_paged_attention`` (ATB PagedAttention, the small-batch decode path of
vllm-ascend and sglang) and ``_npu_paged_attention_get_workspace``, with the wheel's schemas.

    _npu_paged_attention(query [B, N, D], key_cache [blocknum, blocksize, KV_N, D],
        value_cache [blocknum, blocksize, KV_N, Dv], num_kv_heads, num_heads, scale_value,
        block_table int32 [B, max_blocks], context_lens int32 host tensor [B],
        out [B, N, Dv], *, workspace=None)

value_cache's D may differ from key_cache's (ATB PagedAttention takes a value head size of
its own: torch_npu's ``test_paged_attention_aclgraph_update`` runs key D 288 with value D
96).

``context_lens`` is a host tensor: the dispatch reads it when the op is issued (it sizes
the tiling), so it is a parameter that a graph update replaces, not device memory. Its
values are checked at every issue (eager, capture, update): each within the batch's
block_table capacity, and within what the given workspace holds. The math is the
paged FIA kernel's (BSH query of S 1, (blocknum, blocksize, H) caches).
"""

from __future__ import annotations

from typing import Any

import torch

from . import fia_kernel
from .errors import SimUsageError
from .fia_layout import Plan
from .fia_ops import Signature, check_workspace, planned
from .npugraph_handler import NpuGraphOpHandler, register_npu_graph_handler
from .opcall import PATCH_PARAMETERS
from .streams import current_stream
from .tensor import PATCHABLE_OPS, issue, register_host_op

NAME = "_npu_paged_attention"
_ARGS = (
    "Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads, int num_heads, "
    "float scale_value, Tensor block_table, Tensor context_lens"
)
_lib = torch.library.Library("npu", "FRAGMENT")
_lib.define(f"{NAME}({_ARGS}, Tensor(a!) out, *,Tensor? workspace=None) -> ()")
_lib.define(f"{NAME}_get_workspace({_ARGS}, Tensor(a!) out) -> Tensor")
paged_attention = getattr(torch.ops.npu, NAME)
_SIGNATURE = Signature(NAME, paged_attention.default._schema)
_WS_SIGNATURE = Signature(
    f"{NAME}_get_workspace", getattr(torch.ops.npu, f"{NAME}_get_workspace").default._schema
)


def _shapes(b: dict[str, Any]) -> None:
    q, k, v, out = b["query"], b["key_cache"], b["value_cache"], b["out"]
    n, nkv = b["num_heads"], b["num_kv_heads"]
    if q.dim() != 3 or q.shape[1] != n:
        raise SimUsageError(f"{NAME}: query must be [B, num_heads={n}, D], got {list(q.shape)}")
    if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or k.shape[2] != nkv:
        raise SimUsageError(
            f"{NAME}: key_cache/value_cache must be [blocknum, blocksize, num_kv_heads={nkv}, D], "
            f"got {list(k.shape)} and {list(v.shape)}"
        )
    if k.shape[3] != q.shape[2]:
        raise SimUsageError(f"{NAME}: key_cache D {k.shape[3]} differs from query D {q.shape[2]}")
    want = [q.shape[0], n, v.shape[3]]
    if list(out.shape) != want or out.dtype != q.dtype:
        raise SimUsageError(
            f"{NAME}: out must be {want} {q.dtype}, got {list(out.shape)} {out.dtype}"
        )
    bt = b["block_table"]
    if bt.dtype != torch.int32 or bt.dim() != 2 or bt.shape[0] != q.shape[0]:
        raise SimUsageError(
            f"{NAME}: block_table must be int32 [B={q.shape[0]}, max_blocks], got {bt.dtype} "
            f"{list(bt.shape)}"
        )


def _lengths(b: dict[str, Any]) -> list[int]:
    cl = b["context_lens"]
    if isinstance(cl, torch.Tensor) and cl.device.type != "cpu":
        raise SimUsageError(f"{NAME}: context_lens must be a host (CPU) int32 tensor")
    if not isinstance(cl, torch.Tensor) or cl.dim() != 1 or cl.shape[0] != b["query"].shape[0]:
        raise SimUsageError(f"{NAME}: context_lens must hold one length per batch")
    return [int(x) for x in cl.tolist()]


def _v1(b: dict[str, Any], lengths: list[int]) -> dict[str, Any]:
    q, k, v = b["query"], b["key_cache"], b["value_cache"]
    return {
        "query": q.reshape(q.shape[0], 1, -1),
        "key": k.reshape(k.shape[0], k.shape[1], -1),
        "value": v.reshape(v.shape[0], v.shape[1], -1),
        "block_table": b["block_table"],
        "actual_seq_lengths_kv": lengths,
        "num_heads": b["num_heads"],
        "num_key_value_heads": b["num_kv_heads"],
        "scale": b["scale_value"],
        "block_size": k.shape[1],
        "input_layout": "BSH",
        "value_d_free": True,
    }


# What errors name: this op's arguments for the FIA ones _v1 maps them to (key and
# value are not renamed: "value" is also a word of the messages).
_NAMES = {"actual_seq_lengths_kv": "context_lens", "num_key_value_heads": "num_kv_heads",
          "block_size": "key_cache's block size"}  # fmt: skip


def _plan(b: dict[str, Any]) -> Plan:
    return planned(NAME, _v1(b, _lengths(b)), _NAMES)


def _cpu(*args: Any, **kwargs: Any) -> None:
    b = _SIGNATURE.bind(args, kwargs)
    a = _v1(b, _lengths(b))
    o, _ = fia_kernel.compute(planned(NAME, a, _NAMES), a)
    b["out"].copy_(o.reshape(b["out"].shape))


def _meta(*args: Any, **kwargs: Any) -> None:
    _shapes(_SIGNATURE.bind(args, kwargs))


_lib.impl(NAME, _cpu, "CPU")
_lib.impl(NAME, _meta, "Meta")
PATCHABLE_OPS.add(paged_attention.default)
PATCH_PARAMETERS[paged_attention.default] = frozenset({"workspace"})


def _issue_checked(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Value checks of context_lens (the meta kernel sees no data), then the device op."""
    b = _SIGNATURE.bind(args, kwargs)
    _shapes(b)
    check_workspace(NAME, b.get("workspace"), _plan(b).workspace_bytes(),
                    f"torch_npu.{NAME}_get_workspace")  # fmt: skip
    index = b["query"].device.index or 0
    return issue(current_stream(index), func, args, kwargs, index)


def get_workspace(*args: Any, **kwargs: Any) -> torch.Tensor:
    """``_npu_paged_attention_get_workspace``: a uint8 workspace for these lengths."""
    b = _WS_SIGNATURE.bind(args, kwargs)
    _shapes(b)
    return torch.empty(_plan(b).workspace_bytes(), dtype=torch.uint8, device=b["query"].device)


register_host_op(paged_attention.default, _issue_checked)
register_host_op(
    getattr(torch.ops.npu, f"{NAME}_get_workspace").default,
    lambda func, args, kwargs: get_workspace(*args, **kwargs),
)


@register_npu_graph_handler(["_npu_paged_attention.default", "npu_multi_head_latent_attention.out"])
class SimpleGraphHandler(NpuGraphOpHandler):
    """torch_npu's ``_SimpleGraphHandler`` (``_npugraph_handlers/simple_handler.py``): an
    update's ``context_lens`` replaces argument 7 (the MLA op it also names is not
    simulated)."""

    UPDATE_SPECS = {
        "_npu_paged_attention.default": [("arg", 7, "context_lens")],
        "npu_multi_head_latent_attention.out": [("arg", 5, "context_lens")],
    }
