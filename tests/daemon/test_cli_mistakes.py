"""Ordinary mistakes end in one line and an exit status, never a traceback (issue 27):
a worker's endpoint given for the daemon's, a stdout closed early, Ctrl-C wherever it
lands in a load test, and the client taking what a user naturally passes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from daemons import SMALL, RunningDaemon, wait_for

from graphlane.client import Client, SyncClient
from graphlane.client.args import InvalidArgument
from graphlane.protocol.endpoints import InvalidEndpoint

# Small enough to capture fast; the same table as the paged load test's.
PAGED = {"name": "paged_attention", "layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 16, "block_size": 128, "num_blocks": 6, "max_blocks_per_seq": 2,
         "buckets": [4]}  # fmt: skip
BOTH = [SMALL, PAGED]
INTERRUPTED = "graphlane loadtest: interrupted"


def _cli(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "graphlane", *args]
    kw.setdefault("capture_output", True)
    return subprocess.run(cmd, text=True, timeout=180, **kw)


def _one_line(run: subprocess.CompletedProcess[str], code: int) -> str:
    assert run.returncode == code, run.stderr
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    return run.stderr


def _loadtest_args(endpoint: str, report: Path, *extra: str) -> list[str]:
    return ["loadtest", "--connect", endpoint, "--concurrency", "2", "--duration", "120",
            "--report", str(report), "--no-progress", *extra]  # fmt: skip


# ---------------------------------------------------------------------------- a worker's endpoint
def test_a_worker_endpoint_given_for_the_daemon_s_is_named_as_such(
    start_daemon, tmp_path: Path
) -> None:
    """Status prints each worker's endpoint; given one of them, status, loadtest and the
    client say which device's worker it is instead of failing on a missing key. The
    daemon listens on port 0 here: any free port, and status shows the real ones."""
    d: RunningDaemon = start_daemon("tcp", devices=1, listen="tcp://127.0.0.1:0")
    st = d.status()
    worker = st["workers"][0]["endpoint"]
    for endpoint in (st["endpoint"], worker):
        assert int(endpoint.rpartition(":")[2]) > 0, st
    assert d.endpoint == st["endpoint"]

    err = _one_line(_cli("status", "--connect", worker), 2)
    assert worker in err and "device 0's worker" in err
    err = _one_line(_cli(*_loadtest_args(worker, tmp_path / "r")), 2)
    assert worker in err and "device 0's worker" in err

    async def client() -> None:
        with pytest.raises(InvalidEndpoint) as exc:
            async with Client(worker, timeout=30):
                pass
        assert exc.value.code == "BAD_REQUEST"

    asyncio.run(client())


# ---------------------------------------------------------------------------- serve's flags
@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--devices", "0,x"], "--devices"),
        (["--devices", "-2"], "--devices"),
        (["--listen", "tcp://127.0.0.1"], "--listen"),
        (["--metrics-port", "70000"], "--metrics-port"),
        (["--auth-dir", "/nonexistent"], "--auth-dir"),
    ],
)
def test_serve_names_a_bad_flag_as_the_flag(
    args: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A flag's bad value is named as the flag typed (``--devices``), not as the file key
    it sets (``devices``): one line, exit 2, nothing started."""
    from graphlane.cli import main

    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"configuration error: {named}: " in err, err


# ---------------------------------------------------------------------------- client arguments
def _paged_step() -> dict[str, Any]:
    """A one-row paged decode step (its KV slot 2, in blocks 0 and 1)."""
    new = torch.zeros(PAGED["layers"], 1, PAGED["num_kv_heads"], PAGED["head_dim"],
                      dtype=torch.float16)  # fmt: skip
    return {
        "params": {"actual_seq_lengths_kv": [3]},
        "inputs": {"query": torch.zeros(1, PAGED["num_heads"], PAGED["head_dim"],
                                        dtype=torch.float16),
                   "key": new, "value": new.clone(), "slot_mapping": torch.tensor([2]),
                   "block_table": torch.tensor([[0, 1]], dtype=torch.int32)},
    }  # fmt: skip


def test_a_step_without_outputs_gets_every_output_of_its_program(shared_daemon) -> None:
    d = shared_daemon(devices=1, programs=BOTH)
    with SyncClient(d.endpoint, timeout=30) as c:
        r = c.step("paged_attention", 0, **_paged_step())
        assert set(r.outputs) == {"out", "lse"}  # as hello lists them
        assert set(c.step("attention", 0, {"actual_seq_lengths_kv": [3]}).outputs) == {"out"}
        assert set(c.replay("attention", 0, 1).outputs) == {"out"}
        r = c.step("paged_attention", 0, outputs="lse", **_paged_step())  # one name
        assert set(r.outputs) == {"lse"}


def test_kv_slots_take_a_list_and_a_wrong_argument_is_named(shared_daemon) -> None:
    d = shared_daemon(devices=1, programs=BOTH)
    kv = (PAGED["layers"], 2, PAGED["num_kv_heads"], PAGED["head_dim"])
    key = torch.randn(kv, dtype=torch.float16)
    value = torch.randn(kv, dtype=torch.float16)
    with SyncClient(d.endpoint, timeout=30) as c:
        for slots in ([0, 1], (0, 1), range(2), np.array([0, 1]), torch.tensor([0, 1])):
            c.kv_write("paged_attention", 0, slots, key, value)
            back = c.kv_read("paged_attention", 0, slots)
            assert torch.equal(back.outputs["key"], key), type(slots)
        # Anything else is refused at the call, naming the argument.
        refusals = [
            ("slots", lambda: c.kv_write("paged_attention", 0, [0.5, 1], key, value)),
            ("slots", lambda: c.kv_read("paged_attention", 0, "0,1")),
            ("slots", lambda: c.kv_read("paged_attention", 0, torch.tensor([[0, 1]]))),
            ("key", lambda: c.kv_write("paged_attention", 0, [0, 1], key.tolist(), value)),
            ("inputs.query", lambda: c.step("attention", 0, {"actual_seq_lengths_kv": [3]},
                                            {"query": [[0.0]]})),
        ]  # fmt: skip
        for name, call in refusals:
            with pytest.raises(InvalidArgument) as err:
                call()
            assert err.value.code == "BAD_REQUEST", name
            assert err.value.message.startswith(name), (name, err.value.message)
        assert set(c.step("attention", 0, {"actual_seq_lengths_kv": [3]}).outputs) == {"out"}


# ---------------------------------------------------------------------------- a closed stdout
def test_status_into_a_closed_pipe_exits_quietly(shared_daemon) -> None:
    d = shared_daemon(devices=1)
    r, w = os.pipe()
    os.close(r)  # `graphlane status | head -0`: the reader is gone before any write
    try:
        run = _cli("status", "--connect", d.endpoint, capture_output=False, stdout=w,
                   stderr=subprocess.PIPE)  # fmt: skip
    finally:
        os.close(w)
    assert (run.returncode, run.stderr) == (141, "")


# ---------------------------------------------------------------------------- Ctrl-C
_SIGINT_AT_IMPORT = """
import sys

def hook(event, args):  # Ctrl-C while the command first imports torch
    if event == "import" and args[0] == "torch" and not hook.done:
        hook.done = True
        # What Python's SIGINT handler raises, raised here: a real signal is acted on at
        # the interpreter's next check, wherever that falls; once, in a suite run with two
        # CPU-bound neighbours, it was lost inside torch's import and the command ran on.
        raise KeyboardInterrupt

hook.done = False
sys.addaudithook(hook)
from graphlane.cli import main  # as the graphlane script does
sys.exit(main())
"""


def test_ctrl_c_before_the_run_is_one_line_and_130(tmp_path: Path) -> None:
    # While the command loads (the first second of a cold start).
    run = subprocess.run(
        [sys.executable, "-c", _SIGINT_AT_IMPORT, *_loadtest_args("ipc:///x", tmp_path / "r")],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert _one_line(run, 130).strip() == INTERRUPTED
    # While it waits for hello: something accepted the connection and never answers.
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        endpoint = f"tcp://127.0.0.1:{mute.getsockname()[1]}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "graphlane", *_loadtest_args(endpoint, tmp_path / "r")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            mute.settimeout(120)
            conn, _ = mute.accept()  # the load test is connecting
            with conn:
                proc.send_signal(signal.SIGINT)
                _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 130 and err.strip() == INTERRUPTED, err


def _steps(d: RunningDaemon) -> int:
    return sum(int(w.get("steps", 0)) for w in d.status()["workers"])


@pytest.mark.parametrize("program", ["attention", "paged_attention"])
def test_ctrl_c_during_the_run_reports_so_far_then_says_interrupted(
    shared_daemon, tmp_path: Path, program: str
) -> None:
    """The first Ctrl-C of a run ends its sending: the summary and report of the steps
    so far, then one line on stderr and 130, for either workload."""
    d: RunningDaemon = shared_daemon(devices=1, programs=BOTH)
    before = _steps(d)
    report = tmp_path / "r"
    proc = subprocess.Popen(
        [sys.executable, "-m", "graphlane",
         *_loadtest_args(d.endpoint, report, "--program", program)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # Past attention's probe step: the run itself is stepping.
        wait_for(lambda: proc.poll() is not None or _steps(d) > before + 1, 120, "the run")
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    # Two lines: the stop said at once, then the verdict once the report is written.
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and len(lines) == 2, err
    assert "stopping (Ctrl-C)" in lines[0] and lines[1] == INTERRUPTED, err
    assert "interrupted after" in out
    assert json.loads((report / "report.json").read_text())["interrupted"] is True
