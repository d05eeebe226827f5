"""``graphlane loadtest``: drive a running daemon with attention steps and measure it.

Two load models:

* **closed loop** (``--concurrency C``): C callers, each sending its next step as
  soon as the previous one is answered. Latency is measured from the send.
* **open loop** (``--rate R``): Poisson arrivals at R steps/s, scheduled ahead
  from a seeded RNG, each launched as its own task. Latency is measured from
  the arrival's *scheduled* time, so a stalled server (or a stalled client)
  shows up as latency, not as a lower arrival rate. Outstanding calls are
  capped (``--max-outstanding``, default 10 s worth of arrivals, at least 100
  and at most 10,000); an arrival over the cap is not sent and is counted as
  the error ``CLIENT_OVERLOAD``, so memory stays bounded.

Both stop starting steps after ``--duration`` and wait at most ``--timeout``
more for the calls in flight (each call also has that deadline). A call still
unanswered at that point is cancelled and counted as ``CLIENT_DEADLINE``. From
the command line, a first Ctrl-C ends the sending early the same way (the
report is still written, marked ``interrupted``); a second one aborts.
Nothing is retried: every error is counted by its wire code (a
:class:`~graphlane.GraphlaneError`'s ``code``; any other exception by its class
name) and the caller moves on.

What a step sends (the program must be attention-shaped: parameter
``actual_seq_lengths_kv``, inputs ``query``/``key``/``value``, output ``out``):

* an **unverified** step sends random lengths and a query taken from a small
  pool made before the run, like a decode step whose KV cache stays on the
  device: the worker computes on whatever key/value its buffers hold;
* a **verified** step (a ``--verify`` fraction of steps) sends query, key and
  value for every batch row, so its output depends on nothing the daemon kept,
  and is compared with eager attention computed in this process (the sim's
  ``fused_infer_attention``, layer after layer). The cases (lengths, inputs and
  their reference output) are made before the run, a few per batch size, and
  used in turn per (device, batch size), so consecutive verified steps on one
  graph differ; the client does no attention math while it measures. A
  mismatch is counted (``verify_failures``) and the run goes on.

Shapes: the daemon's ``hello`` tells each program's buckets, outputs and task
groups (= layers for attention), not its head counts or lengths. Those come
from ``--shape`` (defaults: :class:`AttentionConfig`'s), the layer count from
``hello``. Before the run one verified step is sent to each device (not
measured; it also opens the connections): a daemon whose program has other
shapes refuses it with BAD_REQUEST naming the field, and the load test stops
there with that message.

The report (:func:`run_load` returns it; :mod:`.report` writes it as
``report.json`` and ``report.html`` with PNG plots): successful ``steps``,
``throughput`` (steps/s over the whole run, tail included), ``latency_ms``
(min, mean, p50, p90, p99, p99.9, max from an HDR histogram of microseconds
with 3 significant digits; its encoding is ``latency_hdr_us``), ``errors`` by
code, ``verified`` / ``verify_failures``, ``per_device`` and ``per_batch``
counts and percentiles, a ``timeseries`` (~120 windows), the open loop's
``send_lag_ms`` (how late the client sent, already part of the latency), the
resolved ``config`` and a ``verdict``.

Exit status of :func:`main`: 0 when at least one step succeeded, no verified
output was wrong and every error was retryable (BUSY, TIMEOUT, WORKER_LOST,
SHUTTING_DOWN, or the client's own CLIENT_OVERLOAD / CLIENT_DEADLINE: what a
loaded or restarting server is expected to answer); 1 when a verification
failed, an error was not retryable (BAD_REQUEST, INTERNAL, a client
exception...) or no step succeeded; 2 when the flags are invalid or the run
could not start (daemon unreachable, program not served, shapes differ);
130 when aborted by a second Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import math
import random
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

import torch

from graphlane import __version__
from graphlane.protocol.errors import GraphlaneError
from graphlane.workers.programs.attention import AttentionConfig
from graphlane.workers.programs.base import ProgramConfigError

from .client import Client, StepReply
from .config import DEFAULT_LISTEN

__all__ = [
    "SHAPE_KEYS",
    "LoadConfig",
    "LoadTestError",
    "add_parser",
    "assess",
    "config_from_args",
    "main",
    "run_load",
]

#: Keys of ``--shape`` / ``LoadConfig.shape`` (defaults from AttentionConfig).
SHAPE_KEYS = ("layers", "num_heads", "num_kv_heads", "head_dim", "max_kv_len", "dtype")
#: Error codes of the load generator itself (never on the wire).
CLIENT_OVERLOAD = "CLIENT_OVERLOAD"
CLIENT_DEADLINE = "CLIENT_DEADLINE"
#: Verified cases made per batch size before the run.
VERIFY_POOL = 4
#: Unverified queries made per batch size before the run.
QUERY_POOL = 4
#: Latency samples kept (reservoir) for the latency-over-time plot.
MAX_SAMPLES = 2000
#: Error examples kept in the report.
MAX_EXAMPLES = 5
#: HDR histograms record microseconds from 1 us to one hour.
HIGHEST_US = 3600 * 10**6
#: Percentiles reported in ``latency_ms`` (and printed).
PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9))
#: Tolerances (atol = rtol) of verification, by output dtype.
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 6e-2, torch.float32: 1e-4}
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_CLIENT_RETRYABLE = frozenset({CLIENT_OVERLOAD, CLIENT_DEADLINE})


class LoadTestError(RuntimeError):
    """The load test could not start against this daemon (shapes, program, ...)."""


# ---------------------------------------------------------------------------- config
@dataclass(frozen=True)
class LoadConfig:
    """One load test. Exactly one of ``concurrency`` (closed loop) and ``rate`` (open loop).

    ``shape`` overrides AttentionConfig's defaults for the keys in
    :data:`SHAPE_KEYS`; ``layers`` defaults to the task groups the daemon's
    ``hello`` reports. ``max_outstanding`` caps the open loop's calls in flight
    (None: 10 s worth of arrivals, clamped to 100..10,000). Invalid values raise
    ValueError naming the command-line flag.
    """

    endpoint: str
    duration_s: float
    concurrency: int | None = None
    rate: float | None = None
    program: str = "attention"
    devices: tuple[int, ...] | None = None
    batch_sizes: tuple[int, ...] | None = None
    verify: float = 0.0
    report_dir: str | None = None
    seed: int = 0
    timeout_s: float = 30.0
    progress: bool = True
    shape: Mapping[str, Any] = field(default_factory=dict)
    max_outstanding: int | None = None

    def __post_init__(self) -> None:
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(self.devices))
        if self.batch_sizes is not None:
            object.__setattr__(self, "batch_sizes", tuple(self.batch_sizes))
        object.__setattr__(self, "shape", MappingProxyType(dict(self.shape or {})))
        self.validate()

    @property
    def mode(self) -> str:
        return "closed" if self.concurrency is not None else "open"

    def validate(self) -> None:
        if not self.endpoint:
            raise ValueError("--connect must name an endpoint (tcp://HOST:PORT or ipc://PATH)")
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError(
                "give exactly one of --concurrency (closed loop) or --rate (open loop)"
            )
        if self.concurrency is not None and (not _is_int(self.concurrency) or self.concurrency < 1):
            raise ValueError(f"--concurrency must be an integer >= 1, not {self.concurrency!r}")
        if self.rate is not None and not (_is_real(self.rate) and 0 < self.rate < math.inf):
            raise ValueError(f"--rate must be > 0 (steps per second), not {self.rate!r}")
        if not (_is_real(self.duration_s) and 0 < self.duration_s < math.inf):
            raise ValueError(f"--duration must be > 0 seconds, not {self.duration_s!r}")
        if not (_is_real(self.timeout_s) and 0 < self.timeout_s < math.inf):
            raise ValueError(f"--timeout must be > 0 seconds, not {self.timeout_s!r}")
        if not (_is_real(self.verify) and 0.0 <= self.verify <= 1.0):
            raise ValueError(f"--verify must be a fraction in [0, 1], not {self.verify!r}")
        if not isinstance(self.program, str) or not self.program:
            raise ValueError("--program must name a program")
        if not _is_int(self.seed):
            raise ValueError(f"--seed must be an integer, not {self.seed!r}")
        if self.devices is not None:
            if not self.devices:
                raise ValueError("--devices must list at least one device")
            if any(not _is_int(d) or d < 0 for d in self.devices):
                raise ValueError(f"--devices must be device ids >= 0, not {list(self.devices)}")
            if len(set(self.devices)) != len(self.devices):
                raise ValueError(f"--devices lists a device twice: {list(self.devices)}")
        if self.batch_sizes is not None:
            if not self.batch_sizes:
                raise ValueError("--batch-sizes must list at least one batch size")
            if any(not _is_int(b) or b < 1 for b in self.batch_sizes):
                raise ValueError(f"--batch-sizes must be >= 1, not {list(self.batch_sizes)}")
        if self.max_outstanding is not None and (
            not _is_int(self.max_outstanding) or self.max_outstanding < 1
        ):
            raise ValueError(f"--max-outstanding must be >= 1, not {self.max_outstanding!r}")
        unknown = sorted(set(self.shape) - set(SHAPE_KEYS))
        if unknown:
            raise ValueError(f"--shape: unknown key(s) {unknown} (known: {', '.join(SHAPE_KEYS)})")
        try:
            AttentionConfig.from_mapping(dict(self.shape), "--shape")
        except ProgramConfigError as exc:
            raise ValueError(str(exc)) from None
        except TypeError as exc:
            raise ValueError(f"--shape: {exc}") from None

    def outstanding_cap(self) -> int:
        if self.max_outstanding is not None:
            return self.max_outstanding
        return min(10_000, max(100, math.ceil(10 * (self.rate or 0.0))))

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["devices"] = None if self.devices is None else list(self.devices)
        out["batch_sizes"] = None if self.batch_sizes is None else list(self.batch_sizes)
        out["shape"] = dict(self.shape)
        out["mode"] = self.mode
        return out


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ---------------------------------------------------------------------------- plan and workload
@dataclass(frozen=True)
class Plan:
    """What the run sends, resolved against the daemon's hello."""

    devices: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    buckets: tuple[int, ...]
    shape: AttentionConfig

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.shape.dtype]

    def shape_dict(self) -> dict[str, Any]:
        return {k: getattr(self.shape, k) for k in SHAPE_KEYS}


def resolve_plan(config: LoadConfig, hello: Mapping[str, Any]) -> Plan:
    """Check the config against the daemon's ``hello``; ValueError names the flag."""
    workers = [w for w in hello.get("workers", []) if isinstance(w, Mapping)]
    served = sorted(int(w["device"]) for w in workers if "device" in w)
    if not served:
        raise LoadTestError(f"the daemon at {config.endpoint} serves no device")
    devices = config.devices if config.devices is not None else tuple(served)
    missing = [d for d in devices if d not in served]
    if missing:
        raise ValueError(f"--devices: {missing} not served by the daemon (serving {served})")
    info: Mapping[str, Any] | None = None
    known: set[str] = set()
    for w in workers:
        programs = w.get("programs") or {}
        known |= set(programs)
        if w.get("device") in devices and config.program in programs and info is None:
            info = programs[config.program]
    if info is None:
        raise ValueError(
            f"--program: {config.program!r} is not served on devices {list(devices)} "
            f"(serving {sorted(known) or 'nothing yet: are the workers ready?'})"
        )
    buckets = tuple(sorted(int(b) for b in info.get("buckets", [])))
    if not buckets:
        raise LoadTestError(f"the daemon reports no buckets for {config.program!r}")
    if "out" not in info.get("outputs", ["out"]):
        raise LoadTestError(
            f"{config.program!r} has no output 'out' (outputs {info.get('outputs')}): "
            "the load test drives attention-shaped programs only"
        )
    groups = int(info.get("groups", 0)) or None
    shape = dict(config.shape)
    if "layers" in shape and groups is not None and shape["layers"] != groups:
        raise ValueError(
            f"--shape: layers={shape['layers']} but {config.program!r} on the daemon has "
            f"{groups} layers (task groups)"
        )
    if groups is not None:
        shape.setdefault("layers", groups)
    attention = AttentionConfig.from_mapping(shape, "--shape")
    batch_sizes = config.batch_sizes if config.batch_sizes is not None else buckets
    too_big = [b for b in batch_sizes if b > buckets[-1]]
    if too_big:
        raise ValueError(
            f"--batch-sizes: {too_big} larger than the largest bucket {buckets[-1]} "
            f"of {config.program!r} (buckets {list(buckets)})"
        )
    return Plan(tuple(devices), tuple(batch_sizes), buckets, attention)


def reference(
    shape: AttentionConfig,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: Sequence[int],
) -> torch.Tensor:
    """Eager attention of the program: layer l+1 attends from layer l's output."""
    from graphlane.workers.sim.attention_kernel import fused_infer_attention

    x = query
    for layer in range(shape.layers):
        x, _ = fused_infer_attention(
            x,
            key[layer],
            value[layer],
            actual_seq_lengths_kv=list(lengths),
            num_heads=shape.num_heads,
            num_key_value_heads=shape.num_kv_heads,
            input_layout="BNSD",
            scale=1.0 / math.sqrt(shape.head_dim),
        )
    return x


@dataclass(frozen=True)
class Case:
    """A verified step: its lengths and inputs, and the output eager attention gives."""

    lengths: list[int]
    inputs: dict[str, torch.Tensor]
    expected: torch.Tensor


@dataclass(frozen=True)
class Step:
    device: int
    batch: int
    lengths: list[int]
    inputs: dict[str, torch.Tensor]
    case: Case | None


class Workload:
    """Makes the steps of a run from pools built up front (see the module docstring)."""

    def __init__(self, plan: Plan, seed: int, verify: float) -> None:
        self.plan = plan
        self.verify = verify
        s = plan.shape
        gen = torch.Generator().manual_seed(seed)
        self.queries: dict[int, list[torch.Tensor]] = {
            b: [self._randn((b, s.num_heads, 1, s.head_dim), gen) for _ in range(QUERY_POOL)]
            for b in plan.batch_sizes
        }
        cases_per_batch = VERIFY_POOL if verify > 0 else 0
        self.cases: dict[int, list[Case]] = {
            b: [self.make_case(b, gen) for _ in range(cases_per_batch)] for b in plan.batch_sizes
        }
        self._turn: Counter[tuple[int, int]] = Counter()

    def _randn(self, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(self.plan.dtype)

    def make_case(self, batch: int, gen: torch.Generator) -> Case:
        s = self.plan.shape
        lengths = torch.randint(1, s.max_kv_len + 1, (batch,), generator=gen).tolist()
        kv = (s.layers, batch, s.num_kv_heads, s.max_kv_len, s.head_dim)
        inputs = {
            "query": self._randn((batch, s.num_heads, 1, s.head_dim), gen),
            "key": self._randn(kv, gen),
            "value": self._randn(kv, gen),
        }
        expected = reference(s, inputs["query"], inputs["key"], inputs["value"], lengths)
        return Case(lengths, inputs, expected)

    def verified_step(self, device: int, batch: int) -> Step:
        turn = self._turn[device, batch]
        self._turn[device, batch] += 1
        case = self.cases[batch][turn % len(self.cases[batch])]
        return Step(device, batch, case.lengths, case.inputs, case)

    def draw(self, rng: random.Random) -> Step:
        device = rng.choice(self.plan.devices)
        batch = rng.choice(self.plan.batch_sizes)
        if self.verify > 0 and rng.random() < self.verify:
            return self.verified_step(device, batch)
        top = self.plan.shape.max_kv_len
        lengths = [rng.randint(1, top) for _ in range(batch)]
        query = self.queries[batch][rng.randrange(QUERY_POOL)]
        return Step(device, batch, lengths, {"query": query}, None)


def check_output(case: Case, out: torch.Tensor, dtype: torch.dtype) -> float | None:
    """The max |out - expected|, or None when the output is wrong (shape or tolerance)."""
    if tuple(out.shape) != tuple(case.expected.shape):
        return None
    tol = TOLERANCE.get(dtype, 1e-2)
    got, want = out.float(), case.expected.float()
    err = float((got - want).abs().max()) if got.numel() else 0.0
    if not torch.allclose(got, want, rtol=tol, atol=tol) or not math.isfinite(err):
        return None
    return err


# ---------------------------------------------------------------------------- recording
def _hist(significant_figures: int = 3) -> Any:
    from hdrh.histogram import HdrHistogram

    return HdrHistogram(1, HIGHEST_US, significant_figures)


def _record(hist: Any, seconds: float) -> None:
    hist.record_value(min(HIGHEST_US, max(1, round(seconds * 1e6))))


def _ms(us: float) -> float:
    return round(us / 1000.0, 3)


def _summary(hist: Any) -> dict[str, Any]:
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
class _DeviceStats:
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
        self.devices: dict[int, _DeviceStats] = {}
        self.batches: dict[int, Any] = {}
        self.arrivals = 0
        self.sent = 0
        self.steps = 0
        self.in_flight = 0
        self.verified = 0
        self.verify_failures = 0
        self.verify_max_error = 0.0
        self.failure_examples: list[dict[str, Any]] = []
        self.samples: list[tuple[float, float]] = []
        self._seen = 0
        self._rng = random.Random(seed ^ 0x5EED)

    def _window(self, t: float) -> _Window:
        i = max(0, int((t - self.start) / self.window_s))
        w = self.windows.get(i)
        if w is None:
            w = self.windows[i] = _Window()
        return w

    def _device(self, device: int) -> _DeviceStats:
        d = self.devices.get(device)
        if d is None:
            d = self.devices[device] = _DeviceStats()
        return d

    def ok(self, step: Step, scheduled: float, done: float) -> None:
        latency = done - scheduled
        self.steps += 1
        _record(self.latency, latency)
        w = self._window(done)
        w.steps += 1
        w.devices[step.device] += 1
        _record(w.hist, latency)
        d = self._device(step.device)
        d.steps += 1
        _record(d.hist, latency)
        b = self.batches.get(step.batch)
        if b is None:
            b = self.batches[step.batch] = _hist()
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

    def verification(self, step: Step, error: float | None) -> None:
        d = self._device(step.device)
        self.verified += 1
        d.verified += 1
        if error is None:
            self.verify_failures += 1
            d.verify_failures += 1
            if len(self.failure_examples) < MAX_EXAMPLES:
                self.failure_examples.append(
                    {"device": step.device, "batch": step.batch, "lengths": step.lengths}
                )
        else:
            self.verify_max_error = max(self.verify_max_error, error)

    def error(
        self, code: str, done: float, *, device: int | None, retryable: bool, message: str = ""
    ) -> None:
        self.errors[code] += 1
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


# ---------------------------------------------------------------------------- the run
@dataclass
class _Run:
    config: LoadConfig
    client: Client
    plan: Plan
    workload: Workload
    rec: Recorder
    stop_at: float
    stop: asyncio.Event
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)  # every task of the run
    sent_until: float | None = None  # when sending ended (stop_at, or earlier when stopped)

    def sending(self) -> bool:
        return self.sent_until is None and not self.stop.is_set()

    async def pause(self, seconds: float) -> None:
        """Sleep, waking up early if the run is stopped."""
        if seconds <= 0.05 or self.stop.is_set():
            await asyncio.sleep(max(0.0, seconds))
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)

    def end_sending(self) -> None:
        if self.sent_until is None:
            now = time.monotonic()
            self.sent_until = now if self.stop.is_set() else min(now, self.stop_at)


async def _one(run: _Run, step: Step, scheduled: float) -> None:
    rec = run.rec
    sent = time.monotonic()
    rec.sent += 1
    rec.in_flight += 1
    if run.config.mode == "open":
        rec.lag(sent - scheduled)
    try:
        reply: StepReply = await run.client.step(
            run.config.program,
            step.device,
            {"actual_seq_lengths_kv": step.lengths},
            step.inputs,
            ("out",),
            batch=step.batch,
            timeout=run.config.timeout_s,
        )
    except GraphlaneError as exc:
        rec.error(
            str(exc.code),
            time.monotonic(),
            device=step.device,
            retryable=exc.retryable,
            message=exc.message,
        )
        return
    except asyncio.CancelledError:
        rec.error(
            CLIENT_DEADLINE,
            time.monotonic(),
            device=step.device,
            retryable=True,
            message="still unanswered at the end of the run (duration + timeout)",
        )
        raise
    except Exception as exc:
        rec.error(
            type(exc).__name__,
            time.monotonic(),
            device=step.device,
            retryable=False,
            message=str(exc),
        )
        return
    finally:
        rec.in_flight -= 1
    done = time.monotonic()
    rec.ok(step, scheduled, done)
    if step.case is not None:
        out = reply.outputs.get("out")
        err = check_output(step.case, out, run.plan.dtype) if out is not None else None
        rec.verification(step, err)


async def _finish(run: _Run, tasks: set[asyncio.Task[Any]]) -> None:
    """Wait for the tasks at most timeout_s after sending ended, then cancel what is left."""
    run.end_sending()
    assert run.sent_until is not None
    deadline = run.sent_until + run.config.timeout_s
    done: set[asyncio.Task[Any]] = set()
    if tasks:
        done, pending = await asyncio.wait(
            set(tasks), timeout=max(0.0, deadline - time.monotonic())
        )
        for t in pending:
            t.cancel()
        for t in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await t
    for t in done:
        error = None if t.cancelled() else t.exception()
        if error is not None:
            raise error  # a bug of the load generator: do not hide it


async def _closed_loop(run: _Run) -> None:
    assert run.config.concurrency is not None

    async def caller(i: int) -> None:
        rng = random.Random(run.config.seed * 1_000_003 + i)
        while time.monotonic() < run.stop_at and run.sending():
            step = run.workload.draw(rng)
            run.rec.arrivals += 1
            before = run.rec.errors_total
            await _one(run, step, time.monotonic())
            if run.rec.errors_total != before:
                await asyncio.sleep(0)  # a failing call may not have yielded: let others run

    tasks = {asyncio.create_task(caller(i)) for i in range(run.config.concurrency)}
    run.tasks.update(tasks)
    await run.pause(run.stop_at - time.monotonic())
    await _finish(run, tasks)


async def _open_loop(run: _Run, start: float) -> None:
    assert run.config.rate is not None
    arrivals = random.Random(run.config.seed)  # the schedule does not depend on the draws
    draws = random.Random(run.config.seed * 1_000_003 + 1)
    cap = run.config.outstanding_cap()
    tasks: set[asyncio.Task[Any]] = set()
    scheduled = start
    while True:
        scheduled += arrivals.expovariate(run.config.rate)
        if scheduled >= run.stop_at:
            break
        await run.pause(scheduled - time.monotonic())
        if not run.sending():
            break
        run.rec.arrivals += 1
        step = run.workload.draw(draws)
        if len(tasks) >= cap:
            run.rec.error(
                CLIENT_OVERLOAD,
                time.monotonic(),
                device=None,
                retryable=True,
                message=f"{cap} calls already outstanding (--max-outstanding)",
            )
            continue
        task = asyncio.create_task(_one(run, step, scheduled))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        run.tasks.add(task)
        task.add_done_callback(run.tasks.discard)
    await _finish(run, tasks)


async def _preflight(
    client: Client,
    config: LoadConfig,
    plan: Plan,
    workload: Workload,
    spawned: set[asyncio.Task[Any]],
) -> dict[str, str]:
    """One verified step per device, unmeasured: checks the shapes, opens the connections."""
    gen = torch.Generator().manual_seed(config.seed + 7)
    batch = min(plan.batch_sizes)
    case = workload.make_case(batch, gen)

    async def probe(device: int) -> str:
        try:
            reply = await client.step(
                config.program,
                device,
                {"actual_seq_lengths_kv": case.lengths},
                case.inputs,
                ("out",),
                batch=batch,
                timeout=config.timeout_s,
            )
        except GraphlaneError as exc:
            if exc.code in ("BAD_REQUEST", "UNKNOWN_PROGRAM", "UNKNOWN_DEVICE"):
                raise LoadTestError(
                    f"device {device} refused a step of {config.program!r} built with the shape "
                    f"{plan.shape_dict()}: {exc}. Give the daemon's program shape with --shape "
                    "(e.g. --shape num_heads=8,num_kv_heads=2,head_dim=64,max_kv_len=256)."
                ) from None
            return str(exc.code)  # retryable or internal: the run will measure it
        out = reply.outputs.get("out")
        if out is None or tuple(out.shape) != tuple(case.expected.shape):
            got = None if out is None else list(out.shape)
            raise LoadTestError(
                f"device {device} answered 'out' of shape {got}, expected "
                f"{list(case.expected.shape)} from the shape {plan.shape_dict()}"
            )
        return "ok" if check_output(case, out, plan.dtype) is not None else "wrong output"

    # Every probe ends (each within timeout_s) before a failure is raised: no call may be
    # left in flight when the client closes.
    tasks = [asyncio.create_task(probe(d)) for d in plan.devices]
    spawned.update(tasks)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return {str(d): str(r) for d, r in zip(plan.devices, results, strict=True)}


async def run_load(config: LoadConfig, *, stop: asyncio.Event | None = None) -> dict[str, Any]:
    """Run the load test; returns the report (also written to ``config.report_dir`` if set).

    Bounded: after the setup (hello and one probe step per device, each with
    ``timeout_s``), it sends for ``duration_s`` (or until ``stop`` is set) and
    then waits at most ``timeout_s`` for the calls in flight.
    """
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    client = Client(config.endpoint, timeout=config.timeout_s, name="graphlane-loadtest")
    # Every task that calls the client; all are ended before it closes (a call still in
    # flight while the client closes could open a socket that then blocks its shutdown).
    spawned: set[asyncio.Task[Any]] = set()
    progress: _Progress | None = None
    try:
        hello = await client.connect()
        plan = resolve_plan(config, hello)
        workload = Workload(plan, config.seed, config.verify)
        preflight = await _preflight(client, config, plan, workload, spawned)
        progress = _Progress() if config.progress else None
        start = time.monotonic()
        rec = Recorder(start, window_for(config.duration_s), config.seed)
        run = _Run(
            config,
            client,
            plan,
            workload,
            rec,
            stop_at=start + config.duration_s,
            stop=stop or asyncio.Event(),
            tasks=spawned,
        )
        if progress is not None:
            spawned.add(asyncio.create_task(progress.tick(run)))
        if config.mode == "closed":
            await _closed_loop(run)
        else:
            await _open_loop(run, start)
        end = time.monotonic()
    finally:
        for t in spawned:
            t.cancel()
        await asyncio.gather(*spawned, return_exceptions=True)
        if progress is not None:
            progress.close()
        await client.close()
    report = build_report(
        config, plan, rec, hello, preflight, started_at, start, end,
        sent_until=run.sent_until, interrupted=run.stop.is_set(),
    )  # fmt: skip
    if config.report_dir:
        from .report import write_report

        json_path, html_path = write_report(report, config.report_dir)
        report["files"] = {"json": str(json_path), "html": str(html_path)}
    return report


def build_report(
    config: LoadConfig,
    plan: Plan,
    rec: Recorder,
    hello: Mapping[str, Any],
    preflight: dict[str, str],
    started_at: str,
    start: float,
    end: float,
    *,
    sent_until: float | None = None,
    interrupted: bool = False,
) -> dict[str, Any]:
    elapsed = max(end - start, 1e-9)
    resolved = config.to_dict()
    resolved.update(
        devices=list(plan.devices),
        batch_sizes=list(plan.batch_sizes),
        shape=plan.shape_dict(),
        buckets=list(plan.buckets),
        window_s=rec.window_s,
    )
    if config.mode == "open":
        resolved["max_outstanding"] = config.outstanding_cap()
    per_device = {}
    for d in plan.devices:
        s = rec.devices.get(d) or _DeviceStats()
        lat = _summary(s.hist)
        per_device[str(d)] = {
            "steps": s.steps,
            "errors": dict(sorted(s.errors.items())),
            "verified": s.verified,
            "verify_failures": s.verify_failures,
            "p50_ms": lat["p50"],
            "p99_ms": lat["p99"],
        }
    per_batch = {}
    for b in sorted(rec.batches):
        lat = _summary(rec.batches[b])
        per_batch[str(b)] = {"steps": lat["count"], "p50_ms": lat["p50"], "p99_ms": lat["p99"]}
    report: dict[str, Any] = {
        "tool": f"graphlane loadtest {__version__}",
        "started_at": started_at,
        "config": resolved,
        "server": {
            "server": hello.get("server"),
            "protocol_version": hello.get("version"),
            "backend": (hello.get("capabilities") or {}).get("backend"),
        },
        "mode": config.mode,
        "duration_s": config.duration_s,
        "sending_s": round((end if sent_until is None else sent_until) - start, 3),
        "elapsed_s": round(elapsed, 3),
        "interrupted": interrupted,
        "arrivals": rec.arrivals,
        "sent": rec.sent,
        "steps": rec.steps,
        "throughput": round(rec.steps / elapsed, 3),
        "offered_rate": config.rate,
        "latency_ms": _summary(rec.latency),
        "latency_basis": "scheduled arrival time" if config.mode == "open" else "send time",
        "errors_total": rec.errors_total,
        "errors": dict(sorted(rec.errors.items())),
        "non_retryable_errors": rec.non_retryable,
        "error_examples": dict(sorted(rec.error_examples.items())),
        "verify_fraction": config.verify,
        "verified": rec.verified,
        "verify_failures": rec.verify_failures,
        "verify_max_abs_error": rec.verify_max_error,
        "verify_tolerance": TOLERANCE.get(plan.dtype, 1e-2),
        "verify_failure_examples": rec.failure_examples,
        "per_device": per_device,
        "per_batch": per_batch,
        "preflight": preflight,
        "timeseries": rec.timeseries(end),
        "latency_cdf": rec.cdf(),
        "latency_samples": {
            "t_s": [round(t, 4) for t, _ in sorted(rec.samples)],
            "latency_ms": [round(1000 * v, 3) for _, v in sorted(rec.samples)],
        },
        "latency_hdr_us": rec.latency.encode().decode("ascii"),
    }
    if config.mode == "open":
        report["send_lag_ms"] = _summary(rec.send_lag)
    code, reasons = assess(report)
    report["verdict"] = {"exit_code": code, "ok": code == 0, "reasons": reasons}
    return report


def assess(report: Mapping[str, Any]) -> tuple[int, list[str]]:
    """The exit status of a finished run and why (see the module docstring)."""
    reasons = []
    if report.get("verify_failures", 0):
        reasons.append(
            f"{report['verify_failures']} of {report.get('verified', 0)} verified outputs "
            "differ from eager attention"
        )
    if report.get("non_retryable_errors", 0):
        codes = [
            c
            for c in report.get("errors", {})
            if c not in _CLIENT_RETRYABLE
            and c not in ("BUSY", "TIMEOUT", "WORKER_LOST", "SHUTTING_DOWN")
        ]
        reasons.append(
            f"{report['non_retryable_errors']} errors that are not retryable "
            f"({', '.join(codes) or 'marked non-retryable by the server'})"
        )
    if not report.get("steps", 0):
        reasons.append("no step succeeded")
    return (1 if reasons else 0), reasons


# ---------------------------------------------------------------------------- progress
class _Progress:
    """A rich Live view on stderr, refreshed 4 times a second by an asyncio task."""

    def __init__(self) -> None:
        from rich.console import Console, Group
        from rich.live import Live
        from rich.text import Text

        self._group, self._text = Group, Text
        self.console = Console(stderr=True)
        self.live = Live(console=self.console, auto_refresh=False, transient=False)
        self.history: deque[tuple[float, int]] = deque(maxlen=5)
        self.run_: _Run | None = None
        self.finished = False

    def render(self) -> Any:
        assert self.run_ is not None
        run, rec, c = self.run_, self.run_.rec, self.run_.config
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
        phase = (
            "done"
            if self.finished
            else "sending"
            if run.sent_until is None
            else "waiting for calls in flight"
        )
        errs = ", ".join(f"{k} {v}" for k, v in sorted(rec.errors.items())) or "none"
        check = f"  verified {rec.verified}, wrong {rec.verify_failures}" if c.verify else ""
        T = self._text
        return self._group(
            T.from_markup(f"[bold]graphlane loadtest[/] {how} -> {c.endpoint}"),
            T.from_markup(
                f"elapsed [bold]{min(elapsed, c.duration_s):.1f}[/]/{c.duration_s:g} s "
                f"({phase})  steps [bold]{rec.steps}[/]  steps/s [bold]{recent:.1f}[/] "
                f"(avg {rec.steps / max(elapsed, 1e-9):.1f})  in flight {rec.in_flight}"
            ),
            T.from_markup(
                f"latency ms p50 [bold]{p50}[/] p99 [bold]{p99}[/]  errors "
                f"[{'red' if rec.errors else 'green'}]{errs}[/]{check}"
            ),
        )

    async def tick(self, run: _Run) -> None:
        self.run_ = run
        self.live.start()
        while True:
            self.live.update(self.render(), refresh=True)
            await asyncio.sleep(0.25)

    def close(self) -> None:
        if self.run_ is None:
            return
        self.finished = True
        self.live.update(self.render(), refresh=True)
        self.live.stop()
        if not self.console.is_terminal:
            self.console.line()


# ---------------------------------------------------------------------------- command line
def _int_list(flag: str) -> Callable[[str], tuple[int, ...]]:
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} takes comma-separated integers, not {text!r}"
            ) from None
        if not values:
            raise argparse.ArgumentTypeError(f"{flag} needs at least one value")
        return values

    return parse


def parse_shape(text: str) -> dict[str, Any]:
    """``layers=2,num_heads=4,dtype=float16`` -> a shape mapping (integers except dtype)."""
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in SHAPE_KEYS:
            raise argparse.ArgumentTypeError(
                f"--shape takes KEY=VALUE pairs with KEY in {', '.join(SHAPE_KEYS)}, not {item!r}"
            )
        if key == "dtype":
            out[key] = value.strip()
            continue
        try:
            out[key] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--shape {key} must be an integer") from None
    return out


def _number(flag: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a number, not {text!r}") from None
        return v

    return parse


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``loadtest`` subcommand to an ``add_subparsers()`` object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "loadtest",
        help="drive a running daemon with steps and report latency and throughput",
        description=(
            "Send attention steps to a running graphlane daemon for --duration seconds, either "
            "closed loop (--concurrency C calls in flight) or open loop (Poisson arrivals at "
            "--rate R steps/s, latency measured from each arrival's scheduled time, so a "
            "stalled server shows as latency rather than as fewer arrivals). Shows live "
            "progress, prints a summary, and writes DIR/report.json and DIR/report.html "
            "(with PNG plots). With --verify F, a fraction F of the steps carry their own "
            "query/key/value and their output is checked against eager attention; the other "
            "steps send lengths and a query only."
        ),
        epilog=(
            "exit status: 0 when steps succeeded, no verified output was wrong and every "
            "error was retryable (BUSY, TIMEOUT, WORKER_LOST, SHUTTING_DOWN, CLIENT_OVERLOAD, "
            "CLIENT_DEADLINE); 1 when a verification failed, an error was not retryable or no "
            "step succeeded; 2 for invalid flags or a run that could not start.\n\n"
            "example: graphlane loadtest --connect tcp://127.0.0.1:7450 --rate 200 "
            "--duration 30 --verify 0.05 --report out/"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--connect",
        metavar="ENDPOINT",
        default=DEFAULT_LISTEN,
        help=f"the daemon's endpoint, tcp://HOST:PORT or ipc://PATH (default {DEFAULT_LISTEN})",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--concurrency",
        type=int,
        metavar="C",
        help="closed loop: keep C steps in flight, each caller sending its next step when "
        "the previous one is answered",
    )
    mode.add_argument(
        "--rate",
        type=_number("--rate"),
        metavar="R",
        help="open loop: Poisson arrivals at R steps/s, whatever the server does",
    )
    p.add_argument(
        "--duration",
        type=_number("--duration"),
        required=True,
        metavar="SECONDS",
        help="how long to send steps; calls in flight then get at most --timeout more",
    )
    p.add_argument(
        "--program", default="attention", metavar="NAME", help="program to step (attention)"
    )
    p.add_argument(
        "--devices",
        type=_int_list("--devices"),
        metavar="LIST",
        help="device ids to send to, e.g. 0,1 (default: every device the daemon serves)",
    )
    p.add_argument(
        "--batch-sizes",
        type=_int_list("--batch-sizes"),
        metavar="LIST",
        help="batch sizes to draw from uniformly, e.g. 1,3,8 (default: the program's buckets)",
    )
    p.add_argument(
        "--verify",
        type=_number("--verify"),
        default=0.0,
        metavar="FRACTION",
        help="fraction of steps (0..1) sent with full inputs and checked against eager "
        "attention computed here (default 0)",
    )
    p.add_argument(
        "--report",
        metavar="DIR",
        required=True,
        help="directory for report.json, report.html and its PNG plots (created if needed)",
    )
    p.add_argument(
        "--shape",
        type=parse_shape,
        default={},
        metavar="KEY=VALUE,...",
        help="the program's shapes, which hello does not tell: keys "
        + ", ".join(SHAPE_KEYS)
        + " (defaults num_heads=8,num_kv_heads=2,head_dim=64,max_kv_len=256,dtype=float16; "
        "layers from the daemon)",
    )
    p.add_argument(
        "--timeout",
        type=_number("--timeout"),
        default=30.0,
        metavar="SECONDS",
        help="deadline of each call, and the most the run waits after --duration (default 30)",
    )
    p.add_argument(
        "--max-outstanding",
        type=int,
        metavar="N",
        help="open loop: most calls in flight; arrivals over it count as CLIENT_OVERLOAD "
        "(default 10 x rate, within 100..10000)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of arrivals, draws and inputs (default 0)"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live progress on stderr (default: when stderr is a terminal)",
    )
    return p


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """The LoadConfig of parsed ``loadtest`` arguments (ValueError names the flag)."""
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    return LoadConfig(
        endpoint=args.connect,
        duration_s=args.duration,
        concurrency=args.concurrency,
        rate=args.rate,
        program=args.program,
        devices=args.devices,
        batch_sizes=args.batch_sizes,
        verify=args.verify,
        report_dir=args.report,
        seed=args.seed,
        timeout_s=args.timeout,
        progress=progress,
        shape=args.shape or {},
        max_outstanding=args.max_outstanding,
    )


def print_summary(report: Mapping[str, Any], console: Any = None) -> None:
    """A rich table of the run's results."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    lat = report["latency_ms"]
    cfg = report["config"]
    how = (
        f"closed loop, concurrency {cfg['concurrency']}"
        if report["mode"] == "closed"
        else f"open loop, {cfg['rate']:g} arrivals/s"
    )
    t = Table(title=f"graphlane loadtest: {how}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    t.add_row("endpoint", str(cfg["endpoint"]))
    t.add_row("program / devices", f"{cfg['program']} on {cfg['devices']}")
    sending = (
        f"interrupted after {report['sending_s']:.2f} s of {report['duration_s']:g} s"
        if report.get("interrupted")
        else f"sending for {report['duration_s']:g} s"
    )
    t.add_row("elapsed", f"{report['elapsed_s']:.2f} s ({sending})")
    t.add_row("steps", f"{report['steps']} of {report['sent']} sent")
    t.add_row("throughput", f"{report['throughput']:.1f} steps/s")
    t.add_row(
        f"latency ms ({report['latency_basis']})",
        "  ".join(f"{k} {ms(lat[k])}" for k in ("p50", "p90", "p99", "p99.9", "max")),
    )
    if "send_lag_ms" in report:
        lag = report["send_lag_ms"]
        t.add_row("send lag ms", f"p50 {ms(lag['p50'])}  p99 {ms(lag['p99'])}")
    errors = ", ".join(f"{k}: {v}" for k, v in report["errors"].items()) or "none"
    t.add_row("errors", f"[red]{errors}[/]" if report["errors"] else errors)
    if report["verify_fraction"]:
        t.add_row(
            "verified",
            f"{report['verified']} checked, {report['verify_failures']} wrong "
            f"(max |out - eager| {report['verify_max_abs_error']:.2g})",
        )
    verdict = report["verdict"]
    t.add_row(
        "result",
        "[green]ok[/]" if verdict["ok"] else "[red]FAILED[/]: " + "; ".join(verdict["reasons"]),
    )
    if "files" in report:
        t.add_row("report", f"{report['files']['html']}\n{report['files']['json']}")
    console.print(t)


def main(args: argparse.Namespace) -> int:
    """Run ``graphlane loadtest`` from parsed arguments; returns the exit status."""
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"graphlane loadtest: {exc}", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(_run_interruptible(config))
    except (ValueError, LoadTestError, GraphlaneError) as exc:
        print(f"graphlane loadtest: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("graphlane loadtest: interrupted", file=sys.stderr)
        return 130
    print_summary(report)
    return int(report["verdict"]["exit_code"])


async def _run_interruptible(config: LoadConfig) -> dict[str, Any]:
    """run_load where the first Ctrl-C ends sending early (the report is still written)
    and a second one aborts."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()

    def on_sigint() -> None:
        if stop.is_set() and me is not None:
            me.cancel()
        stop.set()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
        return await run_load(config)
    try:
        return await run_load(config, stop=stop)
    finally:
        loop.remove_signal_handler(signal.SIGINT)
