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
    ) -> None:
        self.sock = sock
        self.pump = pump
        self.metrics = metrics
        self.roles = roles
        self.responder = Responder(
            codec, handler, self.send, log, between=self._between, errors_by_code=metrics.errors
        )
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
        """Until ``stopping``: poll, answer, run what was posted, pump."""
        sock = self.sock
        wake = self._wake_r
        # zmq_poll itself, not zmq.Poller (its Python), nor getsockopt(EVENTS) (an enum
        # call per test): the socket's readiness is one C call either way.
        both: list[Any] = [(sock, wire.POLLIN), (wake, wire.POLLIN)]
        while not self.stopping:
            readable = woken = False
            for which, _ in zmq_poll(both, 1000):  # at once when anything waits
                if which is sock:
                    readable = True
                else:
                    woken = True
            if woken or self._woken:
                self._take_wakeups()
            if readable:
                # One message per turn: the next turn's poll asks the socket and the
                # wake-up pipe together (a readiness check costs libzmq a poll(2)
                # whichever way it is asked, so a second one just for the socket
                # would cost a lone request one more).
                self._receive()
            self.pump()

    def _receive(self) -> None:
        sender = None
        try:
            if self.roles:  # only then: the sender costs a zero-copy frame
                frames, sender = security.recv_with_sender(
                    self.sock, 2, wire.NOBLOCK, self._keep
                )
            else:
                frames = wire.recv_message(self.sock, 2, wire.NOBLOCK, self._keep)
        except zmq.Again:
            return
        try:
            self.handle(frames, sender)
        except Exception as exc:  # no message may stop the loop
            self._failed_log.warning(
                "a message failed: %s: %s", type(exc).__name__, exc, exc_info=exc
            )

    def handle(self, frames: list[Any], sender: str | None = None) -> None:
        """One received message (its routing id first, as bytes: the outbox groups
        replies by it); a bundle's replies go back together."""
        self.metrics.bytes_in += sum(map(len, frames)) - len(frames[0])
        if len(frames) != 2 or not is_bundle(frames[1]):
            self.responder.message(frames, sender)
            return
        with self.replies_together():
            self.responder.message(frames, sender)

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
        self.metrics.bytes_out += sum(map(_nbytes, frames))
        wire.send_message(self.sock, [ident, *frames])

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


_HOLD_S = 0.0005  # the longest a reply waits in the outbox for the others of its bundle


def _nbytes(frame: Any) -> int:
    return len(frame) if type(frame) is bytes else memoryview(frame).nbytes


__all__ = ["WorkerLoop"]
