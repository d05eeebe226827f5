"""The worker's main-thread loop: its socket, its wake-up pipe and its outbox.

A :class:`WorkerLoop` polls the worker's ROUTER socket and a wake-up pipe
together. Each message received goes to the loop's
:class:`~graphlane.protocol.server.Responder` (decode, answer through the
worker, the :class:`~graphlane.protocol.server.Handler`, reply); commands posted
from other threads (a finished step from the engine's completion thread, a command
from the lifeline) run on the main thread after a wake-up; ``pump`` runs once per
turn (the worker issues waiting steps). Replies to bundled requests wait in an outbox
and go back to each sender as bundles of bounded size (``wire.bundles``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq
from zmq.backend import zmq_poll

from graphlane.logs import Throttled
from graphlane.protocol import security, wire
from graphlane.protocol.admission import is_bundle
from graphlane.protocol.server import Handler, Responder
from graphlane.workers.connections import Connections
from graphlane.workers.memory import FreedMemory
from graphlane.workers.metrics import WorkerMetrics

log = logging.getLogger("graphlane.worker")


class WorkerLoop:
    """The main thread's loop over ``sock`` (see the module docstring). ``roles``: note
    each message's sender (CURVE roles apply); ``pump``: called once per turn;
    ``metrics``: the bytes in and out and the error replies are counted there."""

    def __init__(
        self,
        sock: zmq.Socket[Any],
        codec: wire.Codec,
        handler: Handler,
        *,
        pump: Callable[[], None],
        metrics: WorkerMetrics,
        roles: bool = False,
        connections: Connections | None = None,
        max_unread_bytes: int = 256 * 2**20,
        spin_s: float = 0.0,
        idle: Callable[[], bool] | None = None,
    ) -> None:
        self.sock = sock
        self.pump = pump
        self.metrics = metrics
        self.roles = roles
        #: with it, each message's routing id comes as a Frame (Origin.source: which
        #: connection it came in on), and its monitor is polled beside the socket
        self.connections = connections
        self.unread = UnreadReplies(max_unread_bytes)
        self.responder = Responder(
            codec,
            handler,
            self.send,
            log,
            between=self._between,
            errors_by_code=metrics.errors,
            over_bound=self._over_bound,
        )
        self.freed = FreedMemory()
        self._limit_bytes = codec.limits.max_message_bytes
        # A routing id, then at most max_frames + 1: one more than admitted is refused.
        self._keep = codec.limits.max_frames + 2
        self.stopping = False
        self._failed_log = Throttled(log)  # a message whose handling raised (a bug)
        # Posted by other threads, run by the main thread after a wake-up.
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._woken = False  # a byte is (or is about to be) in the wake-up pipe
        # Replies to bundled requests waiting to go back as one bundle per sender:
        # the sender's routing id -> its reply envelopes; None when none is open.
        self._outbox: dict[bytes, list[bytes]] | None = None
        self._outbox_since = 0.0  # when the open outbox last went out (or opened)
        #: How long the loop polls its socket before it sleeps, when nothing is in
        #: flight (``idle``) and waits have been short (see _sleep); 0: never.
        self.spin_s = spin_s
        self._idle = idle or (lambda: True)
        # The last 8 waits, one bit each (1: it ended within spin_s): the loop spins
        # while at least half did.
        self._short_waits = 0xFF

    # ------------------------------------------------------------ other threads
    def post(self, command: Callable[[], None]) -> None:
        """Run ``command`` on the main thread (from any other thread)."""
        self._commands.append(command)
        if not self._woken:
            self._woken = True
            # A full pipe means the main thread is waking anyway.
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"\0")

    # ------------------------------------------------------------ the main thread
    def serve(self) -> None:
        """Until ``stopping``: receive, answer, run what was posted, pump; sleep in a poll
        when nothing waits."""
        sock = self.sock
        wake = self._wake_r
        # The sleep is a poll(2) of raw descriptors (one system call; zmq_poll of the
        # sockets themselves costs two more per socket and pass, each asking libzmq
        # for ZMQ_EVENTS). A socket's ZMQ_FD is an edge: readable when libzmq has news
        # for it, not while a message waits, and a send may take that news too. So the
        # loop sleeps on it only right after the socket said that no message waits
        # (ZMQ_EVENTS, which takes the news so far), with no send in between.
        fds: list[Any] = [(sock.FD, wire.POLLIN), (wake, wire.POLLIN)]
        connections = self.connections
        monitor = None
        if connections is not None:  # its monitor: connections accepted and gone
            monitor = connections.monitor.FD  # read to its end each time (take_events)
            fds.append((monitor, wire.POLLIN))
        events: Callable[[int], Any] = sock.get  # the compiled getsockopt (no Python wrapper)
        while not self.stopping:
            if self._woken:
                self._take_wakeups()
            # One message per turn: posted commands and the pump run between messages.
            if events(_EVENTS) & _POLLIN:
                self._receive()
            else:
                self._sleep(fds, wake, monitor)
            self.pump()
            if self.unread.peers and self.unread.sweep():
                self.freed.release()  # a connection's replies went: their memory too
            self.freed.poll()

    def _sleep(self, fds: list[Any], wake: int, monitor: int | None) -> None:
        """Wait (at most a second) for the socket, the wake-up pipe or the monitor.

        With ``spin_s``, the wait starts by polling the socket and the posted commands
        for that long, when nothing is in flight (``idle``: no thread of this process
        needs the interpreter lock the poll holds) and at least half of the last 8 waits
        were that short (a client that answers at once: its next request comes before a
        sleep would pay for itself). A sleeping thread's core idles, and a request that
        wakes it runs on cold caches: on this project's machines a lone step's round
        trip took 1.3-1.5x a raw pyzmq one with the worker sleeping between steps,
        1.1-1.2x with it polling (docs/performance.md). The time polled is the
        worker's ``spin_seconds`` (its CPU, not its steps')."""
        spin = self.spin_s
        if not spin:
            ready = zmq_poll(fds, 1000)
        elif self._short_waits.bit_count() >= 4 and self._idle():
            came = self._spin(spin)
            self._note_wait(came)  # (not come: this wait is past spin_s)
            if came:
                return
            ready = zmq_poll(fds, 1000)
        else:
            t0 = time.perf_counter()
            ready = zmq_poll(fds, 1000)
            self._note_wait(time.perf_counter() - t0 < spin)
        if not ready and self.connections is not None:
            self.connections.take_events()  # a second of quiet: look anyway
        for fd, _ in ready:
            if fd == wake:
                self._take_wakeups()
            elif fd == monitor:
                self.connections.take_events()  # type: ignore[union-attr]
        # The socket's own descriptor: the next turn asks it what came.

    def _note_wait(self, short: bool) -> None:
        self._short_waits = ((self._short_waits << 1) | short) & 0xFF

    def _spin(self, spin: float) -> bool:
        """Poll for ``spin`` seconds at most: True as soon as a message waits on the
        socket or a command was posted (the caller's next turn takes it)."""
        events: Callable[[int], Any] = self.sock.get
        clock = time.perf_counter
        c0 = time.thread_time()
        end = clock() + spin
        came = False
        while clock() < end:
            if self._woken or events(_EVENTS) & _POLLIN:
                came = True
                break
            # A thread that shares this core (a client placed here, the ZeroMQ I/O
            # thread bringing the request) runs now, not after the poll.
            _yield()
        self.metrics.spin_seconds += time.thread_time() - c0
        return came

    def _receive(self) -> None:
        sender = source = None
        try:
            if self.roles or self.connections is not None:  # the routing id as a Frame
                frames, source = security.recv_with_source(
                    self.sock, 2, wire.NOBLOCK, self._keep
                )
                sender = security.sender_of(source) if self.roles else None
            else:
                frames = wire.recv_message(self.sock, 2, wire.NOBLOCK, self._keep)
        except zmq.Again:
            return
        big = len(frames) > 2 and (
            len(frames) >= self._keep or sum(map(_nbytes, frames)) > self._limit_bytes
        )
        try:
            self.handle(frames, sender, source)
        except Exception as exc:  # no message may stop the loop
            self._failed_log.warning(
                "a message failed: %s: %s", type(exc).__name__, exc, exc_info=exc
            )
        if big:  # refused TOO_LARGE: what the peer made libzmq hold goes back
            del frames
            self.freed.release()

    def handle(self, frames: list[Any], sender: str | None = None, source: Any = None) -> None:
        """One received message (its routing id first, as bytes: the outbox groups
        replies by it; ``source``: that routing id's Frame, or None); a bundle's replies
        go back together."""
        self.metrics.bytes_in += sum(map(len, frames)) - len(frames[0])
        if len(frames) != 2 or not is_bundle(frames[1]):
            self.responder.message(frames, sender, source)
            return
        with self.replies_together():
            self.responder.message(frames, sender, source)

    def _over_bound(self, ident: bytes) -> str | None:
        """Why a data reply may not go to ``ident`` now (UnreadReplies); the reply it
        replaces is memory to give back."""
        why = self.unread.refusal(ident)
        if why is not None:
            self.freed.release()
        return why

    def _between(self) -> None:
        """Between a bundle's requests: steps that take long to issue (patches that cost
        host time) must not hold the answers of steps finished meanwhile until the
        bundle's end: those go out at most _HOLD_S after the outbox last went out."""
        if self._woken:
            self._take_wakeups()
        if self._outbox is not None and time.perf_counter() - self._outbox_since > _HOLD_S:
            self._flush_outbox(keep_open=True)

    def _take_wakeups(self) -> None:
        """Run posted commands. The protocol (see post): empty the pipe, re-arm, then
        take the deque; anything appended after the re-arm writes a fresh byte; a byte
        written late (after this pass took its item) is read by the next pass."""
        # One read empties the pipe: it returns every byte waiting, up to 4096, and
        # post writes one byte per re-arm.
        with contextlib.suppress(BlockingIOError):
            while len(os.read(self._wake_r, 4096)) == 4096:
                pass
        self._woken = False
        commands = self._commands
        if not commands:
            return
        # Steps that finished together go back together to senders that take bundles.
        with self.replies_together():
            while commands:
                self._run_safely(commands.popleft())

    @staticmethod
    def _run_safely(work: Callable[..., None], *args: Any) -> None:
        """``work(*args)``: one command; a bug in it is logged, not fatal to the loop."""
        try:
            work(*args)
        except Exception:
            log.exception("worker loop: %r%r failed", work, args)

    # ------------------------------------------------------------ replies
    def send(self, ident: Any, frames: list[Any], bundled: bool = False) -> None:
        """Send a reply; one to a bundle's request (``bundled``) waits in the outbox, when
        one is open, for the other replies to the same sender (see replies_together)."""
        if bundled and self._outbox is not None and len(frames) == 1:
            # One sender's replies to several bundles go together (ident is bytes).
            envelopes = self._outbox.get(ident)
            if envelopes is None:
                self._outbox[ident] = [frames[0]]
            else:
                envelopes.append(frames[0])
            return
        if len(frames) == 1:
            self.metrics.bytes_out += len(frames[0])
            wire.send_message(self.sock, (ident, frames[0]))
            return
        # Data frames: each large one is tracked until libzmq is done with it (written
        # to the connection, or dropped with it), so the bytes a peer leaves unread are
        # known (UnreadReplies).
        sock, unread = self.sock, self.unread
        sock.send(ident, _SNDMORE, copy=False)
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            flags = _SNDMORE if i < last else 0
            n = _nbytes(frame)
            self.metrics.bytes_out += n
            if n < _TRACKED:
                sock.send(frame, flags, copy=False)
            else:
                unread.add(ident, sock.send(frame, flags, copy=False, track=True), n)

    @contextlib.contextmanager
    def replies_together(self) -> Iterator[None]:
        """Within it, replies to bundled requests wait in the outbox; at its end each
        sender's go out as bundles of bounded size (wire.bundles). Nested, the
        outermost one sends."""
        if self._outbox is not None:
            yield
            return
        self._outbox = {}
        self._outbox_since = time.perf_counter()
        try:
            yield
        finally:
            self._run_safely(self._flush_outbox)

    def _flush_outbox(self, keep_open: bool = False) -> None:
        """Send the outbox's replies; with ``keep_open`` it stays open for more."""
        outbox, self._outbox = self._outbox, ({} if keep_open else None)
        self._outbox_since = time.perf_counter()
        for ident, envelopes in (outbox or {}).items():
            for _, payload in wire.bundles(envelopes):
                self.metrics.bytes_out += len(payload)
                wire.send_message(self.sock, (ident, payload))

    def close(self) -> None:
        os.close(self._wake_r)
        os.close(self._wake_w)


_EVENTS = int(zmq.EVENTS)
_yield = getattr(os, "sched_yield", lambda: None)
_POLLIN = int(zmq.POLLIN)
_HOLD_S = 0.0005  # the longest a reply waits in the outbox for the others of its bundle
_SNDMORE = int(zmq.SNDMORE)
_TRACKED = 65536  # frames of at least this many bytes are tracked (pyzmq copies smaller ones)


class UnreadReplies:
    """The bytes of replies sent to each peer that libzmq still holds: queued for it,
    or being written to its connection. A peer that does not read its replies stops
    the kernel's socket buffer from draining, and what the worker sends it piles up in
    libzmq (its SNDHWM counts messages, not bytes). Each large frame is sent with a
    pyzmq tracker, done when libzmq releases it; past ``bound`` bytes, the peer's device
    requests are refused BUSY (Worker._accept) and its further data replies replaced by
    an error (Responder's ``over_bound``), so it holds at most ``bound`` plus the
    replies of the requests it had in flight. A peer that goes takes its queued replies
    with it (libzmq drops them): their trackers finish, and :meth:`sweep` forgets it."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.peers: dict[bytes, collections.deque[tuple[Any, int]]] = {}
        self._held: dict[bytes, int] = {}
        self._over: set[bytes] = set()  # peers refused since they last held nothing
        self._gone = False  # one of them holds nothing now (read up, or went)

    def add(self, ident: bytes, tracker: Any, nbytes: int) -> None:
        sent = self.peers.get(ident)
        if sent is None:
            sent = self.peers[ident] = collections.deque()
            self._held[ident] = 0
        sent.append((tracker, nbytes))
        self._held[ident] += nbytes

    def held(self, ident: bytes) -> int:
        """Bytes of replies to ``ident`` libzmq still holds (0 for an unknown peer)."""
        sent = self.peers.get(ident)
        if sent is None:
            return 0
        self._prune(ident, sent)
        return self._held.get(ident, 0)

    def total(self) -> int:
        """Bytes of replies libzmq still holds, over every peer."""
        for ident, sent in list(self.peers.items()):
            self._prune(ident, sent)
        return sum(self._held.values())

    def refusal(self, ident: bytes) -> str | None:
        """Why ``ident`` may be sent nothing more now; None when it may."""
        held = self.held(ident) if ident in self.peers else 0
        if held < self.bound:
            return None
        self._over.add(ident)
        return (
            f"this connection has {held} bytes of replies unread, at most "
            f"{self.bound} (max_unread_reply_bytes): read the replies before sending more"
        )

    def sweep(self) -> bool:
        """Forget what libzmq released, for every peer; whether a peer that had been
        over the bound now holds nothing (it went, or read up): its memory is free."""
        for ident, sent in list(self.peers.items()):
            self._prune(ident, sent)
        gone, self._gone = self._gone, False
        return gone

    def _prune(self, ident: bytes, sent: collections.deque[tuple[Any, int]]) -> int:
        # A peer's frames leave in the order they were sent: stop at the first held one.
        released = 0
        while sent and sent[0][0].done:
            released += sent.popleft()[1]
        if sent:
            self._held[ident] -= released
        else:
            del self.peers[ident], self._held[ident]
            if ident in self._over:
                self._over.discard(ident)
                self._gone = True
        return released


def _nbytes(frame: Any) -> int:
    return len(frame) if type(frame) is bytes else memoryview(frame).nbytes


__all__ = ["WorkerLoop"]
