"""Fork/join capture: side streams that join a capture, and their replay.

As CANN's cross-stream capture (aclmdlRICapture; torch_npu's
``test_aclgraph_multi_stream.py``, MoE shared-expert streams): while a stream S
captures a graph, a stream that waits on an event recorded inside the capture
(``side.wait_stream(S)``, or an Event recorded on S and waited on side) joins the
capture: work issued on it from then on is recorded into the same graph, as a
*branch* with its own nodes, instead of running. A wait between branches of the
capture (``S.wait_stream(side)``) is recorded as an edge. Every branch must be joined
back before the capture ends: its last captured work must be an event record that a
joined stream waits on, directly or through other branches; otherwise capture_end
fails as CANN's does (ACL_ERROR_RT_STREAM_UNJOINED, 107025) and the graph holds
nothing.

Replay runs the capture stream's nodes on the replaying stream and each branch on a
stream of the graph's own (as the runtime adds streams to a captured model), ordered by
the captured event edges only: the branches run concurrently with the main branch, and
the happens-before checks see exactly those edges.
"""

from __future__ import annotations

from typing import Any

from .capture_rules import CaptureOrigin
from .errors import SimUsageError
from .runtime import RUNTIME
from .streams import Capture, Event, EventRecordWork, EventWaitWork, Launch, Stream


class Branch:
    """The work one side stream captured, and the stream its replays run on."""

    def __init__(self, graph: Any, index: int, source: Stream) -> None:
        self.graph = graph
        self.index = index
        self.source = source.name  # the stream it was captured from (for messages)
        self.nodes: list[Any] = []
        self.stream: BranchStream | None = None

    @property
    def where(self) -> str:
        return f" (branch {self.index}, captured on {self.source})"

    def launch_locked(self, launch: Launch) -> None:
        stream = self.stream
        assert stream is not None
        for node in self.nodes:
            node.launch_locked(launch, stream)

    def issue_locked(self, work: Any) -> None:
        stream = self.stream
        assert stream is not None
        stream.issue_locked(work)
        RUNTIME.provider_added_locked(stream)


class BranchStream(Stream):
    """A stream a graph replays one of its branches on."""

    label = ""

    @property
    def name(self) -> str:
        return self.label or super().name


class CapturedWait:
    """A wait of one branch on an event record captured on another."""

    def __init__(self, event: Event, record: EventRecordWork) -> None:
        self.event = event
        self.record = record
        self.label = f"wait {event.name}"

    def launch_locked(self, launch: Launch, stream: Stream) -> None:
        pass

    def run(self, ex: Stream, launch: Launch | None = None) -> None:
        assert launch is not None
        EventWaitWork(self.event, launch.seqs[self.record]).run(ex)


def capture_wait(event: Event, s: Stream) -> bool:
    """``event.wait(s)`` where ``s`` captures or ``event`` was recorded in a capture that
    may be live; False when it is an eager wait after all. Caller holds the runtime lock."""
    graph = event._captured_in
    cap = s.capturing
    origin = graph.capturing if graph is not None else None
    if origin is not None and (
        origin.stream.capturing is not origin  # that capture was ended by a device reset
        or event._captured_at[0].origin is not origin  # recorded in an earlier capture
    ):
        origin = None
    if origin is None:
        if cap is None:
            return False
        raise SimUsageError(
            f"{event.name}.wait() on {s.name} while it captures {cap.graph.name}: the event "
            "was not recorded in that capture (capture isolation; record it on a stream of "
            "the capture first)"
        )
    if cap is None:
        cap = _join(origin, s)
    elif cap.graph is not graph:
        raise SimUsageError(
            f"{event.name}.wait() on {s.name}, which captures {cap.graph.name}, for a record "
            f"captured in {graph.name}: two captures cannot be merged"
        )
    where, record = event._captured_at
    if where is not cap:  # on the same stream, stream order already orders them
        cap.add_node(CapturedWait(event, record))
    return True


def _join(origin: CaptureOrigin, s: Stream) -> Capture:
    if s.is_default:
        raise SimUsageError(
            f"{s.name} cannot join the capture of {origin.graph.name}: a disallowed implicit "
            "dependency from the default stream (CANN ACL_ERROR_RT_STREAM_CAPTURE_IMPLICIT); "
            "fork onto a side stream"
        )
    if s.updating is not None:
        raise SimUsageError(f"{s.name} is between graph_task_update_begin and _end")
    graph = origin.graph
    branch = Branch(graph, len(graph.branches) + 1, s)
    graph.branches.append(branch)
    member = origin.member(s, branch.nodes)
    origin.members.append(member)
    s.capturing = member
    RUNTIME.unobserved.add(s)  # a device synchronize refuses it while it captures
    return member


def end_capture_locked(origin: CaptureOrigin) -> str:
    """End the capture of every stream that joined ``origin``'s; return why it fails
    (a branch not joined back), or "". Caller holds the runtime lock."""
    graph = origin.graph
    for member in origin.members:
        member.stream.capturing = None
    waiters: dict[int, list[Any]] = {}  # id(record) -> the node lists that wait on it
    for nodes in [graph.nodes, *(b.nodes for b in graph.branches)]:
        for node in nodes:
            if isinstance(node, CapturedWait):
                waiters.setdefault(id(node.record), []).append(nodes)
    joined: list[Any] = [graph.nodes]
    pending = list(graph.branches)
    changed = True
    while changed:
        changed = False
        for branch in list(pending):
            last = branch.nodes[-1] if branch.nodes else None
            waited_by = waiters.get(id(last), []) if isinstance(last, EventRecordWork) else []
            if any(any(w is j for j in joined) for w in waited_by):
                joined.append(branch.nodes)
                pending.remove(branch)
                changed = True
    if pending:
        b = pending[0]
        last = b.nodes[-1].label if b.nodes else "nothing"
        return (
            f"capture_end of {graph.name}: the capture model contains a stream that was not "
            "joined to the original stream (CANN ACL_ERROR_RT_STREAM_UNJOINED, 107025): "
            f"{b.source} joined the capture by waiting on its work, and its last captured "
            f"work ({last}) is not waited on by the capture stream. Join it back before "
            f"the capture ends ({origin.stream.name}.wait_stream(side), or an Event recorded "
            "on the side stream and waited on the capture stream) and issue nothing on it "
            "after that"
        )
    return ""


def give_streams(graph: Any, device: int) -> None:
    """Give each branch of a captured graph a stream of the graph's own to replay on
    (reused by later captures of the graph). Caller must not hold the runtime lock."""
    pool = graph.branch_streams
    while len(pool) < len(graph.branches):
        pool.append(BranchStream(device))
    with RUNTIME.cond:
        for branch, stream in zip(graph.branches, pool, strict=False):
            branch.stream = stream
            stream.label = f"branch {branch.index} of {graph.name}"

