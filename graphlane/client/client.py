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
reader callback for that socket (:class:`~.transport.Channel`).
Sockets belong to the event loop that created the client (its thread is their
only user); a send is one message sent without a pause, so frames of
concurrent calls never interleave.

Calls made together to one worker may travel together as one bundle; each
keeps its own id, deadline and reply (:mod:`.transport`).

Failures arrive as :class:`graphlane.GraphlaneError` subclasses whose ``code``
is the wire code. A worker that dies fails every call in flight on it with
WORKER_LOST at once (a socket monitor sees the connection drop); calls to a
device whose worker is restarting fail fast with WORKER_LOST (retryable)
until it is back. Every call has a deadline (TIMEOUT). Cancelling a call loses
nothing: a reply that arrives afterwards is dropped and the connection stays
usable.

:class:`~.sync.SyncClient` is the same client driven from a private event loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import msgspec
import torch

from graphlane.protocol import ops, wire
from graphlane.protocol.admission import CONTROL_LIMITS, DEFAULT_LIMITS, Limits
from graphlane.protocol.endpoints import (
    InvalidEndpoint,
    check_endpoint,
    daemon_endpoint_guess,
)
from graphlane.protocol.errors import (
    ErrorCode,
    GraphlaneError,
    Timeout,
    UnknownDevice,
    WorkerLost,
)
from graphlane.protocol.ops.sequences import MAX_SEQUENCE_ID
from graphlane.protocol.security import ClientKeys

from .args import (
    InvalidArgument,
    as_id,
    as_ids,
    as_params,
    as_slots,
    as_tensor,
    as_tensors,
    call_timeout,
    check_device,
    deadline_ms,
    output_names,
)
from .hosts import Host, expand
from .transport import Call, Channel, Sockets


class StepReply(msgspec.Struct, frozen=True):
    """What a step, update or replay answered: the outputs asked for, the bucket
    (captured batch size) that ran it, which graph instance of the bucket's ring,
    how many task groups were patched, and where. Immutable: a frozen Struct, made in
    C (a frozen dataclass's ``__init__``, eight ``object.__setattr__`` calls, cost the
    client 7% of its instructions per decode step)."""

    outputs: dict[str, Any]  # tensors; lists of their values for decode(as_lists=True)
    bucket: int
    instance: int
    patched: int
    device: int
    server_us: float = 0.0  # time the worker held the request, device work included
    host: str = ""  # the daemon's endpoint
    generation: int = 0  # the answering worker's generation


Device = int | tuple[int | str, int]


def _channel_up(host: Host, local: int) -> Channel | None:
    """The device's channel when a call may be sent on it now: it is up and no earlier
    call to the device waits for it to be made (it would be overtaken)."""
    ch = host.workers.get(local)
    if ch is None or ch.lost or host.connecting.get(local):
        return None
    return ch


def _in_line(host: Host, local: int) -> None:
    """Count a call that waits for the device's channel (until ``_connect_in_line`` has
    made it): while any does, later calls to the device wait behind it."""
    host.connecting[local] = host.connecting.get(local, 0) + 1


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
        self._hosts: list[Host] = []
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
                    for resolved in await expand(ep):
                        if resolved not in endpoints:
                            endpoints.append(resolved)
                for ep in endpoints:
                    host = Host(ep)
                    self._hosts.append(host)
                    host.daemon = Channel(
                        self._sockets, ep, "daemon", self.keys, limits=CONTROL_LIMITS
                    )
            hello = await self.hello()
            for host in self._hosts:
                _check_is_daemon(host.endpoint, host.hello)
            return hello
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
    def _call(self, ch: Channel, op: str, body: Any, timeout: float | None) -> Call:
        """The call, sent: a future of the reply's typed body, or of its error."""
        return ch.send(next(self._ids), ops.OPS[op], body, call_timeout(self.timeout, timeout))

    def _after_failure(self, ch: Channel, body: Any, exc: GraphlaneError) -> None:
        """A device request failed. If it named a generation (its program keeps device
        state), the worker refuses this connection's requests to such programs until
        ``resume``: sent now, before the caller sees the error, so that only what was
        sent behind the failure is refused (docs/programs.md, "Ordering and retries")."""
        if body.generation is not None and exc.code not in _NO_FENCE:
            resume = ops.Resume(body.device)
            ch.post(next(self._ids), ops.OPS["resume"], resume, call_timeout(self.timeout, None))

    def _on_device(
        self, ch: Channel, op: str, body: Any, timeout: float | None, fut: _Fenced | None = None
    ) -> Call:
        """A device request, sent: its failure fences the generation (``_after_failure``)
        before the caller sees it."""
        if fut is None:
            fut = _Fenced(loop=ch._loop)
        fut.client, fut.body = self, body
        return ch.send(next(self._ids), ops.OPS[op], body, call_timeout(self.timeout, timeout), fut)

    def _send(
        self,
        host: Host,
        local: int,
        op: str,
        make: Callable[..., Any],
        args: tuple[Any, ...],
        timeout: float | None,
        as_lists: bool = False,
    ) -> asyncio.Future[StepReply]:
        """``op`` to the device's worker, its body ``make(host, *args)`` (made once the
        channel is up: it may read the hello), as a StepReply (its outputs as lists with
        ``as_lists``): sent before this returns when the device's channel is up, else by
        a task once it is, in order with every call made before (a later call waits
        behind this one). The future is the call itself either way, ended by the
        socket's reader: calls end in the order of their replies, whichever way they
        were sent. Every step of a scheduler passes here: no closure per call."""
        fut = _Replied(asyncio.get_running_loop(), self, host.endpoint, local, as_lists)
        ch = _channel_up(host, local)
        if ch is None:
            _in_line(host, local)  # now: a call made after this one goes behind it
            fut.sending = asyncio.ensure_future(
                self._send_connected(host, local, op, make, args, timeout, fut)
            )
            return fut
        return self._on_device(ch, op, make(host, *args), timeout, fut)

    async def _send_connected(
        self,
        host: Host,
        local: int,
        op: str,
        make: Callable[..., Any],
        args: tuple[Any, ...],
        timeout: float | None,
        fut: _Replied,
    ) -> None:
        """Send ``fut``'s call once the device's channel is up (the call is in line
        since it was made: ``_in_line``); a failure before the send is the call's."""
        try:
            ch = await self._connect_in_line(host, local)
            if not fut.done():  # (not cancelled meanwhile)
                self._on_device(ch, op, make(host, *args), timeout, fut)
        except Exception as exc:
            if not fut.done():
                fut.set_exception(exc)
        finally:
            fut.sending = None

    def _channel(self, host: Host | None = None) -> Channel:
        if self._closing:
            raise WorkerLost("the client was closed")
        if not self._hosts:
            raise RuntimeError(
                "the client is not connected: use 'async with Client(...)' or connect()"
            )
        ch = (host or self._hosts[0]).daemon
        assert ch is not None
        return ch

    def _resolve(self, device: Device) -> tuple[Host, int]:
        if type(device) is int and len(self._hosts) == 1 and not self._closing:
            return self._hosts[0], device  # the common case, before any check it passes
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

    async def _worker_at(self, host: Host, local: int) -> Channel:
        """The device's channel, made (or remade after a restart) when it has none.

        Calls of one client to one device go out in the order they were made: a call
        that finds the channel missing waits for it under the host's lock (FIFO), and
        while any call to the device waits so, a later one waits behind it instead of
        taking the channel the first of them made (a step would overtake the prefill it
        decodes from). Each resumes with nothing to await before its send."""
        ch = _channel_up(host, local)
        if ch is not None:
            return ch
        _in_line(host, local)
        return await self._connect_in_line(host, local)

    async def _connect_in_line(self, host: Host, local: int) -> Channel:
        """The device's channel, made, for a call counted in ``host.connecting``
        (``_in_line``); the count is taken back once it is made or failed."""
        try:
            return await self._connect_worker(host, local)
        finally:
            host.connecting[local] -= 1

    async def _connect_worker(self, host: Host, local: int) -> Channel:
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
            if isinstance(entry.get("generation"), int):
                host.generations.setdefault(local, entry["generation"])
            if ch is not None:
                if ch.endpoint == entry["endpoint"]:
                    ch.lost = False  # same endpoint: the socket reconnects by itself
                    return ch
                ch.close_now()
            # Workers that take bundles get this turn's requests as one message.
            capabilities = hello.get("capabilities", {})
            takes_bundles = bool(capabilities.get("bundles"))
            ch = host.workers[local] = Channel(
                self._sockets,
                entry["endpoint"],
                f"device {local} (daemon {host.endpoint})",
                self.keys,
                bundle_max=wire.BUNDLE_MAX if takes_bundles else 1,
                limits=_worker_limits(capabilities),
            )
            return ch

    async def _hello_on(self, host: Host, timeout: float | None = None) -> dict[str, Any]:
        hello = ops.Hello(client=self.name)
        reply: dict[str, Any] = await self._call(self._channel(host), "hello", hello, timeout)
        host.hello = _described(reply, host.hello)
        return reply

    async def _each(self, op: str, body: Any, timeout: float | None) -> Any:
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
        result: dict[str, Any] = await self._each("status", ops.Status(), timeout)
        return result

    async def drain(
        self, device: Device | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        if device is None:
            result: dict[str, Any] = await self._each("drain", ops.Drain(), timeout)
            return result
        host, local = self._resolve(device)
        result = await self._call(self._channel(host), "drain", ops.Drain(local), timeout)
        # The daemon passes the drain on to the worker without waiting for it; the
        # worker's own answer means it refuses new steps from now on, so a step sent
        # after drain() returns is never served (the race was seen under load).
        await self._call(await self._worker_at(host, local), "drain", ops.Drain(local), timeout)
        return result

    async def shutdown(self, timeout: float | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self._each("shutdown", ops.Shutdown(), timeout)
        return result

    async def worker_status(self, device: Device, timeout: float | None = None) -> dict[str, Any]:
        return await self._call(await self._worker(device), "status", ops.Status(), timeout)

    async def step(
        self,
        program: str,
        device: Device,
        params: Mapping[str, Any],
        inputs: Mapping[str, torch.Tensor] | None = None,
        outputs: str | Sequence[str] | None = None,
        *,
        batch: int | None = None,
        timeout: float | None = None,
    ) -> StepReply:
        """Patch and replay ``program`` on ``device``; returns the requested outputs.

        ``outputs`` defaults to every output of the program, as ``hello`` lists them
        (``out`` for attention; ``out`` and ``lse`` for paged_attention); name fewer
        to copy and send less. ``batch`` defaults to the length of the program's batch
        parameter (``hello`` names it: ``actual_seq_lengths_kv`` for attention); a
        program without one needs ``batch=``. numpy arrays and scalars are accepted
        in ``params`` and ``inputs``."""
        return await self.send_step(
            program, device, params, inputs, outputs, batch=batch, timeout=timeout
        )

    def send_step(
        self,
        program: str,
        device: Device,
        params: Mapping[str, Any],
        inputs: Mapping[str, torch.Tensor] | None = None,
        outputs: str | Sequence[str] | None = None,
        *,
        batch: int | None = None,
        timeout: float | None = None,
    ) -> asyncio.Future[StepReply]:
        """:meth:`step`, sent before this returns (once the device's channel is up: the
        first call to a device, or the first after its worker restarted, goes by a task
        when it is), in order with every call made before it: a future of its reply.
        A scheduler that keeps steps in flight needs no task per step. Bad arguments
        raise here."""
        try:
            host, local = self._resolve(device)
        except WorkerLost as exc:  # the client closed: the call's error, not the caller's
            return _failed(exc)
        params = as_params(params)
        tensors = as_tensors(inputs)
        names = None if outputs is None else output_names(outputs)
        deadline = deadline_ms(self.timeout, timeout)
        args = (program, local, params, tensors, names, batch, deadline)
        return self._send(host, local, "step", _step, args, timeout)

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
        deadline = deadline_ms(self.timeout, timeout)
        ch = await self._worker_at(host, local)
        if batch is None:
            batch = host.batch_params.infer(host.hello, local, program, params)
        gen = host.generation_for(local, program)
        body = ops.Update(
            program, local, as_params(params), as_tensors(inputs), batch, deadline, gen
        )
        done = await self._on_device(ch, "update", body, timeout)
        return _reply(host.endpoint, local, done)

    async def replay(
        self,
        program: str,
        device: Device,
        batch: int,
        outputs: str | Sequence[str] | None = None,
        *,
        timeout: float | None = None,
    ) -> StepReply:
        """Replay the bucket's updated (or next) graph instance; ``outputs`` as in
        :meth:`step` (default: all of the program's)."""
        host, local = self._resolve(device)
        deadline = deadline_ms(self.timeout, timeout)
        ch = await self._worker_at(host, local)
        gen = host.generation_for(local, program)
        names = (
            host.outputs.of(host.hello, local, program)
            if outputs is None
            else output_names(outputs)
        )
        body = ops.Replay(program, local, batch, names, deadline, gen)
        done = await self._on_device(ch, "replay", body, timeout)
        return _reply(host.endpoint, local, done)

    async def kv_write(
        self,
        program: str,
        device: Device,
        slots: Any,
        key: Any,
        value: Any,
        *,
        timeout: float | None = None,
    ) -> StepReply:
        """Write ``key``/``value`` [layers, n, num_kv_heads, head_dim] into ``slots`` [n]
        of the program's KV cache on ``device`` (every layer), in order with the steps
        sent before and after it. ``slots``: a list of ints or a 1-D integer tensor or
        numpy array; ``key``/``value``: tensors or numpy arrays of the program's dtype."""
        slots_t, key_t, value_t = as_slots(slots), as_tensor(key, "key"), as_tensor(value, "value")
        host, local = self._resolve(device)
        ch = await self._worker_at(host, local)
        body = ops.KvWrite(
            program, local, slots_t, key_t, value_t,
            host.generation_for(local, None), deadline_ms(self.timeout, timeout),
        )  # fmt: skip
        done = await self._on_device(ch, "kv_write", body, timeout)
        return _reply(host.endpoint, local, done)

    async def kv_read(
        self, program: str, device: Device, slots: Any, *, timeout: float | None = None
    ) -> StepReply:
        """The ``key``/``value`` [layers, n, num_kv_heads, head_dim] of ``slots`` [n]
        (a list of ints or a 1-D integer tensor or numpy array)."""
        slots_t = as_slots(slots)
        host, local = self._resolve(device)
        ch = await self._worker_at(host, local)
        body = ops.KvRead(
            program, local, slots_t,
            host.generation_for(local, None), deadline_ms(self.timeout, timeout),
        )  # fmt: skip
        done = await self._on_device(ch, "kv_read", body, timeout)
        return _reply(host.endpoint, local, done)

    async def prefill(
        self,
        program: str,
        device: Device,
        tokens: Any,
        block_table: Any,
        *,
        start: int = 0,
        params: Mapping[str, Any] | None = None,
        outputs: str | Sequence[str] = ("tokens",),
        timeout: float | None = None,
    ) -> StepReply:
        """Run one sequence's prompt ``tokens`` [n] (from position ``start``) through a
        model program into the KV cache blocks ``block_table`` [max_blocks_per_seq] names,
        in order with the steps sent before and after it; ``outputs["tokens"]`` [1] is
        its first sampled token (``params``: temperature, top_k, top_p, seed, one value
        each). ``tokens``: a list of ints or an integer tensor; ``block_table`` likewise
        (sent as int32). See docs/models.md."""
        tokens_t = as_slots(tokens, "tokens")
        table_t = as_slots(block_table, "block_table").to(torch.int32)
        host, local = self._resolve(device)
        ch = await self._worker_at(host, local)
        body = ops.Prefill(
            program, local, tokens_t, table_t, start, as_params(params or {}),
            output_names(outputs), host.generation_for(local, None),
            deadline_ms(self.timeout, timeout),
        )  # fmt: skip
        done = await self._on_device(ch, "prefill", body, timeout)
        return _reply(host.endpoint, local, done)

    # ------------------------------------------------------------ sequences (models)
    async def add_sequence(
        self,
        program: str,
        device: Device,
        sequence: int,
        tokens: Any,
        blocks: Sequence[int],
        *,
        params: Mapping[str, Any] | None = None,
        outputs: str | Sequence[str] = ("tokens",),
        timeout: float | None = None,
    ) -> StepReply:
        """Run a new sequence's prompt ``tokens`` into the KV cache ``blocks`` and keep it
        on the worker as ``sequence`` (an id of this client's, >= 0), with its sampling
        settings ``params`` (temperature, top_k, top_p, seed); ``outputs["tokens"]`` [1]
        is its first sampled token. See docs/models.md, "Sequences"."""
        tokens_t = as_slots(tokens, "tokens")
        sid, table = as_id(sequence, "sequence", MAX_SEQUENCE_ID), as_ids(blocks, "blocks")
        host, local = self._resolve(device)
        ch = await self._worker_at(host, local)
        body = ops.AddSequence(
            program, local, sid, tokens_t, table,
            as_params(params or {}), output_names(outputs), host.generation_for(local, None),
            deadline_ms(self.timeout, timeout),
        )  # fmt: skip
        done = await self._on_device(ch, "add", body, timeout)
        return _reply(host.endpoint, local, done)

    async def decode(
        self,
        program: str,
        device: Device,
        sequences: Sequence[int],
        *,
        new_blocks: Mapping[int, Sequence[int]] | None = None,
        outputs: str | Sequence[str] = ("tokens",),
        timeout: float | None = None,
        as_lists: bool = False,
    ) -> StepReply:
        """One token more for each of ``sequences`` (rows in this order), each fed the
        token it sampled last, on the device: it may be sent before the reply of the
        previous decode. ``new_blocks``: blocks appended to some of them first.
        ``as_lists``: each output as a list of its values (``outputs["tokens"]`` the
        sampled token ids, in the rows' order, as Python ints), made from the reply's
        bytes with no torch tensor: what a scheduler that turns sampled tokens into a
        list each step wants, for less of its own CPU than a tensor and ``tolist()``."""
        return await self.send_decode(
            program, device, sequences, new_blocks=new_blocks, outputs=outputs,
            timeout=timeout, as_lists=as_lists,
        )  # fmt: skip

    def send_decode(
        self,
        program: str,
        device: Device,
        sequences: Sequence[int],
        *,
        new_blocks: Mapping[int, Sequence[int]] | None = None,
        outputs: str | Sequence[str] = ("tokens",),
        timeout: float | None = None,
        as_lists: bool = False,
    ) -> asyncio.Future[StepReply]:
        """:meth:`decode`, sent before this returns (as :meth:`send_step` is): a future
        of its reply. Bad arguments raise here."""
        sids = as_ids(sequences, "sequences", MAX_SEQUENCE_ID)
        if type(as_lists) is not bool:
            raise InvalidArgument(f"as_lists: must be True or False, not {as_lists!r}")
        more: dict[int, list[int]] = {}
        if new_blocks is not None:  # (most decodes append none)
            if not isinstance(new_blocks, Mapping):
                raise InvalidArgument(
                    f"new_blocks: must be a mapping of sequence ids to blocks, not "
                    f"{type(new_blocks).__name__}"
                )
            more = {
                as_id(k, "new_blocks", MAX_SEQUENCE_ID): as_ids(v, f"new_blocks[{k!r}]")
                for k, v in new_blocks.items()
            }
        try:
            host, local = self._resolve(device)
        except WorkerLost as exc:
            return _failed(exc)
        names, deadline = output_names(outputs), deadline_ms(self.timeout, timeout)
        args = (program, local, sids, more, names, deadline)
        return self._send(host, local, "decode", _decode, args, timeout, as_lists)

    async def append_blocks(
        self, program: str, device: Device, sequence: int, blocks: Sequence[int],
        *, timeout: float | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Append ``blocks`` to ``sequence``'s blocks (before the decodes sent after it)."""
        sid, more = as_id(sequence, "sequence", MAX_SEQUENCE_ID), as_ids(blocks, "blocks")
        host, local = self._resolve(device)
        ch = await self._worker_at(host, local)
        body = ops.AppendBlocks(program, local, sid, more,
                                host.generation_for(local, None))  # fmt: skip
        return dict(await self._on_device(ch, "append_blocks", body, timeout))

    async def free_sequences(
        self, program: str, device: Device, sequences: Sequence[int],
        *, timeout: float | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """Forget ``sequences`` on the worker (their blocks are this client's to reuse);
        ``freed``: those it had."""
        sids = as_ids(sequences, "sequences", MAX_SEQUENCE_ID)
        host, local = self._resolve(device)
        ch = await self._worker_at(host, local)
        body = ops.Free(program, local, sids,
                        host.generation_for(local, None))  # fmt: skip
        return dict(await self._on_device(ch, "free", body, timeout))

    def generation(self, device: Device) -> int | None:
        """The worker generation this client's requests to ``device`` name (None before
        the client first reached the device)."""
        host, local = self._resolve(device)
        return host.generations.get(local)

    async def reset_state(self, device: Device, timeout: float | None = None) -> int:
        """Adopt the current generation of ``device``'s worker after STATE_LOST (its
        device state is gone: write it again before stepping). Returns it."""
        host, local = self._resolve(device)
        await self._worker_at(host, local)
        hello = await self._hello_on(host, timeout)
        entry: dict[str, Any] = next(
            (w for w in hello.get("workers", []) if w.get("device") == local), {}
        )
        if entry.get("state") != "ready" or not isinstance(entry.get("generation"), int):
            raise WorkerLost(f"device {local} is {entry.get('state')}, not ready", retryable=True)
        host.generations[local] = entry["generation"]
        return host.generations[local]

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


#: Failures after which a worker refuses nothing (a lost generation or connection is a
#: fence of its own; a refused key gets no service at all).
_NO_FENCE = frozenset({ErrorCode.STATE_LOST, ErrorCode.WORKER_LOST, ErrorCode.UNAUTHORIZED})


def _check_is_daemon(endpoint: str, hello: Mapping[str, Any]) -> None:
    """InvalidEndpoint when ``hello`` is a worker's (its endpoint is one that ``status``
    lists for a device): a client talks to the daemon, which says where workers are."""
    device = hello.get("device")
    if "workers" in hello or type(device) is not int:
        return
    guess = daemon_endpoint_guess(endpoint, device)
    raise InvalidEndpoint(
        f"{endpoint} is device {device}'s worker endpoint, not a daemon's: connect to the "
        "daemon instead"
        + (f", probably {guess} (workers listen next to their daemon)" if guess else "")
    )


def _worker_limits(capabilities: Mapping[str, Any]) -> Limits:
    """The sizes a daemon's workers take, as its hello says (the defaults where it is silent)."""
    said = {
        name: value
        for name in ("max_message_bytes", "max_envelope_bytes", "max_frames")
        if type(value := capabilities.get(name)) is int and value >= 1
    }
    return replace(DEFAULT_LIMITS, **said)


class _Fenced(Call):
    """A device request's call: its failure fences the connection's generation first."""

    __slots__ = ("body", "client")
    body: Any
    client: Client | None

    def __init__(self, *, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self.body = self.client = None

    def failing(self, exc: GraphlaneError) -> None:
        if self.channel is not None and self.client is not None:  # (sent: fence)
            self.client._after_failure(self.channel, self.body, exc)

    def answered(self) -> None:
        self.body = None  # (the request, kept for a failure's fence only)


class _Replied(_Fenced):
    """... whose reply is a :class:`StepReply` (where it ran: ``endpoint``, ``local``);
    ``sending``: the task that sends it once the device's channel is up, if any."""

    __slots__ = ("endpoint", "local", "sending")
    endpoint: str
    local: int
    sending: asyncio.Future[None] | None

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        client: Client,
        endpoint: str,
        local: int,
        lists: bool,
    ) -> None:
        super().__init__(loop=loop)
        self.client, self.endpoint, self.local, self.lists = client, endpoint, local, lists
        self.sending = None

    def value(self, body: Any) -> StepReply:
        return _reply(self.endpoint, self.local, body)


def _step(
    host: Host, program: str, local: int, params: dict[str, Any], tensors: dict[str, Any],
    names: list[str] | None, batch: int | None, deadline: int,
) -> ops.Step:  # fmt: skip
    """A step's body, made once the device's channel is up (batch and outputs read its hello)."""
    outputs = host.outputs.of(host.hello, local, program) if names is None else names
    if batch is None:
        batch = host.batch_params.infer(host.hello, local, program, params)
    generation = host.generation_for(local, program)
    return ops.Step(program, local, params, tensors, outputs, batch, deadline, generation)


def _decode(
    host: Host, program: str, local: int, sids: list[int], more: dict[int, list[int]],
    names: list[str], deadline: int,
) -> ops.Decode:  # fmt: skip
    """A decode's body (it names the generation: its sequences are device state)."""
    generation = host.generation_for(local, None)
    return ops.Decode(program, local, sids, more, names, generation, deadline)


def _failed(exc: BaseException) -> asyncio.Future[Any]:
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    fut.set_exception(exc)
    return fut


def _described(reply: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any]:
    """The hello a client describes its programs by (each step's batch parameter and
    outputs): ``reply``, where a worker that is not ready keeps the programs it had when
    it was last described. A hello taken while a worker restarts lists none, and the
    client's channel may reconnect to the new worker by itself (the same endpoint)
    without another hello: its next step was refused in the client as UNKNOWN_PROGRAM.
    A program the new worker does not serve is still refused, by the worker."""
    workers = reply.get("workers")
    if not workers or all(w.get("state") == "ready" for w in workers):
        return reply
    before = {w.get("device"): w.get("programs") for w in previous.get("workers", ())}
    kept = [
        w if w.get("state") == "ready" or not before.get(w.get("device"))
        else {**w, "programs": before[w.get("device")]}
        for w in workers
    ]  # fmt: skip
    return {**reply, "workers": kept}


def _no_host() -> Host:
    raise RuntimeError("the client is not connected: use 'async with Client(...)' or connect()")


def _reply(host: str, device: int, done: ops.DeviceResult) -> StepReply:
    return StepReply(
        done.outputs,
        done.bucket,
        done.instance,
        done.patched,
        device,
        done.server_us,
        host,
        done.generation,
    )
