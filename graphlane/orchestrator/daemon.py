"""The daemon: the orchestrator's control socket over the supervised workers.

The orchestrator answers ``hello`` (protocol version, capabilities, and where
each device's worker listens), ``status``, ``drain`` and ``shutdown`` on its own
ROUTER socket. Steps do not pass through it: clients send ``step``, ``update``
and ``replay`` to the worker's own socket (found with ``hello``), so the hot
path has no extra hop; the orchestrator answers them with BAD_REQUEST naming
the worker endpoint to use.

States: RUNNING -> DRAINING (SIGTERM/SIGINT or ``shutdown``: workers stop
accepting, finish what is in flight and exit) -> STOPPED (exit 0). Signal
handlers only set the state and wake the main flow.

With CurveZMQ and ``admin_keys`` configured, ``drain`` and ``shutdown`` need an admin
key (FORBIDDEN otherwise; docs/security.md); the workers apply the same roles.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import time
from collections.abc import Iterable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from graphlane import __version__
from graphlane.logs import Throttled
from graphlane.protocol import admission, ops, pipe, security, wire
from graphlane.protocol.errors import BadRequest, UnknownDevice
from graphlane.protocol.server import Origin, Responder
from graphlane.workers import affinity
from graphlane.workers.memory import FreedMemory
from graphlane.workers.process_group import GroupSpec
from graphlane.workers.spec import WorkerSpec

from .config import ServeConfig
from .groups import DeviceGroups, group_devices
from .ports import PortInUse, bind_error
from .supervisor import READY, Supervisor, WorkerHandle

log = logging.getLogger("graphlane.daemon")

RUNNING, DRAINING, STOPPED = "running", "draining", "stopped"

#: Bits of a generation that count one worker's restarts (see first_generation).
RESTART_BITS = 22


def first_generation() -> int:
    """The generation of a daemon's workers at their first start: a random daemon
    instance in the high bits, 0 restarts in the low ``RESTART_BITS``; each restart adds
    one. A client holding a generation of an earlier daemon on the same endpoint (or of
    this host before a reboot) is refused with STATE_LOST instead of being served by an
    empty cache. 31 random bits (two daemons collide with odds 2**-31) and 22 of restarts
    (past 4 million, restarts carry into the instance: still unique within the daemon):
    53 bits, exact as a JSON number as well."""
    return (1 + secrets.randbelow(2**31 - 1)) << RESTART_BITS


class Daemon:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.state = RUNNING
        self.started = time.time()
        # The control socket's requests, answered by this daemon (answer, below); the
        # replies of one message are collected, then sent by the serving task.
        self._replies: list[tuple[Any, list[Any]]] = []
        self._freed = FreedMemory()
        self.responder = Responder(
            wire.Codec(admission.CONTROL_LIMITS, tensors=False),  # (no torch here)
            self,
            lambda ident, frames, bundled: self._replies.append((ident, frames)),
            log,
            bundles=False,
        )
        self.counters = self.responder.counters
        generation = first_generation()
        #: The server's keys and the admitted ones, read once: the daemon's socket and
        #: every worker it ever spawns admit these (docs/security.md).
        self.keys = security.ServerKeys.load(config.auth_dir) if config.auth_dir else None
        #: Who may do what (None: every admitted key everything; no auth: no keys).
        self.roles = (
            security.Roles.load(self.keys, config.admin_keys, config.program_clients)
            if self.keys is not None
            else None
        )
        self._failed_log = Throttled(log)  # a message whose handling raised: its cause
        #: The served devices in tensor-parallel groups (size 1: each alone; the config
        #: checked them against the host).
        self.groups: DeviceGroups = group_devices(config.devices, config.tensor_parallel)
        cores = affinity.core_sets(
            config.cpu_affinity, config.backend, len(config.devices), offset=os.getpid(),
            sim_mode=config.sim.mode,
        )
        spin_us = affinity.idle_spin_us(config.idle_spin_us, len(config.devices))
        specs = [
            WorkerSpec(
                device=d,
                runtime_index=self._runtime_index(d),
                backend=config.backend,
                sim=asdict(config.sim) if config.backend == "sim" else None,
                programs=config.programs,
                depth=config.depth,
                pipeline=config.pipeline,
                record_order=config.record_order,
                endpoint=config.worker_endpoint(d),
                max_queued=config.max_queued,
                max_unread_reply_bytes=config.max_unread_reply_bytes,
                idle_spin_us=spin_us,
                sequence_grace_s=config.sequence_grace_s,
                log_level=logging.getLogger().level or logging.INFO,
                log_format=config.log_format,
                faults=dict(config.faults),
                keys=self.keys,
                roles=self.roles,
                cpus=cpus,
                generation=generation,
                group=self._group_spec(d),
            )
            for d, cpus in zip(config.devices, cores, strict=True)
        ]
        self.supervisor = Supervisor(
            specs,
            startup_timeout_s=config.startup_timeout_s,
            max_restarts=config.max_restarts,
            restart_window_s=config.restart_window_s,
            hang_timeout_s=config.hang_timeout_s,
            env_for=self._env_for,
            groups={d: g for g in self.groups.groups if len(g) > 1 for d in g},
        )
        self.metrics_server: Any = None
        self._shutdown = asyncio.Event()
        self.endpoint = ""

    def _group_spec(self, device: int) -> GroupSpec | None:
        """``device``'s place in its tensor-parallel group (its ports are taken at each
        start of the group: Supervisor._start_unit); None when it serves alone."""
        if self.groups.size == 1:
            return None
        index, devices = self.groups.of(device)
        return GroupSpec(index, devices.index(device), devices)

    def _env_for(self, device: int) -> dict[str, str]:
        if self.config.backend == "npu":
            # Pin each worker to its NPU; inside the process it is device 0 (_runtime_index).
            # A group's ranks each see the group's NPUs, numbered 0..N-1 in rank order, as
            # vLLM's ranks see a node's (each then sets its own: rank r, device r).
            devices = self.groups.of(device)[1]
            return {"ASCEND_RT_VISIBLE_DEVICES": ",".join(map(str, devices))}
        return {}

    def _runtime_index(self, device: int) -> int | None:
        """The index of ``device`` inside its worker: the Ascend runtime numbers the
        devices ASCEND_RT_VISIBLE_DEVICES names from 0 (_env_for names its group's)."""
        if self.config.backend != "npu":
            return None
        return self.groups.of(device)[1].index(device)

    # ------------------------------------------------------------ run
    async def run(self, ready_file: str | None = None) -> int:
        """Serve until shutdown; 0 then, 1 when every worker failed for good."""
        exit_code, failure = 0, ""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_shutdown, sig.name)
        ctx = zmq.asyncio.Context()
        auth = None
        sock = ctx.socket(zmq.ROUTER)
        if self.keys is not None:
            auth = security.start_authenticator(ctx, self.keys)
            self.keys.apply(sock)
        sock.setsockopt(zmq.LINGER, 0)
        # A frame over this cuts the peer's connection unanswered; under it, a message
        # over the limits is answered TOO_LARGE (see protocol/admission.py).
        sock.setsockopt(zmq.MAXMSGSIZE, admission.CONTROL_LIMITS.max_message_bytes)
        try:
            endpoint, role = self.config.listen, "the daemon's port"
            _prepare_ipc(endpoint)  # its directory: an OSError too when it cannot be made
            security.bind(sock, endpoint)  # an ipc socket: its owner's only
            if self.config.metrics_port is not None:
                from .metrics import serve_metrics
                from .ports import METRICS_ROLE, metrics_endpoint

                endpoint = metrics_endpoint(self.config.metrics_host, self.config.metrics_port)
                role = METRICS_ROLE
                self.metrics_server = serve_metrics(
                    self.supervisor, self.config.metrics_port, self.config.metrics_host
                )
        except (zmq.ZMQError, OSError, security.SecurityError) as exc:
            sock.close(linger=0)
            if auth is not None:
                auth.stop()
            ctx.destroy(linger=0)
            if isinstance(exc, security.SecurityError):
                raise
            raise PortInUse(bind_error(endpoint, role, exc)) from None  # taken meanwhile
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info(
            "daemon listening on %s, starting %d worker(s)", self.endpoint, len(self.config.devices)
        )
        if self.metrics_server is not None:
            host, port = self.metrics_server.server_address[:2]
            log.info("metrics on http://%s:%s/metrics", host, port)
        serving = asyncio.ensure_future(self._serve(sock))
        try:
            # A shutdown requested while workers still capture does not wait for them.
            starting = asyncio.ensure_future(self.supervisor.start_all())
            stopping = asyncio.ensure_future(self._shutdown.wait())
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if starting.done():
                starting.result()
                if ready_file and not self.supervisor.all_failed.is_set():
                    await asyncio.to_thread(Path(ready_file).write_text, self.endpoint)
                failed = asyncio.ensure_future(self.supervisor.all_failed.wait())
                await asyncio.wait({stopping, failed}, return_when=asyncio.FIRST_COMPLETED)
                failed.cancel()
                if self.supervisor.all_failed.is_set() and not self._shutdown.is_set():
                    exit_code = 1
                    failure = _every_worker_failed(self.supervisor.workers.values())
                    self.request_shutdown("every worker failed")
            else:
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await starting
            log.info("shutdown: draining workers")
            await self.supervisor.stop_all(self.config.shutdown_timeout_s)
        finally:
            self.state = STOPPED
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving
            sock.close(linger=1000)  # the shutdown reply and others still queued go out
            if auth is not None:
                auth.stop()
            ctx.destroy(linger=0)
            if self.metrics_server is not None:
                self.metrics_server.shutdown()
            if exit_code:
                log.error("daemon stopped, exit 1: %s", failure)
            else:
                log.info("daemon stopped")
        return exit_code

    def request_shutdown(self, why: str = "request") -> None:
        if self.state == RUNNING:
            for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal changes nothing
                asyncio.get_running_loop().add_signal_handler(sig, lambda: None)
            log.info("shutdown requested (%s)", why)
            self.state = DRAINING
            self.supervisor.drain()
            self._shutdown.set()

    # ------------------------------------------------------------ control socket
    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        replies = self._replies
        # The rest of a message is read synchronously, frame by frame (libzmq delivers a
        # message whole: once its first frame is here, all are), keeping at most one
        # frame over the limit: a message of millions of frames costs a pass over them
        # that drops each, not a list of them all (wire.recv_message).
        raw: zmq.Socket[Any] = zmq.Socket.shadow(sock.underlying)
        keep = admission.CONTROL_LIMITS.max_frames + 1  # after the routing id
        limit = admission.CONTROL_LIMITS.max_message_bytes
        while True:
            first = await sock.recv(copy=False)
            frames = [first, *wire.recv_message(raw, 1, 0, keep)] if first.more else [first]
            big = len(frames) > 2 and (len(frames) > keep or _nbytes(frames) > limit)
            try:
                # The sender's key (ZAP User-Id, CurveZMQ only), for the roles.
                sender = security.sender_of(first) if self.roles is not None else None
                self.responder.message(frames, sender)
                for ident, reply in replies:
                    await sock.send_multipart([ident, *reply])
            except Exception as exc:  # no message may end the loop: the daemon would go deaf
                self._failed_log.warning(
                    "a message failed: %s: %s", type(exc).__name__, exc, exc_info=exc
                )
            finally:
                replies.clear()
            if big:  # refused TOO_LARGE: what the peer made libzmq hold goes back
                del frames, first
                self._freed.release()
                if self._freed.pending:
                    asyncio.get_running_loop().call_later(self._freed.interval_s, self._freed.poll)

    def answer(self, req: wire.Request, origin: Origin) -> dict[str, Any]:
        """The reply body to one request of the daemon's socket (a Handler's)."""
        op = ops.OPS[req.op]
        if op.device:
            workers = {h.device: h.info.get("endpoint") for h in self.supervisor.workers.values()}
            raise BadRequest(
                f"{req.op} is served by the worker's own socket, not the daemon's: "
                f"device endpoints {workers} (see hello)"
            )
        if self.roles is not None:
            self.roles.check(origin.sender, req.op)  # FORBIDDEN: drain, shutdown need an admin
        body = req.body
        if isinstance(body, ops.Hello):
            return self.hello()
        if isinstance(body, ops.Status):
            return self.status()
        if isinstance(body, ops.Drain):
            devices = [body.device] if body.device is not None else list(self.supervisor.workers)
            for d in devices:
                if d not in self.supervisor.workers:
                    raise UnknownDevice(
                        f"device {d} is not served (serving {sorted(self.supervisor.workers)})"
                    )
                self.supervisor.send(d, pipe.Finish())
            return {"draining": devices}
        self.request_shutdown("shutdown request")
        return {"state": self.state}

    def refused(self, error: wire.DecodeError, origin: Origin) -> None:
        """A request that did not decode: answered with its error, nothing else to do."""

    def _worker_entry(self, h: WorkerHandle) -> dict[str, Any]:
        entry = h.describe()
        ep = entry.get("endpoint")
        if self.config.advertise_host and isinstance(ep, str) and ep.startswith("tcp://"):
            # Workers bound to a wildcard are reached through the advertised host.
            port = ep.rpartition(":")[2]
            entry["endpoint"] = f"tcp://{self.config.advertise_host}:{port}"
        st = h.stats
        entry.update(
            inflight=st.get("inflight", 0),
            queued=st.get("queued", 0),
            steps=st.get("steps", 0),
        )
        if h.spec.group is not None:
            entry["group"] = self._rank_entry(h)
        return entry

    def _rank_entry(self, h: WorkerHandle) -> dict[str, Any]:
        """A rank's place in its group, and how far it is behind the leader."""
        assert h.spec.group is not None
        return {**h.spec.group.describe(), "behind": self.supervisor.behind(h)}

    def hello(self) -> dict[str, Any]:
        return {
            "version": wire.PROTOCOL_VERSION,
            "server": f"graphlane {__version__}",
            "state": self.state,
            "capabilities": {
                "ops": sorted(ops.OPS),
                "auth": "curve" if self.config.auth_dir else "none",
                "backend": self.config.backend,
                # What workers take (their sockets cut a frame over max_message_bytes):
                # graphlane's client checks its messages against these before sending.
                "max_message_bytes": wire.DEFAULT_LIMITS.max_message_bytes,
                "max_envelope_bytes": wire.DEFAULT_LIMITS.max_envelope_bytes,
                "max_frames": wire.DEFAULT_LIMITS.max_frames,
                "bundles": True,  # worker sockets take bundles of requests
            },
            # One endpoint per group, its leader's: the other ranks follow it.
            "workers": [
                self._worker_entry(h)
                for h in self.supervisor.workers.values()
                if h.spec.group is None or h.spec.group.rank == 0
            ],
        }

    def status(self) -> dict[str, Any]:
        workers = [self._worker_entry(h) for h in self.supervisor.workers.values()]
        return {
            "state": self.state,
            "pid": os.getpid(),
            "endpoint": self.endpoint,
            "uptime_s": round(time.time() - self.started, 3),
            "ready": all(w["state"] == READY for w in workers),
            "workers": workers,
            "counters": dict(self.counters),
            "metrics": self.metrics_address(),
            "config": {
                "backend": self.config.backend,
                "devices": list(self.config.devices),
                "tensor_parallel": self.config.tensor_parallel,
                "depth": self.config.depth,
                "pipeline": self.config.pipeline,
                "programs": [p["name"] for p in self.config.programs],
                "sim": replace(self.config.sim).__dict__ if self.config.backend == "sim" else None,
            },
        }

    def metrics_address(self) -> str | None:
        if self.metrics_server is None:
            return None
        host, port = self.metrics_server.server_address[:2]
        return f"http://{host}:{port}/metrics"


def _every_worker_failed(workers: Iterable[WorkerHandle]) -> str:
    """One line: each cause once, with the devices it stopped."""
    causes: dict[str, list[int]] = {}
    for h in workers:
        causes.setdefault(h.last_error, []).append(h.device)
    return "every worker failed: " + "; ".join(
        f"device{'s' if len(ds) > 1 else ''} {', '.join(map(str, ds))}: {cause}"
        for cause, ds in causes.items()
    )


def _prepare_ipc(endpoint: str) -> None:
    """An ipc socket's directory (made the owner's only when it does not exist), without
    the socket file a daemon before left there (security.bind checks the rest)."""
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://") :]
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o700, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def serve(config: ServeConfig, ready_file: str | None = None) -> int:
    daemon = Daemon(config)
    try:
        return asyncio.run(daemon.run(ready_file))
    finally:
        # Shutting down already: a repeated SIGTERM/SIGINT must not kill the exit path.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _nbytes(frames: list[Any]) -> int:
    return sum(f.buffer.nbytes if isinstance(f, zmq.Frame) else len(f) for f in frames[1:])
