"""A ``torch_npu``-shaped namespace over the simulated NPU.

``from graphlane.sim import torch_npu`` sets the device up; code written
for torch_npu then runs on the CPU with only its ``import torch_npu`` line
changed: ``torch_npu.npu`` is ``torch.npu`` (streams, events, graphs, the
task-group update API), and the op functions live at the top level.
"""

from __future__ import annotations

from types import SimpleNamespace

from . import npu
from . import ops as _ops
from .backend import setup
from .fused import fused_update_out_graph

setup()

npu_fused_infer_attention_score = _ops.fused_infer_attention_score
_npu_fused_infer_attention_score_get_max_workspace = _ops.get_max_workspace
_npu_fused_infer_attention_score_infer_output = _ops.infer_output

# torch_npu._C: only the fused update binding graphlane's npu provider looks for.
_C = SimpleNamespace(_npu_fused_infer_attention_score_out_graph=fused_update_out_graph)

__all__ = [
    "_C",
    "_npu_fused_infer_attention_score_get_max_workspace",
    "_npu_fused_infer_attention_score_infer_output",
    "npu",
    "npu_fused_infer_attention_score",
]
