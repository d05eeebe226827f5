"""Collectives of the simulated NPU: a ``torch.distributed`` backend named "hccl".

torch_npu registers ``ProcessGroupHCCL`` for the device "npu" under the name "hccl"; its
collectives are tasks on the device's current stream, issued without blocking the host,
so an ``NPUGraph`` capture records them and its replays run them again. This module gives
the sim the same: ``init_process_group("hccl", ...)`` in each rank's process (one process
per rank, as the field runs), and ``all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``broadcast`` and ``barrier`` become one device task each on the
current stream, eager or captured.

The device model (README, "Collectives"):

- a collective is an edge between the ranks' streams: a rank's task ends only once every
  rank of the group started its matching task (the group's n-th collective, counted at
  issue: eagerly at the call, for a captured one at each replay's launch);
- a rank that never joins is a ``DeadlockError`` after the watchdog, naming the group, the
  collective and the ranks missing; ranks that run different collectives at the same
  position are a ``DeviceFaultError`` naming both;
- the task reads its input and writes its output as any device task does, so the memory
  race checks of :mod:`.access` see it.

Transport: a link per group between the ranks' processes, as the field's device-to-device
link is (not the c10d store, whose few TCP round trips per collective would dwarf the
modelled cost). Each rank binds a Unix datagram socket on an abstract name made from a
token rank 0 posts once in the group's store at creation. A collective is one datagram
from each rank to each other rank: its number, its signature, when it started and its
input (over 32 KiB: the descriptor of a memfd holding it, one copy shared by every peer).
The waiting task reads its socket itself, blocked in ``poll(2)``: the kernel wakes it
when a peer's datagram lands, with no transport thread in between (a ZeroMQ link had two
per message, its I/O threads at each end, each a wake-up on a busy host's cores), and
it files the messages by (number, rank). Every rank reduces the same inputs in rank
order, so every rank gets the same bits. The store is used at creation only.
"""

from __future__ import annotations

import array
import json
import os
import select
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from . import access
from .allocation import record_stream
from .errors import DeadlockError, DeviceFaultError, SimUsageError
from .runtime import RUNTIME
from .streams import Dropped, Event, EventRecordWork, Stream, current_stream

#: The ``ReduceOp`` values the sim reduces, with what they do to the stacked inputs.
_REDUCERS: list[tuple[Any, str, Callable[[torch.Tensor], torch.Tensor]]] = [
    (dist.ReduceOp.SUM, "sum", lambda x: x.sum(0, dtype=x.dtype)),
    (dist.ReduceOp.MAX, "max", lambda x: x.amax(0)),
    (dist.ReduceOp.MIN, "min", lambda x: x.amin(0)),
    (dist.ReduceOp.PRODUCT, "product", lambda x: x.prod(0, dtype=x.dtype)),
]


def _reducer(op: Any) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
    for value, name, fn in _REDUCERS:
        if op == value:
            return name, fn
    name = getattr(getattr(op, "op", op), "name", op)  # ReduceOp holds a RedOpType
    raise SimUsageError(
        f"ReduceOp {name} is not modelled by the simulated NPU's hccl backend "
        "(SUM, MAX, MIN and PRODUCT are)"
    )


def _npu(t: Any, what: str) -> torch.Tensor:
    """The CPU view of npu tensor ``t``; refuses anything else, as HCCL does."""
    data = getattr(t, "_data", None)
    if not isinstance(t, torch.Tensor) or t.device.type != "npu" or data is None:
        where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
        raise SimUsageError(
            f"the hccl backend takes npu tensors; {what} is on {where} (move it with .npu())"
        )
    return data


def _to_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def _from_bytes(raw: bytes, like: torch.Tensor) -> torch.Tensor:
    if not raw:
        return torch.empty(like.shape, dtype=like.dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(like.dtype).reshape(like.shape)


# ======================================================================= the cost
def collective_cost_us(kind: str, nbytes: int, ranks: int, latency_us: float, gb_s: float) -> float:
    """Modelled device time of one collective (timed and perf modes): ``latency_us`` plus
    the bytes each rank sends over a link of ``gb_s`` GB/s (0: no bandwidth term).

    ``nbytes`` is the collective's full tensor: the all-reduce's tensor, the all-gather's
    output, the reduce-scatter's input, the broadcast's tensor. A rank sends, as a ring
    does (the bus bandwidth convention of nccl-tests and HCCL Test): 2(N-1)/N of it for an
    all-reduce (a reduce-scatter, then an all-gather), (N-1)/N for an all-gather or a
    reduce-scatter, all of it for a broadcast. A group of one moves nothing over a link.
    """
    if ranks <= 1 or gb_s <= 0:
        return latency_us
    if kind == "all_reduce":
        factor = 2.0 * (ranks - 1) / ranks
    elif kind in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        factor = (ranks - 1) / ranks
    else:
        factor = 1.0
    return latency_us + factor * nbytes / (gb_s * 1e3)  # GB/s = 1e3 bytes per us


# ======================================================================= the group
class ProcessGroupHCCL(dist.ProcessGroup):
    """The sim's ``ProcessGroupHCCL``: collectives of npu tensors as device tasks on the
    current stream, the ranks met through the group's c10d store."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        timeout: timedelta,
        group_id: str = "0",
        global_ranks: list[int] | None = None,
    ) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self.store = store
        self._rank, self._size = rank, size
        self.timeout = timeout
        self.group_id = group_id
        self.global_ranks = list(global_ranks) if global_ranks else list(range(size))
        self.issued = 0  # collectives issued (eager calls, and launches of captured ones)
        self.link = _Link(store, rank, size, group_id)

    # ------------------------------------------------------------ identity
    def getBackendName(self) -> str:
        return "hccl"

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    @property
    def description(self) -> str:
        return f"process group {self.group_id!r} (hccl, global ranks {self.global_ranks})"

    def next_seq_locked(self) -> int:
        """The number of the collective issued now. Caller holds the runtime lock."""
        self.issued += 1
        return self.issued

    # ------------------------------------------------------------ collectives
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> HcclWork:  # type: ignore[override]
        tensor = self._one(tensors, "all_reduce")
        name, fn = _reducer(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        data = _npu(tensor, "the all_reduce tensor")
        spec = _Spec(self, "all_reduce", name, data, data, reduce=fn)
        return self._issue(spec, tensor, tensor)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> HcclWork:
        work = None
        for t in tensors:
            work = self.allreduce([t], opts)
        assert work is not None
        return work

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> HcclWork:
        out, inp = _npu(output, "the all_gather output"), _npu(input, "the all_gather input")
        if out.numel() != inp.numel() * self._size or out.dtype != inp.dtype:
            raise SimUsageError(
                f"all_gather_into_tensor: the output must hold world size ({self._size}) times "
                f"the input's {inp.numel()} elements of {inp.dtype}; it has {out.numel()} of "
                f"{out.dtype}"
            )
        spec = _Spec(self, "all_gather_into_tensor", "", inp, out)
        return self._issue(spec, output, input)

    _allgather_base = all_gather_single

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> HcclWork:
        out, inp = (
            _npu(output, "the reduce_scatter output"),
            _npu(input, "the reduce_scatter input"),
        )
        if inp.numel() != out.numel() * self._size or out.dtype != inp.dtype:
            raise SimUsageError(
                f"reduce_scatter_tensor: the input must hold world size ({self._size}) times "
                f"the output's {out.numel()} elements of {out.dtype}; it has {inp.numel()} of "
                f"{inp.dtype}"
            )
        name, fn = _reducer(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        spec = _Spec(self, "reduce_scatter_tensor", name, inp, out, reduce=fn)
        return self._issue(spec, output, input)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> HcclWork:  # type: ignore[override]
        tensor = self._one(tensors, "broadcast")
        root = opts.rootRank if opts is not None else 0
        data = _npu(tensor, "the broadcast tensor")
        spec = _Spec(self, "broadcast", f"root {root}", data, data, root=root)
        return self._issue(spec, tensor, tensor)

    def barrier(self, opts: Any = None) -> HcclWork:
        """An all-reduce of one element, waited for by the host (as ProcessGroupHCCL)."""
        flag = torch.zeros(1, device=f"npu:{current_stream().device_index}")
        work = self.allreduce([flag], dist.AllreduceOptions())
        current_stream().synchronize()
        return work

    def _one(self, tensors: list[torch.Tensor], what: str) -> torch.Tensor:
        if len(tensors) != 1:
            raise SimUsageError(
                f"{what}: the hccl backend takes one tensor per call, got {len(tensors)}"
            )
        return tensors[0]

    def _issue(self, spec: _Spec, tensor: torch.Tensor, other: torch.Tensor) -> HcclWork:
        """Issue the collective on ``tensor``'s device's current stream (``other``: its
        other tensor, or ``tensor`` again)."""
        stream = current_stream(tensor.device.index)
        node = CollectiveTask(spec)
        with RUNTIME.cond:
            cap = stream.capturing
            if cap is not None:
                cap.add_node(node)
                return HcclWork(stream, None)
        # As ProcessGroupHCCL records its tensors on the stream its HCCL task runs on: a
        # tensor the host frees before the collective has run keeps its memory until
        # then, whatever stream allocated it (the sim's task runs on the current stream).
        for t in {id(tensor): tensor, id(other): other}.values():
            record_stream(t, stream)
        with RUNTIME.cond:
            node.seq = self.next_seq_locked()
            stream.issue_locked(node)
            # recorded in the same critical section: nothing another thread issues to the
            # stream can come between the collective and the event
            done = Event()
            stream.issue_locked(EventRecordWork(done, done.issue_record_locked(stream)))
        return HcclWork(stream, done)


class HcclWork(dist._Work):
    """What a collective returns: ``wait()`` makes the current stream wait for the
    collective (the host does not block), as ProcessGroupHCCL's work does."""

    def __init__(self, stream: Stream, done: Event | None) -> None:
        super().__init__()
        self.stream = stream
        self.done = done  # recorded after an eager collective; None for a captured one

    def wait(self, timeout: timedelta | None = None) -> bool:
        cur = current_stream(self.stream.device_index)
        if cur is not self.stream:
            if self.done is not None:
                self.done.wait(cur)
            else:  # captured: a join of the capture stream, recorded when it is needed
                cur.wait_stream(self.stream)
        return True

    def is_completed(self) -> bool:
        return self.done is None or self.done.query()

    def is_success(self) -> bool:
        return self.is_completed()


# ======================================================================= the task
class _Spec:
    """One collective call: what it reads and writes and how the ranks' inputs combine."""

    def __init__(
        self,
        group: ProcessGroupHCCL,
        kind: str,
        detail: str,
        inp: torch.Tensor,
        out: torch.Tensor,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
        root: int | None = None,
    ) -> None:
        self.group, self.kind, self.detail = group, kind, detail
        self.inp, self.out = inp, out
        self.reduce, self.root = reduce, root
        # what every rank must agree on: the collective, its operation and the input
        self.signature = [kind, detail, str(inp.dtype), list(inp.shape)]
        self.sig_bytes = json.dumps(self.signature).encode()  # as the link carries it
        full = out if kind == "all_gather_into_tensor" else inp
        self.nbytes = full.numel() * full.element_size()  # the full tensor (the cost's)
        items = [access.item(inp, inp is out, "tensor" if inp is out else "input")]
        if out is not inp:
            items.append(access.item(out, True, "output"))
        self.footprint: access.Footprint = tuple(i for i in items if i is not None)

    def combine(self, inputs: list[torch.Tensor]) -> None:
        """Write the result of the ranks' ``inputs`` (in rank order) into the output."""
        rank = self.group._rank
        if self.kind == "broadcast":
            assert self.root is not None
            result = inputs[self.root]
        elif self.kind == "all_gather_into_tensor":
            result = torch.cat([x.reshape(-1) for x in inputs])
        else:
            assert self.reduce is not None
            reduced = self.reduce(torch.stack(inputs))
            if self.kind == "reduce_scatter_tensor":
                result = reduced.reshape(-1).chunk(self.group._size)[rank]
            else:
                result = reduced
        self.out.copy_(result.reshape(self.out.shape))


class CollectiveTask:
    """One collective on a stream: an eager entry (``seq`` set at issue) or a node of a
    captured graph (a new ``seq`` at each replay's launch)."""

    def __init__(self, spec: _Spec) -> None:
        self.spec = spec
        self.seq = 0
        self.label = f"hccl {spec.kind}"
        self.issued = next(access.ISSUED)
        self.access = access.TaskAccess(spec.footprint)

    def launch_locked(self, launch: Any, stream: Stream) -> None:
        launch.seqs[self] = self.spec.group.next_seq_locked()

    def run(self, ex: Stream, launch: Any = None) -> None:
        spec = self.spec
        seq = self.seq if launch is None else launch.seqs[self]
        ex.tick()
        with RUNTIME.cond:
            if RUNTIME.config.perf:  # performance mode keeps no clocks to check against
                pass
            elif launch is None:
                epoch, gen = ex.clock[ex.actor], RUNTIME.epoch
                for it in spec.footprint:
                    access.touch(ex, epoch, gen, it, (self.issued, self.label, ex))
            else:
                self.access.touch_locked(ex, (launch.issued, (self.label, launch), ex))
        timed = RUNTIME.config.timed  # timed and perf modes
        started = ex.resume_at if ex.resume_at is not None else ex.model_time
        # A replayed task computes nothing in timed mode: the ranks meet, no data moves.
        with_data = not (timed and launch is not None)
        inputs, starts = _Meeting(spec, seq, ex, launch).meet(with_data, started)
        if with_data:
            spec.combine(inputs)
        if timed:
            cfg = RUNTIME.config
            cost = collective_cost_us(spec.kind, spec.nbytes, spec.group._size,
                                      cfg.collective_us, cfg.collective_gb_s)  # fmt: skip
            ex.cost.add_at(cost, max(starts))
            if launch is not None and RUNTIME.config.perf:
                ex.advance()  # what follows settles if anything can observe it
            else:
                ex.settle()


class LinkStats:
    """What a group's link did, for tests and benchmarks: datagrams sent and received,
    payloads passed as shared memory, and the times a waiting task blocked in the poll."""

    __slots__ = ("blocked", "received", "sent", "shared")

    def __init__(self) -> None:
        self.sent = self.received = self.shared = self.blocked = 0


class _PeerStuck(Exception):
    """A peer's queue stayed full for the watchdog's time: it reads no collective."""

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.rank = rank


#: A message's fixed part: the collective's number, the sender's rank, its start time,
#: the length of the signature that follows, and whether the payload is inline (0) or in
#: the shared memory whose descriptor rides with the datagram (1).
_HEAD = struct.Struct("<qidHB")


class _Link:
    """A group's transport between its ranks' processes (module docstring, "Transport")."""

    #: Inputs up to this size travel inside the datagram; larger ones in shared memory.
    INLINE_MAX = 32 * 1024
    #: A receive's buffer: the fixed part, a signature and an inline payload.
    RECV_BYTES = _HEAD.size + 4096 + INLINE_MAX
    ANC_BYTES = socket.CMSG_SPACE(array.array("i").itemsize)  # one descriptor

    def __init__(self, store: Any, rank: int, size: int, group_id: str) -> None:
        self.rank, self.size = rank, size
        self.cond = threading.Condition()
        # (seq, rank) -> (start, signature, payload)
        self.inbox: dict[tuple[int, int], tuple[float, bytes, bytes]] = {}
        self.stats = LinkStats()
        self.reading = False  # a waiting task is reading the socket
        if size <= 1:
            return
        # The n-th creation of a group under this store prefix: every rank adds one, so a
        # group made again over the same store meets under a new key.
        made = (int(store.add("npusim/link/joined", 1)) - 1) // size
        key = f"npusim/link/{made}"
        if rank == 0:
            store.set(key, f"npusim-hccl-{uuid.uuid4().hex}")
        name = store.get(key).decode()  # blocks until rank 0 posted it (the store's timeout)
        # Abstract names (a leading NUL): no file to clean up, gone with the process.
        self.peers = {r: f"\0{name}-{r}".encode() for r in range(size) if r != rank}
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.bind(f"\0{name}-{rank}".encode())
        self.sock.setblocking(False)
        self.poller = select.poll()
        self.poller.register(self.sock, select.POLLIN)
        self.out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.out.setblocking(False)
        self.send_lock = threading.Lock()  # streams of one group run on several threads
        # Every rank bound before any sends: a datagram to a name nobody bound is refused.
        store.set(f"{key}/bound/{rank}", "1")
        store.wait([f"{key}/bound/{r}" for r in range(size)])

    def send(self, seq: int, start: float, signature: bytes, payload: bytes,
             timeout_s: float) -> None:  # fmt: skip
        """This rank's part of collective ``seq`` to every other rank: one datagram each
        (with a payload over :data:`INLINE_MAX`, a descriptor of shared memory holding it).
        Raises :class:`_PeerStuck` if a peer's queue stays full for ``timeout_s``."""
        shared = len(payload) > self.INLINE_MAX
        head = _HEAD.pack(seq, self.rank, start, len(signature), shared)
        with self.send_lock:
            if not shared:
                data = b"".join((head, signature, payload))
                for peer, addr in self.peers.items():
                    self._send_one(peer, addr, data, None, timeout_s)
            else:
                # One copy in shared memory, its descriptor passed to every peer: the
                # memory lives until the last of them closes it, no name to clean up.
                fd = os.memfd_create("npusim-hccl", os.MFD_CLOEXEC)
                try:
                    view = memoryview(payload)
                    while view:
                        view = view[os.write(fd, view) :]
                    for peer, addr in self.peers.items():
                        self._send_one(peer, addr, head + signature, fd, timeout_s)
                finally:
                    os.close(fd)
                self.stats.shared += 1
            self.stats.sent += len(self.peers)

    def _send_one(self, peer: int, addr: bytes, data: bytes, fd: int | None,
                  timeout_s: float) -> None:  # fmt: skip
        deadline = None
        while True:
            try:
                if fd is None:
                    self.out.sendto(data, addr)
                else:
                    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
                    self.out.sendmsg([data], rights, 0, addr)  # send_fds drops the address
                return
            except BlockingIOError:
                # The peer's queue is full (it holds unread messages of collectives it has
                # not reached yet): rare, as a rank runs at most a collective or two ahead.
                now = time.monotonic()
                deadline = now + timeout_s if deadline is None else deadline
                if now >= deadline:
                    raise _PeerStuck(peer) from None
                time.sleep(0.001)
            except (ConnectionRefusedError, FileNotFoundError):
                return  # the peer's process is gone: the watchdog names it as missing

    def receive_locked(self, wait_s: float) -> None:
        """File what arrives within ``wait_s`` in the inbox. Caller holds ``cond``.

        The waiting task reads the socket itself: the sender's datagram wakes it
        directly, no transport thread in between; when several of the rank's streams
        wait, one reads and the others wait on ``cond`` for what it files."""
        if self.reading:
            self.cond.wait(wait_s)
            return
        self.reading = True
        got: list[tuple[tuple[int, int], tuple[float, bytes, bytes]]] = []
        self.cond.release()
        try:
            blocked = False
            while True:
                if not self.poller.poll(0):
                    if got or blocked:
                        break
                    blocked = True
                    self.stats.blocked += 1
                    if not self.poller.poll(max(1, int(wait_s * 1000))):
                        break
                msg, anc, _, _ = self.sock.recvmsg(self.RECV_BYTES, self.ANC_BYTES)
                got.append(self._parse(msg, anc))
        finally:
            self.cond.acquire()
            self.reading = False
            self.stats.received += len(got)
            self.inbox.update(got)
            self.cond.notify_all()

    @staticmethod
    def _parse(msg: bytes, anc: list[tuple[int, int, bytes]]
               ) -> tuple[tuple[int, int], tuple[float, bytes, bytes]]:  # fmt: skip
        seq, rank, start, sig_len, shared = _HEAD.unpack_from(msg)
        body = _HEAD.size + sig_len
        signature = msg[_HEAD.size : body]
        fds = [
            fd
            for level, kind, data in anc
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
            for fd in array.array("i", data[: len(data) - len(data) % 4])
        ]
        if not shared:
            for fd in fds:
                os.close(fd)
            return (seq, rank), (start, signature, msg[body:])
        try:
            size = os.fstat(fds[0]).st_size
            parts, done = [], 0
            while done < size:
                part = os.pread(fds[0], size - done, done)
                parts.append(part)
                done += len(part)
        finally:
            for fd in fds:
                os.close(fd)
        return (seq, rank), (start, signature, b"".join(parts))


class _Meeting:
    """The ranks' rendezvous for one collective, over the group's link."""

    WAKE_S = 0.05  # how often a waiting task looks for a fault, a reset or the watchdog

    def __init__(self, spec: _Spec, seq: int, ex: Stream, launch: Any) -> None:
        self.spec, self.ex, self.launch = spec, ex, launch
        self.group = spec.group
        self.seq = seq

    @property
    def what(self) -> str:
        """The collective, for a report (built only then: a replay runs many of them)."""
        launch, spec = self.launch, self.spec
        where = f" in replay #{launch.number} of {launch.graph_name}" if launch else ""
        return f"{spec.kind} #{self.seq} of {spec.group.description}{where} on {self.ex.name}"

    def meet(self, with_data: bool, started: float) -> tuple[list[torch.Tensor], list[float]]:
        group, spec = self.group, self.spec
        me = group._rank
        if group._size == 1:
            return [spec.inp], [started]
        sends = with_data and (spec.root is None or spec.root == me)
        payload = _to_bytes(spec.inp) if sends else b""
        try:
            group.link.send(self.seq, started, spec.sig_bytes, payload, RUNTIME.config.watchdog_s)
        except _PeerStuck as exc:
            self._never_joined([exc.rank])
        received = self._wait_for([r for r in range(group._size) if r != me])
        inputs: list[torch.Tensor] = []
        starts = [started]
        for r in range(group._size):
            if r == me:
                inputs.append(spec.inp)
                continue
            start, signature, body = received[r]
            if signature != spec.sig_bytes:
                self._mismatch(r, json.loads(signature))
            starts.append(start)
            inputs.append(_from_bytes(body, spec.inp) if body else spec.inp)
        return inputs, starts

    def _wait_for(self, ranks: list[int]) -> dict[int, tuple[float, bytes, bytes]]:
        """Wait (reading the link) until every rank's message is in; a fault or
        reset drops the task, the watchdog reports the ranks that never came."""
        link, ex, seq = self.group.link, self.ex, self.seq
        since = time.monotonic()
        with link.cond:
            while True:
                missing = [r for r in ranks if (seq, r) not in link.inbox]
                if not missing:
                    return {r: link.inbox.pop((seq, r)) for r in ranks}
                if RUNTIME.fault is not None or RUNTIME.epoch != ex.run_epoch or RUNTIME.closing:
                    raise Dropped
                if RUNTIME.watchdog_expired(since):
                    break
                link.receive_locked(self.WAKE_S)
        self._never_joined(missing)

    def _never_joined(self, ranks: list[int]) -> NoReturn:
        names = ", ".join(f"rank {r} (global rank {self.group.global_ranks[r]})" for r in ranks)
        with RUNTIME.cond:
            RUNTIME.report(
                DeadlockError(
                    f"deadlock: {self.what} has waited {RUNTIME.config.watchdog_s:g} s for "
                    f"{names}, which never joined it; every rank of a group must issue its "
                    "collectives in the same order (NPUSIM_WATCHDOG_S sets this limit)",
                    kind="watchdog",
                )
            )
        raise Dropped

    def _mismatch(self, rank: int, theirs: list[Any]) -> NoReturn:
        kind, detail, dtype, shape = theirs
        mine = self.spec.signature
        with RUNTIME.cond:
            RUNTIME.report(
                DeviceFaultError(
                    f"collective mismatch: {self.what} is {mine[0]} {mine[1]} of {mine[2]} "
                    f"{mine[3]} here, but rank {rank} runs {kind} {detail} of {dtype} {shape} "
                    "at that position; every rank of a group must issue the same collectives "
                    "in the same order"
                )
            )
        raise Dropped


# ======================================================================= registration
def _create(options: Any, pg_options: Any = None) -> ProcessGroupHCCL:
    return ProcessGroupHCCL(
        options.store,
        options.group_rank,
        options.group_size,
        options.timeout,
        group_id=str(options.group_id),
        global_ranks=list(options.global_ranks_in_group),
    )


def is_hccl_available() -> bool:
    """``torch.distributed.is_hccl_available()`` of torch_npu: the backend is registered."""
    return "hccl" in dist.Backend.backend_list


def register() -> None:
    """Register the "hccl" backend for the device "npu" and set
    ``torch.distributed.is_hccl_available`` (as ``import torch_npu`` does); idempotent."""
    dist.is_hccl_available = is_hccl_available  # type: ignore[attr-defined]
    if "hccl" in dist.Backend.backend_list and getattr(dist.Backend, "_npusim", False):
        return
    dist.Backend.register_backend("hccl", _create, extended_api=True, devices=["npu"])
    dist.Backend._npusim = True  # type: ignore[attr-defined]
