"""The client's transport: one DEALER connection to a daemon or a worker (:class:`Channel`).

One socket per endpoint, many calls in flight on each, replies matched by request
id by the event loop's reader callback for that socket. Sockets belong to the
event loop that created them (its thread is their only user); a send is one
message sent without a pause (``wire.send_message``), so frames of concurrent calls
never interleave. Every call has
a deadline (:class:`~.deadlines.Deadlines`, one loop timer per channel).

A call made while others are in flight on the same worker, and whose request
is one frame (no tensor large enough for a frame of its own), is not sent at
once: it waits for the end of the event loop's current turn and goes with the
other calls made in that turn as one bundle (at most ``wire.BUNDLE_MAX``, 32
requests, a full bundle going at once, and ``wire.BUNDLE_BYTES``, 64 KiB: a larger
request goes alone), when the daemon says its workers take bundles. A call alone on its
connection is sent at once. Bundling saves a message per call on both sides
and changes nothing else: each call keeps its own id, deadline and reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from typing import Any

import zmq
from zmq.backend import zmq_poll
from zmq.utils.monitor import parse_monitor_message

from graphlane.logs import Throttled
from graphlane.protocol import admission, wire
from graphlane.protocol.errors import (
    GraphlaneError,
    InternalError,
    Unauthorized,
    WorkerLost,
)
from graphlane.protocol.ops import Op
from graphlane.protocol.security import ClientKeys

from .deadlines import Deadlines

log = logging.getLogger("graphlane.client")


class Channel:
    """One DEALER connection: its pending calls, fed by the event loop's reader callbacks.

    The sockets are plain (not ``zmq.asyncio``) sockets whose file descriptors the
    loop watches: a reply costs one ``recv`` and a ``set_result``, and a call one
    non-blocking ``send``. A zmq descriptor signals edges, not levels, so every
    wake-up drains the socket until it is empty, and a send (which may swallow
    the edge of a reply that arrived meanwhile) looks whether a reply waits.
    """

    def __init__(
        self,
        sockets: Sockets,
        endpoint: str,
        name: str,
        keys: ClientKeys | None = None,
        bundle_max: int = 1,
        limits: admission.Limits = admission.DEFAULT_LIMITS,
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        # What the peer takes: a message over it fails its call with TOO_LARGE, unsent
        # (sent, a frame over the peer's cut would lose the connection: see
        # protocol/admission.py).
        self.limits = limits
        self._dropped_log = Throttled(log)
        self._loop = asyncio.get_running_loop()
        self._sockets = sockets
        self.closed = False
        self.sock = sockets.open(zmq.DEALER)
        try:
            self.monitor = self._setup(endpoint, keys)
        except BaseException:
            # A socket left open here would outlive the channel: close it on every path.
            self.closed = True
            sockets.close(self.sock)
            raise
        self.refused: str | None = None  # why the server refused our handshake
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.lost = False  # connected once, then dropped: the peer went away
        self.late_replies = 0
        # Requests of this turn of the loop waiting to go as one bundle (see call).
        self.bundle_max = bundle_max
        self._queued: list[tuple[int, bytes]] = []
        # Messages the high-water mark refused, in the order of their calls, and the task
        # that sends them: while it holds any, a new message goes behind them (a later
        # call never overtakes an earlier one).
        self._backlog: list[tuple[list[Any], list[asyncio.Future[wire.Reply]]]] = []
        self._backlog_task: asyncio.Task[None] | None = None
        self._deadlines = Deadlines(self._loop, name)
        self._fds = [self.sock.FD, self.monitor.FD]
        # Is a reply waiting: zmq_poll, one C call (getsockopt(EVENTS) costs an enum call).
        self._poll_in: list[Any] = [(self.sock, wire.POLLIN)]
        sockets.watch(self._loop, self._fds[0], self._readable)
        sockets.watch(self._loop, self._fds[1], self._watch)
        # Whatever arrived before the loop watched the descriptors raised no edge.
        self._loop.call_soon(self._readable)
        self._loop.call_soon(self._watch)

    def _setup(self, endpoint: str, keys: ClientKeys | None) -> zmq.Socket[bytes]:
        """Options, monitor and connect of the new socket; the monitor socket."""
        if keys is not None:
            keys.apply(self.sock)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 50)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        monitor = self._sockets.adopt(
            self.sock.get_monitor_socket(
                zmq.EVENT_CONNECTED
                | zmq.EVENT_DISCONNECTED
                | zmq.EVENT_HANDSHAKE_SUCCEEDED
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            )
        )
        try:
            self.sock.connect(endpoint)
        except BaseException:
            self._sockets.close(monitor)
            raise
        return monitor

    def _readable(self) -> None:
        if not self.closed and self._drain(_DRAIN_PER_TURN):
            self._loop.call_soon(self._readable)  # more: after other callbacks had a turn

    def _drain(self, limit: int | None) -> bool:
        """Deliver received replies, at most ``limit``; True if more may wait."""
        n = 0
        sock = self.sock
        while limit is None or n < limit:
            try:
                # Asking first is cheaper than the exception of an empty receive.
                if not zmq_poll(self._poll_in, 0):
                    return False
                frame = sock.recv(wire.NOBLOCK, copy=False)
                # A reply is mostly its envelope alone (wire.recv_message reads the rest).
                frames = [frame.bytes] if not frame.more else wire.recv_rest(sock, frame, 1)
            except zmq.ZMQError:  # closed under us
                return False
            try:
                self._deliver(frames)
            except Exception as exc:  # no reply may stop the reader (the rest would wait)
                self._dropped_log.warning(
                    "a reply from %s failed: %s: %s",
                    self.endpoint,
                    type(exc).__name__,
                    exc,
                    exc_info=exc,
                )
            n += 1
        return True

    def _deliver(self, frames: list[Any]) -> None:
        try:
            replies = wire.decode_replies(frames)
        except wire.DecodeError as exc:
            replies = [exc]
        pending = self.pending
        for reply in replies:
            if type(reply) is wire.DecodeError:
                fut = pending.pop(reply.request_id, None) if reply.request_id is not None else None
                if fut is not None and not fut.done():
                    fut.set_exception(InternalError(f"undecodable reply: {reply.message}"))
                else:
                    self._dropped_log.warning(
                        "dropped an undecodable reply from %s: %s", self.endpoint, reply.message
                    )
                continue
            assert type(reply) is wire.Reply
            fut = pending.pop(reply.id, None)
            if fut is None or fut.done():
                self.late_replies += 1  # its call was cancelled or timed out
                continue
            fut.set_result(reply)

    def _watch(self) -> None:
        while not self.closed:
            try:
                msg = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.ZMQError:
                return
            event = msg["event"]
            if event in (
                zmq.EVENT_HANDSHAKE_FAILED_AUTH,
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
            ):
                self.refused = f"{self.endpoint} refused the security handshake (key not admitted?)"
                self.fail_all(Unauthorized(self.refused))
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.refused = None
            elif event == zmq.EVENT_CONNECTED:
                self.lost = False
            elif event == zmq.EVENT_DISCONNECTED:
                self.lost = True
                # A worker's last answers come before its socket closes: they are
                # answers, not WORKER_LOST.
                self._drain(None)
                self.fail_all(WorkerLost(f"connection to {self.name} at {self.endpoint} was lost"))

    def fail_all(self, error: GraphlaneError) -> None:
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error)

    async def call(self, request_id: int, op: Op, body: Any, timeout: float) -> Any:
        """One request (``body`` a Struct of ``op``); its reply's body, typed, or its
        error raised."""
        return await self.send(request_id, op, body, timeout)

    def send(
        self, request_id: int, op: Op, body: Any, timeout: float, fut: Call | None = None
    ) -> Call:
        """Send one request (``body`` a Struct of ``op``) in order with every call made
        before it, with no coroutine: a future of its reply's body, typed, or of its
        error. ``fut``: a :class:`Call` of the caller's (a subclass that shapes the reply
        or hears of the failure), not yet bound to a channel."""
        if fut is None:
            fut = Call(loop=self._loop)
        fut.channel, fut.request_id, fut.op, fut.timer = self, request_id, op, None
        if self.closed:
            fut.set_exception(WorkerLost(f"connection to {self.name} is closed"))
            return fut
        if self.refused is not None:
            fut.set_exception(Unauthorized(self.refused))
            return fut
        if self.lost:
            fut.set_exception(
                WorkerLost(f"{self.name} at {self.endpoint} is not reachable (restarting?)")
            )
            return fut
        frames = wire.encode_request(request_id, op.name, body)
        one = len(frames) == 1
        if not one or len(frames[0]) > self.limits.max_envelope_bytes:
            try:
                admission.check_outgoing(frames, self.limits)
            except GraphlaneError as exc:
                fut.set_exception(exc)
                return fut
        pending = self.pending
        pending[request_id] = fut
        # A deadline instead of wait_for(shield(...)): it fails the future.
        fut.timer = self._deadlines.add(fut, timeout, op.name)
        if one and self.bundle_max > 1 and (self._queued or len(pending) > 1):
            # Other calls are in flight, so this one need not go at once: it goes
            # with the others made in this turn of the loop, as one bundle.
            queued = self._queued
            queued.append((request_id, frames[0]))  # type: ignore[arg-type]  # (bytes)
            if len(queued) >= self.bundle_max:
                self._flush()
            elif len(queued) == 1:
                self._loop.call_soon(self._flush)  # after the callbacks of this turn
        else:
            if self._queued:
                self._flush()  # sends keep the order of the calls
            if not self._send(frames, [fut]):
                fut.set_exception(WorkerLost(f"connection to {self.name} is closed"))
        return fut

    def post(self, request_id: int, op: Op, body: Any, timeout: float) -> None:
        """Send one request now, after every call made before it (queued ones go first),
        and forget its reply: for a request whose answer changes nothing here (``resume``,
        which must reach the server before any call made after this returns)."""
        if self.closed or self.lost or self.refused is not None:
            return
        frames = wire.encode_request(request_id, op.name, body)
        fut: asyncio.Future[wire.Reply] = self._loop.create_future()
        self.pending[request_id] = fut
        timer = self._deadlines.add(fut, timeout, op.name)

        def ended(f: asyncio.Future[wire.Reply]) -> None:
            if timer is not None:
                timer.cancel()
            self.pending.pop(request_id, None)
            if not f.cancelled():
                f.exception()  # retrieved: an error here is nobody's to raise

        fut.add_done_callback(ended)
        if self._queued:
            self._flush()  # sends keep the order of the calls
        if not self._send(frames, [fut]):
            fut.cancel()

    def _send(self, frames: list[Any], futs: list[asyncio.Future[wire.Reply]]) -> bool:
        """Send one message now, or behind the backlog (in order) when the high-water
        mark refuses it or refused one before it; False when the socket is closed."""
        if not self._backlog:
            try:
                wire.send_message(self.sock, frames, wire.NOBLOCK)
            except zmq.Again:  # every peer's queue is full: wait for room, in order
                pass
            except zmq.ZMQError:  # closed under us
                return False
            else:
                self._check_readable()
                return True
        self._backlog.append((frames, futs))
        if self._backlog_task is None:
            self._backlog_task = self._loop.create_task(self._send_backlog())
        return True

    def _check_readable(self) -> None:
        if zmq_poll(self._poll_in, 0):
            self._loop.call_soon(self._readable)  # a send took the edge of a waiting reply

    def _flush(self) -> None:
        """Send the queued requests: alone, or as bundles of bounded size."""
        queued, self._queued = self._queued, []
        if not queued or self.closed:  # closing failed their calls already
            return
        if len(queued) == 1:  # alone in its turn (a scheduler decoding ahead): as itself
            request_id, envelope = queued[0]
            fut = self.pending.get(request_id)
            futs = [fut] if fut is not None else []
            if not self._send([envelope], futs):
                _fail(futs, WorkerLost(f"connection to {self.name} is closed"))
            return
        start = 0
        for count, payload in wire.bundles([envelope for _, envelope in queued]):
            ids = [i for i, _ in queued[start : start + count]]
            start += count
            futs = [fut for i in ids if (fut := self.pending.get(i)) is not None]
            if not self._send([payload], futs):
                _fail(futs, WorkerLost(f"connection to {self.name} is closed"))
                return

    async def _send_backlog(self) -> None:
        """Send the backlog in order as the high-water mark makes room; a message whose
        calls all ended meanwhile (deadline, WORKER_LOST) is dropped; closing fails the
        calls of the rest."""
        delay = 0.0005
        try:
            while self._backlog and not self.closed:
                frames, futs = self._backlog[0]
                if futs and all(fut.done() for fut in futs):
                    self._backlog.pop(0)
                    continue
                try:
                    wire.send_message(self.sock, frames, wire.NOBLOCK)
                except zmq.Again:
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, 0.02)
                    continue
                except zmq.ZMQError:  # closed under us
                    break
                self._backlog.pop(0)
                delay = 0.0005
                self._check_readable()
        finally:
            self._backlog_task = None
            backlog, self._backlog = self._backlog, []
            for _, futs in backlog:
                _fail(futs, WorkerLost(f"connection to {self.name} is closed"))

    async def close(self) -> None:
        self.close_now()

    def close_now(self) -> None:
        """Fail the pending calls and close both sockets (linger 0); idempotent."""
        if self.closed:
            return
        self.closed = True
        self._queued = []
        self.fail_all(WorkerLost(f"connection to {self.name} was closed"))
        self._deadlines.close()
        if self._backlog_task is not None:
            self._backlog_task.cancel()
        for fd in self._fds:
            self._sockets.unwatch(self._loop, fd)
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self._sockets.close(self.monitor)
        self._sockets.close(self.sock)


def shared_context() -> zmq.Context[Any]:
    """The process's one client context: made once per process, never terminated.

    ``term()`` blocks until every socket of its context is closed, and a context
    collected by the garbage collector terms itself after the weak references to
    its sockets are already gone (a reference cycle), so it can wait forever for a
    socket nobody can reach. Clients therefore never terminate a context: they
    close each socket they made, with linger 0, and share this one. A forked
    child gets a context of its own.
    """
    global _CONTEXT, _CONTEXT_PID
    with _CONTEXT_LOCK:
        if _CONTEXT is None or os.getpid() != _CONTEXT_PID:
            _CONTEXT, _CONTEXT_PID = zmq.Context(), os.getpid()
        return _CONTEXT


_CONTEXT: zmq.Context[Any] | None = None
_CONTEXT_PID = 0
_CONTEXT_LOCK = threading.Lock()


class Sockets:
    """Every socket one client made and every descriptor its loop watches for it.

    A client closes all of them on every path (close, a failed or cancelled
    connect, the client being collected, interpreter exit through
    :func:`weakref.finalize`); a socket is recorded the moment it exists, so no
    failure between making and recording it can leave it open.
    """

    def __init__(self) -> None:
        self._open: set[zmq.Socket[bytes]] = set()
        self._watched: set[tuple[asyncio.AbstractEventLoop, int]] = set()

    def open(self, kind: int) -> zmq.Socket[bytes]:
        return self.adopt(shared_context().socket(kind))

    def adopt(self, sock: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
        self._open.add(sock)
        try:
            sock.setsockopt(zmq.LINGER, 0)
        except BaseException:
            self.close(sock)
            raise
        return sock

    def close(self, sock: zmq.Socket[bytes]) -> None:
        self._open.discard(sock)
        sock.close(linger=0)

    def watch(self, loop: asyncio.AbstractEventLoop, fd: int, callback: Any) -> None:
        loop.add_reader(fd, callback)
        self._watched.add((loop, fd))

    def unwatch(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        self._watched.discard((loop, fd))
        if not loop.is_closed():
            loop.remove_reader(fd)

    def close_all(self) -> None:
        """Stop watching and close every socket; never blocks (no context term)."""
        for loop, fd in list(self._watched):
            with contextlib.suppress(Exception):  # a loop of another thread, or closing
                self.unwatch(loop, fd)
        self._watched.clear()
        for sock in list(self._open):
            self.close(sock)

    def __len__(self) -> int:
        return len(self._open)


_DRAIN_PER_TURN = 256  # replies delivered per wake-up before other callbacks run


class Call(asyncio.Future[Any]):
    """A call's future (:meth:`Channel.send`): the channel's reader sets the raw reply,
    which becomes the reply's typed body (or what :meth:`value` makes of it) or its
    error here, with no task or coroutine between the socket and whoever awaits it.
    However it ends (reply, deadline, connection lost, cancelled), the channel forgets
    its id. Slots only, no other object per call: a call lives across turns of the
    loop, and each object that does is one the interpreter's collector may promote to
    its oldest generation, whose collections (tens of ms beside torch's objects) came
    twice as often with a dict and two partials per call (windowed steps/s halved)."""

    __slots__ = ("channel", "lists", "op", "request_id", "timer")
    op: Op
    request_id: int
    timer: asyncio.TimerHandle | None

    def __init__(self, *, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self.channel: Channel | None = None  # (not sent yet: Channel.send binds it)
        self.timer = None
        self.lists = False  # the reply's tensors as lists of their values (Reply.body)

    def value(self, body: Any) -> Any:
        """What the call's future gives for its reply's typed body."""
        return body

    def failing(self, exc: GraphlaneError) -> None:
        """Told of the call's error before anyone awaiting it sees it."""

    def answered(self) -> None:
        """The call succeeded: drop what only a failure needs. (A deadline's queue holds an
        ended call until its deadline passes or the queue is compacted.)"""

    def set_result(self, reply: wire.Reply) -> None:
        if self.timer is not None:
            self.timer.cancel()
        try:
            value = self.value(reply.body(self.op, self.lists))  # raises its error, if any
        except GraphlaneError as exc:
            self.set_exception(exc)
        except wire.DecodeError as exc:
            self.set_exception(InternalError(f"undecodable reply to {self.op.name}: {exc.message}"))
        except Exception as exc:  # never left pending: the caller would wait forever
            self.set_exception(InternalError(f"reply to {self.op.name}: {exc!r}"))
        else:
            super().set_result(value)
            self.answered()

    def set_exception(self, exc: BaseException) -> None:  # type: ignore[override]
        if self.done():
            return
        self._forget()
        if isinstance(exc, GraphlaneError):
            self.failing(exc)
        super().set_exception(exc)

    def cancel(self, msg: Any = None) -> bool:
        self._forget()
        return super().cancel(msg)

    def _forget(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.channel is not None:
            self.channel.pending.pop(self.request_id, None)


def _fail(futs: list[asyncio.Future[wire.Reply]], exc: BaseException) -> None:
    for fut in futs:
        if not fut.done():
            fut.set_exception(exc)
