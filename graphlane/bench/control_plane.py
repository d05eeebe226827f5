"""The control-plane and scaling figures of ``graphlane bench`` (see :mod:`.suite`).

- control plane: a raw pyzmq+msgpack round trip between two processes (a
  ROUTER echo server in a child process, an asyncio DEALER here) against the
  daemon, in the same run: sequential round trips, windowed throughput, and
  large-tensor bandwidth (raw zero-copy frames vs step inputs);
- scaling: windowed steps/s over 1, 2 and 4 simulated devices.

The daemon runs the ``attention`` program on the timed sim with zero costs, so
a step's device work is only the simulator's own Python; each step reply says
how long the worker held it (``server_us``), and the round trip minus that is
the control plane's own cost.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import msgpack
import torch
import zmq
import zmq.asyncio

from graphlane.client import Client
from graphlane.protocol import ops
from graphlane.workers.affinity import place_as

from .daemon import BenchDaemon

TINY = {
    "layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 8,
    "max_kv_len": 8,
    "buckets": [1],
}
WIDE = {
    "layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 64,
    "max_kv_len": 8192,
    "buckets": [4],
}
SCALE = {
    "layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "max_kv_len": 64,
    "buckets": [4],
}


_T = TypeVar("_T")

WINDOW = 64  # requests in flight in the windowed measurements, raw and graphlane alike


# ---------------------------------------------------------------- raw baseline
def _echo_server(endpoint: str) -> None:
    """Raw pyzmq+msgpack: decode the request envelope, answer a small reply (op ``pid``:
    naming this process, op ``stop``: the last)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        frames = sock.recv_multipart(copy=False)
        req = msgpack.unpackb(frames[1].buffer)
        op = req.get("op")
        body = {"pid": os.getpid()} if op == "pid" else {}  # (whose CPU to read)
        reply = msgpack.packb({"v": 1, "id": req["id"], "ok": True, "body": body})
        sock.send_multipart([frames[0], reply])
        if op == "stop":
            break
    sock.close(0)
    ctx.destroy(linger=0)


class RawClient:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.ids = 0

    async def pid(self) -> int:
        """The echo server's process id."""
        self.ids += 1
        await self.sock.send(msgpack.packb({"v": 1, "id": self.ids, "op": "pid", "body": {}}))
        return int(msgpack.unpackb(await self.sock.recv())["body"]["pid"])

    async def call(self, extra: list[Any] | None = None) -> None:
        self.ids += 1
        body = {"program": "attention", "device": 0, "params": {"actual_seq_lengths_kv": [3]}}
        env = msgpack.packb({"v": 1, "id": self.ids, "op": "step", "body": body})
        await self.sock.send_multipart([env, *(extra or [])], copy=False)
        msgpack.unpackb((await self.sock.recv_multipart())[0])

    async def windowed(self, n: int, window: int) -> float:
        """n requests with `window` in flight, each packed with its own id and each
        reply unpacked, as :meth:`call` does; replies counted, not matched (one socket)."""
        t0 = time.perf_counter()
        sent = received = 0
        body = {"program": "attention", "device": 0, "params": {"actual_seq_lengths_kv": [3]}}
        while received < n:
            while sent < n and sent - received < window:
                self.ids += 1
                env = {"v": 1, "id": self.ids, "op": "step", "body": body}
                await self.sock.send(msgpack.packb(env))
                sent += 1
            msgpack.unpackb((await self.sock.recv_multipart())[0])
            received += 1
        return n / (time.perf_counter() - t0)

    async def stop(self) -> None:
        await self.sock.send(msgpack.packb({"v": 1, "id": 0, "op": "stop", "body": {}}))
        await self.sock.recv_multipart()
        self.sock.close(0)
        self.ctx.destroy(linger=0)


async def _windowed_steps(c: Client, n: int, window: int, params: dict[str, Any]) -> float:
    """n steps with ``window`` in flight (as the raw baseline): ``window`` callers,
    each calling again as soon as its reply is in."""
    left = n

    async def caller() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await c.step("attention", 0, params)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(window)))
    return n / (time.perf_counter() - t0)


async def _timed(n: int, call: Callable[[], Awaitable[Any]]) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append(time.perf_counter() - t0)
    return out


async def _alternating(
    n: int, *calls: Callable[[], Awaitable[Any]], rounds: int = 5
) -> list[list[float]]:
    """n timed calls of each, in ``rounds`` alternating blocks: a slow spell of the
    machine falls on both sides alike."""
    out: list[list[float]] = [[] for _ in calls]
    per_round = max(1, n // rounds)
    for _ in range(rounds):
        for times, call in zip(out, calls, strict=True):
            times += await _timed(per_round, call)
    return out


async def _alternating_rates(
    *runs: Callable[[], Awaitable[float]], rounds: int = 3, spreads: list[float] | None = None
) -> list[float]:
    """The median of ``rounds`` alternating runs of each rate measurement; ``spreads``
    gets each one's (max - min) / median over the rounds (how noisy the machine was)."""
    out: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        for rates, run in zip(out, runs, strict=True):
            rates.append(await run())
    if spreads is not None:
        spreads += [(max(r) - min(r)) / statistics.median(r) for r in out]
    return [statistics.median(r) for r in out]


def _ms(xs: list[float]) -> float:
    return 1000 * statistics.median(xs)


async def _control_plane(daemon: BenchDaemon, raw_endpoint: str, n: int) -> dict[str, Any]:
    raw = RawClient(raw_endpoint)
    async with Client(daemon.endpoint, timeout=60) as c:
        # The raw server where the worker runs (cpu_affinity "auto" pins it to one core
        # under SCHED_BATCH): left to the kernel, it answered from the client's core on
        # some runs (a context switch) and from the other on others (a cross-core
        # wake-up), and its round trip moved by 1.4x from run to run with it.
        place_as(await raw.pid(), (await c.status())["workers"][0]["pid"])
        params = {"actual_seq_lengths_kv": [3]}
        for _ in range(50):  # warm up both
            await raw.call()
            await c.step("attention", 0, params)
        server: list[float] = []

        async def step() -> None:
            r = await c.step("attention", 0, params)
            server.append(r.server_us * 1e-6)

        # The transport's own floor: a request the worker answers from its loop with no
        # step (resume, of a connection with nothing to resume), over the same client,
        # codec and worker loop as a step.
        ch = await c._worker(0)

        def resume() -> Awaitable[Any]:
            return c._call(ch, "resume", ops.Resume(0), None)

        spun0 = (await c.worker_status(0))["metrics"]["spin_seconds"]
        raw_rtt, step_rtt, status_rtt, floor_rtt = await _alternating(
            n, raw.call, step, lambda: c.worker_status(0), resume
        )
        # The CPU the worker polled for its next request while idle (idle_spin_us: on by
        # default where the host has a core to spare), per graphlane round trip above.
        spun = (await c.worker_status(0))["metrics"]["spin_seconds"] - spun0
        # Runs long enough (tens of ms at least) that one scheduling hiccup of the two
        # cores does not decide a run, and five of them for the median.
        spreads: list[float] = []
        raw_rate, step_rate = await _alternating_rates(
            lambda: raw.windowed(8 * n, WINDOW),
            lambda: _windowed_steps(c, 8 * n, WINDOW, params),
            rounds=5,
            spreads=spreads,
        )
        await raw.stop()
    overhead = [r - s for r, s in zip(step_rtt, server, strict=True)]
    return {
        "raw_rtt_ms": _ms(raw_rtt),
        "step_rtt_ms": _ms(step_rtt),
        "step_server_ms": _ms(server),
        "step_outside_worker_ms": _ms(overhead),
        "worker_status_rtt_ms": _ms(status_rtt),
        "floor_rtt_ms": _ms(floor_rtt),
        "floor_rtt_vs_raw": _ms(floor_rtt) / _ms(raw_rtt),
        "worker_spin_ms": 1000 * spun / (len(step_rtt) + len(status_rtt) + len(floor_rtt)),
        "step_rtt_vs_raw": _ms(step_rtt) / _ms(raw_rtt),
        "outside_worker_vs_raw": _ms(overhead) / _ms(raw_rtt),
        "raw_windowed_msgs_s": raw_rate,
        "windowed_steps_s": step_rate,
        "windowed_vs_raw": step_rate / raw_rate,
        "windowed_spread": max(spreads),  # over the 5 repeats, raw or ours
    }


async def _bandwidth(daemon: BenchDaemon, raw_endpoint: str, reps: int) -> dict[str, Any]:
    w: dict[str, Any] = WIDE
    shape = (w["layers"], w["buckets"][0], w["num_kv_heads"], w["max_kv_len"], w["head_dim"])
    key = torch.randn(shape).half()
    value = torch.randn(shape).half()
    nbytes = key.numel() * 2 * 2
    raw = RawClient(raw_endpoint)
    frames = [key.view(torch.uint8).numpy().data, value.view(torch.uint8).numpy().data]
    async with Client(daemon.endpoint, timeout=120) as c:
        params = {"actual_seq_lengths_kv": [3] * w["buckets"][0]}
        inputs = {"key": key, "value": value}
        for _ in range(3):  # both sides warm: the first large receives fault their pages in
            await c.step("attention", 0, params, inputs)
            await raw.call(frames)
        # Short blocks: a large transfer's time drifts with the machine's memory state.
        raw_t, step_t = await _alternating(
            reps,
            lambda: raw.call(frames),
            lambda: c.step("attention", 0, params, inputs),
            rounds=max(1, reps // 3),
        )
    await raw.stop()
    raw_mb_s = nbytes / statistics.median(raw_t) / 1e6
    step_mb_s = nbytes / statistics.median(step_t) / 1e6
    return {
        "bytes_per_request": nbytes,
        "raw_mb_s": raw_mb_s,
        "step_inputs_mb_s": step_mb_s,
        "bandwidth_vs_raw": step_mb_s / raw_mb_s,
    }


async def _scaling_rate(daemon: BenchDaemon, devices: int, n: int) -> float:
    async with Client(daemon.endpoint, timeout=120) as c:
        params = [{"actual_seq_lengths_kv": [1 + (i % 60)] * 4} for i in range(n)]
        for d in range(devices):
            await c.step("attention", d, params[0])
        t0 = time.perf_counter()
        await asyncio.gather(*(c.step("attention", i % devices, params[i]) for i in range(n)))
        return n / (time.perf_counter() - t0)


def with_raw_server(fn: Callable[[str], Coroutine[Any, Any, _T]]) -> _T:
    """``fn(endpoint)`` run against a raw echo server in a child process (:func:`_echo_server`),
    which ``fn`` stops (``op`` "stop") before it returns."""
    with tempfile.TemporaryDirectory(prefix="graphlane-raw-") as tmp:
        endpoint = f"ipc://{tmp}/raw.sock"
        proc = mp.get_context("spawn").Process(target=_echo_server, args=(endpoint,), daemon=True)
        proc.start()
        try:
            return asyncio.run(fn(endpoint))
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def _on_each_backend(
    program: dict[str, Any],
    measure: Callable[[BenchDaemon, str], Coroutine[Any, Any, dict[str, Any]]],
) -> dict[str, Any]:
    """``measure(daemon, raw_endpoint)`` against a fresh raw echo server, once with the
    daemon on the null backend (graphlane alone, no device) and once on the timed sim
    with zero costs (graphlane plus the simulator's own Python per device op)."""
    out: dict[str, Any] = {}
    for backend in ("null", "sim"):
        daemon = BenchDaemon(program, backend=backend)
        try:
            out[backend] = with_raw_server(functools.partial(measure, daemon))
        finally:
            daemon.close()
    return out


def control_plane(n: int = 500) -> dict[str, Any]:
    """Step round trips and windowed throughput against the raw baseline."""
    return _on_each_backend(TINY, lambda daemon, raw: _control_plane(daemon, raw, n))


def bandwidth(reps: int = 30) -> dict[str, Any]:
    """Large-tensor inputs against raw frames (on null the inputs are decoded as views
    of the received frames, then go nowhere; the sim adds the staging copy of
    pageable host memory and the device copy)."""
    return _on_each_backend(WIDE, lambda daemon, raw: _bandwidth(daemon, raw, reps))


def scaling(device_counts: tuple[int, ...] = (1, 2, 4), steps: int = 200) -> dict[str, Any]:
    sim = {"mode": "timed", "task_us": 1000.0, "patch_us": 1000.0}
    rates = {}
    for n in device_counts:
        daemon = BenchDaemon(SCALE, devices=n, sim=sim)
        try:
            rates[n] = asyncio.run(_scaling_rate(daemon, n, steps))
        finally:
            daemon.close()
    base = rates[device_counts[0]]
    return {
        "steps_s": {str(k): v for k, v in rates.items()},
        "vs_one_device": {str(k): v / base for k, v in rates.items()},
        "cpu_cores": os.cpu_count(),
    }
