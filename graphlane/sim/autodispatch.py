"""The capture mode of ``torch.npu.graph(g, auto_dispatch_capture=True)``.

As torch_npu 2.14 does it: during such a capture, every call of an op with an
update handler (here the fused infer attention op) is wrapped as
``ExternalEvent.wait`` + ``graph_task_group_begin`` + the ``.out`` form of the op
+ ``graph_task_group_end``, and recorded on the graph; ``NPUGraph.update``
(:mod:`.graphs`) re-issues the recorded ops.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import ops
from .events import ExternalEvent
from .graphs import DispatchRecord, NPUGraph, graph_task_group_begin, graph_task_group_end
from .streams import current_stream

_HANDLED = {ops.fused_infer_attention_score.default, ops.fused_infer_attention_score.out}
_OUT_KEYS = ("input_layout", "num_heads", "num_key_value_heads", "softmax_lse_flag")


class GraphDispatchMode(TorchDispatchMode):
    def __init__(self, graph: NPUGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _HANDLED or not current_stream().capturing:
            return func(*args, **kwargs)
        stream = current_stream()
        event = ExternalEvent()
        event.label = f"auto-dispatch task {len(self.graph.dispatch_records)} of {self.graph.name}"
        event.wait(stream)
        event.reset(stream)
        arguments = ops.bind(args, kwargs)
        functional = func is ops.fused_infer_attention_score.default
        if functional:
            arguments["workspace"] = ops.get_max_workspace(**arguments)
            extra = {k: arguments[k] for k in _OUT_KEYS}
            arguments["out"] = list(
                ops.infer_output(arguments["query"], arguments["value"], **extra)
            )
            func = ops.fused_infer_attention_score.out
        graph_task_group_begin(stream)
        func(**arguments)
        handle = graph_task_group_end(stream)
        self.graph.dispatch_records.append(DispatchRecord(event, handle, func, arguments))
        # The functional form returns its outputs; the .out schema returns nothing.
        return tuple(arguments["out"]) if functional else None


__all__ = ["GraphDispatchMode", "torch"]
