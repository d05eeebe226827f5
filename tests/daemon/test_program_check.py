"""The daemon imports no torch and reads no model to check a config (issue 41): a
program's own keys are checked by the worker that builds it, which reports one it cannot
load in one line; the daemon relays it and, every worker failing for good, exits 1.
``graphlane config check`` builds the programs in its own process and names the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from daemons import finish, launch, write_config

from graphlane.cli import main


def test_a_program_the_worker_cannot_build_is_relayed_in_one_line(
    tmp_path: Path, capsys: Any
) -> None:
    cfg = write_config(
        tmp_path / "bad.toml",
        {"listen": f"ipc://{tmp_path}/bad/daemon.sock", "devices": 1,
         "programs": [{"name": "attention", "layers": 0}]},
    )  # fmt: skip
    log_path = tmp_path / "bad.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "graphlane", "serve", "--config", str(cfg)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        assert proc.wait(120) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    failed = [line for line in text.splitlines() if "every worker failed" in line]
    assert failed and "programs.attention.layers: must be a positive integer" in failed[-1]
    assert "Traceback" not in text  # a mistake in the config is its line, not a bug's trace
    assert main(["config", "check", str(cfg)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "programs.attention.layers" in err[0]


def test_a_group_whose_model_directory_is_missing_exits_in_one_line(tmp_path: Path) -> None:
    # Every rank of a tensor-parallel group fails to load the program: serve exits 1 at
    # once (no rank waits for the others' rendezvous), naming the key, with no traceback.
    cfg = write_config(
        tmp_path / "nomodel.toml",
        {"listen": f"ipc://{tmp_path}/nomodel/daemon.sock", "devices": 2,
         "programs": [{"name": "model", "model": str(tmp_path / "absent"),
                       "tensor_parallel": 2}]},
    )  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "graphlane", "serve", "--config", str(cfg)],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr[-2000:]
    lines = run.stderr.splitlines()
    assert "every worker failed" in lines[-1] and "programs.model.model" in lines[-1], lines[-1]
    assert "Traceback" not in run.stderr


def test_a_serving_daemon_has_no_torch_loaded(shared_daemon: Any) -> None:
    """Its process maps no torch library (its workers do)."""
    d = shared_daemon(devices=1)
    maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
    assert "libtorch" not in maps
    worker = d.worker(0)["pid"]
    assert "libtorch" in Path(f"/proc/{worker}/maps").read_text()


def test_a_step_sent_to_the_daemon_itself_loads_no_torch_there(tmp_path: Path) -> None:
    """A careless client sends a device op with tensors (one inline, one in a frame) to the
    daemon's own socket: refused as an op of the workers' endpoints, its tensors checked
    against their frames but never made, so the daemon still maps no torch."""
    import torch
    import zmq

    from graphlane.protocol import ops, wire

    d = launch(tmp_path, "careless", devices=1)
    try:
        codec = wire.Codec()
        body = ops.Step("attention", 0, inputs={"small": torch.ones(4),
                                                "large": torch.ones(4096)})  # fmt: skip
        ctx = zmq.Context.instance()
        with ctx.socket(zmq.DEALER) as sock:
            sock.connect(d.endpoint)
            sock.send_multipart(codec.encode_request(7, "step", body))
            assert sock.poll(30_000), "no reply within 30 s"
            (reply,) = codec.decode_replies(sock.recv_multipart(copy=False))
        assert isinstance(reply, wire.Reply) and reply.error is not None
        maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
        assert "libtorch" not in maps
        assert d.status()["workers"][0]["state"] == "ready"
    finally:
        finish(d)
