"""``graphlane loadtest`` for a paged program: a scheduler's decode loop against a daemon.

Selected for any program whose ``hello`` entry describes a paged KV cache
(``state.kind == "paged_kv"``, e.g. the built-in ``paged_attention``); its shapes
come from that entry alone. Per device, one scheduler (:mod:`.paged_scheduler`):

* **sequences arrive**: closed loop (``concurrency`` C): C sequences live across
  the devices, a new one arriving as soon as one ends; open loop (``rate`` R):
  Poisson arrivals at R sequences/s, spread over the devices in turn, waiting in
  the device's queue until it has room;
* a sequence is **admitted** when the batch has room (the largest bucket) and the
  client's block allocator has blocks for its whole life (a random prompt length
  in ``prompt_lens`` plus a random number of tokens to decode in
  ``decode_tokens``); its prompt's random KV goes into those blocks' slots with
  ``kv_write``;
* **continuously batched decode**: each step carries one new token of every live
  sequence (query, new K/V, slot mapping, block table, lengths); sequences that
  arrived join the next step, finished ones leave it and their blocks go back to
  the allocator, to be reused by the next arrivals. One step per device is in
  flight, as in a decode loop whose next token depends on the last one. When
  the duration is over, the step in flight is answered and the sequences still
  decoding are cut (counted as ``cut``);
* a ``verify`` share of the steps is checked against a reference computed here
  from the scheduler's own copy of the KV with
  ``torch.nn.functional.scaled_dot_product_attention``.

A worker restart: a step or write answered STATE_LOST means the device's cache is
gone. The scheduler adopts the new generation (``Client.reset_state``) and writes
the KV of every live sequence again (``reprefilled``); a reply is only verified
when every sequence in it was written in the generation that answered, so no
number computed on an emptied cache is ever counted as verified. WORKER_LOST,
BUSY and TIMEOUT are retried after a short pause (the step is rebuilt: a token
is committed to the host copy only when its step succeeded).

The report (``report.json`` in ``report_dir``): ``tokens_per_s``, ``steps``,
``steps_per_s``, ``occupancy`` (mean batch / bucket), ``mean_batch``,
``request_bytes`` per step (the encoded request, measured: mean, min, max),
``verified`` / ``verify_failures`` / ``verify_max_abs_error``, ``sequences``
(arrived, admitted, finished, cut, never_admitted: still queued at the end,
reprefilled), ``blocks_reused``, ``state_lost``,
``errors`` by code, ``latency_ms`` and a ``verdict`` (exit code 1 on any wrong
number, a non-retryable error, or no step at all).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from graphlane.client import Client, StepReply
from graphlane.protocol import ops
from graphlane.protocol.errors import RETRYABLE, GraphlaneError
from graphlane.protocol.wire import encode_request

from .paged_scheduler import DecodeStep, PagedScheduler, PagedShape, Sequence

TOLERANCE = {"float16": 1e-2, "bfloat16": 6e-2, "float32": 1e-4}
_RETRY_PAUSE_S = 0.05


class PagedLoadError(Exception):
    """The run cannot start (no such program, not a paged one, bad ranges)."""


@dataclass(frozen=True)
class PagedLoadConfig:
    endpoint: str
    duration_s: float
    concurrency: int | None = None  # closed loop: live sequences in all
    rate: float | None = None  # open loop: sequence arrivals per second
    program: str = "paged_attention"
    devices: tuple[int, ...] | None = None
    verify: float = 0.2
    prompt_lens: tuple[int, int] | None = None  # default 1..max_len/2
    decode_tokens: tuple[int, int] = (4, 32)
    seed: int = 0
    timeout_s: float = 30.0
    report_dir: str | None = None
    server_key: str | None = None
    client_key: str | None = None

    def __post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give one of --concurrency (closed loop) or --rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError("--rate must be a positive number")
        if not 0.0 <= self.verify <= 1.0:
            raise ValueError("--verify must be a fraction in 0..1")
        if not self.duration_s > 0:
            raise ValueError("--duration must be positive")
        lo, hi = self.decode_tokens
        if not 1 <= lo <= hi:
            raise ValueError("--decode-tokens needs 1 <= LO <= HI")


@dataclass
class Counts:
    steps: int = 0
    tokens: int = 0
    batch_sum: int = 0
    bucket_sum: int = 0
    verified: int = 0
    verify_failures: int = 0
    verify_max_abs_error: float = 0.0
    arrived: int = 0
    admitted: int = 0
    finished: int = 0
    reprefilled: int = 0
    cut: int = 0
    state_lost: int = 0
    prefill_bytes: int = 0
    request_bytes: list[int] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    non_retryable: int = 0
    verified_by_generation: Counter[int] = field(default_factory=Counter)


class DeviceLoop:
    """The scheduler of one device: its queue of arrivals, its live batch, its steps."""

    def __init__(self, run: PagedRun, device: int, shape: PagedShape, seed: int) -> None:
        self.run, self.device, self.shape = run, device, shape
        self.sched = PagedScheduler(shape, torch.Generator().manual_seed(seed))
        self.rng = random.Random(seed)
        self.waiting: list[tuple[int, int, int]] = []  # (sid, prompt, decode)
        self.wake = asyncio.Event()

    def arrive(self, sid: int) -> None:
        cfg, s = self.run.config, self.shape
        lo, hi = cfg.prompt_lens or (1, max(1, s.max_len // 2))
        decode = self.rng.randint(*cfg.decode_tokens)
        prompt = self.rng.randint(lo, hi)
        prompt = max(1, min(prompt, s.max_len - decode))
        self.waiting.append((sid, prompt, min(decode, s.max_len - prompt)))
        self.run.counts.arrived += 1
        self.wake.set()

    async def _admit(self) -> None:
        room = max(self.shape.buckets) - len(self.sched.seqs)
        while self.waiting and room > 0:
            sid, prompt, decode = self.waiting[0]
            seq = self.sched.admit(sid, prompt, decode)
            if seq is None:  # wait for blocks to come back
                return
            self.waiting.pop(0)
            room -= 1
            self.run.counts.admitted += 1
            await self._write(seq)

    async def _write(self, seq: Sequence) -> None:
        slots, key, value = self.sched.prefill(seq)
        r = await self.run.client.kv_write(self.run.config.program, self.device, slots, key, value)
        seq.generation = r.generation
        self.run.counts.prefill_bytes += key.nbytes + value.nbytes + slots.nbytes

    async def _recover(self) -> None:
        """STATE_LOST: adopt the new generation, write every live sequence again."""
        self.run.counts.state_lost += 1
        while True:
            try:
                await self.run.client.reset_state(self.device)
                for seq in self.sched.seqs.values():
                    seq.generation = None
                for seq in list(self.sched.seqs.values()):
                    await self._write(seq)
                    self.run.counts.reprefilled += 1
                return
            except GraphlaneError as exc:
                if exc.code == "STATE_LOST":  # restarted again meanwhile
                    self.run.counts.state_lost += 1
                    continue
                if not exc.retryable:
                    raise
                self.run.counts.errors[str(exc.code)] += 1
                await asyncio.sleep(_RETRY_PAUSE_S)

    async def loop(self) -> None:
        run = self.run
        while not run.stopped():
            try:
                await self._admit()
                if not self.sched.seqs:
                    self.wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.wake.wait(), 0.1)
                    continue
                await self._step()
            except GraphlaneError as exc:
                if exc.code == "STATE_LOST":
                    await self._recover()
                    continue
                run.counts.errors[str(exc.code)] += 1
                if exc.code not in RETRYABLE and not exc.retryable:
                    run.counts.non_retryable += 1
                    self._drop_all()
                    return
                await asyncio.sleep(_RETRY_PAUSE_S)
        self.run.counts.cut += len(self.sched.seqs)  # still decoding at the end
        self._drop_all()

    def _drop_all(self) -> None:
        for sid in list(self.sched.seqs):
            self.sched.end(sid)

    async def _step(self) -> None:
        run, s = self.run, self.shape
        step = self.sched.decode(sorted(self.sched.seqs))
        verify = run.rng.random() < run.config.verify
        expected = self.sched.expected(step) if verify else None
        params = {"actual_seq_lengths_kv": step.lengths}
        run.counts.request_bytes.append(run.request_bytes(self.device, params, step))
        t0 = time.monotonic()
        r = await run.client.step(run.config.program, self.device, params, step.inputs, ["out"])
        run.counts.latencies_s.append(time.monotonic() - t0)
        b = len(step.sids)
        run.counts.steps += 1
        run.counts.tokens += b
        run.counts.batch_sum += b
        run.counts.bucket_sum += s.bucket_for(b)
        if expected is not None:
            self._check(step, r, expected)
        for sid in self.sched.advance(step):
            self.sched.end(sid)
            run.counts.finished += 1
            run.sequence_ended(self.device)

    def _check(self, step: DecodeStep, r: StepReply, expected: torch.Tensor) -> None:
        c = self.run.counts
        # Only numbers computed on KV written in the answering generation count.
        if any(self.sched.seqs[sid].generation != r.generation for sid in step.sids):
            return
        got = r.outputs["out"].float()
        tol = TOLERANCE.get(self.shape.dtype, 1e-2)
        ok = tuple(got.shape) == tuple(expected.shape)
        err = float((got - expected.float()).abs().max()) if ok else math.inf
        if ok and math.isfinite(err) and torch.allclose(got, expected.float(), rtol=tol, atol=tol):
            c.verified += 1
            c.verified_by_generation[r.generation] += 1
            c.verify_max_abs_error = max(c.verify_max_abs_error, err)
        else:
            c.verify_failures += 1


class PagedRun:
    """One run: the client, the device loops, the arrivals and the counts."""

    def __init__(self, config: PagedLoadConfig) -> None:
        self.config = config
        self.counts = Counts()
        self.rng = random.Random(config.seed)
        self.client = Client(
            config.endpoint, timeout=config.timeout_s,
            server_key=config.server_key, client_key=config.client_key,
        )  # fmt: skip
        self.loops: dict[int, DeviceLoop] = {}
        self.shape: PagedShape | None = None
        self.start = 0.0
        self.stop_sending = asyncio.Event()
        self.interrupted = False  # sending ended by ``stop`` (Ctrl-C) before the duration
        self._next_sid = 0
        self._turn = 0

    def stopped(self) -> bool:
        return self.stop_sending.is_set()

    def request_bytes(self, device: int, params: dict[str, Any], step: DecodeStep) -> int:
        """The size of the step's request as the client encodes it (every frame)."""
        body = ops.Step(
            self.config.program, device, params, step.inputs, ["out"], len(step.sids),
            int(self.config.timeout_s * 1000), self.client.generation(device),
        )  # fmt: skip
        return sum(len(memoryview(f)) for f in encode_request(1, "step", body))

    def new_sequence(self) -> None:
        devices = sorted(self.loops)
        loop = self.loops[devices[self._turn % len(devices)]]
        self._turn += 1
        loop.arrive(self._next_sid)
        self._next_sid += 1

    def sequence_ended(self, device: int) -> None:
        if self.config.concurrency is not None and not self.stopped():
            self.new_sequence()

    async def _open_loop(self) -> None:
        assert self.config.rate is not None
        t = time.monotonic()
        while not self.stopped():
            t += self.rng.expovariate(self.config.rate)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_sending.wait(), max(0.0, t - time.monotonic()))
            if not self.stopped():
                self.new_sequence()

    async def setup(self) -> None:
        await self.client.__aenter__()
        hello = await self.client.hello()
        workers = [w for w in hello.get("workers", []) if w.get("state") == "ready"]
        if not workers:
            raise PagedLoadError("the daemon has no ready worker")
        wanted = self.config.devices or tuple(w["device"] for w in workers)
        by_device = {w["device"]: w for w in workers}
        for d in wanted:
            if d not in by_device:
                raise PagedLoadError(f"device {d} is not served (ready: {sorted(by_device)})")
            described = by_device[d].get("programs", {}).get(self.config.program)
            if described is None:
                raise PagedLoadError(f"device {d} serves no program {self.config.program!r}")
            try:
                shape = PagedShape.from_description(described)
            except ValueError as exc:
                raise PagedLoadError(f"program {self.config.program!r}: {exc}") from None
            self.shape = shape
            self.loops[d] = DeviceLoop(self, d, shape, self.config.seed * 1000 + d)
        lo, hi = self.config.prompt_lens or (1, 1)
        assert self.shape is not None
        if not 1 <= lo <= hi < self.shape.max_len:
            raise PagedLoadError(
                f"--prompt-lens must lie in 1..{self.shape.max_len - 1} "
                "(max_blocks_per_seq * block_size - 1)"
            )

    async def run(self, stop: asyncio.Event | None = None) -> dict[str, Any]:
        try:
            await self.setup()
            self.start = time.monotonic()
            if self.config.concurrency is not None:
                for _ in range(self.config.concurrency):
                    self.new_sequence()
            tasks = [asyncio.create_task(lp.loop()) for lp in self.loops.values()]
            arrivals = asyncio.create_task(self._open_loop()) if self.config.rate else None
            waiters = [asyncio.create_task(self.stop_sending.wait())]
            if stop is not None:
                waiters.append(asyncio.create_task(stop.wait()))
            await asyncio.wait(waiters, timeout=self.config.duration_s,
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            for w in waiters:
                w.cancel()
            self.interrupted = stop is not None and stop.is_set()
            self.sending_s = time.monotonic() - self.start
            self.stop_sending.set()
            for lp in self.loops.values():
                lp.wake.set()
            if arrivals is not None:
                await arrivals
            await asyncio.gather(*tasks)
            self.elapsed_s = time.monotonic() - self.start
        finally:
            await self.client.__aexit__(None, None, None)
        return self.report()

    def report(self) -> dict[str, Any]:
        c, cfg = self.counts, self.config
        elapsed = max(self.elapsed_s, 1e-9)
        rb = c.request_bytes
        lat = sorted(c.latencies_s)

        def pct(p: float) -> float | None:
            return round(1000 * lat[min(len(lat) - 1, int(p * len(lat)))], 3) if lat else None

        reasons = []
        if c.verify_failures:
            reasons.append(f"{c.verify_failures} verified steps were wrong")
        if c.non_retryable:
            reasons.append(f"{c.non_retryable} non-retryable errors")
        if not c.steps:
            reasons.append("no step succeeded")
        return {
            "workload": "paged",
            "config": {**asdict(self.config), "shape": asdict(self.shape) if self.shape else None},
            "mode": "closed" if cfg.concurrency is not None else "open",
            "duration_s": cfg.duration_s,
            "sending_s": round(self.sending_s, 3),
            "interrupted": self.interrupted,
            "elapsed_s": round(self.elapsed_s, 3),
            "steps": c.steps,
            "steps_per_s": round(c.steps / elapsed, 2),
            "tokens": c.tokens,
            "tokens_per_s": round(c.tokens / elapsed, 2),
            "mean_batch": round(c.batch_sum / c.steps, 3) if c.steps else 0.0,
            "occupancy": round(c.batch_sum / c.bucket_sum, 3) if c.bucket_sum else 0.0,
            "request_bytes": {
                "mean": round(statistics.fmean(rb), 1) if rb else None,
                "min": min(rb, default=None),
                "max": max(rb, default=None),
            },
            "prefill_bytes": c.prefill_bytes,
            "latency_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0)},
            "verify_fraction": cfg.verify,
            "verified": c.verified,
            "verify_failures": c.verify_failures,
            "verify_max_abs_error": c.verify_max_abs_error,
            "verified_by_generation": {str(k): v for k, v in c.verified_by_generation.items()},
            "sequences": {
                "arrived": c.arrived,
                "admitted": c.admitted,
                "finished": c.finished,
                "reprefilled": c.reprefilled,
                "cut": c.cut,
                "never_admitted": sum(len(lp.waiting) for lp in self.loops.values()),
            },
            "blocks_reused": sum(lp.sched.allocator.reused for lp in self.loops.values()),
            "state_lost": c.state_lost,
            "errors": dict(c.errors),
            "verdict": {"ok": not reasons, "reasons": reasons, "exit_code": 1 if reasons else 0},
        }


async def run_paged(
    config: PagedLoadConfig, stop: asyncio.Event | None = None, run: PagedRun | None = None
) -> dict[str, Any]:
    """Run the paged workload; the report (also written to ``report_dir``/report.json).
    ``run``: a :class:`PagedRun` of ``config`` made by the caller, to watch its counts."""
    run = run or PagedRun(config)
    report = await run.run(stop)
    if config.report_dir:
        report["files"] = {"json": await asyncio.to_thread(_write, config.report_dir, report)}
    return report


def _write(report_dir: str, report: dict[str, Any]) -> str:
    out = Path(report_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return str(out / "report.json")


def is_paged(hello: Mapping[str, Any], program: str) -> bool:
    """Whether ``program`` as the daemon's ``hello`` describes it keeps a paged KV cache."""
    for w in hello.get("workers", []):
        described = w.get("programs", {}).get(program)
        if described is not None:
            return (described.get("state") or {}).get("kind") == "paged_kv"
    return False


def print_paged_summary(report: dict[str, Any], console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    cfg = report["config"]
    how = (
        f"closed loop, {cfg['concurrency']} live sequences"
        if report["mode"] == "closed"
        else f"open loop, {cfg['rate']:g} sequences/s"
    )
    t = Table(title=f"graphlane loadtest (paged decode): {how}", show_header=False,
              title_justify="left")  # fmt: skip
    t.add_column(style="bold")
    t.add_column()
    seqs = report["sequences"]
    rb = report["request_bytes"]
    lat = report["latency_ms"]
    t.add_row("program / devices", f"{cfg['program']} on {cfg['devices'] or 'all'}")
    sending = f"sending for {report['sending_s']:.2f} s"
    if report.get("interrupted"):
        sending = f"interrupted after {report['sending_s']:.2f} s of {report['duration_s']:g} s"
    t.add_row("elapsed", f"{report['elapsed_s']:.2f} s ({sending})")
    t.add_row(
        "sequences",
        f"{seqs['arrived']} arrived, {seqs['admitted']} admitted, {seqs['finished']} finished, "
        f"{seqs['cut']} cut at the end, {seqs['never_admitted']} still queued, "
        f"{seqs['reprefilled']} prefilled again",
    )
    t.add_row("steps", f"{report['steps']} ({report['steps_per_s']:.1f}/s)")
    t.add_row("tokens", f"{report['tokens']} ({report['tokens_per_s']:.1f}/s)")
    t.add_row("batch occupancy", f"{report['occupancy']:.2f} (mean batch {report['mean_batch']})")
    if rb["mean"] is not None:
        t.add_row("request bytes/step", f"mean {rb['mean']:.0f}  min {rb['min']}  max {rb['max']}")
    t.add_row("latency ms", f"p50 {lat['p50']}  p99 {lat['p99']}  max {lat['max']}")
    t.add_row("blocks reused", str(report["blocks_reused"]))
    t.add_row("state lost", str(report["state_lost"]))
    errors = ", ".join(f"{k}: {v}" for k, v in report["errors"].items()) or "none"
    t.add_row("errors", errors)
    if report["verify_fraction"]:
        t.add_row(
            "verified",
            f"{report['verified']} checked, {report['verify_failures']} wrong "
            f"(max |out - sdpa| {report['verify_max_abs_error']:.2g})",
        )
    v = report["verdict"]
    t.add_row("result", "[green]ok[/]" if v["ok"] else "[red]FAILED[/]: " + "; ".join(v["reasons"]))
    if "files" in report:
        t.add_row("report", report["files"]["json"])
    console.print(t)
