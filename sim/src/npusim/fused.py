"""The fused update binding of torch_npu, simulated.

``torch_npu._C._npu_fused_infer_attention_score_out_graph(update_stream, handle,
event, <arguments of npu_fused_infer_attention_score.out>)`` does
``graph_task_update_begin`` + the op + ``graph_task_update_end`` + ``event.record``
on ``update_stream`` in one call (on hardware, with the GIL released) and returns
``(attention_out, softmax_lse)``, the ``out`` tensors. Like the hardware binding, it
binds its arguments itself and never goes through torch's dispatcher (:mod:`.direct`).
"""

from __future__ import annotations

import time
from typing import Any

from . import direct
from .errors import SimUsageError
from .events import ExternalEvent
from .ops import fused_infer_attention_score
from .routing import charge_and_issue
from .runtime import RUNTIME
from .streams import Stream
from .task_groups import (
    PatchWork,
    TaskGroupHandle,
    abandon_update,
    graph_task_update_begin,
    graph_task_update_end,
)

_OUT = fused_infer_attention_score.out


def fused_update_out_graph(
    update_stream: Stream, handle: Any, event: Any, *args: Any, **kwargs: Any
) -> tuple[Any, Any]:
    if not isinstance(handle, TaskGroupHandle):
        raise SimUsageError(
            "_npu_fused_infer_attention_score_out_graph: handle must be a "
            f"torch_npu._C._NPUTaskGroupHandle, got {type(handle).__name__}"
        )
    started = time.perf_counter()  # a timed patch's host cost runs from here
    if RUNTIME.config.perf and _updated_at_once(update_stream, handle, event, args, kwargs,
                                                started):  # fmt: skip
        out = kwargs["out"]
        return out[0], out[1]
    graph_task_update_begin(update_stream, handle)
    try:
        # On the update stream, as the binding's C++ issues it (not the current stream).
        # The release goes with the patch, in its stream entry, when the event is the
        # sim's ExternalEvent (the update's last patch records it).
        ext = event if type(event) is ExternalEvent else None
        released = direct.call(_OUT, args, kwargs, started, update_stream, ext)
    except BaseException:
        abandon_update(update_stream)  # the op's error, not "ended after 0 tasks"
        raise
    graph_task_update_end(update_stream)
    if not released:
        event.record(update_stream)
    out = kwargs["out"]  # (keyword-only in the schema: the binding refused a call without)
    return out[0], out[1]


def _updated_at_once(
    stream: Stream, handle: TaskGroupHandle, event: Any, args: tuple[Any, ...],
    kwargs: dict[str, Any], started: float,
) -> bool:  # fmt: skip
    """Performance mode's fused update in the common case, in one step: a call made as
    one that bound before, over the tensors of the group's one task (the group
    of one attention op), on a stream that is neither capturing nor updating, with a
    handle that is not stale and the sim's ExternalEvent. The patch and the release
    are one stream entry, as :func:`fused_update_out_graph`'s general path makes them;
    what is saved is the begin/end bookkeeping and its locks. False when it is not that
    case, having done nothing: the general path then does it (or refuses it)."""
    if type(event) is not ExternalEvent:
        return False
    call = direct.bind_as_before(_OUT, args, kwargs)
    if call is None:
        return False
    group = handle.group
    graph = group.graph
    with RUNTIME.cond:
        tasks = group.tasks
        if (
            graph.generation != handle.generation
            or not graph.captured
            or stream.capturing is not None
            or stream.updating is not None
            or len(tasks) != 1
            or not tasks[0].call.same_tensors(call)
        ):
            return False
        call._keys = tasks[0].call._keys
        patch = PatchWork(handle, tasks[0], call)
        patch.release = event.record_issued_locked(stream)
    charge_and_issue(stream, patch, started)
    return True
