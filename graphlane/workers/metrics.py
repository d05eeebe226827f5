"""A worker's own measurements, kept as plain numbers in the worker process.

The orchestrator fetches a snapshot through the worker's pipe (ping/pong) and
renders it for Prometheus; nothing here depends on prometheus-client, and
nothing crosses the step path but a few additions.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# Seconds: from 50 us (a patch dispatch) to 10 s (a stalled step).
BUCKETS_S: tuple[float, ...] = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
    2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip


@dataclass
class Histogram:
    """Cumulative-at-render histogram: per-bucket counts, sum and count.

    An observation is only appended (on the step path); they are sorted into
    buckets in bulk, when a snapshot is taken or :data:`PENDING_MAX` wait."""

    bounds: tuple[float, ...] = BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))
    total: float = 0.0
    n: int = 0
    pending: list[float] = field(default_factory=list)

    def observe(self, value: float) -> None:
        pending = self.pending
        pending.append(value)
        if len(pending) >= PENDING_MAX:
            self._bin()

    def _bin(self) -> None:
        pending, self.pending = self.pending, []
        counts, bounds = self.counts, self.bounds
        for value in pending:
            counts[bisect.bisect_left(bounds, value)] += 1
        self.total += sum(pending)
        self.n += len(pending)

    def snapshot(self) -> dict[str, Any]:
        self._bin()
        return {
            "bounds": list(self.bounds),
            "counts": list(self.counts),
            "sum": self.total,
            "count": self.n,
        }


PENDING_MAX = 1024


@dataclass
class WorkerMetrics:
    step_seconds: dict[tuple[str, str], Histogram] = field(default_factory=dict)  # (program, op)
    dispatch_seconds: Histogram = field(default_factory=Histogram)  # host time patching a step
    replay_seconds: Histogram = field(default_factory=Histogram)  # replay issue -> done
    errors: Counter[str] = field(default_factory=Counter)  # wire code -> count
    bytes_in: int = 0
    bytes_out: int = 0
    spin_seconds: float = 0.0  # CPU time the socket thread polled for the next request
    sequences_released: int = 0  # sequences forgotten because their client went
    clients_released: int = 0  # clients that went holding sequences (SequenceOwners)
    # Answered steps not yet in the histograms: (program, op, held, dispatch_s,
    # replay_at, done_at) each, one append per step; sorted in by _take_done.
    done: list[tuple[str, str, float, float, float, float]] = field(default_factory=list)

    def observe_done(
        self,
        program: str,
        op: str,
        held: float,
        dispatch_s: float,
        replay_at: float,
        done_at: float,
    ) -> None:
        """One answered step: the time it was held (``step_seconds``), its dispatch
        (``dispatch_seconds``, when it had any) and replay (``replay_seconds``, from
        ``replay_at`` to ``done_at``, when it replayed). Kept as one tuple and put in
        the histograms in bulk (at a snapshot or every :data:`PENDING_MAX` steps)."""
        done = self.done
        done.append((program, op, held, dispatch_s, replay_at, done_at))
        if len(done) >= PENDING_MAX:
            self._take_done()

    def _take_done(self) -> None:
        """Sort the answered steps into their histograms' pending values (binned by each
        histogram as ever)."""
        done, self.done = self.done, []
        steps = self.step_seconds
        dispatch, replay = self.dispatch_seconds.pending, self.replay_seconds.pending
        for program, op, held, dispatch_s, replay_at, done_at in done:
            h = steps.get((program, op))
            if h is None:
                h = steps[(program, op)] = Histogram()
            h.pending.append(held)
            if dispatch_s:
                dispatch.append(dispatch_s)
            if replay_at:
                took = done_at - replay_at
                replay.append(took if took > 0.0 else 0.0)
        for h in (*steps.values(), self.dispatch_seconds, self.replay_seconds):
            if len(h.pending) >= PENDING_MAX:
                h._bin()

    def snapshot(self) -> dict[str, Any]:
        self._take_done()
        return {
            "step_seconds": [
                {"program": p, "op": op, **h.snapshot()} for (p, op), h in self.step_seconds.items()
            ],
            "dispatch_seconds": self.dispatch_seconds.snapshot(),
            "replay_seconds": self.replay_seconds.snapshot(),
            "errors": dict(self.errors),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "spin_seconds": self.spin_seconds,
            "sequences_released": self.sequences_released,
            "clients_released": self.clients_released,
        }
