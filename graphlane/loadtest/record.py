"""The recording of ``graphlane loadtest``: counts, HDR histograms and the time series of
a run.

Every shape of load records here (independent calls and continuously batched
sequences alike), so every run has the same report. See :mod:`graphlane.loadtest`.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from hdrh.histogram import HdrHistogram

from .availability import Availability


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
    n = hist.get_total_count()
    out: dict[str, Any] = {"count": n}
    if not n:
        out.update({k: None for k in ("min", "mean", *(p for p, _ in PERCENTILES), "max")})
        return out
    out["min"] = _ms(hist.get_min_value())
    out["mean"] = _ms(hist.get_mean_value())
    for name, p in PERCENTILES:
        out[name] = _ms(hist.get_value_at_percentile(p))
    out["max"] = _ms(hist.get_max_value())
    return out


@dataclass
class _Window:
    hist: Any = field(default_factory=lambda: _hist(2))
    steps: int = 0
    errors: int = 0
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
        self.start = start
        self.window_s = window_s
        self.latency = _hist()
        self.send_lag = _hist()
        self.windows: dict[int, _Window] = {}
        self.errors: Counter[str] = Counter()
        self.non_retryable = 0
        self.error_examples: dict[str, str] = {}
        self.devices: dict[int, DeviceStats] = {}
        self.batches: dict[int, Any] = {}
        self.arrivals = 0
        self.sent = 0
        self.steps = 0
        self.in_flight = 0
        self.verified = 0
        self.verify_failures = 0
        self.verify_ties = 0  # right only up to a near tie of the dtype (tokens)
        self.verify_max_error = 0.0
        self.verified_by_generation: Counter[int] = Counter()
        self.failure_examples: list[dict[str, Any]] = []
        self.samples: list[tuple[float, float]] = []
        self._seen = 0
        self._rng = random.Random(seed ^ 0x5EED)
        self.availability = Availability(start, window_s)

    def _window(self, t: float) -> _Window:
        i = max(0, int((t - self.start) / self.window_s))
        w = self.windows.get(i)
        if w is None:
            w = self.windows[i] = _Window()
        return w

    def _device(self, device: int) -> DeviceStats:
        d = self.devices.get(device)
        if d is None:
            d = self.devices[device] = DeviceStats()
        return d

    def ok(self, call: Call, scheduled: float, done: float) -> None:
        latency = done - scheduled
        self.steps += 1
        self.availability.ok(done)
        _record(self.latency, latency)
        w = self._window(done)
        w.steps += 1
        w.devices[call.device] += 1
        _record(w.hist, latency)
        d = self._device(call.device)
        d.steps += 1
        _record(d.hist, latency)
        b = self.batches.get(call.batch)
        if b is None:
            b = self.batches[call.batch] = _hist()
        _record(b, latency)
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
        d = self._device(call.device)
        self.verified += 1
        d.verified += 1
        if tie and error is not None:
            self.verify_ties += 1
        if error is None:
            self.verify_failures += 1
            d.verify_failures += 1
            if len(self.failure_examples) < MAX_EXAMPLES:
                self.failure_examples.append(
                    {"device": call.device, "batch": call.batch, "params": call.params}
                )
        else:
            self.verify_max_error = max(self.verify_max_error, error)
            if generation is not None:
                self.verified_by_generation[generation] += 1

    def error(
        self, code: str, done: float, *, device: int | None, retryable: bool, message: str = ""
    ) -> None:
        self.errors[code] += 1
        self.availability.error(code, done)
        if not retryable:
            self.non_retryable += 1
        if code not in self.error_examples and len(self.error_examples) < 20:
            self.error_examples[code] = message[:300]
        self._window(done).errors += 1
        if device is not None:
            self._device(device).errors[code] += 1

    def lag(self, seconds: float) -> None:
        _record(self.send_lag, max(0.0, seconds))

    @property
    def errors_total(self) -> int:
        return sum(self.errors.values())

    def timeseries(self, end: float) -> dict[str, Any]:
        span = max(0.0, end - self.start)
        last = max([*self.windows, int(span / self.window_s)])
        spans: list[tuple[float, float, _Window]] = []
        for i in range(last + 1):
            lo = i * self.window_s
            # The last window ends with the run: rates are over the part it covers.
            hi = min(lo + self.window_s, max(span, lo + 1e-3))
            spans.append((lo, hi, self.windows.get(i) or _Window()))
        if len(spans) > 1 and spans[-1][1] - spans[-1][0] < self.window_s / 2:
            # A short last window would give a noisy rate: fold it into the one before.
            lo, _, merged = spans[-2]
            _, hi, tail = spans.pop()
            merged.steps += tail.steps
            merged.errors += tail.errors
            merged.devices.update(tail.devices)
            merged.hist.add(tail.hist)
            spans[-1] = (lo, hi, merged)
        t: list[float] = []
        steps, errors = [], []
        rate: list[float] = []
        error_rate: list[float] = []
        p50: list[float | None] = []
        p99: list[float | None] = []
        pmax: list[float | None] = []
        per_device: dict[str, list[float]] = {str(d): [] for d in sorted(self.devices)}
        for lo, hi, w in spans:
            width = hi - lo
            t.append(round(hi, 3))
            steps.append(w.steps)
            errors.append(w.errors)
            rate.append(round(w.steps / width, 3))
            error_rate.append(round(w.errors / width, 3))
            n = w.hist.get_total_count()
            p50.append(_ms(w.hist.get_value_at_percentile(50)) if n else None)
            p99.append(_ms(w.hist.get_value_at_percentile(99)) if n else None)
            pmax.append(_ms(w.hist.get_max_value()) if n else None)
            for d, series in per_device.items():
                series.append(round(w.devices.get(int(d), 0) / width, 3))
        return {
            "window_s": self.window_s,
            "t_s": t,
            "steps": steps,
            "errors": errors,
            "steps_per_s": rate,
            "errors_per_s": error_rate,
            "p50_ms": p50,
            "p99_ms": p99,
            "max_ms": pmax,
            "device_steps_per_s": per_device,
        }

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
