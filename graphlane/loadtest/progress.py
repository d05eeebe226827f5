"""The live view of a run on stderr (``--progress``): a rich Live display refreshed 4
times a second by an asyncio task."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from .run import Run


class Progress:
    """What the run has done so far: steps, rate, latency, errors, checks, and a line of
    the workload's own (``detail``: a model's requests, TTFT, ITL)."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.console = Console(stderr=True)
        self.live = Live(console=self.console, auto_refresh=False, transient=False)
        self.history: deque[tuple[float, int]] = deque(maxlen=5)
        self.started = self.finished = False
        self.detail: Callable[[], str] | None = None

    def render(self) -> Any:
        rec, c = self.run.rec, self.run.config
        now = time.monotonic()
        elapsed = now - rec.start
        self.history.append((now, rec.steps))
        t0, n0 = self.history[0]
        recent = (rec.steps - n0) / (now - t0) if now > t0 else 0.0
        n = rec.latency.get_total_count()
        p50, p99 = (f"{rec.latency.get_value_at_percentile(p) / 1000:.2f}" if n else "-"
                    for p in (50, 99))  # fmt: skip
        how = f"closed loop x{c.concurrency}" if c.mode == "closed" else f"open loop {c.rate:g}/s"
        how += f", {c.num_prompts} requests" if c.num_prompts is not None else ""
        errs = ", ".join(f"{k} {v}" for k, v in sorted(rec.errors.items())) or "none"
        check = f"  verified {rec.verified}, wrong {rec.verify_failures}" if rec.verified else ""
        lines = [
            f"[bold]graphlane loadtest[/] {how} -> {c.endpoint}",
            f"elapsed [bold]{min(elapsed, c.duration_s):.1f}[/]/{c.duration_s:g} s "
            f"({'done' if self.finished else self.run.phase()})  steps [bold]{rec.steps}[/]  "
            f"steps/s [bold]{recent:.1f}[/] (avg {rec.steps / max(elapsed, 1e-9):.1f})  "
            f"in flight {rec.in_flight}",
            f"latency ms p50 [bold]{p50}[/] p99 [bold]{p99}[/]  errors "
            f"[{'red' if rec.errors else 'green'}]{errs}[/]{check}",
            *([self.detail()] if self.detail is not None else []),
        ]  # fmt: skip
        return Group(*map(Text.from_markup, lines))

    async def tick(self) -> None:
        self.started = True
        self.live.start()
        while True:
            self.live.update(self.render(), refresh=True)
            await asyncio.sleep(0.25)

    def close(self) -> None:
        if self.started:
            self.finished = True
            self.live.update(self.render(), refresh=True)
            self.live.stop()
            if not self.console.is_terminal:
                self.console.line()
