"""The fused update binding of torch_npu, simulated.

``torch_npu._C._npu_fused_infer_attention_score_out_graph(update_stream, handle,
event, <arguments of npu_fused_infer_attention_score.out>)`` does
``graph_task_update_begin`` + the op + ``graph_task_update_end`` + ``event.record``
on ``update_stream`` in one call (on hardware, with the GIL released) and returns
``(attention_out, softmax_lse)``, the ``out`` tensors.
"""

from __future__ import annotations

from typing import Any

from .errors import SimUsageError
from .graphs import TaskGroupHandle, graph_task_update_begin, graph_task_update_end
from .ops import fused_infer_attention_score
from .streams import Stream
from .streams import stream as stream_ctx


def fused_update_out_graph(
    update_stream: Stream, handle: Any, event: Any, *args: Any, **kwargs: Any
) -> tuple[Any, Any]:
    if not isinstance(handle, TaskGroupHandle):
        raise SimUsageError(
            "_npu_fused_infer_attention_score_out_graph: handle must be a "
            f"torch_npu._C._NPUTaskGroupHandle, got {type(handle).__name__}"
        )
    with stream_ctx(update_stream):
        graph_task_update_begin(update_stream, handle)
        try:
            result = fused_infer_attention_score.out(*args, **kwargs)
        finally:
            graph_task_update_end(update_stream)
        event.record(update_stream)
    return result
