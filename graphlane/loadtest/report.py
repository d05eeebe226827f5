"""The report of a finished run (:func:`build_report`: one dict for every program, what
:class:`.record.Recorder` measured plus the workload's own figures), its verdict
(:func:`assess`) and its summary in words (:func:`summary_rows`), which the command
line prints and report.html shows. Its keys and the exit status: docs/loadtest.md.
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
    config: LoadConfig, rec: Recorder, hello: Mapping[str, Any], *, load: str,
    resolved: Mapping[str, Any], tolerance: float, preflight: dict[str, str], started_at: str,
    start: float, end: float, sent_until: float | None = None, interrupted: bool = False,
    extra: Mapping[str, Any] | None = None, verify_skipped: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """``resolved``: what the run resolved against the daemon (``devices``, ``buckets``,
    ``shape``, and ``batch_sizes`` for calls), shown in the report's ``config``;
    ``verify_skipped``: why the default check did not run (None: it ran, or none was
    asked for)."""
    elapsed = max(end - start, 1e-9)
    sending_s = max((end if sent_until is None else sent_until) - start, 1e-9)
    unavailable_s = rec.unavailable_s(start + sending_s)
    calls_open = config.mode == "open" and load == "calls"
    settings = config.to_dict()
    share = float(resolved.get("verify", config.verify_share(load)))
    settings.update(resolved, verify=share, window_s=rec.window_s)
    if calls_open:
        settings["max_outstanding"] = config.outstanding_cap()
    per_device = {}
    for d in resolved["devices"]:
        s = rec.devices.get(d) or DeviceStats()
        lat = summary(s.hist)
        per_device[str(d)] = {"steps": s.steps, "errors": dict(sorted(s.errors.items())),
                              "verified": s.verified, "verify_failures": s.verify_failures,
                              "p50_ms": lat["p50"], "p99_ms": lat["p99"]}  # fmt: skip
    per_batch = {str(b): {"steps": (lat := summary(h))["count"], "p50_ms": lat["p50"],
                          "p99_ms": lat["p99"]} for b, h in sorted(rec.batches.items())}
    samples = sorted(rec.samples)
    report: dict[str, Any] = {
        "tool": f"graphlane loadtest {__version__}",
        "started_at": started_at,
        "load": load,
        "config": settings,
        "server": {"server": hello.get("server"), "protocol_version": hello.get("version"),
                   "backend": (hello.get("capabilities") or {}).get("backend")},
        "mode": config.mode,
        "duration_s": config.duration_s,
        "sending_s": round(sending_s, 3),
        "elapsed_s": round(elapsed, 3),
        "interrupted": interrupted,
        "arrivals": rec.arrivals,
        "sent": rec.sent,
        "steps": rec.steps,
        "throughput": round(rec.steps / elapsed, 3),
        "offered_rate": config.rate if load == "calls" else None,  # steps/s offered
        "latency_ms": summary(rec.latency),
        "latency_basis": "scheduled arrival time" if calls_open else "send time",
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
        "latency_samples": {"t_s": [round(t, 4) for t, _ in samples],
                            "latency_ms": [round(1000 * v, 3) for _, v in samples]},
        "latency_hdr_us": rec.latency.encode().decode("ascii"),
    }
    if calls_open:
        report["send_lag_ms"] = summary(rec.send_lag)
    report.update(extra or {})
    if "tokens" in report:
        report["tokens_per_s"] = round(report["tokens"] / elapsed, 3)
    code, reasons = assess(report)
    report["verdict"] = {"exit_code": code, "ok": code == 0, "reasons": reasons}
    return report


def assess(report: Mapping[str, Any]) -> tuple[int, list[str]]:
    """The exit status of a finished run and why (docs/loadtest.md)."""
    reasons = []
    if report.get("verify_failures", 0):
        reasons.append(f"{report['verify_failures']} of {report.get('verified', 0)} checked "
                       "outputs differ from the reference")  # fmt: skip
    if report.get("non_retryable_errors", 0):
        codes = [c for c in report.get("errors", {})
                 if c not in RETRYABLE and c not in _CLIENT_RETRYABLE]  # fmt: skip
        reasons.append(f"{report['non_retryable_errors']} errors that are not retryable "
                       f"({', '.join(codes) or 'marked non-retryable by the server'})")
    share = report.get("unavailable_share", 0.0)
    most = report.get("max_unavailable", MAX_UNAVAILABLE)
    if report.get("steps", 0) and share > most:
        reasons.append(
            f"the server was unavailable for {report.get('unavailable_s', 0.0):.1f} s, "
            f"{100 * share:.0f}% of the {report.get('sending_s', 0.0):g} s of sending "
            f"(more than --max-unavailable {most:g}): no step served, calls got WORKER_LOST, "
            "SHUTTING_DOWN or TIMEOUT"
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
        return (f"{n} requests checked: {n - wrong - ties} exact, {ties} near "
                f"tie{'' if ties == 1 else 's'} (docs/models.md, Precision), {wrong} differ")
    err, tol = report.get("verify_max_abs_error", 0.0), report.get("verify_tolerance")
    if wrong:
        return (f"{n} checked, {wrong} wrong (beyond tolerance {tol}; the right ones "
                f"within {err:.2g})")  # fmt: skip
    return f"{n} checked, 0 wrong (max |out - reference| {err:.2g}, tolerance {tol})"


def load_text(report: Mapping[str, Any]) -> str:
    """The load of a run in words: its loop and what C or R count."""
    cfg = report.get("config", {})
    what = "sequence" if report.get("load") == "sequences" else "call"
    what = "request" if report.get("serving") is not None else what
    if report.get("mode") == "open":
        if cfg.get("rate") == "inf":
            return f"every {what} at once ({cfg.get('num_prompts')})"
        return f"open loop, {cfg.get('rate', 0):g} {what} arrivals/s (Poisson)"
    live = {"sequence": "live sequences", "request": "requests at a time"}.get(what)
    return f"closed loop, {cfg.get('concurrency')} {live or 'calls in flight'}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _stats(m: Mapping[str, Any], keys: tuple[str, ...]) -> str:
    return "  ".join(f"{k} {_ms(m.get(k))}" for k in keys)


def summary_rows(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The run's results as (name, text) rows: the printed summary and report.html's."""
    cfg, seqs = report["config"], report.get("sequences")
    sending = (f"interrupted after {report['sending_s']:.2f} s of {report['duration_s']:g} s"
               if report.get("interrupted") else f"sending for {report['duration_s']:g} s")
    rows = [
        ("load", load_text(report)),
        ("endpoint", str(cfg["endpoint"])),
        ("program / devices", f"{cfg['program']} on devices {cfg['devices']}"),
        ("elapsed", f"{report['elapsed_s']:.2f} s ({sending})"),
        ("steps", f"{report['steps']} succeeded of {report['sent']} sent"),
        ("throughput", f"{report['throughput']:.1f} steps/s"),
        (f"latency ms ({report['latency_basis']})",
         _stats(report["latency_ms"], ("p50", "p90", "p99", "p99.9", "max"))),
    ]  # fmt: skip
    if "send_lag_ms" in report:
        rows.append(("send lag ms (behind schedule)", _stats(report["send_lag_ms"],
                                                             ("p50", "p99", "max"))))
    if seqs is not None:
        rb = report["request_bytes"]
        rows += [("tokens", f"{report['tokens']} ({report['tokens_per_s']:.1f}/s)"),
                 ("batch occupancy", f"{report['occupancy']:.2f} (mean batch "
                                     f"{report['mean_batch']})"),
                 ("sequences", ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in seqs.items()))]
        if rb["mean"] is not None:
            rows.append(("request bytes/step", f"mean {rb['mean']:.0f}  min {rb['min']}  "
                                               f"max {rb['max']}"))  # fmt: skip
        if "blocks_reused" in report:
            rows.append(("blocks reused", str(report["blocks_reused"])))
        rows.append(("state lost", str(report["state_lost"])))
    s = report.get("serving")
    if s is not None:
        rows += [("requests", f"{s['completed']} completed, {s['failed']} failed, {s['cut']} "
                              f"cut, in {s['duration_s']:.2f} s"),
                 ("request / token throughput", f"{s['request_throughput']:.2f} req/s, output "
                  f"{s['output_throughput']:.1f} tok/s, total {s['total_token_throughput']:.1f} "
                  "tok/s")]  # fmt: skip
        for key, name in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms (excl. 1st token)"),
                          ("itl_ms", "ITL ms"), ("e2el_ms", "request latency ms")):  # fmt: skip
            rows.append((name, _stats(s[key], ("mean", "median", "p99"))))
    errors = report["errors"]
    rows.append(("errors", ", ".join(f"{k}: {v}" for k, v in errors.items()) or "none"))
    checked = verify_text(report)
    if checked is not None:
        rows.append(("verified", checked))
    verdict = report["verdict"]
    rows.append(("result", "ok" if verdict["ok"] else "FAILED: " + "; ".join(verdict["reasons"])))
    return rows


def serving_text(report: Mapping[str, Any]) -> str:
    """A model run's figures as vLLM's benchmark_serving prints them."""
    s = report["serving"]

    def line(name: str, value: Any, fmt: str = "") -> str:
        return f"{name:<40}{'-' if value is None else format(value, fmt):<10}"

    lines = [" Serving Benchmark Result ".center(50, "=")]
    for name, key, fmt in (("Successful requests:", "completed", ""),
                           ("Failed requests:", "failed", ""),
                           ("Benchmark duration (s):", "duration_s", ".2f"),
                           ("Total input tokens:", "total_input_tokens", ""),
                           ("Total generated tokens:", "total_output_tokens", ""),
                           ("Request throughput (req/s):", "request_throughput", ".2f"),
                           ("Output token throughput (tok/s):", "output_throughput", ".2f"),
                           ("Total Token throughput (tok/s):", "total_token_throughput", ".2f")):
        lines.append(line(name, s[key], fmt))  # fmt: skip
    for title, key, short in (("Time to First Token", "ttft_ms", "TTFT"),
                              ("Time per Output Token (excl. 1st token)", "tpot_ms", "TPOT"),
                              ("Inter-token Latency", "itl_ms", "ITL")):  # fmt: skip
        lines.append(title.center(50, "-"))
        lines += [line(f"{w} {short} (ms):", s[key][k], ".2f")
                  for w, k in (("Mean", "mean"), ("Median", "median"), ("P99", "p99"))]
    return "\n".join([*lines, "=" * 50])
