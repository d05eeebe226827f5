"""``torch_npu.npu`` of the strict torch_npu: the sim's, each call of the device, stream,
event and graph API bound against torch_npu 2.14's signature first. Names not wrapped
here (memory statistics, random numbers, ...) are the sim's."""

from __future__ import annotations

from typing import Any

from npusim import npu as _sim
from npusim.capture import graph as _sim_graph

from ._strict import API, PYTHON, THREAD, bind, function, require_device, trace

_STREAM_KEYWORDS = set(API["c_bindings"]["_NPUStreamBase.__new__"]["keywords"]) - {"priority"}


def set_device(*args: Any, **kwargs: Any) -> None:
    bound = bind("set_device", PYTHON["set_device"], args, kwargs)
    trace("set_device", dict(bound.arguments))
    _sim.set_device(*args, **kwargs)  # a device the runtime does not show is refused there
    THREAD.set = True


class device:
    """``torch_npu.npu.device(device)``: the device is set in the block."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = bind("device.__init__", PYTHON["device.__init__"], (self, *args), kwargs)
        self._ctx = _sim.device(*args, **kwargs)
        self._was = THREAD.set
        self._sets = bound.arguments["device"] is not None

    def __enter__(self) -> None:
        self._ctx.__enter__()
        THREAD.set = self._was or self._sets

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
        THREAD.set = self._was


current_device = function("current_device", _sim.current_device, device=False)
device_count = function("device_count", _sim.device_count, device=False)
is_available = function("is_available", _sim.is_available, device=False)
synchronize = function("synchronize", _sim.synchronize)
stream = function("stream", _sim.stream)
set_stream = function("set_stream", _sim.set_stream)
current_stream = function("current_stream", _sim.current_stream)
default_stream = function("default_stream", _sim.default_stream)
is_current_stream_capturing = function(
    "is_current_stream_capturing", _sim.is_current_stream_capturing, device=False
)
graph_pool_handle = function("graph_pool_handle", _sim.graph_pool_handle)
graph_task_group_begin = function("graph_task_group_begin", _sim.graph_task_group_begin)
graph_task_group_end = function("graph_task_group_end", _sim.graph_task_group_end)
graph_task_update_begin = function("graph_task_update_begin", _sim.graph_task_update_begin)
graph_task_update_end = function("graph_task_update_end", _sim.graph_task_update_end)


def _methods(cls: type, owner: str, names: tuple[str, ...]) -> None:
    for name in names:
        setattr(cls, name, function(f"{owner}.{name}", getattr(cls, name)))


class Stream(_sim.Stream):
    """``torch_npu.npu.Stream(device=None, priority=0, **kwargs)``; the keywords go to
    ``_NPUStreamBase`` (its keyword list, from the wheel's Stream.cpp)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        bound = bind("Stream.__new__", PYTHON["Stream.__new__"], (cls, *args), kwargs)
        for key in bound.arguments.get("kwargs", {}):
            if key not in _STREAM_KEYWORDS:
                raise TypeError(f"_NPUStreamBase.__new__() got an unexpected keyword {key!r}")
        require_device("Stream")
        s = super().__new__(cls, *args, **kwargs)
        priority = bound.arguments.get("priority", 0)
        trace("Stream", dict(bound.arguments), stream={"stream": s.stream_id}, priority=priority)
        return s


_methods(Stream, "Stream", ("wait_event", "wait_stream", "record_event", "query", "synchronize"))


class Event(_sim.Event):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = bind("Event.__new__", PYTHON["Event.__new__"], (type(self), *args), kwargs)
        require_device("Event")
        super().__init__(*args, **kwargs)
        trace("Event", dict(bound.arguments), event=self.name)


_methods(Event, "Event", ("record", "wait", "query", "synchronize", "elapsed_time"))


class ExternalEvent(_sim.ExternalEvent):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = bind("ExternalEvent.__new__", PYTHON["ExternalEvent.__new__"], (type(self), *args),
                     kwargs)  # fmt: skip
        require_device("ExternalEvent")
        super().__init__()
        trace("ExternalEvent", dict(bound.arguments), event=self.name)


_methods(ExternalEvent, "ExternalEvent", ("record", "wait", "reset"))


class NPUGraph(_sim.NPUGraph):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bind("NPUGraph.__init__", PYTHON["NPUGraph.__init__"], (self, *args), kwargs)
        require_device("NPUGraph")
        super().__init__()
        trace("NPUGraph", {}, graph=self.name)


_methods(NPUGraph, "NPUGraph",
         ("capture_begin", "capture_end", "replay", "reset", "pool", "update"))  # fmt: skip


class graph(_sim_graph):
    """``torch_npu.npu.graph(npu_graph, pool=None, stream=None, auto_dispatch_capture=False,
    capture_error_mode="global")``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = bind("graph.__init__", PYTHON["graph.__init__"], (self, *args), kwargs)
        require_device("graph")
        trace("graph", dict(bound.arguments))
        super().__init__(*args, **kwargs)


def __getattr__(name: str) -> Any:
    return getattr(_sim, name)
