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
calls in flight on each, replies matched by request id in one reader task.
Sockets belong to the event loop that created the client (its thread is their
only user); a send is a single ``send_multipart``, so frames of concurrent
calls never interleave.

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
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from graphlane.protocol import codec
from graphlane.protocol.errors import (
    GraphlaneError,
    InternalError,
    Timeout,
    Unauthorized,
    UnknownDevice,
    WorkerLost,
)
from graphlane.protocol.security import ClientKeys

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


class Channel:
    """One DEALER connection with its reader and monitor tasks and pending calls."""

    def __init__(
        self, ctx: zmq.asyncio.Context, endpoint: str, name: str, keys: ClientKeys | None = None
    ) -> None:
        self.endpoint = endpoint
        self.name = name
        self.sock = ctx.socket(zmq.DEALER)
        if keys is not None:
            keys.apply(self.sock)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 50)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )  # fmt: skip
        self.refused: str | None = None  # why the server refused our handshake
        self.sock.connect(endpoint)
        self.pending: dict[int, asyncio.Future[codec.Reply]] = {}
        self.connected = False
        self.lost = False  # connected once, then dropped: the peer went away
        self.late_replies = 0
        self.closed = False
        self._tasks = [
            asyncio.ensure_future(self._read()),
            asyncio.ensure_future(self._watch()),
        ]

    async def _read(self) -> None:
        while True:
            try:
                frames = await self.sock.recv_multipart(copy=False)
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            try:
                reply = codec.decode_reply(frames)
            except codec.DecodeError as exc:
                fut = self.pending.pop(exc.request_id, None) if exc.request_id is not None else None
                if fut is not None and not fut.done():
                    fut.set_exception(InternalError(f"undecodable reply: {exc.message}"))
                else:
                    log.warning(
                        "dropped an undecodable reply from %s: %s", self.endpoint, exc.message
                    )
                continue
            fut = self.pending.pop(reply.id, None)
            if fut is None or fut.done():
                self.late_replies += 1  # its call was cancelled or timed out
                continue
            fut.set_result(reply)

    async def _watch(self) -> None:
        while True:
            try:
                msg = parse_monitor_message(await self.monitor.recv_multipart())
            except (zmq.ZMQError, asyncio.CancelledError):
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
            elif msg["event"] == zmq.EVENT_CONNECTED:
                self.connected, self.lost = True, False
            elif msg["event"] == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self.lost = True
                self.fail_all(WorkerLost(f"connection to {self.name} at {self.endpoint} was lost"))

    def fail_all(self, error: GraphlaneError) -> None:
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error)

    async def call(
        self, request_id: int, op: str, body: Mapping[str, Any], timeout: float
    ) -> codec.Reply:
        if self.closed:
            raise WorkerLost(f"connection to {self.name} is closed")
        if self.refused is not None:
            raise Unauthorized(self.refused)
        if self.lost:
            raise WorkerLost(f"{self.name} at {self.endpoint} is not reachable (restarting?)")
        frames = codec.encode_request(request_id, op, body)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[codec.Reply] = loop.create_future()
        self.pending[request_id] = fut
        # One timer instead of wait_for(shield(...)): the deadline fails the future.
        timer = loop.call_later(timeout, _expire, fut, f"{op} to {self.name}", timeout)
        try:
            await self.sock.send_multipart(frames, copy=False)
            return await fut
        finally:
            # A cancelled or timed-out call forgets its id; a late reply is dropped.
            timer.cancel()
            self.pending.pop(request_id, None)

    async def close(self) -> None:
        self.closed = True
        self.fail_all(WorkerLost(f"connection to {self.name} was closed"))
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


def _expire(fut: asyncio.Future[Any], what: str, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(Timeout(f"{what} got no reply within {timeout:g} s"))


class Client:
    """Async client of a graphlane daemon (see the module docstring)."""

    def __init__(
        self,
        endpoint: str,
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
        self.endpoint = endpoint
        self.timeout = timeout
        self.name = name
        self._ctx: zmq.asyncio.Context | None = None
        self._daemon: Channel | None = None
        self._workers: dict[int, Channel] = {}
        self._ids = itertools.count(1)
        self._hello: dict[str, Any] = {}
        self._refresh_lock: asyncio.Lock | None = None

    # ------------------------------------------------------------ lifecycle
    async def connect(self) -> dict[str, Any]:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
            self._daemon = Channel(self._ctx, self.endpoint, "daemon", self.keys)
            self._refresh_lock = asyncio.Lock()
        return await self.hello()

    async def close(self) -> None:
        for ch in [*self._workers.values(), *([self._daemon] if self._daemon else [])]:
            await ch.close()
        self._workers.clear()
        self._daemon = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def __aenter__(self) -> Client:
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ------------------------------------------------------------ plumbing
    async def _call(
        self, ch: Channel, op: str, body: Mapping[str, Any], timeout: float | None
    ) -> dict[str, Any]:
        reply = await ch.call(
            next(self._ids), op, body, self.timeout if timeout is None else timeout
        )
        if not reply.ok:
            assert reply.error is not None
            raise reply.error
        return reply.body

    def _channel(self) -> Channel:
        if self._daemon is None:
            raise RuntimeError(
                "the client is not connected: use 'async with Client(...)' or connect()"
            )
        return self._daemon

    async def _worker(self, device: int) -> Channel:
        ch = self._workers.get(device)
        if ch is not None and not ch.lost:
            return ch
        assert self._refresh_lock is not None
        async with self._refresh_lock:  # one hello for many callers after a restart
            ch = self._workers.get(device)
            if ch is not None and not ch.lost:
                return ch
            hello = await self.hello()
            entry = next((w for w in hello.get("workers", []) if w.get("device") == device), None)
            if entry is None:
                served = [w.get("device") for w in hello.get("workers", [])]
                raise UnknownDevice(f"device {device} is not served (serving {served})")
            if entry.get("state") != "ready" or not entry.get("endpoint"):
                raise WorkerLost(
                    f"device {device} is {entry.get('state')}, not ready", retryable=True
                )
            if ch is not None:
                if ch.endpoint == entry["endpoint"]:
                    ch.lost = False  # same endpoint: the socket reconnects by itself
                    return ch
                await ch.close()
            assert self._ctx is not None
            ch = self._workers[device] = Channel(
                self._ctx, entry["endpoint"], f"device {device}", self.keys
            )
            return ch

    # ------------------------------------------------------------ operations
    async def hello(self, timeout: float | None = None) -> dict[str, Any]:
        self._hello = await self._call(self._channel(), "hello", {"client": self.name}, timeout)
        return self._hello

    async def status(self, timeout: float | None = None) -> dict[str, Any]:
        return await self._call(self._channel(), "status", {}, timeout)

    async def drain(
        self, device: int | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        body = {} if device is None else {"device": device}
        return await self._call(self._channel(), "drain", body, timeout)

    async def shutdown(self, timeout: float | None = None) -> dict[str, Any]:
        return await self._call(self._channel(), "shutdown", {}, timeout)

    async def worker_status(self, device: int, timeout: float | None = None) -> dict[str, Any]:
        return await self._call(await self._worker(device), "status", {}, timeout)

    async def step(
        self,
        program: str,
        device: int,
        params: Mapping[str, Any],
        inputs: Mapping[str, torch.Tensor] | None = None,
        outputs: Sequence[str] = ("out",),
        *,
        batch: int | None = None,
        timeout: float | None = None,
    ) -> StepReply:
        """Patch and replay ``program`` on ``device``; returns the requested outputs."""
        body = _step_body(program, device, params, inputs, batch)
        body["outputs"] = list(outputs)
        return _reply(device, await self._call(await self._worker(device), "step", body, timeout))

    async def update(
        self,
        program: str,
        device: int,
        params: Mapping[str, Any],
        inputs: Mapping[str, torch.Tensor] | None = None,
        *,
        batch: int | None = None,
        timeout: float | None = None,
    ) -> StepReply:
        """Patch the next replay of the bucket (no replay)."""
        body = _step_body(program, device, params, inputs, batch)
        return _reply(device, await self._call(await self._worker(device), "update", body, timeout))

    async def replay(
        self,
        program: str,
        device: int,
        batch: int,
        outputs: Sequence[str] = ("out",),
        *,
        timeout: float | None = None,
    ) -> StepReply:
        """Replay the bucket's updated (or next) graph instance."""
        body = {"program": program, "device": device, "batch": batch, "outputs": list(outputs)}
        return _reply(device, await self._call(await self._worker(device), "replay", body, timeout))

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


def _reply(device: int, body: Mapping[str, Any]) -> StepReply:
    return StepReply(
        outputs=dict(body.get("outputs", {})),
        bucket=int(body.get("bucket", 0)),
        slot=int(body.get("slot", 0)),
        patched=int(body.get("patched", 0)),
        device=device,
        server_us=float(body.get("server_us", 0.0)),
    )


class SyncClient:
    """The async :class:`Client`, driven from a private event-loop thread.

    Every public coroutine of Client is available here as a blocking method
    (the methods are generated from Client's, not written twice).
    """

    def __init__(self, endpoint: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="graphlane-sync-client", daemon=True
        )
        self._thread.start()
        self._client = Client(endpoint, **kwargs)
        try:
            self._run(self._client.connect())
        except BaseException:
            self.close()
            raise

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._run(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
