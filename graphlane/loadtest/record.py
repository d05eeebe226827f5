"""The recording of a run, the same for every shape of load: counts, HDR histograms and
the time series (:class:`Recorder`), and :class:`Call`, what it records a step of."""

from __future__ import annotations

import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from hdrh.histogram import HdrHistogram

from graphlane.protocol.errors import GraphlaneError

from .availability import UNAVAILABLE


@dataclass(frozen=True)
class Call:
    """One step the load test sends; ``expected``: what its output is checked against
    (None: not checked); ``rows``: the sequences of its rows (a program with state)."""

    device: int
    batch: int
    params: dict[str, Any]
    inputs: dict[str, torch.Tensor]
    expected: torch.Tensor | None = None
    rows: tuple[int, ...] = field(default=())


#: Latency samples kept (reservoir) for the latency-over-time plot.
MAX_SAMPLES = 2000
#: Error examples kept in the report.
MAX_EXAMPLES = 5
#: HDR histograms record microseconds from 1 us to one hour.
HIGHEST_US = 3600 * 10**6
#: Percentiles reported in ``latency_ms`` (and printed).
PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9))


# ---------------------------------------------------------------------------- recording
def _hist(significant_figures: int = 3) -> Any:
    return HdrHistogram(1, HIGHEST_US, significant_figures)


def _record(hist: Any, seconds: float) -> None:
    hist.record_value(min(HIGHEST_US, max(1, round(seconds * 1e6))))


def _ms(us: float) -> float:
    return round(us / 1000.0, 3)


def summary(hist: Any) -> dict[str, Any]:
    """count, min, mean, the :data:`PERCENTILES` and max of a histogram, in ms."""
    n = hist.get_total_count()
    values = [hist.get_min_value(), hist.get_mean_value(),
              *(hist.get_value_at_percentile(p) for _, p in PERCENTILES), hist.get_max_value()]
    keys = ("min", "mean", *(name for name, _ in PERCENTILES), "max")
    return {"count": n, **{k: _ms(v) if n else None for k, v in zip(keys, values, strict=True)}}


@dataclass
class _Window:
    hist: Any = field(default_factory=lambda: _hist(2))
    steps: int = 0
    errors: int = 0
    down: int = 0  # errors that say the server did not serve (UNAVAILABLE)
    devices: Counter[int] = field(default_factory=Counter)


@dataclass
class DeviceStats:
    steps: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    verified: int = 0
    verify_failures: int = 0
    hist: Any = field(default_factory=_hist)


class Recorder:
    """Counts and histograms of one run; times are ``time.monotonic()`` seconds."""

    def __init__(self, start: float, window_s: float, seed: int) -> None:
        self.start, self.window_s = start, window_s
        self.latency, self.send_lag = _hist(), _hist()
        self.windows: defaultdict[int, _Window] = defaultdict(_Window)
        self.errors: Counter[str] = Counter()
        self.error_examples: dict[str, str] = {}
        self.devices: defaultdict[int, DeviceStats] = defaultdict(DeviceStats)
        self.batches: defaultdict[int, Any] = defaultdict(_hist)
        self.arrivals = self.sent = self.steps = self.in_flight = self.non_retryable = 0
        self.verified = self.verify_failures = 0
        self.verify_ties = 0  # right only up to a near tie of the dtype (tokens)
        self.verify_max_error = 0.0
        self.verified_by_generation: Counter[int] = Counter()
        self.failure_examples: list[dict[str, Any]] = []
        self.samples: list[tuple[float, float]] = []
        self._seen = 0
        self._rng = random.Random(seed ^ 0x5EED)

    def _window(self, t: float) -> _Window:
        return self.windows[max(0, int((t - self.start) / self.window_s))]

    def ok(self, call: Call, scheduled: float, done: float) -> None:
        latency = done - scheduled
        self.steps += 1
        w, d = self._window(done), self.devices[call.device]
        w.steps += 1
        w.devices[call.device] += 1
        d.steps += 1
        for hist in (self.latency, w.hist, d.hist, self.batches[call.batch]):
            _record(hist, latency)
        # Reservoir sample (algorithm R) for the latency-over-time scatter.
        self._seen += 1
        sample = (done - self.start, latency)
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append(sample)
        else:
            j = self._rng.randrange(self._seen)
            if j < MAX_SAMPLES:
                self.samples[j] = sample

    def verification(
        self, call: Call, error: float | None, generation: int | None = None, *, tie: bool = False
    ) -> None:
        """A checked output: wrong (``error`` None) or right within ``error``, computed by
        the worker ``generation``; ``tie``: right, but only up to a near tie (tokens that
        differ where the reference's own logits were within the dtype's allowance)."""
        d = self.devices[call.device]
        self.verified += 1
        d.verified += 1
        if tie and error is not None:
            self.verify_ties += 1
        if error is None:
            self.verify_failures += 1
            d.verify_failures += 1
            if len(self.failure_examples) < MAX_EXAMPLES:
                self.failure_examples.append({"device": call.device, "batch": call.batch,
                                              "params": call.params})  # fmt: skip
        else:
            self.verify_max_error = max(self.verify_max_error, error)
            if generation is not None:
                self.verified_by_generation[generation] += 1

    def error(
        self, code: str, done: float, *, device: int | None, retryable: bool, message: str = ""
    ) -> None:
        self.errors[code] += 1
        self._window(done).down += code in UNAVAILABLE
        if not retryable:
            self.non_retryable += 1
        if code not in self.error_examples and len(self.error_examples) < 20:
            self.error_examples[code] = message[:300]
        self._window(done).errors += 1
        if device is not None:
            self.devices[device].errors[code] += 1

    def failed(self, exc: Exception, device: int | None) -> None:
        """A call to ``device`` failed: counted by its wire code (or its class name)."""
        if isinstance(exc, GraphlaneError):
            self.error(str(exc.code), time.monotonic(), device=device, retryable=exc.retryable,
                       message=exc.message)  # fmt: skip
        else:
            self.error(type(exc).__name__, time.monotonic(), device=device, retryable=False,
                       message=str(exc))  # fmt: skip

    def lag(self, seconds: float) -> None:
        _record(self.send_lag, max(0.0, seconds))

    @property
    def errors_total(self) -> int:
        return sum(self.errors.values())

    def unavailable_s(self, until: float) -> float:
        """Seconds the server was unavailable from the start up to ``until``: windows in
        which calls ended, none succeeded and one said so, and the silent ones after."""
        span, down, seconds = max(0.0, until - self.start), False, 0.0
        for i in range(int(span / self.window_s) + 1):
            w = self.windows.get(i) or _Window()
            down = False if w.steps else (True if w.down else down)
            seconds += max(0.0, min(self.window_s, span - i * self.window_s)) if down else 0.0
        return seconds

    def timeseries(self, end: float) -> dict[str, Any]:
        """Per window up to ``end``: steps, errors, their rates, latency percentiles; a
        short last window (a noisy rate) is folded into the one before."""
        span = max(0.0, end - self.start)
        spans: list[tuple[float, float, _Window]] = []
        for i in range(max([*self.windows, int(span / self.window_s)]) + 1):
            lo = i * self.window_s
            # The last window ends with the run: rates are over the part it covers.
            spans.append((lo, min(lo + self.window_s, max(span, lo + 1e-3)),
                          self.windows.get(i) or _Window()))  # fmt: skip
        if len(spans) > 1 and spans[-1][1] - spans[-1][0] < self.window_s / 2:
            (lo, _, merged), (_, hi, tail) = spans[-2], spans.pop()
            merged.steps += tail.steps
            merged.errors += tail.errors
            merged.devices.update(tail.devices)
            merged.hist.add(tail.hist)
            spans[-1] = (lo, hi, merged)

        def pct(w: _Window, p: float) -> float | None:
            return _ms(w.hist.get_value_at_percentile(p)) if w.hist.get_total_count() else None

        return {
            "window_s": self.window_s,
            "t_s": [round(hi, 3) for _, hi, _ in spans],
            "steps": [w.steps for *_, w in spans],
            "errors": [w.errors for *_, w in spans],
            "steps_per_s": [round(w.steps / (hi - lo), 3) for lo, hi, w in spans],
            "errors_per_s": [round(w.errors / (hi - lo), 3) for lo, hi, w in spans],
            "p50_ms": [pct(w, 50) for *_, w in spans],
            "p99_ms": [pct(w, 99) for *_, w in spans],
            "max_ms": [pct(w, 100) for *_, w in spans],
            "device_steps_per_s": {str(d): [round(w.devices.get(d, 0) / (hi - lo), 3)
                                            for lo, hi, w in spans] for d in sorted(self.devices)},
        }  # fmt: skip

    def cdf(self) -> dict[str, list[float]]:
        if not self.latency.get_total_count():
            return {"percentile": [], "latency_ms": []}
        grid = [float(p) for p in range(0, 100)]
        grid += [99 + i / 10 for i in range(1, 10)] + [99.9 + i / 100 for i in range(1, 10)]
        grid += [99.99 + i / 1000 for i in range(1, 10)] + [100.0]
        values = [_ms(self.latency.get_value_at_percentile(p)) for p in grid]
        return {"percentile": [round(p, 3) for p in grid], "latency_ms": values}


def window_for(duration_s: float) -> float:
    """Time-series bucket width: ~120 buckets over the run, at least 0.25 s."""
    return round(max(0.25, duration_s / 120.0), 3)
