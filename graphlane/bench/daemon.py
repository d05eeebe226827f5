"""The daemon a benchmark measures: ``graphlane serve`` in a child process on a private
ipc endpoint, with one program and the timed sim (unless told otherwise)."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class BenchDaemon:
    """``graphlane serve`` in a child process on a private ipc endpoint."""

    def __init__(
        self,
        program: dict[str, Any],
        devices: int = 1,
        sim: dict[str, Any] | None = None,
        max_queued: int = 4096,
        backend: str = "sim",
        settings: dict[str, Any] | None = None,
    ):
        """``settings``: more top-level keys of the config (``depth``, ``pipeline``);
        every other key is ``graphlane serve``'s default."""
        self.tmp = tempfile.TemporaryDirectory(prefix="graphlane-bench-")
        self.endpoint = f"ipc://{self.tmp.name}/daemon.sock"
        sim = sim or {"mode": "timed", "task_us": 0.0, "patch_us": 0.0}
        lines = [
            f'listen = "{self.endpoint}"',
            f"devices = {devices}",
            f"max_queued = {max_queued}",
            f'backend = "{backend}"',
        ]
        lines += [f"{k} = {str(v).lower() if isinstance(v, bool) else v}"
                  for k, v in (settings or {}).items()]  # fmt: skip
        lines.append("[sim]")
        lines += [f"{k} = {v!r}".replace("'", '"') for k, v in sim.items()]
        lines += ["[[programs]]", f'name = "{program.get("name", "attention")}"']
        lines += [f"{k} = {v}" for k, v in program.items() if k != "name"]
        cfg = Path(self.tmp.name, "bench.toml")
        cfg.write_text("\n".join(lines) + "\n")
        ready = Path(self.tmp.name, "ready")
        cmd = [sys.executable, "-m", "graphlane", "serve", "--config", str(cfg),
               "--ready-file", str(ready), "--log-level", "WARNING"]  # fmt: skip
        self.proc = subprocess.Popen(cmd)
        deadline = time.monotonic() + 180
        while not (ready.exists() and ready.stat().st_size):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the benchmark daemon did not start")
            time.sleep(0.05)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)
        self.tmp.cleanup()
