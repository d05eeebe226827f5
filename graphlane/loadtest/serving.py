"""The load test of a model program (hello's entry has the state op ``prefill``): a
serving benchmark, measured as vLLM's ``benchmark_serving`` measures one.

Requests arrive: open loop (``rate`` R): Poisson arrivals at R requests/s, or all at once
when R is infinite (then ``num_prompts`` says how many); closed loop (``concurrency``
C): C requests at a time, a new one when one is answered. ``num_prompts`` (optional
otherwise) ends the arrivals after that many. Each request has a random prompt of a
length drawn in ``prompt_lens`` and generates a number of tokens drawn in
``decode_tokens`` (vLLM's random dataset: ``--prompt-len``/``--output-len`` with a
``--range-ratio``). Arrivals go to the devices in turn, each device running the
continuous-batching loop with decoding ahead of :mod:`.generation` (the demo's). Arrivals
end after ``duration``; the requests that arrived are then answered within ``timeout``,
and those still unanswered are cut.

Every decode step is recorded as a step of the run (steps/s, step latency from its
send, errors by code), so the report has what every run's has; it adds ``serving``:

* ``completed`` requests (every token back), ``failed`` (an error ended them), ``cut``;
* ``duration_s``: from the first arrival to the last token;
* ``request_throughput`` (completed / duration), ``output_throughput`` (their output
  tokens / duration), ``total_token_throughput`` (input and output tokens / duration);
* ``ttft_ms`` (time to first token: from the request's arrival, so queueing for room
  counts, as a server's queue counts in vLLM's), ``tpot_ms`` (time per output token
  after the first: (latency - TTFT) / (output tokens - 1), requests of more than one
  token), ``itl_ms`` (every gap between two tokens of a request) and ``e2el_ms`` (a
  request's latency), each with ``mean``, ``median``, ``std``, ``p90``, ``p99`` (linear
  interpolation, as numpy's percentile), ``min``, ``max``, over completed requests.

A ``verify`` share of the completed requests is checked, after the clock stopped,
against transformers' greedy ``generate`` of the served model (:func:`.generation.
reference_model`). Steps sample greedily, so in float32 the tokens must be equal; in
bfloat16 or float16 a near tie can go either way between two implementations, and a
request whose first different token is one (docs/models.md, "Precision";
:class:`.generation.Judge`) counts as checked and right, in ``verify_ties``. Any other
difference counts as a verify failure.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import statistics
import time
from collections.abc import Mapping
from typing import Any

from graphlane.client.scheduler import GenerationLoop, ModelShape, Request
from graphlane.protocol.errors import GraphlaneError

from .availability import DeviceBackoff
from .config import DECODE_TOKENS
from .generation import DIFFER, TIE, Judge, reference_model
from .run import CLIENT_DEADLINE, Run, finish
from .workload import Call

#: Requests in flight per device (prefills and steps): step N+1 and N+2 go out before
#: step N's reply is back.
WINDOW = 3
#: Samples of TTFT / ITL kept for the report's plots.
MAX_SAMPLES = 5000


class DeviceObserver:
    """What one device's loop reports, recorded into the run (see the module doc)."""

    def __init__(self, serving: Serving, device: int) -> None:
        self.serving, self.device = serving, device
        self.rec = serving.run.rec

    def _call(self, rows: list[Request]) -> Call:
        return Call(self.device, len(rows), {}, {}, rows=tuple(r.rid for r in rows))

    def sent(self, kind: str, rows: list[Request]) -> None:
        if kind == "step":
            self.rec.sent += 1
            self.rec.in_flight += 1
        else:
            self.serving.prefills += 1

    def answered(self, kind: str, rows: list[Request], sent: float, done: float) -> None:
        self.serving.backoff.success(self.device)
        if kind == "step":
            self.rec.in_flight -= 1
            self.rec.ok(self._call(rows), sent, done)
        self.serving.tokens += len(rows)

    def failed(self, kind: str, rows: list[Request], exc: GraphlaneError) -> None:
        if kind == "step":
            self.rec.in_flight -= 1
        self.rec.error(str(exc.code), time.monotonic(), device=self.device,
                       retryable=exc.retryable, message=exc.message)  # fmt: skip

    def cancelled(self, kind: str, rows: list[Request]) -> None:
        if kind == "step":
            self.rec.in_flight -= 1
        self.rec.error(CLIENT_DEADLINE, time.monotonic(), device=self.device, retryable=True,
                       message="still unanswered at the end of the run (duration + timeout)")

    def ended(self, request: Request) -> None:
        self.serving.ended(1)


class Serving:
    """The arrivals of a run's requests, spread over the devices' generation loops."""

    def __init__(self, run: Run, shape: ModelShape, devices: tuple[int, ...]) -> None:
        self.run, self.shape = run, shape
        cfg = run.config
        self.rng = random.Random(cfg.seed)
        self.backoff = DeviceBackoff(random.Random(cfg.seed ^ 0xB0FF))
        self.loops = {
            d: GenerationLoop(run.client, cfg.program, d, shape, window=WINDOW,
                              observer=DeviceObserver(self, d), hold=self._holder(d))
            for d in devices
        }  # fmt: skip
        self.requests: list[Request] = []
        self.prefills = 0
        self.tokens = 0
        self.start = 0.0
        self._turn = itertools.cycle(self.loops.values())
        self._all_arrived = asyncio.Event()

    def _holder(self, device: int) -> Any:
        async def hold() -> None:
            now = time.monotonic()
            self.backoff.failure(device, now)
            await self.run.pause(self.backoff.until[device] - now)

        return hold

    # ------------------------------------------------------------ arrivals
    def lengths(self) -> tuple[int, int]:
        """A prompt length and a number of tokens to generate that fit a sequence."""
        cfg, rng = self.run.config, self.rng
        longest = min(self.shape.max_len, self.shape.block_size * self.shape.num_blocks)
        lo, hi = cfg.prompt_lens or (1, max(1, longest // 2))
        new = rng.randint(*(cfg.decode_tokens or DECODE_TOKENS))
        prompt = max(1, min(rng.randint(lo, hi), longest - new))
        return prompt, max(1, min(new, longest - prompt))

    def arrive(self) -> None:
        cfg = self.run.config
        if cfg.num_prompts is not None and len(self.requests) >= cfg.num_prompts:
            self._all_arrived.set()
            return
        prompt, new = self.lengths()
        tokens = [self.rng.randrange(self.shape.vocab_size) for _ in range(prompt)]
        r = Request(len(self.requests), tokens, new, arrived=time.monotonic())
        self.requests.append(r)
        self.run.rec.arrivals += 1
        next(self._turn).arrive(r)
        if cfg.num_prompts is not None and len(self.requests) >= cfg.num_prompts:
            self._all_arrived.set()

    def ended(self, count: int) -> None:
        """Requests ended (answered or failed): the closed loop lets as many arrive."""
        if self.run.config.mode == "closed" and self.run.sending():
            for _ in range(count):
                self.arrive()

    async def _open_loop(self) -> None:
        rate = self.run.config.rate
        assert rate is not None
        t = time.monotonic()
        while self.run.sending() and not self._all_arrived.is_set():
            if math.isfinite(rate):
                t += self.rng.expovariate(rate)
                await self.run.pause(min(t, self.run.stop_at) - time.monotonic())
            if self.run.sending() and time.monotonic() < self.run.stop_at:
                self.arrive()

    async def drive(self) -> None:
        """Arrivals until the duration is over (or every request of ``num_prompts``
        arrived and was answered), then the rest within ``timeout``; fills ``run.extra``."""
        run, cfg = self.run, self.run.config
        self.start = time.monotonic()
        loops = {asyncio.create_task(lp.run()) for lp in self.loops.values()}
        run.tasks.update(loops)
        if cfg.mode == "closed":
            for _ in range(cfg.concurrency or 0):
                self.arrive()
        else:
            run.tasks.add(asyncio.create_task(self._open_loop()))
        if cfg.num_prompts is None:
            await run.pause(run.stop_at - time.monotonic())
        else:
            await self._until_stopped(self._all_arrived.wait())
            for lp in self.loops.values():
                lp.close()
            await self._until_stopped(asyncio.wait(loops))
        run.end_sending()
        for lp in self.loops.values():
            lp.close()
            if run.stop.is_set():
                lp.stop()
        await finish(run, loops)
        run.extra.update(self.figures())

    async def _until_stopped(self, awaitable: Any) -> None:
        """Await ``awaitable`` until the duration is over or the run is stopped
        (Ctrl-C), whichever comes first."""
        run = self.run
        waited = asyncio.ensure_future(awaitable)
        stopped = asyncio.ensure_future(run.stop.wait())
        try:
            await asyncio.wait([waited, stopped], return_when=asyncio.FIRST_COMPLETED,
                               timeout=max(0.0, run.stop_at - time.monotonic()))  # fmt: skip
        finally:
            waited.cancel()
            stopped.cancel()
            await asyncio.gather(waited, stopped, return_exceptions=True)

    def progress_line(self) -> str:
        """The live view's line: requests, output tokens/s, TTFT and ITL so far."""
        done = [r for r in self.requests if r.done]
        failed = sum(r.failed is not None for r in self.requests)
        elapsed = max(time.monotonic() - self.start, 1e-9)
        ttft = sorted(next(t for t in r.times if t is not None) - r.arrived for r in done)
        gaps = [b - a for r in done[-50:] for a, b in itertools.pairwise(r.times)
                if a is not None and b is not None]  # fmt: skip
        median = (f"TTFT p50 [bold]{1000 * ttft[len(ttft) // 2]:.1f}[/] ms" if ttft else "TTFT -")
        itl = f"ITL p50 [bold]{1000 * statistics.median(gaps):.2f}[/] ms" if gaps else "ITL -"
        return (
            f"requests [bold]{len(done)}[/] done of {len(self.requests)} arrived"
            f"{f' ({failed} failed)' if failed else ''}  output tok/s "
            f"[bold]{self.tokens / elapsed:.1f}[/]  {median}  {itl}"
        )

    # ------------------------------------------------------------ report
    def figures(self) -> dict[str, Any]:
        loops = list(self.loops.values())
        steps = sum(lp.steps for lp in loops)
        batch_sum = sum(lp.batch_sum for lp in loops)
        bucket_sum = sum(lp.bucket_sum for lp in loops)
        admitted = sum(len(lp.admitted) for lp in loops)
        done = [r for r in self.requests if r.done]
        return {
            "tokens": self.tokens,
            "mean_batch": round(batch_sum / steps, 3) if steps else 0.0,
            "occupancy": round(batch_sum / bucket_sum, 3) if bucket_sum else 0.0,
            "request_bytes": {"mean": None, "min": None, "max": None},
            "sequences": {
                "arrived": len(self.requests),
                "admitted": admitted,
                "finished": len(done),
                "failed": sum(r.failed is not None for r in self.requests),
                "reprefilled": sum(lp.reprefilled for lp in loops),
                "cut": sum(r.cut for r in self.requests),
                "never_admitted": sum(len(lp.queue) for lp in loops),
            },
            "state_lost": sum(lp.state_losses for lp in loops),
            "prefills": self.prefills,
            "serving": serving_metrics(self.requests, self.start),
        }

    async def check(self, described: Mapping[str, Any], share: float) -> None:
        """Check a ``share`` of the completed requests against transformers (in a thread:
        after the clock stopped): equal tokens, or a near tie of the served dtype
        (:class:`.generation.Judge`), or a verify failure. A stop ends the check."""
        done = [r for r in self.requests if r.done]
        rng = random.Random(self.run.config.seed ^ 0xC4EC)
        picked = [r for r in done if rng.random() < share]
        if not picked:
            return
        judge = Judge(await asyncio.to_thread(reference_model, described))
        for r in picked:
            if self.run.stop.is_set():
                return
            found, first = await asyncio.to_thread(judge, r.prompt, r.out)
            params: dict[str, Any] = {"request": r.rid, "prompt_len": len(r.prompt),
                                      "output_len": r.new}  # fmt: skip
            if first is not None:
                params["first_different_token"] = first
            self.run.rec.verification(Call(0, 1, params, {}),
                                      None if found == DIFFER else 0.0, tie=found == TIE)


def serving_metrics(requests: list[Request], start: float) -> dict[str, Any]:
    """vLLM's serving metrics over the completed requests (see the module docstring)."""
    done = [r for r in requests if r.done]
    times = [[t for t in r.times if t is not None] for r in done]
    ttft = [t[0] - r.arrived for r, t in zip(done, times, strict=True)]
    e2el = [t[-1] - r.arrived for r, t in zip(done, times, strict=True)]
    tpot = [(e - f) / (r.new - 1) for r, f, e in zip(done, ttft, e2el, strict=True) if r.new > 1]
    itl = [b - a for t in times for a, b in itertools.pairwise(t)]
    last = max((t[-1] for t in times), default=start)
    duration = max(last - start, 1e-9)
    inputs = sum(len(r.prompt) for r in done)
    outputs = sum(r.new for r in done)
    rng = random.Random(0)
    return {
        "completed": len(done),
        "failed": sum(r.failed is not None for r in requests),
        "cut": sum(r.cut for r in requests),
        "duration_s": round(duration, 3),
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": round(len(done) / duration, 3),
        "output_throughput": round(outputs / duration, 3),
        "total_token_throughput": round((inputs + outputs) / duration, 3),
        "ttft_ms": stats_ms(ttft),
        "tpot_ms": stats_ms(tpot),
        "itl_ms": stats_ms(itl),
        "e2el_ms": stats_ms(e2el),
        "samples": {
            "arrival_s": [round(r.arrived - start, 4) for r in done][:MAX_SAMPLES],
            "ttft_ms": [round(1000 * v, 3) for v in ttft][:MAX_SAMPLES],
            "e2el_ms": [round(1000 * v, 3) for v in e2el][:MAX_SAMPLES],
            "itl_ms": [round(1000 * v, 3) for v in
                       (rng.sample(itl, MAX_SAMPLES) if len(itl) > MAX_SAMPLES else itl)],
        },
    }


def stats_ms(values: list[float]) -> dict[str, float | None]:
    """mean, median, std, p90, p99, min, max of ``values`` (seconds) in ms."""
    if not values:
        return {k: None for k in ("mean", "median", "std", "p90", "p99", "min", "max")}
    v = sorted(values)

    def pct(p: float) -> float:  # numpy's default: linear between the closest ranks
        k = (len(v) - 1) * p / 100
        f = math.floor(k)
        c = min(f + 1, len(v) - 1)
        return v[f] + (v[c] - v[f]) * (k - f)

    def ms(x: float) -> float:
        return round(1000 * x, 3)

    return {
        "mean": ms(statistics.fmean(v)),
        "median": ms(pct(50)),
        "std": ms(statistics.pstdev(v)),
        "p90": ms(pct(90)),
        "p99": ms(pct(99)),
        "min": ms(v[0]),
        "max": ms(v[-1]),
    }


def serving_text(report: Mapping[str, Any]) -> str:
    """The serving figures as vLLM's benchmark_serving prints them."""
    s = report["serving"]

    def line(name: str, value: Any, fmt: str = "") -> str:
        text = "-" if value is None else format(value, fmt)
        return f"{name:<40}{text:<10}"

    def block(title: str, key: str, short: str) -> list[str]:
        m = s[key]
        return [title.center(50, "-"),
                line(f"Mean {short} (ms):", m["mean"], ".2f"),
                line(f"Median {short} (ms):", m["median"], ".2f"),
                line(f"P99 {short} (ms):", m["p99"], ".2f")]  # fmt: skip

    return "\n".join([
        " Serving Benchmark Result ".center(50, "="),
        line("Successful requests:", s["completed"]),
        line("Failed requests:", s["failed"]),
        line("Benchmark duration (s):", s["duration_s"], ".2f"),
        line("Total input tokens:", s["total_input_tokens"]),
        line("Total generated tokens:", s["total_output_tokens"]),
        line("Request throughput (req/s):", s["request_throughput"], ".2f"),
        line("Output token throughput (tok/s):", s["output_throughput"], ".2f"),
        line("Total Token throughput (tok/s):", s["total_token_throughput"], ".2f"),
        *block("Time to First Token", "ttft_ms", "TTFT"),
        *block("Time per Output Token (excl. 1st token)", "tpot_ms", "TPOT"),
        *block("Inter-token Latency", "itl_ms", "ITL"),
        "=" * 50,
    ])  # fmt: skip
