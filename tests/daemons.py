"""Real daemons for the tests: ``graphlane serve`` as a child process, real worker
processes, real sockets on loopback tcp and ipc. Every daemon a test starts is
stopped with SIGTERM at the end and must exit 0 leaving no worker behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from graphlane.protocol.errors import GraphlaneError

POLL_S = 0.02

SMALL = {"name": "attention", "layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 16, "max_kv_len": 32, "buckets": [1, 2, 4]}  # fmt: skip


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` until it returns a truthy value; fail the test at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(POLL_S)


async def until(predicate: Callable[[], Any], limit_s: float = 30.0) -> None:
    """Yield to the event loop until ``predicate()`` holds (e.g. requests on the wire)."""
    deadline = time.monotonic() + limit_s
    while not predicate():  # client internals offer no event to await
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {limit_s:g} s waiting for a condition")
        await asyncio.sleep(0)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A loopback port nothing listens on, with the ``span - 1`` ports above it free too:
    a daemon's workers listen on its port + 1 + device id. Chosen below the kernel's
    ephemeral range, so that no connection's own port can take one of them while the
    test runs: a worker restarted after a SIGKILL binds its port again, and a loaded
    suite run saw another test's connection hold it then ("Address already in use")."""
    rng = random.Random()  # (not the tests' seeded random)
    low = _ephemeral_low()
    for _ in range(200):
        port = rng.randrange(_FIRST_PORT, low - span)
        if all(_bindable(port + i) for i in range(span)):
            return port
    raise RuntimeError(f"no {span} free ports in a row on loopback below {low}")


_FIRST_PORT = 10000  # above the well-known and registered ports services tend to use


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (connections' own ports)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table (a model program's ``random``)
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    return str(value)


def write_config(path: Path, config: dict[str, Any]) -> Path:
    lines = []
    tables = {k: v for k, v in config.items() if isinstance(v, dict)}
    programs = config.get("programs", [SMALL])
    for k, v in config.items():
        if k not in tables and k != "programs":
            lines.append(f"{k} = {_toml(v)}")
    for name, table in tables.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml(v)}" for k, v in table.items()]
    for p in programs:
        lines.append("[[programs]]")
        lines += [f"{k} = {_toml(v)}" for k, v in p.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class RunningDaemon:
    endpoint: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    stopped: bool = False
    signalled: bool = False
    client_keys: dict[str, str] = field(default_factory=dict)
    worker_pids_seen: set[int] = field(default_factory=set)

    def status(self) -> dict[str, Any]:
        from graphlane.client import Client

        async def get() -> dict[str, Any]:
            # A hang guard, not a latency check: a loaded 2-core machine can hold a
            # just-started daemon's answer for seconds.
            async with Client(self.endpoint, timeout=30, **self.client_keys) as c:
                return await c.status()

        st = asyncio.run(get())
        self.worker_pids_seen |= {w["pid"] for w in st["workers"] if w["pid"]}
        return st

    def worker(self, device: int) -> dict[str, Any]:
        return next(w for w in self.status()["workers"] if w["device"] == device)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        self.signalled = True
        self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None and not self.signalled:
            self.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(
                f"daemon did not stop within {timeout} s after {sig}:\n{self.log()[-3000:]}"
            )
        self.stopped = True
        return code


def launch(
    tmp_dir: Path,
    name: str,
    transport: str = "ipc",
    devices: int = 2,
    client_keys: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    **config: Any,
) -> RunningDaemon:
    """``graphlane serve`` in a child process, its files under ``tmp_dir`` named by
    ``name``, with ``env`` added to its environment; returned once its workers are ready
    and it answers status."""
    if transport == "ipc":
        listen = f"ipc://{tmp_dir}/{name}/daemon.sock"
    else:
        listen = f"tcp://127.0.0.1:{free_port(1 + devices)}"
    cfg = {"listen": listen, "devices": devices, **config}
    path = write_config(tmp_dir / f"{name}.toml", cfg)
    argv = [sys.executable, "-m", "graphlane", "serve", "--config", str(path)]
    return serve_until_ready(
        tmp_dir, name, argv, {**os.environ, **(env or {})}, dict(client_keys or {})
    )


def serve_until_ready(
    tmp_dir: Path,
    name: str,
    argv: list[str],
    env: dict[str, str] | None = None,
    client_keys: dict[str, str] | None = None,
) -> RunningDaemon:
    """``ARGV --ready-file PATH`` (a ``graphlane serve`` command line) as a child process
    whose output goes to ``tmp_dir/NAME.log``, returned once its workers are ready and
    it answers status."""
    ready = tmp_dir / f"{name}.ready"
    log_path = tmp_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*argv, "--ready-file", str(ready)], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    d = RunningDaemon("", proc, log_path, client_keys=dict(client_keys or {}))

    def is_ready() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"daemon exited with {proc.returncode}:\n{d.log()[-3000:]}")
        return ready.exists() and ready.stat().st_size > 0

    try:
        wait_for(is_ready, 120, "the daemon's workers to be ready")
        d.endpoint = ready.read_text()
        try:
            d.status()
        except GraphlaneError as e:  # say what the daemon was doing
            pytest.fail(f"the ready daemon did not answer status: {e}\n{d.log()[-3000:]}")
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    return d


def finish(d: RunningDaemon) -> None:
    """Stop ``d`` unless the test did: it must exit 0 and leave no worker behind."""
    if not d.stopped:
        code = d.stop()
        assert code == 0, f"daemon exit code {code}:\n{d.log()[-3000:]}"
    pids = list(d.worker_pids_seen)
    wait_for(lambda: not any(map(pid_alive, pids)), 10, f"workers {pids} to exit")


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., RunningDaemon]]:
    """A daemon of the test's own, for a test that changes its state (kills, drains,
    stops it) or needs a configuration no other test shares."""
    started: list[RunningDaemon] = []

    def start(*args: Any, **kwargs: Any) -> RunningDaemon:
        d = launch(tmp_path, f"daemon{len(started)}", *args, **kwargs)
        started.append(d)
        return d

    yield start
    for d in started:
        finish(d)


#: Pids of the daemons that outlive a test (shared by several): not a test's leak.
SHARED_PIDS: set[int] = set()


class SharedDaemons:
    """One daemon per configuration, started when a test first asks for it and stopped
    at the end of the session (where it must exit 0 and leave no worker behind)."""

    def __init__(self, tmp_dir: Path) -> None:
        self.tmp_dir = tmp_dir
        self.daemons: dict[str, RunningDaemon] = {}
        self.count = 0

    def get(self, transport: str = "ipc", devices: int = 2, **config: Any) -> RunningDaemon:
        key = json.dumps([transport, devices, config], sort_keys=True)
        d = self.daemons.get(key)
        if d is not None and d.proc.poll() is not None:
            self.discard(d)  # it died between tests: the test that used it last failed
            d = None
        if d is None:
            d = launch(self.tmp_dir, f"shared{self.count}", transport, devices, **config)
            self.count += 1
            self.daemons[key] = d
            SHARED_PIDS.add(d.proc.pid)
        return d

    def discard(self, d: RunningDaemon) -> None:
        """Stop a daemon a test left unhealthy: the next test gets a new one."""
        for key, other in list(self.daemons.items()):
            if other is d:
                del self.daemons[key]
        try:
            if d.proc.poll() is None:
                d.proc.terminate()
                try:
                    d.proc.wait(60)
                except subprocess.TimeoutExpired:
                    d.proc.kill()
                    d.proc.wait()
        finally:
            SHARED_PIDS.discard(d.proc.pid)

    def close(self) -> None:
        try:
            for d in self.daemons.values():
                finish(d)
        finally:
            SHARED_PIDS.difference_update(d.proc.pid for d in self.daemons.values())
            self.daemons.clear()


@pytest.fixture(scope="session")
def shared_daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedDaemons]:
    pool = SharedDaemons(tmp_path_factory.mktemp("shared"))
    yield pool
    pool.close()


def _health(d: RunningDaemon) -> dict[int, tuple[Any, ...]]:
    """Per device: the worker's pid, state and restarts."""
    return {w["device"]: (w["pid"], w["state"], w["restarts"]) for w in d.status()["workers"]}


@pytest.fixture
def shared_daemon(shared_daemons: SharedDaemons) -> Iterator[Callable[..., RunningDaemon]]:
    """A daemon shared with other tests of the same configuration (same arguments as
    ``start_daemon``), for a test that leaves it as it found it: it must not stop it,
    drain, kill or restart a worker, or depend on counters starting at zero. After the
    test the daemon must be running with the same workers, all ready; otherwise the
    test fails and the daemon is replaced for the next."""
    used: dict[int, tuple[RunningDaemon, dict[int, tuple[Any, ...]]]] = {}

    def get(*args: Any, **kwargs: Any) -> RunningDaemon:
        d = shared_daemons.get(*args, **kwargs)
        if id(d) not in used:
            before = _health(d)
            assert all(state == "ready" for _, state, _ in before.values()), before
            used[id(d)] = (d, before)
        return d

    yield get
    for d, before in used.values():
        after = None
        if d.proc.poll() is None and not d.signalled:
            with contextlib.suppress(Exception):
                after = _health(d)
        if after != before:
            shared_daemons.discard(d)
            pytest.fail(
                f"the test left a shared daemon changed: workers {before} -> {after} "
                f"(exit {d.proc.returncode}):\n{d.log()[-3000:]}"
            )


def _resource_tracker(pid: str) -> bool:
    """multiprocessing's resource tracker: started once per process by the first process
    it spawns (the benchmarks' echo servers), it lives as long as this one, by design."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


@pytest.fixture(autouse=True)
def no_leaked_children() -> Iterator[None]:
    """A test must not leave child processes of its own running."""
    yield
    me = os.getpid()

    def children() -> list[int]:
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        fields = f.read().split(")")[-1].split()
                except OSError:
                    continue
                mine = int(fields[1]) == me and fields[0] != "Z"
                if mine and int(entry) not in SHARED_PIDS and not _resource_tracker(entry):
                    out.append(int(entry))
        return out

    wait_for(lambda: not children(), 10, "the test's child processes to exit")
