"""The client library that scheduler processes use.

```python
async with graphlane.Client("tcp://127.0.0.1:7450") as c:
    r = await c.step("attention", device=0,
                     params={"actual_seq_lengths_kv": [100, 7]},
                     inputs={"query": q}, outputs=["out"], timeout=5.0)
    r.outputs["out"]          # torch.Tensor
    await c.status()
```

The client asks the daemon (``hello``) where each device's worker listens and
sends steps straight to that worker: one DEALER socket per endpoint, many
calls in flight on each, replies matched by request id by the event loop's
reader callback for that socket.
Sockets belong to the event loop that created the client (its thread is their
only user); a send is a single ``send_multipart``, so frames of concurrent
calls never interleave.

A call made while others are in flight on the same worker, and whose request
is one frame (no tensor large enough for a frame of its own), is not sent at
once: it waits for the end of the event loop's current turn and goes with the
other calls made in that turn as one bundle (at most 32 requests, a full
bundle going at once, and ``codec.BUNDLE_BYTES``, 64 KiB: a larger request
goes alone), when the daemon says its workers take bundles. A call alone on its
connection is sent at once. Bundling saves a message per call on both sides
and changes nothing else: each call keeps its own id, deadline and reply.

Failures arrive as :class:`graphlane.GraphlaneError` subclasses whose ``code``
is the wire code. A worker that dies fails every call in flight on it with
WORKER_LOST at once (a socket monitor sees the connection drop); calls to a
device whose worker is restarting fail fast with WORKER_LOST (retryable)
until it is back. Every call has a deadline (TIMEOUT). Cancelling a call loses
nothing: a reply that arrives afterwards is dropped and the connection stays
usable.

:class:`SyncClient` is the same client driven from a private event loop thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import itertools
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from graphlane.protocol import codec
from graphlane.protocol.endpoints import check_endpoint
from graphlane.protocol.errors import (
    GraphlaneError,
    InternalError,
    Timeout,
    Unauthorized,
    UnknownDevice,
    WorkerLost,
)
from graphlane.protocol.security import ClientKeys

from .client_args import BatchParams, check_device, check_timeout, sendable

log = logging.getLogger("graphlane.client")
T = TypeVar("T")


@dataclass(frozen=True)
class StepReply:
    outputs: dict[str, torch.Tensor]
    bucket: int
    slot: int
    patched: int
    device: int
    server_us: float = 0.0  # time the worker held the request, device work included
    host: str = ""  # the daemon's endpoint


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
    ) -> None:
        self.endpoint = endpoint
        self.name = name
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
        self.pending: dict[int, asyncio.Future[codec.Reply]] = {}
        self.lost = False  # connected once, then dropped: the peer went away
        self.late_replies = 0
        # Requests of this turn of the loop waiting to go as one bundle (see call).
        self.bundle_max = bundle_max
        self._queued: list[tuple[int, bytes]] = []
        self._retries: set[asyncio.Task[None]] = set()
        self._deadlines = _Deadlines(self._loop, name)
        self._fds = [self.sock.FD, self.monitor.FD]
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
                zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
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
                if not cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    return False
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.ZMQError:  # closed under us
                return False
            self._deliver(frames)
            n += 1
        return True

    def _deliver(self, frames: list[Any]) -> None:
        try:
            replies = codec.decode_replies(frames)
        except codec.DecodeError as exc:
            replies = [exc]
        pending = self.pending
        for reply in replies:
            if type(reply) is codec.DecodeError:
                fut = pending.pop(reply.request_id, None) if reply.request_id is not None else None
                if fut is not None and not fut.done():
                    fut.set_exception(InternalError(f"undecodable reply: {reply.message}"))
                else:
                    log.warning(
                        "dropped an undecodable reply from %s: %s", self.endpoint, reply.message
                    )
                continue
            assert type(reply) is codec.Reply
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

    async def call(
        self, request_id: int, op: str, body: Mapping[str, Any], timeout: float
    ) -> dict[str, Any]:
        """One request; its reply's body, or its error raised."""
        if self.closed:
            raise WorkerLost(f"connection to {self.name} is closed")
        if self.refused is not None:
            raise Unauthorized(self.refused)
        if self.lost:
            raise WorkerLost(f"{self.name} at {self.endpoint} is not reachable (restarting?)")
        try:
            frames = codec.encode_request(request_id, op, body)
        except ValueError as exc:  # numpy values, as schedulers have them: made plain
            frames = codec.encode_request(request_id, op, sendable(body, exc))
        loop = self._loop
        fut: asyncio.Future[codec.Reply] = loop.create_future()
        self.pending[request_id] = fut
        # A deadline instead of wait_for(shield(...)): it fails the future.
        timer = self._deadlines.add(fut, timeout, op)
        try:
            if len(frames) == 1 and self.bundle_max > 1 and (self._queued or len(self.pending) > 1):
                # Other calls are in flight, so this one need not go at once: it goes
                # with the others made in this turn of the loop, as one bundle.
                self._queue(request_id, cast(bytes, frames[0]))  # envelopes are bytes
            else:
                if self._queued:
                    self._flush()  # sends keep the order of the calls
                try:
                    self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                except zmq.Again:  # every peer's queue is full: wait for room
                    await self._send_later(frames, [fut])
                except zmq.ZMQError as exc:  # closed under us
                    raise WorkerLost(f"connection to {self.name} is closed") from exc
                self._check_readable()
            reply = await fut
        finally:
            # A cancelled or timed-out call forgets its id; a late reply is dropped.
            if timer is not None:
                timer.cancel()
            self.pending.pop(request_id, None)
        if reply.error is not None:
            raise reply.error
        return reply.body

    def _check_readable(self) -> None:
        if cast(int, self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            self._loop.call_soon(self._readable)  # a send took the edge of a waiting reply

    def _queue(self, request_id: int, envelope: bytes) -> None:
        self._queued.append((request_id, envelope))
        if len(self._queued) >= self.bundle_max:
            self._flush()
        elif len(self._queued) == 1:
            self._loop.call_soon(self._flush)  # after the callbacks of this turn

    def _flush(self) -> None:
        """Send the queued requests: alone, or as bundles of bounded size."""
        queued, self._queued = self._queued, []
        if not queued or self.closed:  # closing failed their calls already
            return
        start, sent = 0, False
        for count, payload in codec.bundles([envelope for _, envelope in queued]):
            ids = [i for i, _ in queued[start : start + count]]
            start += count
            futs = [fut for i in ids if (fut := self.pending.get(i)) is not None]
            try:
                self.sock.send(payload, zmq.NOBLOCK)
                sent = True
            except zmq.Again:  # every peer's queue is full: retry in the background
                task = self._loop.create_task(self._send_bundle_later(payload, futs))
                self._retries.add(task)
                task.add_done_callback(self._retries.discard)
            except zmq.ZMQError:  # closed under us
                _fail(futs, WorkerLost(f"connection to {self.name} is closed"))
                return
        if sent:
            self._check_readable()

    async def _send_bundle_later(
        self, payload: bytes, futs: list[asyncio.Future[codec.Reply]]
    ) -> None:
        try:
            await self._send_later([payload], futs)
        except WorkerLost as exc:
            _fail(futs, exc)
        else:
            self._check_readable()

    async def _send_later(
        self, frames: list[Any], futs: list[asyncio.Future[codec.Reply]]
    ) -> None:
        """Retry a send the high-water mark refused until it goes, its calls end
        (deadline, WORKER_LOST) or the channel closes."""
        delay = 0.0005
        while not all(fut.done() for fut in futs):
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.02)
            if self.closed:
                raise WorkerLost(f"connection to {self.name} is closed")
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                continue

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
        for task in list(self._retries):
            task.cancel()
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
# Requests per bundle: a full one goes at once, overlapping the worker. The worker
# answers a bundle's requests together, so the first waits for the last; 32 kept
# two bundles of a 64-call window in flight and gave the most steps/s on null
# (16: ~10% fewer; 64: no overlap, half).
_BUNDLE_MAX = 32


def _fail(futs: list[asyncio.Future[codec.Reply]], exc: BaseException) -> None:
    for fut in futs:
        if not fut.done():
            fut.set_exception(exc)


def _expire(fut: asyncio.Future[Any], what: str, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(Timeout(f"{what} got no reply within {timeout:g} s"))


class _Deadlines:
    """The deadlines of one channel's calls, with one loop timer, armed for the earliest.

    A loop timer per call costs a handle, a heap push and the pop of the cancelled
    handle, several microseconds a call. Calls with the same timeout expire in the
    order they were made, so a queue per timeout value stays sorted for the cost of
    an append. An entry whose call ended stays in its queue until the timer passes
    it or ended entries crowd the queue (then it is compacted: bounded memory). A
    call with an unusual timeout (more than ``_TIMEOUT_QUEUES`` distinct values in
    use) gets a loop timer of its own, as before.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        self._loop = loop
        self._name = name
        # timeout -> [queue of (deadline, future, op), length that triggers compaction]
        self._queues: dict[float, list[Any]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    def add(
        self, fut: asyncio.Future[Any], timeout: float, op: str
    ) -> asyncio.TimerHandle | None:
        """Fail ``fut`` with TIMEOUT after ``timeout`` s unless it is done by then; a
        loop timer to cancel when the call ends, or None when nothing needs doing."""
        entry = self._queues.get(timeout)
        if entry is None:
            if len(self._queues) >= _TIMEOUT_QUEUES:
                what = f"{op} to {self._name}"
                return self._loop.call_later(timeout, _expire, fut, what, timeout)
            entry = self._queues[timeout] = [collections.deque(), _COMPACT_AT]
        when = self._loop.time() + timeout
        queue: collections.deque[tuple[float, asyncio.Future[Any], str]] = entry[0]
        queue.append((when, fut, op))
        if len(queue) >= entry[1]:  # mostly ended calls: keep the live ones
            entry[0] = queue = collections.deque(e for e in queue if not e[1].done())
            entry[1] = max(_COMPACT_AT, 2 * len(queue))
        if when < self._timer_at:
            self._arm(when)
        return None

    def close(self) -> None:
        """Forget every deadline (the channel failed its calls already)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, float("inf")
        self._queues.clear()

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._expire)
        self._timer_at = when

    def _expire(self) -> None:
        """Fail the calls whose deadline passed; drop ended calls from the queues'
        fronts (so that the next wake-up is for a live call); re-arm."""
        self._timer, self._timer_at = None, float("inf")
        now = self._loop.time() + _CLOCK_RESOLUTION  # the loop runs a timer that early
        earliest = float("inf")
        for timeout, entry in list(self._queues.items()):
            queue = entry[0]
            while queue:
                when, fut, op = queue[0]
                if not fut.done():
                    if when > now:
                        earliest = min(earliest, when)
                        break
                    _expire(fut, f"{op} to {self._name}", timeout)
                queue.popleft()
            if not queue:
                del self._queues[timeout]
        if earliest < float("inf"):
            self._arm(earliest)


_TIMEOUT_QUEUES = 8  # distinct timeout values with a queue of their own, per channel
_COMPACT_AT = 1024  # the least queue length at which ended calls are dropped
_CLOCK_RESOLUTION = time.get_clock_info("monotonic").resolution


Device = int | tuple[int | str, int]


class _Host:
    """One daemon: its control channel and its workers' channels."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.daemon: Channel | None = None
        self.workers: dict[int, Channel] = {}
        self.hello: dict[str, Any] = {}
        self.lock = asyncio.Lock()
        self.batch_params = BatchParams()


class Client:
    """Async client of one or several graphlane daemons (see the module docstring).

    ``endpoints`` is one endpoint, a list (one daemon per host), or a tcp endpoint
    whose DNS name resolves to several addresses (e.g. a Kubernetes headless
    Service): each address is a host. With one host, devices are plain ints; with
    several, a device is ``(host, device)`` where host is the host's index or
    endpoint.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout: float = 10.0,
        name: str = "graphlane-client",
        server_key: str | bytes | None = None,
        client_key: str | bytes | None = None,
    ) -> None:
        """``server_key`` (the server's NAME.key, or its Z85 public key) and ``client_key``
        (this client's NAME.key_secret) turn on CurveZMQ; both or neither."""
        if (server_key is None) != (client_key is None):
            raise ValueError("server_key and client_key go together (CurveZMQ needs both)")
        self.keys = (
            ClientKeys.load(server_key, client_key)
            if server_key is not None and client_key is not None
            else None
        )
        self.requested = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if not self.requested:
            raise ValueError("Client needs at least one endpoint")
        for ep in self.requested:
            check_endpoint(ep)  # before any socket exists: a typo is one line, at once
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.endpoint = self.requested[0]
        self.timeout = timeout
        self.name = name
        self._sockets = Sockets()
        # Closes whatever is still open when the client is collected unclosed, or at
        # interpreter exit; it holds the sockets, never the client.
        self._finalizer = weakref.finalize(self, self._sockets.close_all)
        self._hosts: list[_Host] = []
        self._ids = itertools.count(1)
        self._closing = False

    # ------------------------------------------------------------ lifecycle
    async def connect(self) -> dict[str, Any]:
        """Open the daemons' channels and say hello. On any failure or cancellation
        everything opened is closed again, and connect may be called once more."""
        self._closing = False
        try:
            if not self._hosts:
                endpoints: list[str] = []
                for ep in self.requested:
                    for resolved in await _expand(ep):
                        if resolved not in endpoints:
                            endpoints.append(resolved)
                for ep in endpoints:
                    host = _Host(ep)
                    self._hosts.append(host)
                    host.daemon = Channel(self._sockets, ep, f"daemon at {ep}", self.keys)
            return await self.hello()
        except BaseException:
            self._close_now()
            raise

    async def close(self) -> None:
        """Fail calls in flight with WORKER_LOST and close every socket; idempotent,
        never blocks."""
        self._close_now()

    def _close_now(self) -> None:
        self._closing = True
        for host in self._hosts:
            for ch in [*host.workers.values(), *([host.daemon] if host.daemon else [])]:
                ch.close_now()
        self._hosts = []
        self._sockets.close_all()

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._close_now()

    @property
    def hosts(self) -> list[str]:
        return [h.endpoint for h in self._hosts]

    @property
    def _workers(self) -> dict[int, Channel]:
        """The first host's worker channels (single-host clients and tests)."""
        return self._hosts[0].workers if self._hosts else {}

    # ------------------------------------------------------------ plumbing
    def _call(
        self, ch: Channel, op: str, body: Mapping[str, Any], timeout: float | None
    ) -> Coroutine[Any, Any, dict[str, Any]]:
        """The call's coroutine (the reply's body; its error raised)."""
        if timeout is not None:
            check_timeout(timeout)  # 0 or negative: refused here, not a retryable TIMEOUT
        return ch.call(next(self._ids), op, body, self.timeout if timeout is None else timeout)

    def _channel(self, host: _Host | None = None) -> Channel:
        if self._closing:
            raise WorkerLost("the client was closed")
        if not self._hosts:
            raise RuntimeError(
                "the client is not connected: use 'async with Client(...)' or connect()"
            )
        ch = (host or self._hosts[0]).daemon
        assert ch is not None
        return ch

    def _resolve(self, device: Device) -> tuple[_Host, int]:
        if type(device) is not int:
            check_device(device)  # "0" is a type error, not a device that is not served
            if not isinstance(device, tuple):
                device = int(device)  # a numpy integer
        if self._closing or not self._hosts:
            self._channel()  # raises: not connected
        if isinstance(device, tuple):
            which, local = device
            if isinstance(which, int) and 0 <= which < len(self._hosts):
                return self._hosts[which], local
            for h in self._hosts:
                if h.endpoint == which:
                    return h, local
            raise UnknownDevice(f"host {which!r} is not one of {self.hosts}")
        if len(self._hosts) > 1:
            raise UnknownDevice(
                f"this client has {len(self._hosts)} hosts: address devices as (host, device)"
            )
        return self._hosts[0], device

    async def _worker(self, device: Device) -> Channel:
        return await self._worker_at(*self._resolve(device))

    async def _worker_at(self, host: _Host, local: int) -> Channel:
        ch = host.workers.get(local)
        if ch is not None and not ch.lost:
            return ch
        async with host.lock:  # one hello for many callers after a restart
            ch = host.workers.get(local)
            if ch is not None and not ch.lost:
                return ch
            hello = await self._hello_on(host)
            entry = next((w for w in hello.get("workers", []) if w.get("device") == local), None)
            if entry is None:
                served = [w.get("device") for w in hello.get("workers", [])]
                raise UnknownDevice(
                    f"device {local} is not served at {host.endpoint} (serving {served})"
                )
            if entry.get("state") != "ready" or not entry.get("endpoint"):
                raise WorkerLost(
                    f"device {local} at {host.endpoint} is {entry.get('state')}, not ready",
                    retryable=True,
                )
            if self._closing:
                raise WorkerLost("the client is closing")
            if ch is not None:
                if ch.endpoint == entry["endpoint"]:
                    ch.lost = False  # same endpoint: the socket reconnects by itself
                    return ch
                ch.close_now()
            # Workers that take bundles get this turn's requests as one message.
            takes_bundles = bool(hello.get("capabilities", {}).get("bundles"))
            ch = host.workers[local] = Channel(
                self._sockets,
                entry["endpoint"],
                f"device {local} at {host.endpoint}",
                self.keys,
                bundle_max=_BUNDLE_MAX if takes_bundles else 1,
            )
            return ch

    async def _hello_on(self, host: _Host, timeout: float | None = None) -> dict[str, Any]:
        host.hello = await self._call(self._channel(host), "hello", {"client": self.name}, timeout)
        return host.hello

    async def _each(self, op: str, body: Mapping[str, Any], timeout: float | None) -> Any:
        """``op`` on every host: the reply, or {"hosts": [...]} with several hosts."""
        replies = await asyncio.gather(
            *(self._call(self._channel(h), op, body, timeout) for h in self._hosts)
        )
        if len(replies) == 1:
            return replies[0]
        hosts = [{"host": h.endpoint, **r} for h, r in zip(self._hosts, replies, strict=True)]
        return {"hosts": hosts, "ready": all(r.get("ready", True) for r in replies)}

    # ------------------------------------------------------------ operations
    async def hello(self, timeout: float | None = None) -> dict[str, Any]:
        if len(self._hosts) <= 1:
            return await self._hello_on(self._hosts[0] if self._hosts else _no_host(), timeout)
        replies = await asyncio.gather(*(self._hello_on(h, timeout) for h in self._hosts))
        return {
            "hosts": [{"host": h.endpoint, **r} for h, r in zip(self._hosts, replies, strict=True)]
        }

    async def status(self, timeout: float | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self._each("status", {}, timeout)
        return result

    async def drain(
        self, device: Device | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        if device is None:
            result: dict[str, Any] = await self._each("drain", {}, timeout)
            return result
        host, local = self._resolve(device)
        return await self._call(self._channel(host), "drain", {"device": local}, timeout)

    async def shutdown(self, timeout: float | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self._each("shutdown", {}, timeout)
        return result

    async def worker_status(self, device: Device, timeout: float | None = None) -> dict[str, Any]:
        return await self._call(await self._worker(device), "status", {}, timeout)

    async def step(
        self,
        program: str,
        device: Device,
        params: Mapping[str, Any],
        inputs: Mapping[str, torch.Tensor] | None = None,
        outputs: Sequence[str] = ("out",),
        *,
        batch: int | None = None,
        timeout: float | None = None,
    ) -> StepReply:
        """Patch and replay ``program`` on ``device``; returns the requested outputs.

        ``batch`` defaults to the length of the program's batch parameter (``hello``
        names it: ``actual_seq_lengths_kv`` for attention); a program without one
        needs ``batch=``. numpy arrays and scalars are accepted in ``params`` and
        ``inputs``."""
        host, local = self._resolve(device)
        if timeout is not None:
            check_timeout(timeout)
        ch = host.workers.get(local)
        if ch is None or ch.lost:
            ch = await self._worker_at(host, local)
        if batch is None:
            batch = host.batch_params.infer(host.hello, local, program, params)
        body = _step_body(program, local, params, inputs, batch)
        body["outputs"] = list(outputs)
        return _reply(host.endpoint, local, await self._call(ch, "step", body, timeout))

    async def update(
        self,
        program: str,
        device: Device,
        params: Mapping[str, Any],
        inputs: Mapping[str, torch.Tensor] | None = None,
        *,
        batch: int | None = None,
        timeout: float | None = None,
    ) -> StepReply:
        """Patch the next replay of the bucket (no replay); ``batch`` as in :meth:`step`."""
        host, local = self._resolve(device)
        if timeout is not None:
            check_timeout(timeout)
        ch = await self._worker_at(host, local)
        if batch is None:
            batch = host.batch_params.infer(host.hello, local, program, params)
        body = _step_body(program, local, params, inputs, batch)
        return _reply(host.endpoint, local, await self._call(ch, "update", body, timeout))

    async def replay(
        self,
        program: str,
        device: Device,
        batch: int,
        outputs: Sequence[str] = ("out",),
        *,
        timeout: float | None = None,
    ) -> StepReply:
        """Replay the bucket's updated (or next) graph instance."""
        host, local = self._resolve(device)
        body = {"program": program, "device": local, "batch": batch, "outputs": list(outputs)}
        ch = await self._worker_at(host, local)
        return _reply(host.endpoint, local, await self._call(ch, "replay", body, timeout))

    async def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until every worker is ready (polling status); TIMEOUT at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            with contextlib.suppress(Timeout):
                st = await self.status(timeout=max(0.1, min(2.0, left)))
                if st.get("ready"):
                    return st
            if time.monotonic() >= deadline:
                raise Timeout(f"workers not ready within {timeout:g} s")
            await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def _no_host() -> _Host:
    raise RuntimeError("the client is not connected: use 'async with Client(...)' or connect()")


async def _expand(endpoint: str) -> list[str]:
    """A tcp endpoint whose name resolves to several addresses: one endpoint each."""
    if not endpoint.startswith("tcp://"):
        return [endpoint]
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    try:
        ipaddress.ip_address(host.strip("[]"))
        return [endpoint]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return [endpoint]  # let the socket report the problem
    addresses = sorted({str(info[4][0]) for info in infos})
    # A name for one machine (localhost: 127.0.0.1 and ::1) is one host, not several.
    if len(addresses) <= 1 or any(ipaddress.ip_address(a).is_loopback for a in addresses):
        return [endpoint]
    return [f"tcp://[{a}]:{port}" if ":" in a else f"tcp://{a}:{port}" for a in addresses]


def _step_body(
    program: str,
    device: int,
    params: Mapping[str, Any],
    inputs: Mapping[str, torch.Tensor] | None,
    batch: int | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"program": program, "device": device, "params": dict(params)}
    if inputs:
        body["inputs"] = dict(inputs)
    if batch is not None:
        body["batch"] = batch
    return body


def _reply(host: str, device: int, body: Mapping[str, Any]) -> StepReply:
    reply = object.__new__(StepReply)  # the frozen class's fields, set once (as its __init__)
    reply.__dict__.update(
        outputs=dict(body.get("outputs", {})),
        bucket=int(body.get("bucket", 0)),
        slot=int(body.get("slot", 0)),
        patched=int(body.get("patched", 0)),
        device=device,
        server_us=float(body.get("server_us", 0.0)),
        host=host,
    )
    return reply


class SyncClient:
    """The async :class:`Client`, driven from a private event-loop thread.

    Every public coroutine of Client is available here as a blocking method
    (the methods are generated from Client's, not written twice).
    """

    def __init__(self, endpoint: str | Sequence[str], **kwargs: Any) -> None:
        self._client = Client(endpoint, **kwargs)  # checks its arguments: no thread yet
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="graphlane-sync-client", daemon=True
        )
        self._thread.start()
        # Stops the loop thread and closes the sockets when the SyncClient is closed,
        # collected unclosed, or alive at interpreter exit.
        self._finalizer = weakref.finalize(
            self, _stop_loop, self._loop, self._thread, self._client
        )
        try:
            self._run(self._client.connect())
        except BaseException:
            self.close()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self._finalizer.alive:
            coro.close()
            raise WorkerLost("the client was closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("a SyncClient cannot be called from its own event-loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Close the connection and stop the loop thread; idempotent, from any thread."""
        self._finalizer()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _stop_loop(
    loop: asyncio.AbstractEventLoop, thread: threading.Thread, client: Client
) -> None:
    """Close ``client`` on its loop, stop the loop and join its thread (bounded)."""
    if loop.is_closed():
        return
    own = threading.current_thread() is thread
    if thread.is_alive():
        done = threading.Event()

        def stop() -> None:
            try:
                client._close_now()
            finally:
                loop.stop()
                done.set()

        try:
            loop.call_soon_threadsafe(stop)
        except RuntimeError:  # closed meanwhile
            return
        if own:
            return  # the loop stops after this callback; nobody is left to join it
        done.wait(_STOP_WAIT_S)
        thread.join(_STOP_WAIT_S)
    if not thread.is_alive():
        loop.close()
    else:
        log.warning("the SyncClient's loop thread did not stop; leaving it (daemon thread)")


_STOP_WAIT_S = 5.0


def _sync_method(name: str) -> Any:
    async_method = getattr(Client, name)

    def method(self: SyncClient, *args: Any, **kwargs: Any) -> Any:
        return self._run(getattr(self._client, name)(*args, **kwargs))

    method.__name__ = name
    method.__doc__ = async_method.__doc__
    return method


for _name in (
    "hello",
    "status",
    "drain",
    "shutdown",
    "worker_status",
    "step",
    "update",
    "replay",
    "wait_ready",
):
    setattr(SyncClient, _name, _sync_method(_name))
