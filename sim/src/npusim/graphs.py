"""Graph capture and replay of the simulated NPU.

Capture records the work issued on the capturing stream (ops, event records
and waits) as the nodes of an ``NPUGraph`` instead of running it; replay runs
the nodes, in order, on the stream current at replay time, into the same
storage. Task groups of a captured graph and their updates (patches of a
group's tasks between replays) are in :mod:`.task_groups`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import capture_rules, forkjoin, npugraph_utils, rng
from .access import ISSUED, Footprint, TaskAccess
from .allocation import (
    capture_begin,
    capture_end,
    check_task_memory_locked,
    graph_reset,
    replay_issued_locked,
)
from .errors import SimUsageError
from .opcall import OpCall
from .runtime import RUNTIME
from .streams import Event, Stream, current_stream

_graph_ids = itertools.count(1)
_log = logging.getLogger("npusim.graphs")


class TaskGroup(Protocol):
    """A task group of a captured graph as the graph sees it (a
    :class:`.task_groups.TaskGroup`: task groups are built on graphs)."""

    index: int
    cause: BaseException | None  # what left it open, if a capture ended inside it

    def check_read_locked(self, ex: Stream, launch: Launch) -> None: ...


class DispatchRecord(Protocol):
    """One op call an ``auto_dispatch_capture`` recorded (an
    :class:`.autodispatch.GraphDispatchRecord`: auto-dispatch is built on graphs)."""

    def update(self, values: dict[str, Any]) -> None:
        """Re-issue the call with ``values`` patched in, on the process's update stream."""


# =================================================================== nodes
class TaskNode:
    """A captured op. Its ``call`` arguments are what patches replace; its
    ``footprint`` (what memory it reads and writes) is its capture's, or that of the
    last patch that named other tensors (:mod:`.task_groups`)."""

    def __init__(self, call: OpCall, footprint: Footprint = ()) -> None:
        self.call = call
        self.footprint = TaskAccess(footprint)
        self.group: TaskGroup | None = None
        self.label = call.label

    def launch_locked(self, launch: Launch, stream: Stream) -> None:
        pass

    def enter_locked(self, ex: Stream, launch: Launch) -> None:
        """Stream ``ex`` starts the task: a step of its clock, its group's read and its
        footprint checked. Caller holds the runtime lock."""
        ex.tick()
        if self.group is not None:
            self.group.check_read_locked(ex, launch)
            # an update may have repointed it after its replay was issued: its memory is
            # checked now (the other tasks' when the replay was issued)
            check_task_memory_locked(self, f"replay #{launch.number} of {launch.graph_name} "
                                     f"on {ex.name}")  # fmt: skip
        if self.footprint:
            self.footprint.touch_locked(ex, (launch.issued, (self.label, launch), ex))


# =================================================================== replay
@dataclass(eq=False)
class Launch:
    """One replay of a graph. It names its graph but does not hold it: memory-access
    records and finished stream entries keep launches, and a graph the program dropped
    must be collectable (its private pool freed) once its replays ran."""

    graph_name: str
    number: int
    seqs: dict[Any, int] = field(default_factory=dict)
    issued: int = field(default_factory=ISSUED.__next__)  # issue order, for messages


class ReplayWork:
    inert = True  # in performance mode (the only mode that asks) it computes nothing

    def __init__(
        self, graph: NPUGraph, launch: Launch, nodes: list[Any] | None = None, where: str = ""
    ) -> None:
        self.launch = launch
        if nodes is None:
            nodes = graph.perf_plan().steps if RUNTIME.config.perf else graph.nodes
        elif RUNTIME.config.perf:
            nodes = ReplayPlan(nodes).steps
        self.nodes = list(nodes)
        self.label = f"replay #{launch.number} of {graph.name}{where}"

    def run(self, ex: Stream) -> None:
        # Tasks in a row run together (_run_tasks); anything else (a wait, a record, a
        # fork or join) first waits until the tasks before it are over.
        nodes, self.nodes = self.nodes, []  # a finished entry stays referenced (a stream's
        launch = self.launch  # last entry, a buffer's uses): it must not keep the graph alive
        if RUNTIME.config.perf:
            _run_perf(ex, launch, nodes)
            return
        i, n = 0, len(nodes)
        while i < n:
            if type(nodes[i]) is TaskNode:
                j = i + 1
                while j < n and type(nodes[j]) is TaskNode:
                    j += 1
                _run_tasks(ex, launch, nodes[i:j])
                i = j
            else:
                ex.settle()
                nodes[i].run(ex, launch)
                i += 1
        ex.settle()


class ReplayPlan:
    """A graph's nodes as performance mode replays them: each run of tasks in a row is
    one number (how many), every other node stays; ``launchers`` are the nodes whose
    ``launch_locked`` does something (a task's does nothing)."""

    def __init__(self, nodes: list[Any]) -> None:
        self.source, self.size = nodes, len(nodes)
        self.steps: list[Any] = []
        for node in nodes:
            if type(node) is TaskNode:
                if self.steps and type(self.steps[-1]) is int:
                    self.steps[-1] += 1
                else:
                    self.steps.append(1)
            else:
                self.steps.append(node)
        self.launchers = [node for node in nodes if type(node) is not TaskNode]


#: Graph nodes after which performance mode need not have finished the tasks before
#: them in wall time: nothing the host or another stream can observe follows from them
#: (a wait's release time and the tasks' modelled ends are kept in modelled time).
UNOBSERVED = frozenset({"EventWaitWork", "ExtWaitWork", "ExtResetWork"})


def _run_perf(ex: Stream, launch: Launch, steps: list[Any]) -> None:
    """Performance mode: a run of ``n`` tasks is one charge of ``n * task_us`` of modelled
    device time from where the first could start, with no Python per task and no check
    of the tasks (their reads of patched groups, their memory footprint: the correctness
    modes prove those). The stream waits off the interpreter lock only before what another
    stream or the host could observe (a record, a fork or join, the replay's end), so a
    replay whose waits are its only other nodes is one sleep, and a stretch of
    ExternalEvent waits and resets is passed at once (:func:`_pass_stretch`)."""
    task_us = RUNTIME.config.task_us
    i, n = 0, len(steps)
    while i < n:
        step = steps[i]
        if type(step) is int:
            started = ex.resume_at if ex.resume_at is not None else ex.model_time
            ex.resume_at = None
            ex.cost.add_at(task_us * step, started)
            i += 1
            continue
        kind = type(step).__name__
        if kind == "ExtWaitWork":
            i = _pass_stretch(ex, launch, steps, i)
            continue
        if kind in UNOBSERVED:
            ex.advance()
        elif kind == "CollectiveTask":
            # The other ranks see this rank's part only as the modelled start it sends
            # them: the tasks before it need not be over in wall time (a sleep and a
            # wake-up per collective, on hosts whose ranks share the cores).
            ex.advance()
        else:
            ex.settle()
        step.run(ex, launch)
        i += 1
    ex.settle()


def _pass_stretch(ex: Stream, launch: Launch, steps: list[Any], i: int) -> int:
    """Performance mode, at an ExternalEvent wait (step ``i``): the stretch from it of such
    waits, their resets and runs of tasks, up to the next other node or a second wait on
    one event (its second record must follow the first wait), blocks once until every
    event it waits on is set, instead of waking at each record (a layer-by-layer graph's
    20 waits: one wake-up), then passes in one critical section, each wait at its own
    record's modelled time, as the nodes one by one would (their 40 critical sections
    were the stream thread's Python per replay, which on an NPU costs the host nothing).
    Nothing in it is observable, so no record it waits for can depend on the stream
    passing one of its nodes. Returns where the stream goes on: the stretch's end, or a
    wait whose event a reset before it in the stretch cleared (older CANN), which then
    waits again."""
    from .events import await_records

    events: list[Any] = []
    j, n = i, len(steps)
    while j < n:
        step = steps[j]
        kind = type(step).__name__
        if kind == "ExtWaitWork":
            if step.event in events:
                break
            events.append(step.event)
        elif kind != "ExtResetWork" and type(step) is not int:
            break
        j += 1
    if not all(ev.flag for ev in events):
        await_records(ex, events)
    task_us = RUNTIME.config.task_us
    with RUNTIME.cond:
        for k in range(i, j):
            step = steps[k]
            if type(step) is int:
                started = ex.resume_at if ex.resume_at is not None else ex.model_time
                ex.resume_at = None
                ex.cost.add_at(task_us * step, started)
                continue
            ex.advance()
            if type(step).__name__ == "ExtWaitWork":
                if not step.event.flag:  # a reset in the stretch consumed its record
                    return k
                step.passed_locked(ex, launch, ex.model_time)
            else:
                ex.tick()
                step.ran_locked(ex, launch)
    return j


def _run_tasks(ex: Stream, launch: Launch, tasks: list[TaskNode]) -> None:
    """Tasks in a row, with nothing between them that another stream or the host could
    observe (no record, no wait). Computing, each is checked and then runs. Timed, one
    critical section checks them all and one charge, from where the first could start
    (when the wait before it was satisfied, the tasks before it ended, or its replay was
    issued, in modelled time), covers their device time: per task, the lock and the
    calls would cost the sim more than a field task's modelled 1 us."""
    if not RUNTIME.config.timed:
        ex.resume_at = None
        for task in tasks:
            with RUNTIME.cond:
                task.enter_locked(ex, launch)
            task.call.execute()
        return
    started = ex.resume_at if ex.resume_at is not None else ex.model_time
    ex.resume_at = None
    with RUNTIME.cond:
        for task in tasks:
            task.enter_locked(ex, launch)
    ex.cost.add_at(RUNTIME.config.task_us * len(tasks), started)


# =================================================================== capture state
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

    def member(self, stream: Stream, nodes: list[Any]) -> CaptureState:
        """The part of side stream ``stream``, which joins this capture, recording into
        ``nodes`` (its branch: :mod:`.forkjoin`)."""
        return CaptureState(self.graph, stream, self.mode, origin=self, nodes=nodes)

    def wait_locked(self, event: Event, stream: Stream) -> bool:
        """A wait that involves this capture: captured, or a fork (:mod:`.forkjoin`)."""
        return forkjoin.capture_wait(event, stream)


# =================================================================== NPUGraph
class GraphDispatchState:
    """``NPUGraph.graph_dispatch_mode`` of torch_npu: the records of an
    ``auto_dispatch_capture`` (``graph_dispatch_records``) and their update."""

    #: The one update stream of the process (torch_npu creates it with the first
    #: ``_GraphDispatchMode``, i.e. the first NPUGraph): every ``update`` runs on it.
    update_stream: Stream | None = None

    def __init__(self, graph: NPUGraph) -> None:
        # A weak reference: the graph holds this, and ``del g`` must free the graph (and
        # its private pool) at once, as torch_npu's does, not at the next gc cycle.
        self._graph = weakref.ref(graph)
        self.graph_dispatch_records: list[DispatchRecord] = []
        if GraphDispatchState.update_stream is None:
            GraphDispatchState.update_stream = Stream()

    @property
    def graph(self) -> NPUGraph:
        graph = self._graph()
        if graph is None:
            raise SimUsageError("graph_dispatch_mode of an NPUGraph that was freed")
        return graph

    def update_capture_record(self, cpu_update_input: list[dict[str, Any]]) -> None:
        """Re-issue every record with its entry of ``cpu_update_input`` (one entry: the
        same for every record) patched in."""
        records = self.graph_dispatch_records
        updates = list(cpu_update_input)
        if len(updates) == 1:
            updates = [dict(updates[0]) for _ in records]
        if len(updates) != len(records):
            raise SimUsageError(
                f"Currently, there are {len(records)} operators that need to be updated by "
                f"capture, and there are only {len(updates)} elements in the incoming "
                "cpu_update_input list"
            )
        for record, update in zip(records, updates, strict=True):
            record.update(update)


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
        self._plan: ReplayPlan | None = None
        self.auto_dispatch_capture = False
        self.graph_dispatch_mode = GraphDispatchState(self)
        self._pool = (id(self), 0)
        self.capturing: CaptureState | None = None  # the capture stream's, during capture
        self.branches: list[forkjoin.Branch] = []  # side-stream work (fork/join capture)
        self.branch_streams: list[forkjoin.BranchStream] = []  # what branches replay on
        # the generators its capture's random ops used (:mod:`.rng`); freed with the graph
        self.rng = rng.GraphRng()
        weakref.finalize(self, self.rng.release)
        # the sim extensions its captured tasks used (:mod:`.extensions`; its profile names them)
        self.extensions: set[str] = set()

    def __repr__(self) -> str:
        return f"<npusim {self.name}>"

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        capture_rules.check_task_queue()
        capture_rules.check_mode(capture_error_mode)
        s = current_stream()
        with RUNTIME.cond:
            if s.is_default:
                # torch_npu 2.14's NPUGraph::capture_begin (a string of libtorch_npu.so)
                raise SimUsageError(
                    "NPU graphs must be captured on a non-default stream. (However, after "
                    "capture, it's ok to replay them on the default stream.) (capture_begin "
                    "on the default stream; torch.npu.graph captures on a side stream)"
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
            self.extensions = set()
            self.capture_stream = s
            self.rng.begin()
            self._pool = capture_begin(self, pool, s)  # allocations come from its pool
            s.capturing = self.capturing = CaptureState(self, s, capture_error_mode)
            RUNTIME.unobserved.add(s)  # a device synchronize refuses it while it captures
            capture_rules.LIVE.append(s.capturing)

    def capture_end(self) -> None:
        s = self.capture_stream
        with RUNTIME.cond:
            cap = self.capturing
            if s is None or s.capturing is not cap or cap is None:  # (a device reset ends it)
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
                cause = open_group.cause
                why = (
                    "call graph_task_group_end first"
                    if cause is None
                    else f"{type(cause).__name__} raised inside it left it open: {cause}"
                )
                raise SimUsageError(
                    f"capture of {self.name} ended inside task group {open_group.index}: {why}"
                ) from cause
            if unjoined:
                self.nodes, self.groups, self.branches = [], [], []
                raise SimUsageError(unjoined)
            self.captured = True
            self.rng.end()
            capture_end(self)
        if self.branches:
            forkjoin.give_streams(self, s.device_index)
        if not self.nodes and not any(b.nodes for b in self.branches):
            # torch's CUDAGraph::capture_end wording, as Ascend/pytorch's test_npu.py expects
            warnings.warn(
                "The NPU Graph is empty. This usually means that the graph was attempted to be "
                "captured on wrong device or stream.",
                stacklevel=2,
            )

    def replay(self) -> None:
        s = current_stream()
        with RUNTIME.cond:
            if not self.captured:
                raise SimUsageError(f"replay of {self.name}, which holds no captured graph")
            if s.capturing is not None:
                raise SimUsageError(f"replay of {self.name} on {s.name} while it captures")
            self.replays += 1
            launch = Launch(self.name, self.replays)
            self.rng.replay_prologue_locked(s)  # the seed and offset its random ops read
            for node in self.perf_plan().launchers:
                node.launch_locked(launch, s)
            for branch in self.branches:
                branch.launch_locked(launch)
            s.issue_locked(ReplayWork(self, launch))
            replay_issued_locked(self, s)
            RUNTIME.provider_added_locked(s)
            for branch in self.branches:  # side-stream work, ordered by its captured events
                branch.issue_locked(ReplayWork(self, launch, branch.nodes, branch.where))

    def perf_plan(self) -> ReplayPlan:
        """The captured nodes as :class:`ReplayPlan` (made once per capture)."""
        plan = self._plan
        if plan is None or plan.source is not self.nodes or plan.size != len(self.nodes):
            plan = self._plan = ReplayPlan(self.nodes)
        return plan

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
            self.rng.release()
            graph_reset(self)

    def register_generator_state(self, generator: Any) -> None:
        """torch_npu 2.14: a no-op (generators register themselves at their first random
        op in a capture), with its deprecation warning."""
        warnings.warn(
            "NPUGraph.register_generator_state() is deprecated, and will be removed in a "
            "future torch_npu release. It is now a no-op and can be safely removed from your "
            "code. Generator states are automatically registered when RNG ops first execute "
            "during graph capture.",
            DeprecationWarning,
            stacklevel=2,
        )

    def pool(self) -> tuple[int, int]:
        """The id of this graph's memory pool, for another capture to share; only after a
        successful capture, as torch_npu's NPUGraph.cpp checks."""
        if not self.captured:
            raise SimUsageError(
                f"Called NPUGraph::pool() without a preceding successful capture. ({self.name})"
            )
        return self._pool

    def update(self, cpu_update_input: list[dict[str, Any]]) -> None:
        """Patch every op recorded by an ``auto_dispatch_capture`` capture (torch_npu 2.14)."""
        if not self.auto_dispatch_capture:
            raise SimUsageError(
                "The current graph configuration does not support update; capture with "
                "auto_dispatch_capture=True"
            )
        self.graph_dispatch_mode.update_capture_record(cpu_update_input)

    def debug_dump(self, debug_path: str) -> None:
        """Write the captured graph as the runtime's JSON trace, then its
        ``.aligned.json`` (torch_npu 2.14 ``NPUGraph.debug_dump``; :mod:`.npugraph_utils`).
        Without a successful capture nothing is written: a warning, as the C++ call's."""
        if not self.captured:
            warnings.warn(
                "Called NPUGraph::debug_dump without a preceding successful capture. "
                f"({self.name})",
                stacklevel=2,
            )
            return
        with RUNTIME.cond:
            events = npugraph_utils.trace_events(self)
        with open(debug_path, "w", encoding="utf-8") as f:
            json.dump(events, f, indent=2)
        try:  # looked up at the call, as torch_npu's: tests patch it
            npugraph_utils.align_trace_json(debug_path, None)
        except Exception:  # the optional post-processing must not affect debug_dump
            _log.warning("Failed to generate aligned trace for %s", debug_path, exc_info=True)


def is_current_stream_capturing() -> bool:
    return current_stream().capturing is not None
