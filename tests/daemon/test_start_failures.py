"""Worker start failures (issues 27 and 29): a failure that would recur (a program's
error in its capture, a missing dependency, a device that does not exist) fails the
worker once, with its cause, and is not restarted; a daemon whose every worker failed
exits 1 at once, its exit message naming the cause. (Transient failures are still
restarted: see test_reliability.py and test_errors_and_faults.py.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from daemons import RunningDaemon, write_config

WORKERS_TESTS = str(Path(__file__).parents[1] / "workers")  # the custom programs


def serve_until_exit(tmp_path: Path, config: dict[str, Any], *flags: str) -> tuple[int, str]:
    """``graphlane serve`` that is expected to exit by itself: its exit code and log."""
    listen = f"ipc://{tmp_path}/daemon/daemon.sock"
    path = write_config(tmp_path / "daemon.toml", {"listen": listen, **config})
    paths = [WORKERS_TESTS, *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    log_path = tmp_path / "daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "graphlane", "serve", "--config", str(path), *flags],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        code = proc.wait(100)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, log_path.read_text(errors="replace")


def exit_message(log: str) -> str:
    """The daemon's last word: one line saying why it exits 1."""
    lines = [ln for ln in log.splitlines() if " graphlane.daemon " in ln and "exit 1" in ln]
    assert len(lines) == 1, log[-3000:]
    return lines[0]


def test_a_program_failing_in_its_capture_fails_once_and_the_daemon_exits_with_the_cause(
    tmp_path: Path,
) -> None:
    """The program names a plain torch op where torch_npu's name is expected, inside an
    open task group: the cause is that name, not the group the error left open."""
    program = {"name": "misnamed_op_program:MisnamedOp"}
    code, log = serve_until_exit(tmp_path, {"devices": 1, "programs": [program]})
    assert code == 1, log[-3000:]
    assert log.count("worker start device=") == 1, log[-3000:]  # never restarted
    message = exit_message(log)
    assert "torch_npu has no op 'mm'" in message and "task group" not in message
    # The worker's log has the traceback, down to the author's line.
    assert "Traceback" in log and "misnamed_op_program.py" in log


@pytest.mark.skipif(
    importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here"
)
def test_backend_npu_without_torch_npu_fails_once_and_the_daemon_exits_naming_it(
    tmp_path: Path,
) -> None:
    code, log = serve_until_exit(tmp_path, {"devices": 2}, "--backend", "npu")
    assert code == 1, log[-3000:]
    assert log.count("worker start device=") == 2, log[-3000:]  # one per device, no restart
    assert "torch_npu" in exit_message(log)


def test_a_device_that_does_not_exist_is_failed_without_restarts_beside_one_that_serves(
    start_daemon,
) -> None:
    """The simulated NPU has devices 0..7: device 8's worker fails for good at once and
    says why in status, while device 0 serves."""
    d: RunningDaemon = start_daemon(devices=[0, 8])
    workers = {w["device"]: w for w in d.status()["workers"]}
    assert workers[0]["state"] == "ready"
    bad = workers[8]
    assert (bad["state"], bad["restarts"]) == ("failed", 0), bad
    assert "npu:8" in bad["last_error"]
    assert d.log().count("worker start device=8") == 1
