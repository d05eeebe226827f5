"""Requests to a model program, served by the reference scheduler
(:mod:`graphlane.client.scheduler`) and measured as vLLM's ``benchmark_serving``
measures a server (docs/models.md, "Measuring it")."""

from __future__ import annotations

import asyncio
import functools
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
from .generation import DIFFER, TIE, Judge, reference_model
from .run import Call, Run, arrive, batch_figures, deadline, finish

#: Requests in flight per device (prefills and steps): step N+1 and N+2 go out before
#: step N's reply is back.
WINDOW = 3
#: Samples of TTFT / ITL kept for the report's plots.
MAX_SAMPLES = 5000


class DeviceObserver:
    """What one device's loop reports, recorded into the run: its decode steps as the
    run's steps, its errors by code, a request's end."""

    def __init__(self, serving: Serving, device: int) -> None:
        self.serving, self.device, self.rec = serving, device, serving.run.rec

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
            self.rec.ok(Call(self.device, len(rows), {}, {}, rows=tuple(r.rid for r in rows)),
                        sent, done)  # fmt: skip
        self.serving.tokens += len(rows)

    def failed(self, kind: str, rows: list[Request], exc: GraphlaneError) -> None:
        self.rec.in_flight -= kind == "step"
        self.rec.failed(exc, self.device)

    def cancelled(self, kind: str, rows: list[Request]) -> None:
        self.rec.in_flight -= kind == "step"
        deadline(self.rec, self.device)

    def ended(self, request: Request) -> None:
        ended = self.serving.waiting.pop(request.rid, None)
        if ended is not None and not ended.done():
            ended.set_result(None)


class Serving:
    """The run's requests, arriving (:func:`.run.arrive`) in turn on the devices' loops."""

    def __init__(self, run: Run, shape: ModelShape, devices: tuple[int, ...]) -> None:
        self.run, self.shape = run, shape
        self.rng = random.Random(run.config.seed)
        self.backoff = DeviceBackoff(random.Random(run.config.seed ^ 0xB0FF))
        self.loops = {
            d: GenerationLoop(run.client, run.config.program, d, shape, window=WINDOW,
                              observer=DeviceObserver(self, d),
                              hold=functools.partial(self.backoff.hold, d, run.pause))
            for d in devices
        }  # fmt: skip
        run.loops = list(self.loops.values())
        self.requests: list[Request] = []
        self.waiting: dict[int, asyncio.Future[None]] = {}  # requests not ended yet
        self.prefills = self.tokens = 0
        self.start = 0.0
        self._turn = itertools.cycle(self.loops.values())

    def one(self, arrived: float) -> asyncio.Future[None]:
        """A request arrives; the future is done when it got its last token or failed."""
        longest = min(self.shape.max_len, self.shape.block_size * self.shape.num_blocks)
        prompt, new = self.run.config.draw_lengths(self.rng, longest)
        tokens = [self.rng.randrange(self.shape.vocab_size) for _ in range(prompt)]
        r = Request(len(self.requests), tokens, new, arrived=arrived)
        self.requests.append(r)
        ended = self.waiting[r.rid] = asyncio.get_running_loop().create_future()
        next(self._turn).arrive(r)
        return ended

    async def drive(self) -> None:
        """Arrivals until the duration is over (or every request of ``num_prompts``
        arrived and was answered), then the rest within ``timeout``; fills ``run.extra``."""
        run = self.run
        self.start = time.monotonic()
        loops = {run.spawn(lp.run()) for lp in self.loops.values()}
        await arrive(run, self.one, limit=run.config.num_prompts)
        if run.config.num_prompts is not None:
            for lp in self.loops.values():
                lp.close()
            await run.until(asyncio.wait(loops))
        run.end_sending()
        for lp in self.loops.values():
            lp.close()
            if run.stop.is_set():
                lp.stop()
        await finish(run, loops)
        run.extra.update(self.figures())

    def progress_line(self) -> str:
        """The live view's line: requests, output tokens/s, TTFT and ITL so far."""
        done = [r for r in self.requests if r.done]
        failed = sum(r.failed is not None for r in self.requests)
        elapsed = max(time.monotonic() - self.start, 1e-9)
        ttft = sorted(next(t for t in r.times if t is not None) - r.arrived for r in done)
        gaps = [b - a for r in done[-50:] for a, b in itertools.pairwise(r.times)
                if a is not None and b is not None]  # fmt: skip
        median = f"TTFT p50 [bold]{1000 * ttft[len(ttft) // 2]:.1f}[/] ms" if ttft else "TTFT -"
        itl = f"ITL p50 [bold]{1000 * statistics.median(gaps):.2f}[/] ms" if gaps else "ITL -"
        return (f"requests [bold]{len(done)}[/] done of {len(self.requests)} arrived"
                f"{f' ({failed} failed)' if failed else ''}  output tok/s "
                f"[bold]{self.tokens / elapsed:.1f}[/]  {median}  {itl}")  # fmt: skip

    def figures(self) -> dict[str, Any]:
        r = self.requests
        out = batch_figures(list(self.loops.values()), self.tokens, len(r),
                            sum(q.done for q in r), sum(q.cut for q in r))  # fmt: skip
        out["sequences"]["failed"] = sum(q.failed is not None for q in r)
        return {**out, "request_bytes": {"mean": None, "min": None, "max": None},
                "prefills": self.prefills, "serving": serving_metrics(r, self.start)}

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
    """vLLM's serving metrics over the completed requests: throughputs over the time from
    the first arrival to the last token; TTFT from the arrival (queueing counts), TPOT
    excluding the first token, ITL every gap between two tokens, E2EL."""
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
        "samples": {  # for the plots: every request's, a random share of the gaps
            "arrival_s": [round(r.arrived - start, 4) for r in done][:MAX_SAMPLES],
            **{k: [round(1000 * x, 3) for x in v][:MAX_SAMPLES]
               for k, v in (("ttft_ms", ttft), ("e2el_ms", e2el),
                            ("itl_ms", rng.sample(itl, min(len(itl), MAX_SAMPLES))))},
        },
    }


def stats_ms(values: list[float]) -> dict[str, float | None]:
    """mean, median, std, p90, p99, min, max of ``values`` (seconds) in ms."""
    keys = ("mean", "median", "std", "p90", "p99", "min", "max")
    if not values:
        return dict.fromkeys(keys)
    v = sorted(values)

    def pct(p: float) -> float:  # numpy's default: linear between the closest ranks
        k = (len(v) - 1) * p / 100
        f = math.floor(k)
        return v[f] + (v[min(f + 1, len(v) - 1)] - v[f]) * (k - f)

    got = (statistics.fmean(v), pct(50), statistics.pstdev(v), pct(90), pct(99), v[0], v[-1])
    return {k: round(1000 * x, 3) for k, x in zip(keys, got, strict=True)}
