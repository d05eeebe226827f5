"""The worker's main-thread loop and its lifeline, apart from what requests ask of the device.

:class:`WorkerLoop`, the base of :class:`~.worker.Worker`, is the machinery around
the step engine: the main thread's poll loop over the ROUTER socket and the
wake-up pipe (``_serve``); each message decoded into requests, those of a bundle
answered together (``_handle``, ``_request``); replies sent at once or held in an
outbox and sent back as bundles (``_send``, ``_replies_together``); the lifeline
thread that reads the orchestrator's pipe and posts its commands to the main
thread (``_lifeline``, ``_post``); and stopping when drained. The Worker sets the
state up (its ``__init__``) and does the rest: what a request asks
(``_dispatch``), issuing waiting steps (``_pump``), answering a finished step
(``_finish``) and its ``status``.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import zmq
from zmq.backend import zmq_poll

from graphlane.protocol import pipe, requests, security, wire
from graphlane.protocol.errors import GraphlaneError, as_error

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from graphlane.logs import Throttled
    from graphlane.workers.metrics import WorkerMetrics
    from graphlane.workers.step import Step
    from graphlane.workers.worker import WorkerSpec

log = logging.getLogger("graphlane.worker")


class WorkerLoop:
    """The socket loop and the lifeline of a :class:`~.worker.Worker` (see the module
    docstring). A base class rather than an object of its own: the loop and the Worker
    share the main thread's socket and state, set up by ``Worker.__init__``."""

    spec: WorkerSpec
    conn: Connection
    sock: zmq.Socket[Any]
    metrics: WorkerMetrics
    counters: dict[str, int]
    draining: bool
    _dropped_log: Throttled
    _failed_log: Throttled  # a message whose handling raised (a bug): its cause, throttled
    _stopping: bool
    _stop_when_idle: bool
    # Filled by other threads, emptied by the main thread after a wake-up.
    _finished: collections.deque[Step]
    _commands: collections.deque[Callable[[], None]]
    _wake_r: int
    _wake_w: int
    _woken: bool
    _outbox: dict[bytes, list[bytes]] | None
    _outbox_since: float
    roles: security.Roles | None  # None: no roles apply (always so without CurveZMQ)
    sender: str | None  # the key (ZAP User-Id) of the message being handled, with roles

    # ------------------------------------------------------------ the Worker's part
    @property
    def inflight(self) -> int:
        """Accepted requests not answered yet."""
        raise NotImplementedError

    def status(self) -> dict[str, Any]:
        raise NotImplementedError

    def _dispatch(self, ident: bytes, req: wire.Request, received: float, bundled: bool) -> None:
        """Act on one decoded request: answer it, or accept its step."""
        raise NotImplementedError

    def _pump(self) -> None:
        """Issue waiting steps (once per turn of the loop)."""
        raise NotImplementedError

    def _finish(self, step: Step) -> None:
        """Answer a finished step (on the main thread)."""
        raise NotImplementedError

    # ------------------------------------------------------------ lifecycle
    def _lifeline(self) -> None:
        """Commands from the orchestrator; EOF means it died: exit, do not linger as an orphan."""
        while True:
            try:
                cmd = pipe.recv(self.conn)
            except (EOFError, OSError):
                os._exit(4)
            except ValueError:
                log.error("ignored an unreadable message from the orchestrator")
                continue
            if isinstance(cmd, pipe.Drain):
                self._post(functools.partial(self._begin_drain, cmd.stop))
            elif isinstance(cmd, pipe.Ping):
                # Answered by the main thread: the status is its state, and a loop that
                # cannot answer is a hung worker.
                self._post(self._pong)

    def _post(self, command: Callable[[], None]) -> None:
        """Run ``command`` on the main thread (from any other thread)."""
        self._commands.append(command)
        self._wake()

    def _wake(self) -> None:
        if not self._woken:
            self._woken = True
            # A full pipe means the main thread is waking anyway.
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"\0")

    def _pong(self) -> None:
        try:
            pipe.send(self.conn, pipe.Pong(self.status()))
        except OSError:
            os._exit(4)

    def _begin_drain(self, stop: bool) -> None:
        self.draining = True
        if stop:
            self._stop_when_idle = True
            self._maybe_stop()

    def _maybe_stop(self) -> None:
        if self._stop_when_idle and self.inflight == 0:
            self._stopping = True

    def _serve(self) -> None:
        sock = self.sock
        wake = self._wake_r
        # zmq_poll itself, not zmq.Poller (its Python), nor getsockopt(EVENTS) (an enum
        # call per test): the socket's readiness is one C call either way.
        both: list[Any] = [(sock, wire.POLLIN), (wake, wire.POLLIN)]
        recv = wire.recv_message
        if self.roles is not None:  # only then: the sender costs a zero-copy frame
            recv = self._recv_noting_sender
        while not self._stopping:
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
                try:
                    frames = recv(sock, 2, wire.NOBLOCK)
                except zmq.Again:
                    pass
                else:
                    try:
                        self._handle(frames)
                    except Exception as exc:  # no message may stop the loop
                        self._failed_log.warning(
                            "a message failed: %s: %s", type(exc).__name__, exc, exc_info=exc
                        )
            self._pump()

    def _recv_noting_sender(self, sock: zmq.Socket[Any], copied: int, flags: int = 0) -> list[Any]:
        """wire.recv_message that notes the sender's key for the roles (``self.sender``,
        read by the requests of this message)."""
        frames, self.sender = security.recv_with_sender(sock, copied, flags)
        return frames

    def _take_wakeups(self) -> None:
        """Run posted commands and answer finished steps. The protocol (see _wake):
        empty the pipe, re-arm, then take the deques; anything appended after the
        re-arm writes a fresh byte; a byte written late (after this pass took its
        item) is read by the next pass."""
        # One read empties the pipe: it returns every byte waiting, up to 4096, and
        # _wake writes one byte per re-arm.
        with contextlib.suppress(BlockingIOError):
            while len(os.read(self._wake_r, 4096)) == 4096:
                pass
        self._woken = False
        while self._commands:
            self._run_safely(self._commands.popleft())
        finished = self._finished
        if not finished:
            return
        # Steps that finished together go back together to senders that take bundles.
        with self._replies_together():
            while finished:
                self._run_safely(self._finish, finished.popleft())

    @staticmethod
    def _run_safely(work: Callable[..., None], *args: Any) -> None:
        """``work(*args)``: one command or completion; a bug in it is logged, not fatal
        to the loop."""
        try:
            work(*args)
        except Exception:
            log.exception("worker loop: %r%r failed", work, args)

    # ------------------------------------------------------------ requests
    def _send(self, ident: Any, frames: list[Any], bundled: bool = False) -> None:
        """Send a reply; one to a bundle's request (``bundled``) waits in the outbox, when
        one is open, for the other replies to the same sender (see _replies_together)."""
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
    def _replies_together(self) -> Iterator[None]:
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

    def _reply_error(
        self, ident: Any, request_id: int, error: GraphlaneError, bundled: bool = False
    ) -> None:
        self.counters["errors"] += 1
        self.metrics.errors[str(error.code)] += 1
        self._send(ident, wire.encode_error(request_id, error), bundled)

    def _handle(self, frames: list[Any]) -> None:
        """One message: a request, or a bundle of them whose replies go back together."""
        received = time.perf_counter()
        self.metrics.bytes_in += sum(map(len, frames)) - len(frames[0])
        ident = frames[0]  # bytes (see wire.recv_message): the outbox groups replies by it
        try:
            # Bodies decoded with their envelopes (the same requests and errors as wire's).
            reqs: list[wire.Request | wire.DecodeError] = requests.decode_requests(
                frames[1:], self.spec.limits
            )
        except wire.DecodeError as exc:
            reqs = [exc]
        if len(reqs) == 1:
            self._request(ident, reqs[0], received, False)
            return
        self.counters["bundles"] += 1
        with self._replies_together():
            for req in reqs:
                self._request(ident, req, received, True)
                # Steps that take long to issue (patches that cost host time) must not
                # hold the answers of steps finished meanwhile until the bundle's end:
                # those go out at most _HOLD_S after the outbox last went out.
                if self._woken:
                    self._take_wakeups()
                if time.perf_counter() - self._outbox_since > _HOLD_S:
                    self._flush_outbox(keep_open=True)

    def _request(
        self, ident: Any, req: wire.Request | wire.DecodeError, received: float, bundled: bool
    ) -> None:
        self.counters["requests"] += 1
        if type(req) is wire.DecodeError:
            if req.request_id is None:
                self.counters["undecodable"] += 1
                self._dropped_log.warning("dropped an undecodable message: %s", req.message)
                return
            self._reply_error(ident, req.request_id, req.to_error(), bundled)
            return
        assert type(req) is wire.Request
        try:
            self._dispatch(ident, req, received, bundled)
        except wire.DecodeError as exc:  # the body did not fit its op's type
            self._reply_error(ident, req.id, exc.to_error(), bundled)
        except Exception as exc:  # never let one request take the worker down
            if not isinstance(exc, GraphlaneError):
                log.exception("request %s (%s) failed", req.id, req.op)
            self._reply_error(ident, req.id, as_error(exc), bundled)


_HOLD_S = 0.0005  # the longest a reply waits in the outbox for the others of its bundle


def _nbytes(frame: Any) -> int:
    return len(frame) if type(frame) is bytes else memoryview(frame).nbytes
