"""Figures for the README's reliability table, each from the same scenario as a test
in tests/daemon/ (test_errors_and_faults.py, test_reliability.py):

- SIGKILL a worker under load on 2 devices: how soon every call in flight on it is
  answered (WORKER_LOST), how soon the device serves again, errors on the other device;
- overload: bursts far above saturation against a bounded queue: BUSY share, how
  soon a BUSY arrives, RSS of the worker before and after;
- hostile input: 2000 malformed frames: replies, worker restarts.

    .venv/bin/python benchmarks/reliability.py
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import time
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from graphlane import GraphlaneError
from graphlane.client import Client

from .control_plane import SCALE
from .daemon import BenchDaemon

SLOW = {"mode": "timed", "task_us": 5000.0, "patch_us": 200.0}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def kill_under_load() -> dict[str, Any]:
    d = BenchDaemon(SCALE, devices=2, sim=SLOW)
    try:
        async with Client(d.endpoint, timeout=120) as c:
            victim = next(w for w in (await c.status())["workers"] if w["device"] == 0)["pid"]
            for dev in (0, 1):
                await c.step("attention", dev, {"actual_seq_lengths_kv": [3] * 4})
            answered: list[float] = []

            async def one(dev: int, i: int) -> str:
                try:
                    await c.step("attention", dev, {"actual_seq_lengths_kv": [1 + i % 60] * 4})
                    return "ok"
                except GraphlaneError as e:
                    answered.append(time.perf_counter())
                    return e.code

            tasks = [asyncio.ensure_future(one(i % 2, i)) for i in range(40)]
            while len(c._workers[0].pending) < 5:  # noqa: ASYNC110 - no event to await
                await asyncio.sleep(0.001)
            killed = time.perf_counter()
            os.kill(victim, signal.SIGKILL)
            codes = await asyncio.gather(*tasks)
            while True:
                try:
                    await c.step("attention", 0, {"actual_seq_lengths_kv": [3] * 4}, timeout=5)
                    break
                except GraphlaneError:
                    await asyncio.sleep(0.05)
            back = time.perf_counter()
        return {
            "in_flight_lost": sum(1 for i, code in enumerate(codes) if i % 2 == 0 and code != "ok"),
            "all_answered_ms": 1000 * (max(answered) - killed) if answered else 0.0,
            "serving_again_s": back - killed,
            "errors_on_other_device": sum(
                1 for i, code in enumerate(codes) if i % 2 and code != "ok"
            ),
        }
    finally:
        d.close()


async def overload() -> dict[str, Any]:
    d = BenchDaemon(SCALE, devices=1, sim=SLOW, max_queued=16)
    try:
        async with Client(d.endpoint, timeout=120) as c:
            pid = (await c.status())["workers"][0]["pid"]
            await c.step("attention", 0, {"actual_seq_lengths_kv": [3] * 4})
            before = rss_mib(pid)
            busy_ms: list[float] = []
            ok = busy = 0

            async def one(i: int) -> None:
                nonlocal ok, busy
                t0 = time.perf_counter()
                try:
                    await c.step("attention", 0, {"actual_seq_lengths_kv": [1 + i % 60] * 4})
                    ok += 1
                except GraphlaneError as e:
                    if e.code == "BUSY":
                        busy += 1
                        busy_ms.append(1000 * (time.perf_counter() - t0))

            for _ in range(10):
                await asyncio.gather(*(one(i) for i in range(300)))
            return {
                "requests": ok + busy,
                "busy_share": busy / (ok + busy),
                "busy_answer_p50_ms": statistics.median(busy_ms) if busy_ms else 0.0,
                "rss_before_mib": before,
                "rss_after_mib": rss_mib(pid),
            }
    finally:
        d.close()


async def hostile() -> dict[str, Any]:
    d = BenchDaemon(SCALE, devices=1)
    try:
        async with Client(d.endpoint) as c:
            worker = (await c.hello())["workers"][0]["endpoint"]
            rng = random.Random(1)
            ctx = zmq.asyncio.Context()
            sock = ctx.socket(zmq.DEALER)
            sock.connect(worker)
            for i in range(2000):
                if i % 2:
                    frames = [rng.randbytes(rng.randint(0, 200))]
                else:
                    frames = [msgpack.packb({"v": 1, "id": i, "op": "step", "body": {"x": i}})]
                await sock.send_multipart(frames)
            replies = 0
            while await sock.poll(1000):
                await sock.recv_multipart()
                replies += 1
            sock.close(0)
            ctx.destroy(linger=0)
            r = await c.step("attention", 0, {"actual_seq_lengths_kv": [3] * 4})
            st = await c.status()
            return {
                "frames": 2000,
                "replies": replies,
                "served_after": r.outputs["out"].shape[0] == 4,
                "restarts": st["workers"][0]["restarts"],
            }
    finally:
        d.close()


def main() -> None:
    for name, fn in (("kill", kill_under_load), ("overload", overload), ("hostile", hostile)):
        print(
            name,
            {k: round(v, 3) if isinstance(v, float) else v for k, v in asyncio.run(fn()).items()},
        )


if __name__ == "__main__":
    main()
