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
from .streams import Stream
from .task_groups import (
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
