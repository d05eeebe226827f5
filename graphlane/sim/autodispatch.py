"""``torch.npu.graph(g, auto_dispatch_capture=True)`` and ``NPUGraph.update``.

As torch_npu 2.14 does it: during such a capture, every call of an op with an
update handler (here the fused infer attention op) is wrapped as
``ExternalEvent.wait`` + ``graph_task_group_begin`` + the ``.out`` form of the op
+ ``graph_task_group_end``, and recorded. ``NPUGraph.update(cpu_update_input)``
then re-issues every recorded op with the given arguments on one process-wide
update stream, between ``graph_task_update_begin/end``, and records its event.
A single entry in ``cpu_update_input`` is applied to every recorded op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import ops
from .errors import SimUsageError
from .events import ExternalEvent
from .graphs import (
    NPUGraph,
    TaskGroupHandle,
    graph_task_group_begin,
    graph_task_group_end,
    graph_task_update_begin,
    graph_task_update_end,
)
from .streams import Stream, current_stream
from .streams import stream as stream_ctx

_HANDLED = {ops.fused_infer_attention_score.default, ops.fused_infer_attention_score.out}
_OUT_KEYS = ("input_layout", "num_heads", "num_key_value_heads", "softmax_lse_flag")


@dataclass
class DispatchRecord:
    event: ExternalEvent
    handle: TaskGroupHandle
    func: Any
    arguments: dict[str, Any]


class GraphDispatchMode(TorchDispatchMode):
    update_stream: Stream | None = None  # one per process, as in torch_npu

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


def update_records(graph: NPUGraph, cpu_update_input: list[dict[str, Any]]) -> None:
    records = graph.dispatch_records
    updates = list(cpu_update_input)
    if len(updates) == 1:
        updates = [dict(updates[0]) for _ in records]
    if len(updates) != len(records):
        raise SimUsageError(
            f"Currently, there are {len(records)} operators that need to be updated by capture, "
            f"and there are only {len(updates)} elements in the incoming cpu_update_input list"
        )
    if GraphDispatchMode.update_stream is None:
        GraphDispatchMode.update_stream = Stream()
    u = GraphDispatchMode.update_stream
    with stream_ctx(u):
        for record, update in zip(records, updates, strict=True):
            for key in update:
                if key not in record.arguments or key in ("out", "query", "key", "value"):
                    raise SimUsageError(
                        f"NPUGraph.update: {key!r} is not an updatable argument of "
                        f"{record.func.__name__}"
                    )
            graph_task_update_begin(u, record.handle)
            record.arguments.update(update)
            record.func(**record.arguments)
            graph_task_update_end(u)
            record.event.record(u)


__all__ = ["GraphDispatchMode", "torch", "update_records"]
