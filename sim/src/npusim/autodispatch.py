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

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import ops
from .errors import UpdateKeyIgnoredWarning
from .events import ExternalEvent
from .graphs import NPUGraph
from .streams import Stream, current_stream
from .streams import stream as stream_ctx
from .task_groups import (
    graph_task_group_begin,
    graph_task_group_end,
    graph_task_update_begin,
    graph_task_update_end,
)


@dataclass
class GraphDispatchRecord:
    """torch_npu's ``_GraphDispatchRecord``: one recorded op call of a capture."""

    event: ExternalEvent
    handle: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    args: list[Any] = field(default_factory=list)
    op_cache_entry: Any = None

    def update(self, values: dict[str, Any]) -> None:
        """Re-issue the call with ``values`` patched in (``NPUGraph.update``), on the
        process's update stream, and record its event."""
        u = GraphDispatchMode.update_stream
        assert u is not None
        with stream_ctx(u):
            graph_task_update_begin(u, self.handle)
            _apply(self, values)
            self.op_cache_entry(*self.args, **self.kwargs)
            graph_task_update_end(u)
            self.event.record(u)


@dataclass(frozen=True)
class GraphOpHandler:
    """What a capture does with one op family; ``update_specs`` maps update keys to
    positional slots (``("arg", index, key)``) as torch_npu's ``UPDATE_SPECS`` do."""

    update_specs: tuple[tuple[str, int, str], ...] = ()
    prepare: Callable[[Any, tuple[Any, ...], dict[str, Any]], tuple[Any, tuple[Any, ...],
                      dict[str, Any]]] | None = None  # fmt: skip
    returns_out: bool = False  # the result is kwargs["out"] (tensor-list outputs)


HANDLERS: dict[Any, GraphOpHandler] = {}


def register_handler(funcs: list[Any], handler: GraphOpHandler) -> None:
    for func in funcs:
        HANDLERS[func] = handler


def _prepare_fia(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    out_op = ops.fused_infer_attention_score.out
    if func is out_op:
        return func, args, kwargs
    kwargs = dict(kwargs)
    kwargs["workspace"] = ops.get_max_workspace(*args, **kwargs)
    keys = ("input_layout", "quant_scale2", "block_table", "num_heads", "num_key_value_heads",
            "softmax_lse_flag", "query_rope")  # fmt: skip
    o, lse = ops.infer_output(args[0], args[2], **{k: kwargs[k] for k in keys if k in kwargs})
    kwargs["out"] = [o, lse]
    return out_op, args, kwargs


register_handler(
    [ops.fused_infer_attention_score.default, ops.fused_infer_attention_score.out],
    GraphOpHandler(
        update_specs=(("arg", 5, "actual_seq_lengths"), ("arg", 6, "actual_seq_lengths_kv")),
        prepare=_prepare_fia,
        returns_out=True,
    ),
)


class GraphDispatchMode(TorchDispatchMode):
    update_stream: Stream | None = None  # one per process, as in torch_npu

    def __init__(self, graph: NPUGraph) -> None:
        super().__init__()
        self.graph = graph
        if GraphDispatchMode.update_stream is None:
            GraphDispatchMode.update_stream = Stream()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = HANDLERS.get(func)
        if handler is None or not current_stream().capturing:
            return func(*args, **kwargs)
        records = self.graph.graph_dispatch_mode.graph_dispatch_records
        stream = current_stream()
        event = ExternalEvent()
        event.label = f"auto-dispatch task {len(records)} of {self.graph.name}"
        event.wait(stream)
        event.reset(stream)
        if handler.prepare is not None:
            func, args, kwargs = handler.prepare(func, args, kwargs)
        graph_task_group_begin(stream)
        result = func(*args, **kwargs)
        handle = graph_task_group_end(stream)
        records.append(GraphDispatchRecord(event, handle, dict(kwargs), list(args), func))
        return list(kwargs["out"]) if handler.returns_out else result


def _apply(record: GraphDispatchRecord, update: dict[str, Any]) -> None:
    handler = HANDLERS[record.op_cache_entry]
    applied = set()
    for key, value in update.items():
        if key in record.kwargs:
            record.kwargs[key] = value
            applied.add(key)
    for loc, index, key in handler.update_specs:
        if loc == "arg" and key in update and len(record.args) > index:
            record.args[index] = update[key]
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
    "GraphOpHandler",
    "UpdateKeyIgnoredWarning",
    "register_handler",
    "torch",
]
