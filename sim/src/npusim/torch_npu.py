"""A ``torch_npu``-shaped namespace over the simulated NPU.

``from npusim import torch_npu`` sets the device up; code written
for torch_npu then runs on the CPU with only its ``import torch_npu`` line
changed: ``torch_npu.npu`` is ``torch.npu`` (streams, events, graphs, the
task-group update API), and the op functions live at the top level.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from . import atb_rotary as _atb_rotary
from . import fused_ops as _fused
from . import npu
from . import ops as _ops
from .backend import setup
from .fia_v2 import fused_infer_attention_score_v2
from .flash_attention_qlens import flash_attention_qlens
from .fused import fused_update_out_graph
from .npu_extras import (
    Format,
    _construct_NPU_Tensor_From_Storage_And_Metadata,
    _construct_storage_from_data_pointer,
    get_npu_format,
)
from .npugraph_handler import _weak_ref_tensor
from .paged_attention import paged_attention
from .task_groups import TaskGroupHandle

setup()
if torch.distributed.is_available():  # torch.distributed's "hccl" backend for the device "npu"
    from . import collectives as _collectives

    _collectives.register()
    distributed = SimpleNamespace(is_hccl_available=_collectives.is_hccl_available)

_npu_ops = torch.ops.npu
npu_fused_infer_attention_score = _ops.fused_infer_attention_score
_npu_fused_infer_attention_score_get_max_workspace = (
    _npu_ops._npu_fused_infer_attention_score_get_max_workspace
)
_npu_fused_infer_attention_score_infer_output = (
    _npu_ops._npu_fused_infer_attention_score_infer_output
)
npu_fused_infer_attention_score_v2 = fused_infer_attention_score_v2
_npu_fused_infer_attention_score_v2_get_max_workspace = (
    _npu_ops._npu_fused_infer_attention_score_v2_get_max_workspace
)
_npu_fused_infer_attention_score_v2_infer_output = (
    _npu_ops._npu_fused_infer_attention_score_v2_infer_output
)
_npu_paged_attention = paged_attention
_npu_flash_attention_qlens = flash_attention_qlens
# The field's fused ops (:mod:`.fused_ops`).
npu_rms_norm = _fused.rms_norm
npu_add_rms_norm = _fused.add_rms_norm
npu_rotary_mul = _fused.rotary_mul
npu_apply_rotary_pos_emb = _fused.apply_rotary_pos_emb
npu_mrope = _fused.mrope
_npu_rotary_embedding = _atb_rotary.rotary_embedding
npu_swiglu = _fused.swiglu
npu_scatter_pa_kv_cache = _fused.scatter_pa_kv_cache
_npu_reshape_and_cache = _fused.reshape_and_cache
npu_top_k_top_p = _fused.top_k_top_p
_npu_paged_attention_get_workspace = _npu_ops._npu_paged_attention_get_workspace

# torch_npu._C: the names serving stacks use (the fused update binding, the task-group
# handle type, torchair's tensor-from-storage constructors).
_C = SimpleNamespace(
    _npu_fused_infer_attention_score_out_graph=fused_update_out_graph,
    _NPUTaskGroupHandle=TaskGroupHandle,
    _construct_storage_from_data_pointer=_construct_storage_from_data_pointer,
    _construct_NPU_Tensor_From_Storage_And_Metadata=_construct_NPU_Tensor_From_Storage_And_Metadata,
    _weak_ref_tensor=_weak_ref_tensor,
)

__all__ = [
    "_C",
    "Format",
    "_npu_flash_attention_qlens",
    "_npu_fused_infer_attention_score_get_max_workspace",
    "_npu_fused_infer_attention_score_infer_output",
    "_npu_fused_infer_attention_score_v2_get_max_workspace",
    "_npu_fused_infer_attention_score_v2_infer_output",
    "_npu_paged_attention",
    "_npu_paged_attention_get_workspace",
    "_npu_reshape_and_cache",
    "_npu_rotary_embedding",
    "get_npu_format",
    "npu",
    "npu_add_rms_norm",
    "npu_apply_rotary_pos_emb",
    "npu_fused_infer_attention_score",
    "npu_fused_infer_attention_score_v2",
    "npu_mrope",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_scatter_pa_kv_cache",
    "npu_swiglu",
    "npu_top_k_top_p",
]
