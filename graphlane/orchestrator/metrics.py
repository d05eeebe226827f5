"""Prometheus metrics of the daemon (``--metrics-port``), rendered at scrape time
from the orchestrator's view of its workers (the snapshots each worker sends
back over its pipe, about once a second) and the supervisor's own state."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from .supervisor import READY, Supervisor


def _buckets(snap: dict[str, Any]) -> list[tuple[str, float]]:
    out, running = [], 0
    for bound, n in zip([*snap["bounds"], float("inf")], snap["counts"], strict=True):
        running += n
        out.append(("+Inf" if bound == float("inf") else repr(bound), running))
    return out


class DaemonCollector(Collector):
    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily(
            "graphlane_worker_up", "1 when the device's worker is ready", labels=["device"]
        )
        restarts = CounterMetricFamily(
            "graphlane_worker_restarts", "Worker restarts", labels=["device"]
        )
        queued = GaugeMetricFamily(
            "graphlane_queue_depth", "Requests queued in the engine", labels=["device"]
        )
        inflight = GaugeMetricFamily(
            "graphlane_inflight", "Requests accepted, not answered", labels=["device"]
        )
        errors = CounterMetricFamily(
            "graphlane_errors", "Error replies by code", labels=["device", "code"]
        )
        b_in = CounterMetricFamily(
            "graphlane_bytes_in", "Request bytes received", labels=["device"]
        )
        b_out = CounterMetricFamily("graphlane_bytes_out", "Reply bytes sent", labels=["device"])
        sequences = GaugeMetricFamily(
            "graphlane_sequences", "Sequences a worker keeps for its clients",
            labels=["device", "program"],
        )  # fmt: skip
        spin = CounterMetricFamily(
            "graphlane_worker_spin_seconds",
            "CPU time a worker's socket thread polled for the next request (idle_spin_us)",
            labels=["device"],
        )
        released = CounterMetricFamily(
            "graphlane_sequences_released", "Sequences released because their client went",
            labels=["device"],
        )  # fmt: skip
        step = HistogramMetricFamily(
            "graphlane_step_seconds", "Time a worker held a request (decode to reply)",
            labels=["device", "program", "op"],
        )  # fmt: skip
        dispatch = HistogramMetricFamily(
            "graphlane_update_dispatch_seconds", "Host time copying inputs and dispatching patches",
            labels=["device"],
        )  # fmt: skip
        behind = GaugeMetricFamily(
            "graphlane_group_rank_behind_steps",
            "Steps a tensor-parallel group's leader completed that this rank has not",
            labels=["device", "group", "rank"],
        )
        replay = HistogramMetricFamily(
            "graphlane_replay_seconds", "From replay issue to the step's completion on the device",
            labels=["device"],
        )  # fmt: skip
        for h in self.supervisor.workers.values():
            d = str(h.device)
            group = h.spec.group
            if group is not None:
                lag = self.supervisor.behind(h)
                behind.add_metric([d, str(group.index), str(group.rank)], lag)
            up.add_metric([d], 1.0 if h.state == READY else 0.0)
            restarts.add_metric([d], h.restarts)
            st = h.stats
            if not st:
                continue
            queued.add_metric([d], st.get("queued", 0))
            inflight.add_metric([d], st.get("inflight", 0))
            m = st.get("metrics", {})
            for code, n in sorted(m.get("errors", {}).items()):
                errors.add_metric([d, code], n)
            b_in.add_metric([d], m.get("bytes_in", 0))
            b_out.add_metric([d], m.get("bytes_out", 0))
            released.add_metric([d], m.get("sequences_released", 0))
            spin.add_metric([d], m.get("spin_seconds", 0.0))
            for program, held in sorted(st.get("sequences", {}).items()):
                sequences.add_metric([d, program], held.get("sequences", 0))
            for s in m.get("step_seconds", []):
                step.add_metric([d, s["program"], s["op"]], _buckets(s), s["sum"])
            if "dispatch_seconds" in m:
                dispatch.add_metric(
                    [d], _buckets(m["dispatch_seconds"]), m["dispatch_seconds"]["sum"]
                )
            if "replay_seconds" in m:
                replay.add_metric([d], _buckets(m["replay_seconds"]), m["replay_seconds"]["sum"])
        yield from (up, restarts, queued, inflight, errors, b_in, b_out, sequences, released, spin)
        yield from (step, dispatch, replay)
        yield behind


def serve_metrics(supervisor: Supervisor, port: int, host: str = "127.0.0.1") -> Any:
    """Start the HTTP endpoint (a thread); returns the server, or raises OSError."""
    registry = CollectorRegistry()
    registry.register(DaemonCollector(supervisor))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
