"""The worker process on its own (no orchestrator, no client library): a real worker
process running worker_main, its pipe, and a DEALER on its socket.

A reply that cannot be encoded becomes an INTERNAL error and the worker serves on,
whether the step was answered on the spot (null) or from the completion thread
(sim); a bundle is answered call by call; a step whose ``timeout_ms`` passes while
it waits for the device is answered TIMEOUT without running."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from graphlane.protocol import ops, wire

TINY = {
    "name": "attention",
    "layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 8,
    "max_kv_len": 8,
    "buckets": [1],
}


def _request(request_id: int, **fields: Any) -> list[bytes | memoryview]:
    body = ops.Step("attention", 0, {"actual_seq_lengths_kv": [2]}, outputs=["out"], **fields)
    return wire.encode_request(request_id, "step", body)


def _step_done(reply: wire.Reply) -> ops.DeviceResult:
    done: ops.DeviceResult = reply.body(ops.OPS["step"])
    return done


# The worker process: worker_main as the supervisor runs it, with the orchestrator's end
# of the pipe relayed to this test through stdin/stdout (so that no multiprocessing
# helper process outlives the test in pytest's own process).
LAUNCHER = """
import json, multiprocessing, sys, threading
from graphlane.protocol import pipe
from graphlane.workers.worker import WorkerSpec, worker_main
here, there = multiprocessing.Pipe()
def orchestrator():
    ready = pipe.recv(here)
    print(json.dumps(ready.info if isinstance(ready, pipe.Ready) else None), flush=True)
    sys.stdin.readline()
    pipe.send(here, pipe.Finish(stop=True))
threading.Thread(target=orchestrator, daemon=True).start()
worker_main(WorkerSpec(**json.loads(sys.argv[1])), there)
"""


class WorkerClient:
    """A worker process and a DEALER connected to its socket."""

    def __init__(self, proc: subprocess.Popen[str], sock: zmq.Socket[Any]) -> None:
        self.proc, self.sock = proc, sock

    def replies(self, n: int, timeout_s: float = 60) -> list[list[wire.Reply | wire.DecodeError]]:
        """The next messages until they hold ``n`` replies, one list per message."""
        messages: list[list[wire.Reply | wire.DecodeError]] = []
        while sum(map(len, messages)) < n:
            assert self.sock.poll(int(timeout_s * 1000)), f"{n} replies did not come"
            messages.append(wire.decode_replies(self.sock.recv_multipart()))
        return messages

    def by_id(self, n: int) -> dict[int, wire.Reply]:
        out = {}
        for message in self.replies(n):
            for r in message:
                assert isinstance(r, wire.Reply), r
                out[r.id] = r
        return out

    def status(self) -> dict[str, Any]:
        self.sock.send_multipart(wire.encode_request(999_999, "status", ops.Status()))
        reply = self.by_id(1)[999_999]
        assert reply.error is None
        status: dict[str, Any] = reply.body(ops.OPS["status"])
        return status


@contextlib.contextmanager
def serving(tmp_path: Path, backend: str, **spec: Any) -> Iterator[WorkerClient]:
    """A worker process for device 0 on an ipc endpoint; drained and stopped at the end."""
    spec = {"programs": [TINY], **spec, "device": 0, "backend": backend,
            "endpoint": f"ipc://{tmp_path}/worker.sock"}  # fmt: skip
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parents[1]), str(here)])}
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, json.dumps(spec)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    zctx: zmq.Context[Any] = zmq.Context()
    sock = zctx.socket(zmq.DEALER)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        info = json.loads(proc.stdout.readline() or "null")
        assert info, "the worker did not start"
        sock.connect(info["endpoint"])
        yield WorkerClient(proc, sock)
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        assert proc.wait(60) == 0, f"the worker exited with {proc.returncode}"
    finally:
        sock.close(0)
        zctx.destroy(linger=0)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


@pytest.mark.parametrize("backend", ["null", "sim"])
def test_an_unsendable_reply_becomes_an_internal_error_and_the_worker_serves_on(
    tmp_path: Path, backend: str
) -> None:
    program = {**TINY, "name": "unsendable_program:FirstOutputUnsendable"}
    with serving(tmp_path, backend, programs=(program,)) as w:
        w.sock.send_multipart(_request(1))
        w.sock.send_multipart(_request(2))
        replies = w.by_id(2)
        first, second = replies[1], replies[2]
        assert first.error is not None and first.error.code == "INTERNAL"
        assert "complex64" in first.error.message
        assert _step_done(second).outputs["out"].shape[0] == 1
        status = w.status()
        assert status["inflight"] == 0 and status["failure"] is None
        assert status["steps"] == 2 and status["counters"]["errors"] == 1


@pytest.mark.parametrize("backend", ["null", "sim"])
def test_a_bundle_is_answered_call_by_call_and_a_bad_call_fails_alone(
    tmp_path: Path, backend: str
) -> None:
    bad = wire.encode_request(
        2, "step", ops.Step("attention", 0, {"actual_seq_lengths_kv": "x"}, outputs=["out"])
    )
    envelopes = [bytes(_request(1)[0]), bytes(bad[0]), bytes(_request(3)[0])]
    with serving(tmp_path, backend) as w:
        w.sock.send(wire.bundle(envelopes))
        messages = w.replies(3)
        replies = {r.id: r for m in messages for r in m if isinstance(r, wire.Reply)}
        assert sorted(replies) == [1, 2, 3]
        assert _step_done(replies[1]).outputs["out"].shape[0] == 1
        assert _step_done(replies[3]).outputs["out"].shape[0] == 1
        error = replies[2].error
        assert error is not None and error.code == "BAD_REQUEST"
        assert "actual_seq_lengths_kv" in error.message
        assert len(messages) <= 3  # how the replies group depends on when the steps finish
        counters = w.status()["counters"]
        assert counters["bundles"] == 1 and counters["requests"] == 4  # and the status


def test_replies_to_a_large_bundle_come_in_bundles_a_client_can_read(tmp_path: Path) -> None:
    """As many status requests in one bundle as a worker takes (Limits.max_bundle): their
    replies (about 200 KB in all) come back as several bundles, each within the reader's
    1 MiB envelope limit (a bundle of another sender: graphlane's make none of more than
    wire.BUNDLE_MAX)."""
    n = wire.DEFAULT_LIMITS.max_bundle
    envelopes = [bytes(wire.encode_request(i + 1, "status", ops.Status())[0]) for i in range(n)]
    with serving(tmp_path, "null") as w:
        w.sock.send(b"\xdc" + n.to_bytes(2, "big") + b"".join(envelopes))
        ids: list[int] = []
        sizes: list[int] = []
        while len(ids) < n:
            assert w.sock.poll(60_000), f"{n - len(ids)} replies never came"
            frames = w.sock.recv_multipart()
            sizes.append(len(frames[0]))
            for r in wire.decode_replies(frames):  # default limits: a client's
                assert isinstance(r, wire.Reply) and r.error is None, r
                ids.append(r.id)
        assert sorted(ids) == list(range(1, n + 1))
        assert sum(sizes) > wire.BUNDLE_BYTES and len(sizes) > 1
        assert max(sizes) <= wire.BUNDLE_BYTES


def test_a_step_past_its_deadline_while_queued_is_answered_timeout_unrun(tmp_path: Path) -> None:
    """A slow device (timed sim, 50 ms per replay): eight steps take every in-flight
    permit; a ninth with timeout_ms=1 waits behind them, is answered TIMEOUT and never
    runs; a tenth without a deadline runs."""
    sim = {"mode": "timed", "task_us": 50_000.0, "patch_us": 0.0}
    with serving(tmp_path, "sim", sim=sim) as w:
        for i in range(8):
            w.sock.send_multipart(_request(i + 1))
        w.sock.send_multipart(_request(9, timeout_ms=1))
        w.sock.send_multipart(_request(10))
        replies = w.by_id(10)
        late = replies.pop(9)
        assert late.error is not None and late.error.code == "TIMEOUT"
        assert all(r.error is None for r in replies.values())
        assert w.status()["steps"] == 9  # the late step was not run
