"""The report of a finished ``graphlane loadtest`` run (:func:`build_report`) and its
verdict (:func:`assess`): the dict :mod:`.report_files` writes as report.json and
report.html. One format for every program: what :class:`.record.Recorder` measured, plus
the figures of the shape of load (``load``: "calls" or "sequences"; see
:mod:`.batching` for the latter's).

See :mod:`graphlane.loadtest` (what the report holds, the exit status).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from graphlane import __version__
from graphlane.protocol.errors import RETRYABLE

from .availability import MAX_UNAVAILABLE
from .config import LoadConfig
from .record import DeviceStats, Recorder, summary
from .run import CLIENT_DEADLINE, CLIENT_OVERLOAD

_CLIENT_RETRYABLE = frozenset({CLIENT_OVERLOAD, CLIENT_DEADLINE})


def build_report(
    config: LoadConfig,
    rec: Recorder,
    hello: Mapping[str, Any],
    *,
    load: str,
    resolved: Mapping[str, Any],
    tolerance: float,
    preflight: dict[str, str],
    started_at: str,
    start: float,
    end: float,
    sent_until: float | None = None,
    interrupted: bool = False,
    extra: Mapping[str, Any] | None = None,
    verify_skipped: str | None = None,
) -> dict[str, Any]:
    """``resolved``: what the run resolved against the daemon (``devices``, ``buckets``,
    ``shape``, and ``batch_sizes`` for calls), shown in the report's ``config``;
    ``verify_skipped``: why the default check did not run (None: it ran, or none was
    asked for)."""
    elapsed = max(end - start, 1e-9)
    sending_s = max((end if sent_until is None else sent_until) - start, 1e-9)
    unavailable_s = rec.availability.total(start + sending_s)
    devices = list(resolved["devices"])
    settings = config.to_dict()
    share = float(resolved.get("verify", config.verify_share(load)))
    settings.update(resolved, verify=share, window_s=rec.window_s)
    if config.mode == "open" and load == "calls":
        settings["max_outstanding"] = config.outstanding_cap()
    per_device = {}
    for d in devices:
        s = rec.devices.get(d) or DeviceStats()
        lat = summary(s.hist)
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
        lat = summary(rec.batches[b])
        per_batch[str(b)] = {"steps": lat["count"], "p50_ms": lat["p50"], "p99_ms": lat["p99"]}
    report: dict[str, Any] = {
        "tool": f"graphlane loadtest {__version__}",
        "started_at": started_at,
        "load": load,
        "config": settings,
        "server": {
            "server": hello.get("server"),
            "protocol_version": hello.get("version"),
            "backend": (hello.get("capabilities") or {}).get("backend"),
        },
        "mode": config.mode,
        "duration_s": config.duration_s,
        "sending_s": round(sending_s, 3),
        "elapsed_s": round(elapsed, 3),
        "interrupted": interrupted,
        "arrivals": rec.arrivals,
        "sent": rec.sent,
        "steps": rec.steps,
        "throughput": round(rec.steps / elapsed, 3),
        # the throughput plot's line: steps/s offered (for sequences R is arrivals of
        # sequences, not of steps)
        "offered_rate": config.rate if load == "calls" else None,
        "latency_ms": summary(rec.latency),
        "latency_basis": "scheduled arrival time"
        if config.mode == "open" and load == "calls"
        else "send time",
        "errors_total": rec.errors_total,
        "errors": dict(sorted(rec.errors.items())),
        "non_retryable_errors": rec.non_retryable,
        "unavailable_s": round(unavailable_s, 3),
        "unavailable_share": round(min(1.0, unavailable_s / sending_s), 4),
        "max_unavailable": config.max_unavailable,
        "error_examples": dict(sorted(rec.error_examples.items())),
        "verify_fraction": share,
        "verified": rec.verified,
        "verify_failures": rec.verify_failures,
        "verify_exact": rec.verified - rec.verify_failures - rec.verify_ties,
        "verify_ties": rec.verify_ties,
        "verify_skipped": verify_skipped,
        "verify_max_abs_error": rec.verify_max_error,
        "verify_tolerance": tolerance,
        "verified_by_generation": {str(k): v for k, v in rec.verified_by_generation.items()},
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
    if config.mode == "open" and load == "calls":
        report["send_lag_ms"] = summary(rec.send_lag)
    if extra:
        report.update(extra)
        if "tokens" in extra:
            report["tokens_per_s"] = round(extra["tokens"] / elapsed, 3)
    code, reasons = assess(report)
    report["verdict"] = {"exit_code": code, "ok": code == 0, "reasons": reasons}
    return report


def assess(report: Mapping[str, Any]) -> tuple[int, list[str]]:
    """The exit status of a finished run and why (see the module docstring)."""
    reasons = []
    if report.get("verify_failures", 0):
        reasons.append(
            f"{report['verify_failures']} of {report.get('verified', 0)} checked outputs "
            "differ from the reference"
        )
    if report.get("non_retryable_errors", 0):
        codes = [
            c for c in report.get("errors", {}) if c not in RETRYABLE and c not in _CLIENT_RETRYABLE
        ]
        reasons.append(
            f"{report['non_retryable_errors']} errors that are not retryable "
            f"({', '.join(codes) or 'marked non-retryable by the server'})"
        )
    share = report.get("unavailable_share", 0.0)
    if report.get("steps", 0) and share > report.get("max_unavailable", MAX_UNAVAILABLE):
        reasons.append(
            f"the server was unavailable for {report.get('unavailable_s', 0.0):.1f} s, "
            f"{100 * share:.0f}% of the {report.get('sending_s', 0.0):g} s of sending "
            f"(more than --max-unavailable {report.get('max_unavailable', MAX_UNAVAILABLE):g}): "
            "no step served, calls got WORKER_LOST, SHUTTING_DOWN or TIMEOUT"
        )
    if not report.get("steps", 0):
        reasons.append("no step succeeded")
    return (1 if reasons else 0), reasons


def verify_text(report: Mapping[str, Any]) -> str | None:
    """The verification in a line: what was checked and what it found, or why nothing
    was (None: no check asked for)."""
    if report.get("verify_skipped"):
        return f"not checked: {report['verify_skipped']}"
    if not report.get("verify_fraction"):
        return None
    n, wrong = report.get("verified", 0), report.get("verify_failures", 0)
    if report.get("serving") is not None:  # tokens: equal, a near tie, or different
        ties = report.get("verify_ties", 0)
        return (
            f"{n} requests checked: {n - wrong - ties} exact, {ties} near "
            f"tie{'' if ties == 1 else 's'} (docs/models.md, Precision), {wrong} differ"
        )
    err, tol = report.get("verify_max_abs_error", 0.0), report.get("verify_tolerance")
    if wrong:
        return (f"{n} checked, {wrong} wrong (beyond tolerance {tol}; the right ones "
                f"within {err:.2g})")  # fmt: skip
    return f"{n} checked, 0 wrong (max |out - reference| {err:.2g}, tolerance {tol})"


def load_text(report: Mapping[str, Any]) -> str:
    """The load of a run in words: its loop and what C or R count."""
    cfg = report.get("config", {})
    what = "sequence" if report.get("load") == "sequences" else "call"
    if report.get("serving") is not None:
        what = "request"
    if report.get("mode") == "open":
        rate = cfg.get("rate", 0)
        if rate == "inf":
            return f"every {what} at once ({cfg.get('num_prompts')})"
        return f"open loop, {rate:g} {what} arrivals/s (Poisson)"
    live = {"sequence": "live sequences", "request": "requests at a time"}.get(
        what, "calls in flight"
    )
    return f"closed loop, {cfg.get('concurrency')} {live}"
