"""The worker's own in-process cost per bundled step, on the ``null`` device.

A real :class:`~graphlane.workers.worker.Worker` (its engine, programs and ROUTER
socket, the ``null`` backend: no device work) is handed bundles of 16 step
requests exactly as its socket loop receives them (a routing id, then the
bundle's frame), and answers each as it does in service: decode, validation,
plan, issue, completion, reply encode and send (to a routing id nobody holds, so
ZeroMQ drops the replies). What is timed is the CPU time of the handling thread
per step, the median of several blocks: graphlane's own code per step, without
the socket's receive, the client or the device.

    python benchmarks/control_plane.py     # prints it with the control plane
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time
from typing import Any

from graphlane.protocol import ops, wire
from graphlane.workers.worker import Worker, WorkerSpec

PROGRAM = {"name": "attention", "layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 8,
           "max_kv_len": 8, "buckets": [1]}  # fmt: skip
BUNDLE = 16


def _bundle(first_id: int) -> list[Any]:
    envelopes = []
    for i in range(BUNDLE):
        body = ops.Step("attention", 0, {"actual_seq_lengths_kv": [1 + i % 8]}, outputs=["out"])
        envelopes.append(bytes(wire.encode_request(first_id + i, "step", body)[0]))
    return [b"\x00bench", wire.bundle(envelopes)]


def per_step_us(bundles: int = 2000, blocks: int = 5) -> dict[str, Any]:
    """CPU microseconds per bundled step: the median of ``blocks`` blocks, and each."""
    parent, child = mp.Pipe()
    with tempfile.TemporaryDirectory(prefix="graphlane-bench-worker-") as tmp:
        spec = WorkerSpec(device=0, backend="null", programs=(PROGRAM,),
                          endpoint=f"ipc://{tmp}/worker.sock")  # fmt: skip
        worker = Worker(spec, child)
        try:
            messages = [_bundle(i * BUNDLE) for i in range(bundles)]

            def run(batch: list[list[Any]]) -> float:
                t0 = time.thread_time()
                for frames in batch:
                    worker.loop.handle(frames)  # the socket loop's own handler
                return (time.thread_time() - t0) / (len(batch) * BUNDLE) * 1e6

            run(messages[: bundles // 10])  # warm up
            size = bundles // blocks
            times = [run(messages[k * size : (k + 1) * size]) for k in range(blocks)]
            deadline = time.monotonic() + 10
            while worker.inflight and time.monotonic() < deadline:
                worker.loop._take_wakeups()  # answers another thread posted (the engine's)
                time.sleep(0.001)
            if worker.inflight:
                raise RuntimeError(f"{worker.inflight} steps were not answered")
        finally:
            worker.engine.close()
            worker.sock.close(0)
            worker.ctx.destroy(0)
            parent.close()
            child.close()
    return {"per_step_us": statistics.median(times), "blocks_us": times, "bundle": BUNDLE}


__all__ = ["per_step_us"]
