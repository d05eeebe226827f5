"""Fault injection for tests: a backend that wraps a real one and misbehaves on cue.

The worker wraps its backend in :class:`FaultyBackend` when the daemon's config
asks for it (``[faults]``: ``hang_device_after = N``, ``device_fault_after = N``),
so the engine and the worker run their production code and meet the fault where
a device would show it:

- ``hang_after=N``: the replay after N replays never runs: the stream it is
  issued on first waits on an ExternalEvent nobody records, so it and all the
  stream's later work wait on the device forever (a hung device), and from then
  on no graph event is released (every ExternalEvent record, fused or not, is
  dropped). The (N+1)-th step hangs whatever the order its releases and its
  replay were issued in (a step's patches may go before its replay).
- ``device_fault_after=N``: the replay after N replays fails with
  :class:`InjectedDeviceFault`, as a device fault does at launch.

(``fail_start = true`` is the worker's: its start fails with
:class:`InjectedStartFault`, a transient failure.)
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

import torch

from .base import DeviceBackend

log = logging.getLogger("graphlane.faults")


class InjectedDeviceFault(RuntimeError):
    """The device fault that ``device_fault_after`` injects."""

    transient = True  # a device fault may pass: the worker is restarted


class InjectedStartFault(RuntimeError):
    """The start failure that ``fail_start`` injects: transient (a device not ready
    yet), so the worker is restarted with backoff, up to max_restarts."""

    transient = True


class FaultyBackend:
    """``inner`` with the faults asked for; everything else is ``inner``'s."""

    def __init__(
        self,
        inner: DeviceBackend,
        *,
        hang_after: int | None = None,
        device_fault_after: int | None = None,
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.device = inner.device
        self.hang_after = hang_after
        self.device_fault_after = device_fault_after
        self.replays = 0
        self.hanging = False
        self.stuck: Any = None  # the ExternalEvent the hung stream waits on
        self._external: set[int] = set()  # ids of the ExternalEvents made here

    # ------------------------------------------------------------ faults
    def replay(self, graph: Any, stream: Any) -> None:
        self.replays += 1
        if self.device_fault_after is not None and self.replays > self.device_fault_after:
            raise InjectedDeviceFault("fault injection: the device failed (device_fault_after)")
        if self.hang_after is not None and self.replays > self.hang_after and not self.hanging:
            log.error("fault injection: the device hangs at replay %d", self.replays)
            self.hanging = True
            # Never recorded here (a test may record it to let the device go on).
            self.stuck = self.inner.new_external_event()
            self.inner.wait_external(stream, self.stuck)
        self.inner.replay(graph, stream)

    def new_external_event(self) -> Any:
        event = self.inner.new_external_event()
        self._external.add(id(event))
        return event

    def record(self, event: Any, stream: Any) -> None:
        if self.hanging and id(event) in self._external:
            return
        self.inner.record(event, stream)

    def patch(
        self,
        stream: Any,
        handle: Any,
        op: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        release: Any = None,
    ) -> None:
        self.inner.patch(stream, handle, op, args, kwargs, None if self.hanging else release)

    # ------------------------------------------------------------ the rest: inner's
    def new_stream(self, priority: int = 0) -> Any:
        return self.inner.new_stream(priority)

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return self.inner.use_stream(stream)

    def new_event(self) -> Any:
        return self.inner.new_event()

    def wait(self, stream: Any, event: Any) -> None:
        self.inner.wait(stream, event)

    def wait_external(self, stream: Any, event: Any) -> None:
        self.inner.wait_external(stream, event)

    def synchronize(self) -> None:
        self.inner.synchronize()

    def enter_thread(self) -> None:
        self.inner.enter_thread()

    def new_graph(self) -> Any:
        return self.inner.new_graph()

    def capture(self, graph: Any, stream: Any) -> AbstractContextManager[Any]:
        return self.inner.capture(graph, stream)

    def task_group_begin(self, stream: Any) -> None:
        self.inner.task_group_begin(stream)

    def task_group_end(self, stream: Any) -> Any:
        return self.inner.task_group_end(stream)

    def call(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.inner.call(op, args, kwargs)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.inner.empty(shape, dtype)

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.inner.copy_in(dst, src)


__all__ = ["FaultyBackend", "InjectedDeviceFault"]
