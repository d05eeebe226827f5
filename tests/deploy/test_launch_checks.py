"""deploy/launch.sh start checks that the daemon answering is the one it started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_deploy import LAUNCH, output, small_config


def _launch(tmp_path: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """launch.sh with this interpreter's graphlane (the checkout under test)."""
    wrapper = tmp_path / "bin" / "graphlane"
    wrapper.parent.mkdir(exist_ok=True)
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m graphlane "$@"\n')
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHLANE_")}
    env["GRAPHLANE_BIN"] = str(wrapper)
    cmd = [str(LAUNCH), *map(str, args)]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, env=env, stdin=subprocess.DEVNULL
    )


def test_launch_sh_start_refuses_someone_else_s_daemon(shared_daemon, tmp_path: Path) -> None:
    other = shared_daemon(transport="tcp", devices=2)
    run_dir = tmp_path / "run"
    started = _launch(
        tmp_path, "start", "--backend", "sim", "--devices", "4", "--run-dir", run_dir,
        "--listen", other.endpoint, "--config", small_config(tmp_path),
    )  # fmt: skip
    try:
        assert started.returncode == 1, output(started)
        assert "graphlane ready" not in started.stdout, output(started)
        assert "exited with status 1 before it was ready" in started.stderr
        port = other.endpoint.rpartition(":")[2]
        assert f"port {port}" in started.stderr and "is in use" in started.stderr
        assert "Traceback" not in started.stderr, output(started)
        assert not (run_dir / "graphlane.pid").exists()
        assert other.status()["ready"]  # the other daemon serves on, untouched
    finally:
        if (run_dir / "graphlane.pid").exists():
            _launch(tmp_path, "stop", "--run-dir", run_dir)
