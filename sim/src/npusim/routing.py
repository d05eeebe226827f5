"""Where a dispatched op call goes on its stream.

:func:`route` patches it into the task-group update open on the stream, records
it into the graph the stream captures, or queues it on the stream; a timed
patch also costs the host its dispatch time (the tiling of an update on the
NPU), charged on this thread's cost clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from . import access
from .graphs import TaskNode
from .opcall import OpCall
from .runtime import RUNTIME, CostClock, host_clock
from .streams import Stream
from .task_groups import PatchWork


def route(
    stream: Stream,
    call: OpCall,
    func: Any,
    started: float | None,
    footprint: Callable[[], access.Footprint] | None = None,
    release: Any = None,
) -> bool:
    """Patch, capture or queue ``call`` on ``stream``. ``footprint`` gives the device
    memory it reads and writes (default: every tensor of the call but ``call.host``).
    ``release``: an ExternalEvent to record on ``stream`` after a patch that ends its
    update (the fused update binding), in the patch's stream entry; True when it was
    (else the caller records it)."""
    with RUNTIME.cond:
        update = stream.updating
        if update is not None:
            if update.next == 0 and started is not None:
                started = min(started, update.begun)  # the group's host work began there
            patch = update.patch_for(call, stream)
            assert isinstance(patch, PatchWork)
            if release is not None and update.next == len(update.tasks):
                patch.release = release.record_issued_locked(stream)
            config = RUNTIME.config
            if not config.timed or config.patch_us <= 0:
                _issue_patch_locked(stream, patch)  # nothing to charge: issue it right away
                return patch.release is not None
        else:
            footprint = footprint or partial(access.of_call, call)
            if stream.capturing is not None:
                stream.capturing.add_node(TaskNode(call, footprint()))
            else:
                stream.issue_locked(access.AccessWork(call.label, call.execute, footprint))
            return False
    charge_and_issue(stream, patch, started)
    return patch.release is not None


def charge_and_issue(stream: Stream, patch: PatchWork, started: float | None) -> None:
    """Charge the host cost of a timed patch whose dispatch began at ``started``, then
    issue it. The host-side dispatch of an update (tiling on the real NPU) costs host
    time from the start of its dispatch: the sim's own Python is inside it."""
    config = RUNTIME.config
    if not config.timed or config.patch_us <= 0:
        with RUNTIME.cond:
            _issue_patch_locked(stream, patch)  # nothing to charge: issue it right away
        return
    t0 = time.perf_counter() if started is None else started
    clock = host_clock(t0)
    if config.perf:
        charge_split(clock, config.patch_us, config.patch_gil_us, t0)
    else:
        clock.charge(config.patch_us, t0)
    with RUNTIME.cond:
        # Issued at the charge's end, in the model as in wall time (what model_now()
        # would say here, without asking the clocks again).
        _issue_patch_locked(stream, patch, clock.end)


def _issue_patch_locked(stream: Stream, patch: PatchWork, model: float | None = None) -> None:
    stream.issue_locked(patch, model)
    if patch.release is not None:
        RUNTIME.provider_added_locked(stream)


def charge_split(clock: CostClock, cost_us: float, gil_us: float, started: float) -> None:
    """Performance mode's patch: ``cost_us`` of host time from ``started`` (in the model),
    of which the first ``gil_us`` hold the interpreter lock (pure Python, as the Python
    that prepares the update's call does in the field; the sim's own Python before it is
    inside that share) and the rest is a sleep off the lock (the op's dispatch and tiling,
    which torch_npu's C++ binding runs with the lock released: sim/README.md)."""
    clock.add(cost_us, started)
    held_until = clock.end - (cost_us - min(gil_us, cost_us)) * 1e-6
    while time.perf_counter() < held_until:  # holds the lock, as Python does
        pass
    clock.settle()
