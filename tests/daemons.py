"""Real daemons for the tests: ``graphlane serve`` as a child process, real worker
processes, real sockets on loopback tcp and ipc. Every daemon a test starts is
stopped with SIGTERM at the end and must exit 0 leaving no worker behind."""

from __future__ import annotations

import asyncio
import os
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
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
            async with Client(self.endpoint, timeout=10, **self.client_keys) as c:
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


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., RunningDaemon]]:
    started: list[RunningDaemon] = []

    def start(
        transport: str = "ipc",
        devices: int = 2,
        client_keys: dict[str, str] | None = None,
        **config: Any,
    ) -> RunningDaemon:
        n = len(started)
        if transport == "ipc":
            listen = f"ipc://{tmp_path}/run{n}/daemon.sock"
        else:
            listen = f"tcp://127.0.0.1:{free_port()}"
        cfg = {"listen": listen, "devices": devices, **config}
        path = write_config(tmp_path / f"daemon{n}.toml", cfg)
        ready = tmp_path / f"ready{n}"
        log_path = tmp_path / f"daemon{n}.log"
        cmd = [sys.executable, "-m", "graphlane", "serve", "--config", str(path),
               "--ready-file", str(ready)]  # fmt: skip
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        d = RunningDaemon(listen, proc, log_path, client_keys=dict(client_keys or {}))
        started.append(d)

        def is_ready() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"daemon exited with {proc.returncode}:\n{d.log()[-3000:]}")
            return ready.exists() and ready.stat().st_size > 0

        wait_for(is_ready, 120, "the daemon's workers to be ready")
        d.endpoint = ready.read_text()
        d.status()
        return d

    yield start
    for d in started:
        if not d.stopped:
            code = d.stop()
            assert code == 0, f"daemon exit code {code}:\n{d.log()[-3000:]}"
        pids = list(d.worker_pids_seen)
        wait_for(lambda pids=pids: not any(map(pid_alive, pids)), 10, f"workers {pids} to exit")


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
                if int(fields[1]) == me and fields[0] != "Z":
                    out.append(int(entry))
        return out

    wait_for(lambda: not children(), 10, "the test's child processes to exit")
