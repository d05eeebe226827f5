"""What CANN refuses while a capture is underway, beyond the capture stream itself.

``capture_error_mode`` (aclmdlRICaptureMode) decides which threads may make calls that
are unsafe during a capture: in "global" mode no thread may, in "thread_local" mode the
thread that began the capture may not, in "relaxed" mode all may. The one such call the
sim sees is the stream synchronization torch_npu makes for a ``non_blocking`` copy
between the device and *pageable* host memory (``process_non_blocking_copy``: memory it
did not pin is copied synchronously); CANN refuses it with
ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT (107030, EE1016). Host-device copies are also
refused inside a task group (they are not Cube/Vector-core kernels).
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Protocol

import torch

from .errors import SimUsageError
from .streams import Capture, Stream


class CaptureOrigin(Capture, Protocol):
    """The capture stream's part in a capture (a :class:`.graphs.CaptureState`, built on
    this module): its mode, the thread that began it, and the side streams that joined
    it (:mod:`.forkjoin`)."""

    mode: str  # capture_error_mode
    thread: int
    members: list[Any]

    def member(self, stream: Stream, nodes: list[Any]) -> Capture:
        """The part of side stream ``stream``, which joins the capture, recording into
        ``nodes``."""


#: The capture streams' states of the captures underway (kept by graphs.py).
LIVE: list[CaptureOrigin] = []

CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")


_TASK_QUEUE: list[str] = []  # TASK_QUEUE_ENABLE, read at the first capture


def check_task_queue() -> None:
    """torch_npu's NPUGraph::capture_begin refuses TASK_QUEUE_ENABLE=2 (the two-level
    task queue); it reads the setting once, at the first capture of the process."""
    if not _TASK_QUEUE:
        _TASK_QUEUE.append(os.environ.get("TASK_QUEUE_ENABLE", "1").strip())
    if _TASK_QUEUE[0] == "2":
        raise SimUsageError(
            "Do not support TASK_QUEUE_ENABLE = 2 during NPU graph capture, please export "
            "TASK_QUEUE_ENABLE=1/0."
        )


def check_mode(mode: str) -> None:
    if mode not in CAPTURE_ERROR_MODES:  # torch_npu's _NPUGraph.capture_begin (Graph.cpp)
        raise SimUsageError(
            "Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, "
            f"got {mode}"
        )


def refuse_in_group(cap: Capture, what: str) -> None:
    """CANN packs only Cube/Vector-core kernels into a task group (EE1006)."""
    group = cap.open_group
    assert group is not None
    raise SimUsageError(
        f"{what} on {cap.stream.name} inside task group {group.index} of {cap.graph.name}: "
        "adding the task to the task group failed. Only tasks running on Cube Core or Vector "
        "Core can be added to a task group (CANN EE1006): event records and waits and "
        "host-device copies go before graph_task_group_begin or after graph_task_group_end"
    )


def forbidding_capture() -> CaptureOrigin | None:
    """The capture underway whose mode forbids an unsafe call from this thread."""
    for origin in list(LIVE):
        if origin.stream.capturing is not origin:  # ended by a device reset
            with contextlib.suppress(ValueError):  # (another thread may remove it too)
                LIVE.remove(origin)
        elif origin.mode == "global" or (
            origin.mode == "thread_local" and origin.thread == threading.get_ident()
        ):
            return origin
    return None


def check_host_copy(stream: Stream, label: str, non_blocking: bool, host: torch.Tensor) -> None:
    """A copy between the device and host memory ``host``, issued on ``stream``."""
    cap = stream.capturing
    if cap is not None and cap.open_group is not None:
        refuse_in_group(cap, label)
    if not non_blocking or getattr(host, "_sim_pinned", False) or host.is_pinned():
        return  # (_sim_pinned: memory torch pins itself, the output of .to("cpu", non_blocking))
    origin = forbidding_capture()
    if origin is None:
        return
    raise SimUsageError(
        f"non_blocking {label} on {stream.name} with pageable host memory while "
        f"{origin.graph.name} is captured in {origin.mode!r} mode: torch_npu synchronizes "
        "the stream for a copy with host memory it did not pin, and the current thread is "
        "in the capture state and the current operation cannot be performed; this "
        "operation is supported only in the RELAXED mode (CANN "
        "ACL_ERROR_RT_CAPTURE_MODE_NOT_SUPPORT, 107030). Copy before the capture, or "
        "capture with capture_error_mode='relaxed' (pinned memory would do on the NPU; "
        "the sim cannot pin host memory)"
    )
