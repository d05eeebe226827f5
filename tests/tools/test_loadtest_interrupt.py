"""Ctrl-C on ``graphlane loadtest``, as a user gives it: SIGINT to the command's process
mid-run, for every program it drives (independent calls, a paged KV cache, a model with
and without ``--num-prompts``). The run ends at once, not when ``--duration`` or
``--timeout`` would have ended it: "interrupted", exit 130, a report of what ran with
the real sending time."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
from daemons import SMALL, RunningDaemon

from graphlane.client import Client
from graphlane.demo_model import PROGRAM_TOML

pytestmark = pytest.mark.timeout(300)

MODEL = tomllib.loads(PROGRAM_TOML)["programs"][0]
PAGED = {"name": "paged_attention", "layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 16, "block_size": 128, "num_blocks": 6, "max_blocks_per_seq": 2,
         "buckets": [4]}  # fmt: skip
#: What the command is asked for: far longer than the test waits before Ctrl-C.
DURATION_S = 120.0

#: The calls in flight get a short drain at a Ctrl-C, not --timeout: a stalled worker's
#: (SIGSTOP, until the command exited) would have held the run for all of it.
TIMEOUT_S = 20.0
RUNS = {
    "attention, its worker stalled": ["--program", "attention", "--concurrency", "2"],
    "paged": ["--program", "paged_attention", "--concurrency", "4", "--prompt-lens", "1,100",
              "--decode-tokens", "4,8"],
    "model, its worker stalled": ["--program", "model", "--request-rate", "20",
                                  "--prompt-len", "16", "--output-len", "24"],
    # Issue 43: with --num-prompts, a Ctrl-C ran on to the full duration.
    "model --num-prompts": ["--program", "model", "--request-rate", "10", "--num-prompts",
                            "100000", "--prompt-len", "16", "--output-len", "24"],
}  # fmt: skip


async def _steps(endpoint: str) -> int:
    async with Client(endpoint, timeout=30) as c:
        return int((await c.worker_status(0))["steps"])


def _wait_for_steps(d: RunningDaemon, proc: subprocess.Popen[bytes], more: int) -> None:
    """Until the daemon ran ``more`` steps of the load test's (it may have run others)."""
    before = asyncio.run(_steps(d.endpoint))
    deadline = time.monotonic() + DURATION_S / 2
    while asyncio.run(_steps(d.endpoint)) < before + more:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"the load test ran no steps (exit {proc.returncode}): {err.decode()}")
        time.sleep(0.05)


def _main_thread(pid: int) -> tuple[str, int]:
    """The load test's main thread: its state (R running or runnable, S asleep) and its
    time on a CPU so far (ns)."""
    with open(f"/proc/{pid}/task/{pid}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        return state, int(f.read().split()[0])


def _wait_until_idle(pid: int) -> None:
    """Until the load test's main thread has been almost idle for 0.1 s, asleep at both
    ends (a thread that waits for a core is not idle), at most 30 s: with its worker
    stalled, it has then taken every reply the worker sent before the stop and sent the
    calls that replace them, which the worker holds. A Ctrl-C that came first (a busy
    host's scheduling) found no call in flight to abandon."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state, before = _main_thread(pid)
        time.sleep(0.1)
        state_after, after = _main_thread(pid)
        if state == state_after == "S" and after - before < 5_000_000:  # under 5% of a core
            return


@pytest.mark.parametrize("run", list(RUNS))
def test_ctrl_c_ends_any_load_test_at_once_and_reports_what_ran(
    shared_daemon: Any, tmp_path: Path, run: str
) -> None:
    d: RunningDaemon = shared_daemon(devices=1, programs=[SMALL, PAGED, MODEL])
    out = tmp_path / "report"
    argv = [sys.executable, "-m", "graphlane", "loadtest", "--connect", d.endpoint,
            "--duration", str(DURATION_S), "--timeout", str(TIMEOUT_S), "--report",
            str(out), "--no-progress", *RUNS[run]]  # fmt: skip
    stall = d.worker(0)["pid"] if "stalled" in run else None
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_for_steps(d, proc, 3)
        if stall is not None:
            os.kill(stall, signal.SIGSTOP)
            _wait_until_idle(proc.pid)  # its calls sent, the stalled worker holding them
        signalled = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=DURATION_S)
        exited = time.monotonic()
    finally:
        if stall is not None:
            os.kill(stall, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr.decode()
    assert "interrupted" in stderr.decode()
    # Said at once, before the drain and the report's files (a few seconds of plots on a
    # busy host): the user knows the Ctrl-C was taken.
    err = stderr.decode()
    assert 0 <= err.find("stopping (Ctrl-C)") < err.find("interrupted"), err
    report = json.loads((out / "report.json").read_text())
    assert report["interrupted"] is True
    assert report["steps"] > 0
    # What the run measured: it sent until the signal, not for the duration asked for...
    assert report["sending_s"] <= signalled - started < DURATION_S / 2
    # ... and it ended long before that duration would have (nor --timeout more).
    assert exited - signalled < (DURATION_S - report["sending_s"]) / 2, (
        exited - signalled, report["sending_s"],
    )  # fmt: skip
    # The calls in flight got a short drain at most, then were abandoned.
    assert report["elapsed_s"] - report["sending_s"] < TIMEOUT_S / 2
    if stall is not None:
        assert report["errors"].get("CLIENT_DEADLINE", 0) >= 1, report["errors"]
    if run.startswith("model"):
        assert "Serving Benchmark Result" in stdout.decode()
        assert report["verify_skipped"] and "interrupted" in report["verify_skipped"]
