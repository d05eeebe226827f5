"""The device interface the worker core is written against.

It names what graphlane needs from an NPU runtime and nothing more: streams,
events with ExternalEvent semantics, graph capture and replay, task groups and
their updates, host<->device copies, and ops *by name* (as in torch_npu's
namespace: ``"npu_fused_infer_attention_score.out"``, ``"_npu_paged_attention"``).
The interface knows no particular op: a program says which op each task group
re-issues and with which arguments (``GraphProgram.group_call``), and
:meth:`DeviceBackend.patch` re-issues it inside a task update. Providers: ``npu``
(torch_npu on Ascend hardware), ``sim`` (the same code over the simulated NPU's
torch_npu namespace), ``null`` (no device), and the fault-injecting wrapper
(:mod:`.faults`, for tests).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch


class DeviceBackend(Protocol):
    name: str
    device: torch.device

    # streams and events
    def new_stream(self, priority: int = 0) -> Any:
        """A new stream of this device (lower ``priority`` numbers run first, as in
        torch_npu: the update stream gets -1, as npugraph_ex gives its own)."""
        ...

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]: ...
    def new_event(self) -> Any: ...
    def new_external_event(self) -> Any: ...
    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream`` (for an ExternalEvent: release its wait)."""
        ...

    def wait(self, stream: Any, event: Any) -> None: ...
    def wait_external(self, stream: Any, event: Any) -> None:
        """The wait on an ExternalEvent that a captured task group sits behind: the wait,
        then ``reset`` on the same stream, as torch_npu's own capture paths issue it
        (older CANN clears the flag only in ``reset``; current CANN, in the wait)."""
        ...

    def synchronize(self) -> None: ...
    def enter_thread(self) -> None:
        """Make this backend's device current on the calling thread (the device is
        per host thread, as in torch_npu: every thread that issues work calls this)."""
        ...

    # graphs
    def new_graph(self) -> Any: ...
    def capture(self, graph: Any, stream: Any) -> AbstractContextManager[Any]: ...
    def replay(self, graph: Any, stream: Any) -> None: ...
    def task_group_begin(self, stream: Any) -> None: ...
    def task_group_end(self, stream: Any) -> Any: ...
    def patch(
        self,
        stream: Any,
        handle: Any,
        op: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        release: Any = None,
    ) -> None:
        """Patch the task group ``handle`` by re-issuing ``op(*args, **kwargs)`` in a task
        update on ``stream``; then, if ``release`` is an event, record it on ``stream``
        (a provider may fuse the two, as torch_npu's update bindings do)."""
        ...

    # ops and memory
    def call(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Issue ``op(*args, **kwargs)`` on the current stream (or into the capture)."""
        ...

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...
    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue a copy of host tensor ``src`` into device tensor ``dst`` on the current
        stream, asynchronous to the host (a provider stages pageable memory in pinned
        memory: an NPU copies pageable memory synchronously). The caller must not change
        ``src`` until the stream has run the copy."""
        ...
