"""The live view of a run on stderr (``--progress``): a rich Live display refreshed 4
times a second by an asyncio task, from the run's recorder."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from .config import LoadConfig
from .record import Recorder


class Progress:
    """What the run has done so far: steps, rate, latency, errors, checks."""

    def __init__(self, config: LoadConfig, rec: Recorder, phase: Callable[[], str]) -> None:
        self.config, self.rec, self.phase = config, rec, phase
        self.console = Console(stderr=True)
        self.live = Live(console=self.console, auto_refresh=False, transient=False)
        self.history: deque[tuple[float, int]] = deque(maxlen=5)
        self.started = False
        self.finished = False
        #: a line of the workload's own (e.g. a model's requests, TTFT, ITL)
        self.detail: Callable[[], str] | None = None

    def render(self) -> Any:
        rec, c = self.rec, self.config
        now = time.monotonic()
        elapsed = now - rec.start
        self.history.append((now, rec.steps))
        t0, n0 = self.history[0]
        recent = (rec.steps - n0) / (now - t0) if now > t0 else 0.0
        lat = rec.latency
        n = lat.get_total_count()
        p50 = f"{lat.get_value_at_percentile(50) / 1000:.2f}" if n else "-"
        p99 = f"{lat.get_value_at_percentile(99) / 1000:.2f}" if n else "-"
        how = f"closed loop x{c.concurrency}" if c.mode == "closed" else f"open loop {c.rate:g}/s"
        if c.num_prompts is not None:
            how += f", {c.num_prompts} requests"
        phase = "done" if self.finished else self.phase()
        errs = ", ".join(f"{k} {v}" for k, v in sorted(rec.errors.items())) or "none"
        checked = rec.verified or rec.verify_failures
        check = f"  verified {rec.verified}, wrong {rec.verify_failures}" if checked else ""
        detail = [Text.from_markup(self.detail())] if self.detail is not None else []
        return Group(
            Text.from_markup(f"[bold]graphlane loadtest[/] {how} -> {c.endpoint}"),
            Text.from_markup(
                f"elapsed [bold]{min(elapsed, c.duration_s):.1f}[/]/{c.duration_s:g} s "
                f"({phase})  steps [bold]{rec.steps}[/]  steps/s [bold]{recent:.1f}[/] "
                f"(avg {rec.steps / max(elapsed, 1e-9):.1f})  in flight {rec.in_flight}"
            ),
            Text.from_markup(
                f"latency ms p50 [bold]{p50}[/] p99 [bold]{p99}[/]  errors "
                f"[{'red' if rec.errors else 'green'}]{errs}[/]{check}"
            ),
            *detail,
        )

    async def tick(self) -> None:
        self.started = True
        self.live.start()
        while True:
            self.live.update(self.render(), refresh=True)
            await asyncio.sleep(0.25)

    def close(self) -> None:
        if not self.started:
            return
        self.finished = True
        self.live.update(self.render(), refresh=True)
        self.live.stop()
        if not self.console.is_terminal:
            self.console.line()
