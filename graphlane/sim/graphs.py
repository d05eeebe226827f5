"""Graph capture, replay and task-group updates of the simulated NPU.

Capture records the work issued on the capturing stream (ops, event records
and waits) as the nodes of an ``NPUGraph`` instead of running it; replay runs
the nodes, in order, on the stream current at replay time, into the same
storage. ``graph_task_group_begin/end`` bracket nodes into a task group and
return its handle; between ``graph_task_update_begin(u, handle)`` and
``graph_task_update_end(u)``, an op issued on stream ``u`` is not run: it is
checked against the group's next captured op (same op, same tensors) and
becomes a *patch* of that task's arguments, applied in ``u``'s order.

A patch and a replay that reads the patched task must be ordered
(happen-before) one way or the other; otherwise the simulator reports a
HazardError naming the graph, the group and both operations.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import capture_rules, forkjoin
from .access import ISSUED, Footprint, TaskAccess
from .allocation import capture_begin, capture_end, graph_reset, replay_issued_locked
from .errors import HazardError, SimUsageError
from .opcall import OpCall
from .runtime import RUNTIME, Clock, clock_leq
from .streams import Stream, current_stream

_graph_ids = itertools.count(1)


# =================================================================== nodes
class TaskNode:
    """A captured op. Its ``call`` arguments are what patches replace; its
    ``footprint`` (what memory it reads and writes) is fixed at capture, as a patch
    changes parameters, not tensors."""

    def __init__(self, call: OpCall, footprint: Footprint = ()) -> None:
        self.call = call
        self.footprint = TaskAccess(footprint)
        self.group: TaskGroup | None = None
        self.label = call.label

    def launch_locked(self, launch: Launch, stream: Stream) -> None:
        pass

    def run(self, ex: Stream, launch: Launch | None = None) -> None:
        assert launch is not None
        # The task's device time runs from when the stream could start it: when the
        # wait before it was satisfied, not when this thread got round to it.
        started = ex.resume_at if ex.resume_at is not None else time.perf_counter()
        ex.resume_at = None
        ex.tick()
        group = self.group
        if group is not None or self.footprint:
            with RUNTIME.cond:
                if group is not None:
                    group.check_read_locked(ex, launch)
                call = self.call
                if self.footprint:
                    self.footprint.touch_locked(ex, (launch.issued, (self.label, launch), ex))
        else:
            call = self.call
        if RUNTIME.config.mode == "timed":
            ex.cost.charge(RUNTIME.config.task_us, started)
        else:
            call.execute()


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
    """Applies re-issued arguments to one captured task, on the update stream."""

    def __init__(self, handle: TaskGroupHandle, task: TaskNode, call: OpCall) -> None:
        self.handle = handle
        self.task = task
        self.call = call
        self.label = f"patch of {call.label}"

    def run(self, ex: Stream) -> None:
        ex.tick()
        group = self.handle.group
        with RUNTIME.cond:
            if group.graph.generation != self.handle.generation:
                return  # the graph was reset meanwhile; nothing to patch
            group.check_patch_locked(ex, self.call.label)
            self.task.call = self.call


# =================================================================== replay
@dataclass(eq=False)
class Launch:
    graph: NPUGraph
    number: int
    seqs: dict[Any, int] = field(default_factory=dict)
    issued: int = field(default_factory=ISSUED.__next__)  # issue order, for messages


class ReplayWork:
    def __init__(
        self, graph: NPUGraph, launch: Launch, nodes: list[Any] | None = None, where: str = ""
    ) -> None:
        self.graph = graph
        self.launch = launch
        self.nodes = list(graph.nodes if nodes is None else nodes)
        self.label = f"replay #{launch.number} of {graph.name}{where}"

    def run(self, ex: Stream) -> None:
        for node in self.nodes:
            node.run(ex, self.launch)


# =================================================================== capture/update state
class CaptureState:
    """One stream's part in a capture: the capture stream's (``origin`` is itself) or a
    side stream's that joined it (:mod:`.forkjoin`); ``nodes`` is its branch."""

    def __init__(
        self,
        graph: NPUGraph,
        stream: Stream,
        mode: str = "global",
        origin: CaptureState | None = None,
        nodes: list[Any] | None = None,
    ) -> None:
        self.graph = graph
        self.stream = stream
        self.mode = mode  # capture_error_mode
        self.thread = threading.get_ident()  # the thread that began the capture
        self.origin = self if origin is None else origin
        self.nodes: list[Any] = graph.nodes if nodes is None else nodes
        self.members: list[CaptureState] = []  # the side streams that joined (origin only)
        self.open_group: TaskGroup | None = None

    def add_node(self, node: Any) -> None:
        group = self.open_group
        if group is not None and not isinstance(node, TaskNode):
            capture_rules.refuse_in_group(self, node.label)
        self.nodes.append(node)
        if group is not None:
            node.group = group
            node.call.tensor_keys()  # what a patch is checked against: capture-time keys


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
        problem = task.call.mismatch(call)
        if problem:
            raise SimUsageError(
                f"update of {group.name}: re-issued op does not match captured task "
                f"{self.next} ({task.call.label}): {problem}"
            )
        self.next += 1
        return PatchWork(self.handle, task, call)


# =================================================================== NPUGraph
class GraphDispatchState:
    """``NPUGraph.graph_dispatch_mode`` of torch_npu: the records of an
    ``auto_dispatch_capture`` (``graph_dispatch_records``) and their update."""

    def __init__(self, graph: NPUGraph) -> None:
        self.graph = graph
        self.graph_dispatch_records: list[Any] = []

    #: Re-issues the records with new arguments: set by the auto-dispatch capture
    #: module when it is imported (it imports this one, not the other way round).
    updater: Callable[[NPUGraph, list[dict[str, Any]]], None] | None = None

    def update_capture_record(self, cpu_update_input: list[dict[str, Any]]) -> None:
        self.graph.update(cpu_update_input)


class NPUGraph:
    """``torch_npu.npu.NPUGraph``: capture once, replay many times, patch task groups."""

    def __init__(self) -> None:
        self.name = f"NPUGraph#{next(_graph_ids)}"
        self.nodes: list[Any] = []
        self.groups: list[TaskGroup] = []
        self.generation = 0
        self.captured = False
        self.capture_stream: Stream | None = None
        self.replays = 0
        self.auto_dispatch_capture = False
        self.graph_dispatch_mode = GraphDispatchState(self)
        self._pool = (id(self), 0)
        self.capturing: CaptureState | None = None  # the capture stream's, during capture
        self.branches: list[forkjoin.Branch] = []  # side-stream work (fork/join capture)
        self.branch_streams: list[forkjoin.BranchStream] = []  # what branches replay on

    def __repr__(self) -> str:
        return f"<graphlane sim {self.name}>"

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        capture_rules.check_mode(capture_error_mode)
        s = current_stream()
        with RUNTIME.cond:
            if s.is_default:
                raise SimUsageError(
                    "capture_begin on the default stream is not allowed; capture on a "
                    "side stream (torch.npu.graph does this for you)"
                )
            if s.capturing is not None:
                raise SimUsageError(f"{s.name} is already capturing {s.capturing.graph.name}")
            if s.updating is not None:
                raise SimUsageError(f"{s.name} is between graph_task_update_begin and _end")
            if self.captured:
                raise SimUsageError(f"{self.name} was captured already; reset() it first")
            self.nodes = []
            self.groups = []
            self.branches = []
            self.capture_stream = s
            self._pool = capture_begin(self, pool, s)  # allocations come from its pool
            s.capturing = self.capturing = CaptureState(self, s, capture_error_mode)
            capture_rules.LIVE.append(s.capturing)

    def capture_end(self) -> None:
        s = self.capture_stream
        with RUNTIME.cond:
            cap = self.capturing
            if s is None or cap is None or s.capturing is not cap:  # (a device reset ends it)
                self.capturing = None
                raise SimUsageError(f"capture_end on {self.name}, which is not capturing")
            if current_stream() is not s:  # torch_npu's NPUGraph::capture_end
                raise SimUsageError(
                    "Capture must end on the same stream it began on. (capture_end of "
                    f"{self.name} on {current_stream().name}; it began on {s.name})"
                )
            open_group = next((c.open_group for c in [cap, *cap.members] if c.open_group), None)
            self.capturing = s.capturing = None
            with contextlib.suppress(ValueError):  # (pruned already after a device reset)
                capture_rules.LIVE.remove(cap)
            unjoined = forkjoin.end_capture_locked(cap)
            if open_group is not None:
                raise SimUsageError(
                    f"capture of {self.name} ended inside task group {open_group.index}: "
                    "call graph_task_group_end first"
                )
            if unjoined:
                self.nodes, self.groups, self.branches = [], [], []
                raise SimUsageError(unjoined)
            self.captured = True
            capture_end(self)
        if self.branches:
            forkjoin.give_streams(self, s.device_index)

    def replay(self) -> None:
        s = current_stream()
        with RUNTIME.cond:
            if not self.captured:
                raise SimUsageError(f"replay of {self.name}, which holds no captured graph")
            if s.capturing is not None:
                raise SimUsageError(f"replay of {self.name} on {s.name} while it captures")
            self.replays += 1
            launch = Launch(self, self.replays)
            for node in self.nodes:
                node.launch_locked(launch, s)
            for branch in self.branches:
                branch.launch_locked(launch)
            s.issue_locked(ReplayWork(self, launch))
            replay_issued_locked(self, s)
            RUNTIME.provider_added_locked(s)
            for branch in self.branches:  # side-stream work, ordered by its captured events
                branch.issue_locked(ReplayWork(self, launch, branch.nodes, branch.where))

    def reset(self) -> None:
        """Delete the captured graph. An ExternalEvent a captured wait consumed keeps its
        waited flag (torch_npu clears it only in ``record``)."""
        with RUNTIME.cond:
            self.nodes = []
            self.groups = []
            self.branches = []
            self.captured = False
            self.generation += 1
            self.graph_dispatch_mode.graph_dispatch_records = []
            graph_reset(self)

    def pool(self) -> tuple[int, int]:
        return self._pool

    def update(self, cpu_update_input: list[dict[str, Any]]) -> None:
        """Patch every op recorded by an ``auto_dispatch_capture`` capture (torch_npu 2.14)."""
        if not self.auto_dispatch_capture:
            raise SimUsageError(
                "The current graph configuration does not support update; capture with "
                "auto_dispatch_capture=True"
            )
        updater = GraphDispatchState.updater
        if updater is None:
            raise SimUsageError("NPUGraph.update: nothing was captured with auto_dispatch_capture")
        updater(self, cpu_update_input)

    def debug_dump(self, debug_path: str) -> None:
        with open(debug_path, "w") as f:
            lanes = [("", self.nodes)] + [(f"branch {b.index} ", b.nodes) for b in self.branches]
            for prefix, nodes in lanes:
                for i, node in enumerate(nodes):
                    group = getattr(node, "group", None)
                    tag = f"  [group {group.index}]" if group is not None else ""
                    f.write(f"{prefix}{i}: {node.label}{tag}\n")


# =================================================================== task groups
def _require_capturing(stream: Stream, what: str) -> CaptureState:
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
            others = [s.name for s in RUNTIME.streams if s.capturing and s.capturing.open_group]
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


def is_current_stream_capturing() -> bool:
    return current_stream().capturing is not None
