"""``torch.npu.graph(g, auto_dispatch_capture=True)`` and ``NPUGraph.update``.

As torch_npu 2.14 does it (``torch_npu/npu/graphs.py`` ``_GraphDispatchMode`` and
``torch_npu/npu/_npugraph_handlers``): during such a capture every call of an op with a
handler is wrapped as ``ExternalEvent.wait`` + ``graph_task_group_begin`` + the op (the
fused attention ops switch to their ``.out`` overload with a workspace from
``*_get_max_workspace`` and outputs from ``*_infer_output``) + ``graph_task_group_end``,
and recorded with the call's positional ``args`` and keyword ``kwargs`` as the dispatcher
passed them. ``NPUGraph.update(cpu_update_input)`` re-issues every recorded op on one
process-wide update stream between ``graph_task_update_begin/end`` and records its event.

The update rule is torch_npu's: a key replaces a recorded keyword argument only if the
capture passed it (the dispatcher leaves out keyword arguments given their default), and
a positional slot only where the op's handler names one (``_npu_paged_attention``'s
``context_lens``, argument 7). Any other key is dropped, so the replay keeps the captured
value: on the NPU silently; the sim also warns (:class:`UpdateKeyIgnoredWarning`), a
sim-only diagnostic, because it is a classic source of wrong answers.
"""

from __future__ import annotations

import re
import warnings
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import ops
from .errors import SimUsageError, UpdateKeyIgnoredWarning
from .events import ExternalEvent
from .graphs import GraphDispatchState, NPUGraph
from .npugraph_handler import (
    _NPU_GRAPH_OP_HANDLERS,
    NpuGraphOpHandler,
    TensorListOutHandler,
    _weak_ref_tensor,
    register_npu_graph_handler,
    specs_for,
)
from .streams import current_stream
from .streams import stream as stream_ctx
from .task_groups import (
    graph_task_group_begin,
    graph_task_group_end,
    graph_task_update_begin,
    graph_task_update_end,
)


@dataclass
class GraphDispatchRecord:
    """torch_npu's ``_GraphDispatchRecord``: one recorded op call of a capture. Its device
    tensors are weak references (``_weak_ref_tensor``), as torch_npu records them: the
    record does not keep them allocated."""

    event: ExternalEvent
    handle: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    args: list[Any] = field(default_factory=list)
    op_cache_entry: Any = None

    def update(self, values: dict[str, Any]) -> None:
        """Re-issue the call with ``values`` patched in (``NPUGraph.update``), on the
        process's update stream, and record its event."""
        u = GraphDispatchState.update_stream
        assert u is not None  # made with the first graph
        with stream_ctx(u):
            graph_task_update_begin(u, self.handle)
            _apply(self, values)
            self.op_cache_entry(*self.args, **self.kwargs)
            graph_task_update_end(u)
            self.event.record(u)


@register_npu_graph_handler([
    "npu_fused_infer_attention_score",
    "npu_fused_infer_attention_score.default",
    "npu_fused_infer_attention_score.out",
])  # fmt: skip
class IFAv1DefaultHandler(TensorListOutHandler):
    """torch_npu's ``_IFAv1DefaultHandler``: ``.default`` gets a workspace sized once, here,
    by ``_get_max_workspace`` on the captured arguments, and outputs from
    ``_infer_output``, and becomes ``.out``; ``.out`` passes through."""

    UPDATE_SPECS = specs_for(
        "npu_fused_infer_attention_score",
        [("arg", 5, "actual_seq_lengths"), ("arg", 6, "actual_seq_lengths_kv")],
    )

    @classmethod
    def prepare_capture(cls, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        out_op = ops.fused_infer_attention_score.out
        if func is out_op:
            return func, args, kwargs
        kwargs = dict(kwargs)
        kwargs["workspace"] = ops.get_max_workspace(*args, **kwargs)
        keys = ("input_layout", "quant_scale2", "block_table", "num_heads",
                "num_key_value_heads", "softmax_lse_flag", "query_rope")  # fmt: skip
        o, lse = ops.infer_output(args[0], args[2], **{k: kwargs[k] for k in keys if k in kwargs})
        kwargs["out"] = [o, lse]
        return out_op, args, kwargs


_TENSOR_PARAMS: dict[str, list[str]] = {}


def _tensor_param_names(func: Any) -> list[str]:
    """The tensor parameters of ``func``'s schema (torch_npu's ``update_schema``)."""
    name = str(func.__name__)
    names = _TENSOR_PARAMS.get(name)
    if names is None:
        names = _TENSOR_PARAMS[name] = re.findall(r"Tensor(?:\(a!\)|\?)?\s+(\w+)",
                                                  str(func._schema))  # fmt: skip
    return names


def _record(event: ExternalEvent, handle: Any, args: Any, kwargs: dict[str, Any], func: Any,
            handler: type[NpuGraphOpHandler]) -> GraphDispatchRecord:  # fmt: skip
    """torch_npu's ``_append_dispatch_record``: device tensors as weak references, every
    other value deep-copied."""
    args_ref = [
        _weak_ref_tensor(a) if torch.is_tensor(a) and "npu" in str(a.device) else deepcopy(a)
        for a in args
    ]
    names = _tensor_param_names(func)
    kwargs_ref = {k: handler.record_wrap_kwarg(k, v, names) for k, v in kwargs.items()}
    return GraphDispatchRecord(event, handle, kwargs_ref, args_ref, func)


class GraphDispatchMode(TorchDispatchMode):
    """The dispatch mode of one auto-dispatch capture: the capture skeleton of torch_npu's
    ``_GraphDispatchMode.__torch_dispatch__`` (the records go to the graph's
    ``graph_dispatch_mode``)."""

    def __init__(self, graph: NPUGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _NPU_GRAPH_OP_HANDLERS.get(func.__name__)
        if handler is None or not current_stream().capturing:
            return func(*args, **kwargs)
        should_handle = getattr(handler, "should_handle", None)
        if should_handle is not None and not should_handle(func, args, kwargs):
            return func(*args, **kwargs)
        records = self.graph.graph_dispatch_mode.graph_dispatch_records
        stream = current_stream()
        event = ExternalEvent()
        event.label = f"auto-dispatch task {len(records)} of {self.graph.name}"
        event.wait(stream)
        event.reset(stream)
        func, args, kwargs = handler.prepare_capture(func, args, dict(kwargs))
        graph_task_group_begin(stream)
        try:
            result = func(*args, **kwargs)
        except BaseException as exc:  # the group stays open (as torch_npu leaves it): the
            cap = stream.capturing  # capture's end names this error as its cause
            if cap is not None and cap.open_group is not None:
                cap.open_group.cause = exc
            raise
        handle = graph_task_group_end(stream)
        records.append(_record(event, handle, args, kwargs, func, handler))
        return handler.postprocess_result(result, kwargs)


def _apply(record: GraphDispatchRecord, update: dict[str, Any]) -> None:
    name = record.op_cache_entry.__name__
    handler = _NPU_GRAPH_OP_HANDLERS.get(name)
    if handler is None:
        raise SimUsageError(
            f"No handler for recorded op: {name}. This indicates the handler was "
            "unregistered between capture and update."
        )
    applied = set()
    for key, value in update.items():
        if key in record.kwargs:
            record.kwargs[key] = value
            applied.add(key)
    handler.update_args(record, update)
    for loc, index, key in handler.get_update_specs(name):
        if key in update and (loc == "kwarg" or len(record.args) > index):
            applied.add(key)
    for key in update.keys() - applied:
        warnings.warn(
            f"NPUGraph.update: {key!r} patches nothing in {record.op_cache_entry}: the "
            "captured call did not pass it (or passed its default), so torch_npu drops it "
            "silently and the replay keeps the captured value. Pass it at capture.",
            UpdateKeyIgnoredWarning,
            stacklevel=5,
        )


__all__ = [
    "GraphDispatchMode",
    "GraphDispatchRecord",
    "IFAv1DefaultHandler",
    "UpdateKeyIgnoredWarning",
]
