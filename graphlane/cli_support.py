"""Helpers of the ``graphlane`` command line that do more than parse flags."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from graphlane.protocol.errors import Timeout, WorkerLost

if TYPE_CHECKING:
    from graphlane.client import Client
    from graphlane.orchestrator.config import ServeConfig


async def connect_within(client: Client, wait_s: float, attempt_s: float) -> float:
    """Connect ``client``, retrying until ``wait_s`` has passed (a daemon that is not
    up yet does not answer hello); each attempt has at most ``attempt_s``. Returns
    the seconds left; TIMEOUT naming the endpoint at the deadline."""
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        try:
            await asyncio.wait_for(client.connect(), max(0.05, min(attempt_s, left)))
            return max(0.0, deadline - time.monotonic())
        except (Timeout, TimeoutError, WorkerLost) as exc:
            if time.monotonic() >= deadline:
                raise Timeout(
                    f"no daemon answered at {', '.join(client.requested)} within {wait_s:g} s"
                ) from exc
        await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def no_daemon(endpoint: str, wait_s: float, flag: str, server_key: str | None) -> Timeout:
    """TIMEOUT for a hello nobody answered, asking what a user would check first."""
    keys = " (or it has other keys: CurveZMQ does not answer a client it refuses)"
    return Timeout(
        f"nothing answered at {endpoint} within {wait_s:g} s ({flag}): "
        "is the daemon running there?" + (keys if server_key else "")
    )


def key_flags_problem(server_key: str | None, client_key: str | None) -> str | None:
    """Why --server-key/--client-key cannot be used as given, or None."""
    if (server_key is None) == (client_key is None):
        return None
    if client_key is None:
        return (
            "--server-key needs --client-key (this client's NAME.key_secret): "
            "CurveZMQ needs both"
        )
    return "--client-key needs --server-key (the daemon's server.key): CurveZMQ needs both"


def default_keys_dir() -> Path:
    """Where ``graphlane keys generate`` writes without a DIR: outside any repository."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "graphlane" / "keys"


def unignored_in_repo(secret: Path) -> Path | None:
    """The git work tree holding ``secret`` when git would not ignore it, else None."""
    directory = secret.resolve().parent
    for d in (directory, *directory.parents):
        if (d / ".git").exists():
            try:
                ignored = subprocess.run(
                    ["git", "-C", str(d), "check-ignore", "-q", str(secret.resolve())],
                    capture_output=True,
                    timeout=10,
                    check=False,
                )
            except (OSError, subprocess.SubprocessError):
                return d  # no git to ask: say so anyway
            return None if ignored.returncode == 0 else d
    return None


def check_programs(conf: ServeConfig) -> None:
    """Build each program of ``conf`` as a worker will, in this process (torch, and a
    model's config.json and weight files): ConfigError naming the key. ``serve`` leaves
    this to its workers (a program one cannot build fails its start, permanently)."""
    from graphlane.orchestrator.config import ConfigError
    from graphlane.workers.programs import ProgramConfigError, load_program

    for p in conf.programs:
        try:
            load_program(p["name"], p).check_backend(conf.backend)
        except ProgramConfigError as exc:
            raise ConfigError(exc.key, str(exc).split(": ", 1)[-1]) from exc


def check_config(path: str) -> int:
    """``graphlane config check FILE``: 0 and the resolved settings, or 2 and the error."""
    import sys

    from graphlane.orchestrator import config as cfg

    try:
        conf = cfg.load(path)
        check_programs(conf)
    except cfg.ConfigError as exc:
        print(f"graphlane config: {path}: {exc}", file=sys.stderr)
        return 2
    print(f"{path}: ok")
    print(f"  listen {conf.listen} (workers: {conf.worker_endpoint(conf.devices[0])} ...)")
    print(f"  backend {conf.backend}, devices {list(conf.devices)}, depth {conf.depth}")
    print(f"  cpu_affinity {conf.cpu_affinity}")
    from graphlane.workers.affinity import idle_spin_us

    spin = idle_spin_us(conf.idle_spin_us, len(conf.devices))
    print(f"  idle_spin_us {conf.idle_spin_us} ({spin:g} us on this host)")
    if conf.tensor_parallel > 1:
        from graphlane.orchestrator.groups import group_devices

        groups = group_devices(conf.devices, conf.tensor_parallel)
        print(
            f"  tensor_parallel {conf.tensor_parallel}: groups "
            f"{[list(g) for g in groups.groups]}, clients reach devices {groups.leaders()}"
        )
    if conf.admin_keys is not None:
        print(f"  admin_keys {list(conf.admin_keys)} (drain, shutdown)")
    for p in conf.programs:
        keys = ", ".join(f"{k}={v}" for k, v in p.items() if k != "name")
        clients = conf.program_clients.get(p["name"])
        if clients is not None:
            keys += (", " if keys else "") + f"clients={list(clients)}"
        print(f"  program {p['name']}" + (f": {keys}" if keys else ""))
    return 0
