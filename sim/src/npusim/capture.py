"""``torch.npu.graph``: the context that captures a graph on a side stream.

Entering it synchronizes the device, makes the capture stream current, enters the
auto-dispatch capture mode when asked (:mod:`.autodispatch`) and begins the
capture (:mod:`.graphs`); leaving it ends the capture. Left by an error raised
inside it, it ends (abandons) the capture and lets that error propagate as itself:
what ending the capture complains of becomes a note on it.
"""

from __future__ import annotations

from typing import Any

from . import device
from .allocation import empty_cache
from .autodispatch import GraphDispatchMode
from .graphs import NPUGraph
from .streams import Stream
from .streams import stream as stream_ctx


class graph:
    """``torch.npu.graph(g, pool=None, stream=None, auto_dispatch_capture=False)``."""

    default_capture_stream: Stream | None = None

    def __init__(
        self,
        npu_graph: NPUGraph,
        pool: Any = None,
        stream: Stream | None = None,
        auto_dispatch_capture: bool = False,
        capture_error_mode: str = "global",
    ) -> None:
        if stream is None:
            if graph.default_capture_stream is None:
                graph.default_capture_stream = Stream()
            stream = graph.default_capture_stream
        self.capture_stream = stream
        self.npu_graph = npu_graph
        self.pool = pool
        self.capture_error_mode = capture_error_mode
        npu_graph.auto_dispatch_capture = auto_dispatch_capture
        self._stream_ctx: Any = None
        self._mode: Any = None

    def __enter__(self) -> None:
        device.synchronize(self.capture_stream.device_index)
        empty_cache()  # as torch_npu's graph does
        self._stream_ctx = stream_ctx(self.capture_stream)
        self._stream_ctx.__enter__()
        if self.npu_graph.auto_dispatch_capture:
            self._mode = GraphDispatchMode(self.npu_graph)
            self._mode.__enter__()
        try:
            self.npu_graph.capture_begin(self.pool, capture_error_mode=self.capture_error_mode)
        except BaseException:  # no capture began: leave the stream and mode as they were
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
            self._stream_ctx.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            try:
                self.npu_graph.capture_end()
            except Exception as end:
                if exc[1] is None:
                    raise
                # An error inside the capture propagates as itself: ending the capture it
                # abandoned may complain (of a task group the error left open), but that
                # complaint is a note on the cause, never its replacement.
                exc[1].add_note(f"ending the abandoned capture also failed: {end}")
        finally:
            if self._mode is not None:
                self._mode.__exit__(*exc)
            self._stream_ctx.__exit__(*exc)
