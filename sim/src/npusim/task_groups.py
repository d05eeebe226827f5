"""Task groups of a captured graph and their updates, on the simulated NPU.

``graph_task_group_begin/end`` bracket nodes of a capture into a task group and
return its handle; between ``graph_task_update_begin(u, handle)`` and
``graph_task_update_end(u)``, an op issued on stream ``u`` is not run: it is
checked against the group's next captured op (same op, tensors of the same
shapes, strides and dtypes: :meth:`.opcall.OpCall.mismatch`) and becomes a
*patch* of that task's arguments (:class:`PatchWork`), applied in ``u``'s
order. A patch may name other tensors than the capture (their addresses are
parameters of the task, as CANN replaces them): the task then reads and writes
those, its memory footprint follows them, and the graph's replays check that
their memory was not freed and reused (what ``allocation.task_patched``
tracks); nothing keeps them allocated, as on the NPU.

A patch and a replay that reads the patched task must be ordered
(happen-before) one way or the other; otherwise the simulator reports a
HazardError naming the graph, the group and both operations.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import access
from .allocation import task_patched
from .errors import HazardError, SimUsageError
from .graphs import TaskNode
from .runtime import RUNTIME, Clock, clock_leq
from .streams import Capture, Stream

if TYPE_CHECKING:
    from .graphs import Launch, NPUGraph
    from .opcall import OpCall


# =================================================================== groups and patches
class Access:
    """One stream's latest access to a task group: its clock, and what it was (formatted
    only for a report: ``template.format(*parts)``)."""

    __slots__ = ("clock", "parts", "template")

    def __init__(self, clock: Clock, template: str, *parts: Any) -> None:
        self.clock = clock
        self.template = template
        self.parts = parts

    @property
    def what(self) -> str:
        return self.template.format(*self.parts)


_REPLAY = "replay #{0} of {1} on {2.name}"
_PATCH = "the patch of {0} on {1.name}"


@dataclass(eq=False)
class TaskGroup:
    graph: NPUGraph
    index: int
    start: int
    end: int = -1
    reads: dict[int, Access] = field(default_factory=dict)  # per stream actor
    patches: dict[int, Access] = field(default_factory=dict)  # per stream actor
    _tasks: list[TaskNode] | None = field(default=None, repr=False)
    lane: list[Any] | None = field(default=None, repr=False)  # its branch's nodes
    # The error an op raised inside the open group (an auto-dispatch capture's op): if the
    # capture ends with the group still open, that error is the cause ending reports.
    cause: BaseException | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        ops = {n.label for n in self.tasks}
        return f"task group {self.index} ({', '.join(sorted(ops))}) of {self.graph.name}"

    @property
    def tasks(self) -> list[TaskNode]:
        tasks = self._tasks
        if tasks is None:
            nodes = self.graph.nodes if self.lane is None else self.lane
            tasks = [n for n in nodes[self.start : self.end] if isinstance(n, TaskNode)]
            if self.end >= 0:  # a closed group's tasks are fixed until the graph is reset
                self._tasks = tasks
        return tasks

    def check_read_locked(self, ex: Stream, launch: Launch) -> None:
        access = Access(dict(ex.clock), _REPLAY, launch.number, self.graph.name, ex)
        for acc in self.patches.values():
            if not clock_leq(acc.clock, ex.clock):
                RUNTIME.report(
                    HazardError(
                        f"race on {self.name}: {access.what} reads the task group while "
                        f"{acc.what} "
                        "is not ordered before it (the replay may run with the old or a "
                        "half-applied patch). Order the patch before the replay, e.g. with the "
                        "ExternalEvent the graph waits on before this group."
                    )
                )
        self.reads[ex.actor] = access

    def check_patch_locked(self, ex: Stream, label: str) -> None:
        access = Access(dict(ex.clock), _PATCH, label, ex)
        for acc in self.reads.values():
            if not clock_leq(acc.clock, ex.clock):
                RUNTIME.report(
                    HazardError(
                        f"race on {self.name}: {access.what} is not ordered after {acc.what}, "
                        "which "
                        "reads the same tasks; the patch may land while that replay runs them. "
                        "Make the update stream wait for an event recorded after that replay."
                    )
                )
        for actor, acc in self.patches.items():
            if actor != ex.actor and not clock_leq(acc.clock, ex.clock):
                RUNTIME.report(
                    HazardError(
                        f"race on {self.name}: {access.what} and {acc.what} are not ordered"
                    )
                )
        self.patches[ex.actor] = access


class TaskGroupHandle:
    """Opaque handle returned by ``graph_task_group_end``."""

    def __init__(self, group: TaskGroup, generation: int) -> None:
        self.group = group
        self.generation = generation

    def __repr__(self) -> str:
        return f"<TaskGroupHandle {self.group.name}>"


class PatchWork:
    """Applies re-issued arguments to one captured task, on the update stream;
    ``footprint``: the memory the task uses from then on, when the patch names other
    tensors than the task did (None: the task's footprint holds)."""

    def __init__(
        self,
        handle: TaskGroupHandle,
        task: TaskNode,
        call: OpCall,
        footprint: access.Footprint | None = None,
    ) -> None:
        self.handle = handle
        self.task = task
        self.call = call
        self.footprint = footprint
        # The record of an ExternalEvent issued with the patch, run right after it in the
        # same entry (the fused update binding's release: :mod:`.fused`).
        self.release: Any = None

    @property
    def label(self) -> str:
        return f"patch of {self.call.label}"

    def run(self, ex: Stream) -> None:
        ex.tick()
        with RUNTIME.cond:
            self._apply_locked(ex)

    def run_now_locked(self, ex: Stream) -> bool:
        """Performance mode: the patch at its issue (``Stream.issue_locked``)."""
        ex.tick()
        self._apply_locked(ex)
        return True

    def _apply_locked(self, ex: Stream) -> None:
        group = self.handle.group
        if group.graph.generation == self.handle.generation:  # else reset: nothing to patch
            if not RUNTIME.config.perf:  # performance mode checks no replay against a patch
                group.check_patch_locked(ex, self.call.label)
            self.task.call = self.call
            if self.footprint is not None:
                self.task.footprint = access.TaskAccess(self.footprint)
        if self.release is not None:
            ex.tick()
            self.release._set_locked(ex, None)


class UpdateState:
    def __init__(self, handle: TaskGroupHandle) -> None:
        self.handle = handle
        self.tasks = handle.group.tasks
        self.next = 0
        self.begun = time.perf_counter()  # the update's host work starts here

    def patch_for(self, call: OpCall, stream: Stream) -> PatchWork:
        group = self.handle.group
        if self.next >= len(self.tasks):
            raise SimUsageError(
                f"update of {group.name}: op {call.label} re-issued on {stream.name}, but the "
                f"group has only {len(self.tasks)} task(s) and all were re-issued already"
            )
        task = self.tasks[self.next]
        if RUNTIME.config.perf and task.call.same_tensors(call):
            # Performance mode: a patch over the task's own tensors matches it and moves
            # nothing (no keys compared, no memory tracked: its checks are off).
            self.next += 1
            call._keys = task.call._keys
            return PatchWork(self.handle, task, call)
        problem = task.call.mismatch(call)
        if problem:
            raise SimUsageError(
                f"update of {group.name}: re-issued op does not match captured task "
                f"{self.next} ({task.call.label}): {problem}"
            )
        self.next += 1
        moved = task.call.moves(call)
        # The replays issued from now on use the memory of the patch's tensors (host
        # order, as the patch's issue), and the task's accesses follow other tensors
        # once it is applied.
        task_patched(group.graph, task, call, moved)
        return PatchWork(self.handle, task, call, access.of_call(call) if moved else None)


# =================================================================== the graph_task_* API
def _require_capturing(stream: Stream, what: str) -> Capture:
    cap = stream.capturing
    if cap is None:
        raise SimUsageError(f"{what} on {stream.name}, which is not capturing a graph")
    return cap


def graph_task_group_begin(stream: Stream) -> None:
    with RUNTIME.cond:
        cap = _require_capturing(stream, "graph_task_group_begin")
        if cap.open_group is not None:
            raise SimUsageError(
                f"graph_task_group_begin on {stream.name}: task group {cap.open_group.index} "
                "is still open (task groups cannot nest)"
            )
        graph = cap.graph
        cap.open_group = TaskGroup(graph, len(graph.groups), len(cap.nodes), lane=cap.nodes)


def graph_task_group_end(stream: Stream) -> TaskGroupHandle:
    with RUNTIME.cond:
        cap = stream.capturing
        if cap is None or cap.open_group is None:
            others = [
                s.name
                for s in RUNTIME.streams
                if isinstance(s, Stream) and s.capturing and s.capturing.open_group
            ]
            hint = f" (a group is open on {', '.join(others)})" if others else ""
            raise SimUsageError(
                f"graph_task_group_end on {stream.name} without a graph_task_group_begin on "
                f"that stream{hint}: begin and end must use the same capturing stream"
            )
        group = cap.open_group
        group.end = len(cap.nodes)
        cap.open_group = None
        if not group.tasks:
            raise SimUsageError(f"task group {group.index} of {cap.graph.name} holds no op")
        cap.graph.groups.append(group)
        return TaskGroupHandle(group, cap.graph.generation)


def graph_task_update_begin(stream: Stream, handle: Any) -> None:
    with RUNTIME.cond:
        if not isinstance(handle, TaskGroupHandle):
            raise SimUsageError(
                f"graph_task_update_begin needs a task group handle, got {handle!r}"
            )
        group = handle.group
        graph = group.graph
        if graph.generation != handle.generation or not graph.captured:
            raise SimUsageError(
                f"graph_task_update_begin with a handle of {graph.name}, which was reset or "
                "re-captured since: the handle is stale"
            )
        if stream.capturing is not None:
            raise SimUsageError(
                f"graph_task_update_begin on {stream.name}, which is capturing "
                f"{stream.capturing.graph.name}: update on a stream that is not capturing"
            )
        if stream.updating is not None:
            raise SimUsageError(
                f"graph_task_update_begin on {stream.name} while an update of "
                f"{stream.updating.handle.group.name} is open (call graph_task_update_end)"
            )
        stream.updating = UpdateState(handle)


def graph_task_update_end(stream: Stream) -> None:
    with RUNTIME.cond:
        state = stream.updating
        if state is None:
            raise SimUsageError(
                f"graph_task_update_end on {stream.name} without graph_task_update_begin"
            )
        stream.updating = None
        if state.next != len(state.tasks):
            raise SimUsageError(
                f"update of {state.handle.group.name} ended after {state.next} of its "
                f"{len(state.tasks)} task(s) were re-issued"
            )


def abandon_update(stream: Stream) -> None:
    """Close the update open on ``stream`` after its op was refused (nothing was patched
    by it), so that the op's error is the one reported and the stream can update again."""
    with RUNTIME.cond:
        stream.updating = None
