"""The supervisor on its own, with real worker processes: the restart handshake.

A worker that dies while the supervisor waits for a message on its pipe (the startup
handshake, or a health check's answer) is restarted, and the new worker's ``Ready``
is seen at once, even though its pipe may get the same fd number as the dead one's.
(Issue 28: the receive that was pending left a stale reader for the old fd number in
the event loop's selector; the new pipe's reader then replaced that stale entry's
callback without registering the new fd with epoll, so ``Ready`` was never read and
the worker stayed ``starting`` until the handshake timed out.)

The supervisor runs in a child process of the test (it spawns its workers with
multiprocessing, whose helper process must not outlive the test in pytest's own).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import asyncio, json, os, signal, sys, time
import zmq
from graphlane.orchestrator.supervisor import READY, STARTING, Supervisor
from graphlane.protocol import ops, wire
from graphlane.workers.worker import WorkerSpec

TINY = {"name": "attention", "layers": 1, "num_heads": 2, "num_kv_heads": 1,
        "head_dim": 8, "max_kv_len": 8, "buckets": [1]}
endpoint = f"ipc://{sys.argv[1]}/worker.sock"


def answers_hello(sock, request_id):
    sock.send_multipart(wire.encode_request(request_id, "hello", ops.Hello()))
    return bool(sock.poll(200)) and bool(sock.recv_multipart())


async def until(predicate, limit_s, what):
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {limit_s} s waiting for {what}")
        await asyncio.sleep(0.01)


async def main():
    spec = WorkerSpec(device=0, backend="null", programs=(TINY,), endpoint=endpoint)
    # The handshake timeout is far beyond this test: only the Ready itself can make
    # the restarted worker ready here.
    sup = Supervisor([spec], startup_timeout_s=600, backoff_s=(0.05, 0.05), poll_s=0.05)
    h = sup.workers[0]
    starting = asyncio.ensure_future(sup.start_all())
    await until(lambda: h.process is not None and h.state == STARTING, 60, "the first start")
    first = h.process.pid
    os.kill(first, signal.SIGKILL)  # while the supervisor waits for its handshake
    await until(lambda: h.process.pid != first, 60, "the restart")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    ids = iter(range(1, 10**6))
    try:
        # The new worker serves on its socket only after it sent Ready on its pipe.
        deadline = time.monotonic() + 90
        while not await asyncio.to_thread(answers_hello, sock, next(ids)):
            if time.monotonic() > deadline:
                raise SystemExit("the restarted worker never answered hello")
            sock.close(0)
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
        # Its Ready is on the pipe: the supervisor has only to read it.
        deadline = time.monotonic() + 30
        while h.state != READY and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        result = {"state": str(h.state), "restarts": h.restarts, "generation": h.generation}
    finally:
        sock.close(0)
        ctx.term()
        await starting
        await sup.stop_all(10)
    print(json.dumps(result), flush=True)


asyncio.run(main())
"""


def test_a_worker_killed_during_its_handshake_is_restarted_and_its_ready_is_seen(
    tmp_path: Path,
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result == {"state": "ready", "restarts": 1, "generation": 1}, proc.stderr[-3000:]
