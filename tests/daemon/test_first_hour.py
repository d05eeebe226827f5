"""What a new user meets in the first hour (issue 16): each mistake or failure gets a
clear one-line answer, never a traceback, a hang or a wrong "ok"."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from daemons import SMALL, free_port, wait_for

from graphlane.client import Client, SyncClient
from graphlane.loadtest import LoadConfig, run_load
from graphlane.loadtest.availability import BACKOFF_CAP_S, Backoff, DeviceBackoff
from graphlane.protocol.errors import BadRequest, GraphlaneError, UnknownProgram

ROOT = Path(__file__).resolve().parents[2]
SHAPE = {k: SMALL[k] for k in ("layers", "num_heads", "num_kv_heads", "head_dim", "max_kv_len")}


# ---------------------------------------------------------------------------- 1. load test
def test_backoff_doubles_with_jitter_up_to_its_cap() -> None:
    import random

    b = Backoff(random.Random(1), first_s=0.01, cap_s=1.0)
    delays = [b.next_delay() for _ in range(12)]
    for i, d in enumerate(delays):
        top = min(1.0, 0.01 * 2**i)
        assert top / 2 <= d <= top
    b.success()
    assert b.next_delay() <= 0.01

    held = DeviceBackoff(random.Random(2))
    held.failure(1, now=100.0)
    assert held.held(1, 100.0) and not held.held(0, 100.0)
    assert held.all_held((0, 1), 100.0) is None  # device 0 serves: draw it instead
    held.failure(0, now=100.0)
    release = held.all_held((0, 1), 100.0)
    assert release is not None and 100.0 < release <= 100.01
    held.success(1)
    assert not held.held(1, 100.0) and held.all_held((0, 1), 100.0) is None


def test_a_load_test_against_a_daemon_that_dies_fails_and_backs_off(
    start_daemon, tmp_path: Path
) -> None:
    d = start_daemon(devices=1)
    concurrency = 4
    config = LoadConfig(
        d.endpoint, 120.0, concurrency=concurrency, shape=SHAPE, progress=False,
        timeout_s=5.0, report_dir=str(tmp_path / "report"),
    )  # fmt: skip
    stop = asyncio.Event()

    async def scenario() -> dict:
        t0 = time.monotonic()
        run = asyncio.create_task(run_load(config, stop=stop))
        # Kill the daemon once it has served steps of the run (the worker reports its
        # count about once a second; the preflight's probe is one step).
        await asyncio.to_thread(wait_for, lambda: d.worker(0)["steps"] >= 5, 60, "steps served")
        t_kill = time.monotonic()
        d.send_signal(signal.SIGINT)
        await asyncio.to_thread(d.proc.wait, 60)
        # Keep sending while the server is gone for twice as long as it served.
        gone = 2 * (t_kill - t0) + 1.0
        await asyncio.to_thread(
            wait_for, lambda: time.monotonic() - t_kill > gone, 600, "the outage to last"
        )
        stop.set()
        return await run

    report = asyncio.run(scenario())
    assert d.stop() == 0  # the SIGINT drained it cleanly
    verdict = report["verdict"]
    assert report["steps"] > 0
    assert verdict["exit_code"] == 1 and not verdict["ok"], verdict
    assert any("unavailable" in r for r in verdict["reasons"]), verdict
    assert report["unavailable_share"] > report["max_unavailable"]
    # Bounded by the backoff: a few fast retries per caller, then one per half cap.
    bound = concurrency * (12 + report["unavailable_s"] / (BACKOFF_CAP_S / 2) + 2)
    assert report["errors_total"] <= bound, (report["errors"], report["unavailable_s"])


# ---------------------------------------------------------------------------- 4. programs
def _blocks(path: Path, lang: str) -> list[str]:
    """The fenced ```lang blocks of a Markdown file."""
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def test_the_docs_program_serves_by_module_path_and_bad_inputs_get_bad_request(
    start_daemon, tmp_path: Path, monkeypatch
) -> None:
    program, client_example = _blocks(ROOT / "docs" / "programs.md", "python")[:2]
    (tmp_path / "my_prefill.py").write_text(program)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), str(ROOT)]))
    table = {"name": "my_prefill:PrefillProgram", "heads": 2, "seq": 4}
    d = start_daemon(transport="tcp", devices=1, programs=[table])

    # The page's client example, as written, against this daemon.
    script = client_example.replace("tcp://127.0.0.1:7450", d.endpoint)
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "torch.Size([2, 2, 4, 8])"

    pid = d.worker(0)["pid"]

    async def calls() -> None:
        async with Client(d.endpoint, timeout=30) as c:
            hello = (await c.hello())["workers"][0]["programs"]["prefill"]
            assert hello["batch_param"] == "kv_len"
            q = torch.randn(2, 2, 4, 8, dtype=torch.float16)
            params = {"q_len": [4, 2], "kv_len": [8, 5]}
            bad = {
                "shape": {"query": q[:, :, :3]},
                "dtype": {"query": q.float()},
                "name": {"queries": q},
            }
            for why, inputs in bad.items():
                with pytest.raises(BadRequest) as err:
                    await c.step("prefill", 0, params, inputs)
                assert err.value.code == "BAD_REQUEST", why
                assert "inputs.quer" in str(err.value), (why, str(err.value))
            r = await c.step("prefill", 0, params, {"query": q})  # batch from kv_len
            assert tuple(r.outputs["out"].shape) == (2, 2, 4, 8)
            with pytest.raises(BadRequest, match=r"^BAD_REQUEST: params\.kv_len: missing"):
                await c.step("prefill", 0, {"q_len": [4]})

    asyncio.run(calls())
    w = d.worker(0)
    assert w["pid"] == pid and w["restarts"] == 0  # the worker never died


# ---------------------------------------------------------------------------- 7. client API
def test_client_takes_numpy_and_names_a_caller_s_mistake(shared_daemon) -> None:
    d = shared_daemon(devices=1)
    c = SMALL

    async def calls() -> None:
        async with Client(d.endpoint, timeout=30) as client:
            q = np.zeros((2, c["num_heads"], 1, c["head_dim"]), dtype=np.float16)
            lengths = np.array([3, 5])
            r = await client.step(
                "attention", np.int64(0), {"actual_seq_lengths_kv": lengths}, {"query": q}
            )
            assert tuple(r.outputs["out"].shape) == (2, c["num_heads"], 1, c["head_dim"])
            r = await client.step(
                "attention", 0, {"actual_seq_lengths_kv": [np.int32(4), np.int64(1)]}
            )
            assert r.bucket == 2

            with pytest.raises(
                GraphlaneError, match=r"^BAD_REQUEST: params\.actual_seq_length_kv: unknown"
            ):
                await client.step("attention", 0, {"actual_seq_length_kv": [3]})
            with pytest.raises(TypeError, match="device must be an int"):
                await client.step("attention", "0", {"actual_seq_lengths_kv": [3]})
            for timeout in (0, -1.0, float("nan")):
                with pytest.raises(ValueError, match="timeout must be a positive number"):
                    await client.step(
                        "attention", 0, {"actual_seq_lengths_kv": [3]}, timeout=timeout
                    )
                with pytest.raises(ValueError, match="timeout must be a positive number"):
                    await client.status(timeout=timeout)
            with pytest.raises(UnknownProgram):
                await client.step("atention", 0, {"actual_seq_lengths_kv": [3]})
            with pytest.raises(BadRequest, match="cannot send a value of type set"):
                await client.step("attention", 0, {"actual_seq_lengths_kv": {3}}, batch=1)
            # Still serving after every refusal.
            await client.step("attention", 0, {"actual_seq_lengths_kv": [3]})

    asyncio.run(calls())
    with SyncClient(d.endpoint, timeout=30) as sync:
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            sync.step("attention", 0, {"actual_seq_lengths_kv": [3]}, timeout=0)
        assert sync.step("attention", 0, {"actual_seq_lengths_kv": np.array([2])}).bucket == 1


# ---------------------------------------------------------------------------- 3. README
def test_the_readme_client_example_runs_as_written(start_daemon) -> None:
    (example,) = _blocks(ROOT / "README.md", "python")
    assert "asyncio.run(main())" in example
    d = start_daemon(transport="tcp", devices=1, programs=[{"name": "attention"}])
    script = example.replace("tcp://127.0.0.1:7450", d.endpoint)
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["torch.Size([2,", "8,", "1,", "64])", "True"]


# ---------------------------------------------------------------------------- 5. waiting, ports
def _serve(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "graphlane", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_status_wait_covers_a_daemon_that_is_not_up_yet(start_daemon) -> None:
    port = free_port(2)  # the daemon and its worker
    endpoint = f"tcp://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "graphlane", "status", "--connect", endpoint,
           "--wait", "120", "--timeout", "1"]  # fmt: skip
    status = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        # Nothing listens yet: the command keeps waiting past its per-request timeout.
        wait_for(lambda: time.monotonic() - t0 > 2.0, 10, "two per-request timeouts")
        assert status.poll() is None, status.communicate()
        start_daemon(devices=1, listen=endpoint)
        out, err = status.communicate(timeout=120)
    finally:
        if status.poll() is None:
            status.kill()
            status.communicate()
    assert status.returncode == 0, err
    assert "ready=True" in out


def test_a_port_in_use_is_one_line_naming_it(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # The daemon's own port.
        run = _serve("--listen", f"tcp://127.0.0.1:{port}", "--devices", "1")
        assert run.returncode == 1
        assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
        assert f"port {port}" in run.stderr and "is in use" in run.stderr
        # A worker's port: listen + 1 + device id.
        run = _serve("--listen", f"tcp://127.0.0.1:{port - 2}", "--devices", "2")
        assert run.returncode == 1
        assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
        assert f"port {port}" in run.stderr and "device 1's worker" in run.stderr
        assert "listen port + 1 + device id" in run.stderr


def test_a_daemon_whose_workers_can_never_start_exits_with_the_reason(tmp_path: Path) -> None:
    from daemons import write_config

    try:
        import torch_npu  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torch_npu is installed here")
    cfg = write_config(
        tmp_path / "npu.toml",
        {"listen": f"ipc://{tmp_path}/npu/daemon.sock", "backend": "npu", "devices": 2,
         "max_restarts": 1, "programs": [SMALL]},
    )  # fmt: skip
    run = _serve("--config", str(cfg))
    assert run.returncode == 1, run.stderr[-2000:]
    last = [line for line in run.stderr.splitlines() if "exit 1: every worker failed" in line]
    assert last and "torch_npu" in last[0] and "devices 0, 1" in last[0]  # one cause, once


# ---------------------------------------------------------------------------- 6. authentication
def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "graphlane", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _one_line_error(run: subprocess.CompletedProcess[str], code: int = 2) -> str:
    assert run.returncode == code, run.stderr
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    return run.stderr


def test_keys_flags_and_a_curve_load_test(start_daemon, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    for where, name in ((keys, "server"), (keys / "clients", "sched")):
        assert _cli("keys", "generate", str(where), "--name", name).returncode == 0
    server, secret = str(keys / "server.key"), str(keys / "clients" / "sched.key_secret")

    err = _one_line_error(_cli("status", "--client-key", secret))
    assert "--client-key needs --server-key" in err
    err = _one_line_error(_cli("status", "--server-key", server, "--client-key", server))
    assert "holds no secret key" in err

    admitted = {"server_key": server, "client_key": secret}
    d = start_daemon("tcp", devices=1, client_keys=admitted, auth_dir=str(keys))
    common = ["loadtest", "--connect", d.endpoint, "--concurrency", "2", "--duration", "1",
              "--no-progress", "--report", str(tmp_path / "report"), "--shape",
              ",".join(f"{k}={v}" for k, v in SHAPE.items())]  # fmt: skip
    err = _one_line_error(_cli(*common, "--client-key", secret))
    assert "--client-key needs --server-key" in err
    run = _cli(*common, "--server-key", server, "--client-key", secret)
    assert run.returncode == 0, run.stderr
    assert "result" in run.stdout and "ok" in run.stdout


def test_keys_generate_warns_about_a_secret_in_a_repository(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True, capture_output=True)
    run = _cli("keys", "generate", str(repo / "keys"), "--name", "server")
    assert run.returncode == 0
    assert "warning" in run.stderr and ".gitignore" in run.stderr
    (repo / ".gitignore").write_text("*.key_secret\n")
    run = _cli("keys", "generate", str(repo / "keys"), "--name", "client")
    assert run.returncode == 0 and run.stderr == ""
    # Without DIR: the per-user config directory, outside any repository.
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    run = _cli("keys", "generate", "--name", "me", env=env)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "config" / "graphlane" / "keys" / "me.key_secret").exists()
