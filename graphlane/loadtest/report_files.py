"""The files of a load test report: ``report.json``, ``report.html`` and its PNG plots.

:func:`write_report` takes the dict :func:`graphlane.loadtest.driver.run_load`
returns and writes, into one directory:

* ``report.json``: that dict, plus ``plots`` (the PNG file names);
* ``latency_over_time.png``, ``latency_cdf.png``, ``throughput_over_time.png`` (and
  for a model, ``token_latency.png``: TTFT and ITL distributions, and
  ``ttft_over_time.png``): drawn with matplotlib's Agg canvas (no display, no pyplot
  global state);
* ``report.html``: a page with no outside resources: the verdict and a summary
  table first, then the plots (``<img>`` by relative path, so the directory can
  be moved or served as is), then per-device and per-batch tables and the
  configuration. A run of sequences (see :mod:`.batching`) adds its tokens, batch
  occupancy, sequences and request bytes to the summary.
"""

from __future__ import annotations

import html
import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .report import load_text, verify_text

__all__ = ["PLOTS", "plot_all", "render_html", "write_report"]


def write_report(report: Mapping[str, Any], directory: str | Path) -> tuple[Path, Path]:
    """Write the report's JSON, plots and HTML into ``directory``; returns (json, html)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    plots = plot_all(report, out)
    data = {**report, "plots": plots}
    json_path = out / "report.json"
    json_path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    html_path = out / "report.html"
    html_path.write_text(render_html(data, plots))
    return json_path, html_path


# ---------------------------------------------------------------------------- plots
def _nan(values: Sequence[float | None]) -> list[float]:
    return [math.nan if v is None else float(v) for v in values]


def _figure(width: float = 9.0, height: float = 4.0) -> Any:
    # matplotlib loads in about a second: only a run that writes a report pays for it
    # (not ``graphlane --help``, whose parser imports the load test's flags).
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _log_if_wide(ax: Any, values: Sequence[float], axis: str = "y") -> None:
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if positive and max(positive) / min(positive) > 30:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")


def plot_all(report: Mapping[str, Any], directory: Path) -> dict[str, str]:
    """Draw every plot into ``directory``; returns {file name: title}. A run of a model
    (``serving`` in the report) adds its TTFT and ITL plots."""
    drawers = dict(_DRAWERS)
    if report.get("serving") is not None:
        drawers.update(_SERVING_DRAWERS)
    for name, (_, draw) in drawers.items():
        fig = draw(report)
        fig.savefig(directory / name, format="png")
    return {name: title for name, (title, _) in drawers.items()}


def _subtitle(report: Mapping[str, Any]) -> str:
    cfg = report.get("config", {})
    return f"{cfg.get('program')} on devices {cfg.get('devices')}, {load_text(report)}"


def plot_latency_over_time(report: Mapping[str, Any]) -> Any:
    fig = _figure()
    ax = fig.add_subplot()
    ts = report.get("timeseries", {})
    samples = report.get("latency_samples", {})
    sx, sy = samples.get("t_s", []), samples.get("latency_ms", [])
    if not sx:
        _empty(ax, "no successful steps")
        return fig
    ax.scatter(sx, sy, s=6, alpha=0.35, color="tab:grey", label="steps (sample)", linewidths=0)
    edges = [0.0, *ts.get("t_s", [])]
    t = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
    for key, label, color in (
        ("p50_ms", "p50", "tab:blue"),
        ("p99_ms", "p99", "tab:orange"),
        ("max_ms", "max", "tab:red"),
    ):
        ax.plot(t, _nan(ts.get(key, [])), label=f"{label} per {ts.get('window_s')} s", color=color)
    _log_if_wide(ax, list(sy))
    _sending_stopped(ax, report)
    ax.set_xlabel("time since start (s), by completion")
    ax.set_ylabel(f"latency (ms, from {report.get('latency_basis', 'send')})")
    ax.set_title(f"Latency over time: {_subtitle(report)}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return fig


def plot_latency_cdf(report: Mapping[str, Any]) -> Any:
    fig = _figure(10.0, 4.0)
    left, right = fig.subplots(1, 2)
    cdf = report.get("latency_cdf", {})
    pct, lat = cdf.get("percentile", []), cdf.get("latency_ms", [])
    if not lat:
        _empty(left, "no successful steps")
        _empty(right, "no successful steps")
        return fig
    # Left: the CDF itself.
    left.step(lat, [p / 100 for p in pct], where="post", color="tab:blue")
    left.set_xlabel("latency (ms)")
    left.set_ylabel("fraction of steps at or below")
    left.set_ylim(0, 1.02)
    left.set_title("Latency CDF", fontsize=10)
    left.grid(True, alpha=0.3)
    # Right: the tail, on a "nines" axis (x = 1 / (1 - p)).
    tail = [(1 / (1 - p / 100), v) for p, v in zip(pct, lat, strict=True) if p < 100]
    right.plot([x for x, _ in tail], [v for _, v in tail], color="tab:purple")
    right.set_xscale("log")
    ticks = [(2, "50%"), (10, "90%"), (100, "99%"), (1000, "99.9%"), (10000, "99.99%")]
    right.set_xticks([x for x, _ in ticks], [label for _, label in ticks])
    right.minorticks_off()
    summary = report.get("latency_ms", {})
    for key, color in (("p50", "tab:blue"), ("p99", "tab:orange"), ("p99.9", "tab:red")):
        v = summary.get(key)
        if v is not None:
            right.axhline(v, color=color, ls=":", lw=1, label=f"{key} {v:.2f} ms")
    if summary.get("max") is not None:
        right.axhline(
            summary["max"], color="black", ls="--", lw=1, label=f"max {summary['max']:.2f}"
        )
    _log_if_wide(right, [v for _, v in tail])
    right.set_xlabel("percentile")
    right.set_ylabel("latency (ms)")
    right.set_title("Latency by percentile (tail)", fontsize=10)
    right.grid(True, alpha=0.3)
    right.legend(loc="upper left", fontsize=8)
    return fig


def _sending_stopped(ax: Any, report: Mapping[str, Any]) -> None:
    """The line where sending stopped (a run stopped early: where it stopped), and the
    x axis ending where the run ended, not where the duration asked for would have."""
    stopped = report.get("sending_s", report.get("duration_s"))
    if stopped:
        ax.axvline(stopped, color="grey", ls="--", lw=1, label="sending stopped")
    ax.set_xlim(left=0)
    end = max(report.get("elapsed_s") or 0.0, stopped or 0.0)
    if end > 0:
        ax.set_xlim(right=end * 1.02)


def plot_throughput(report: Mapping[str, Any]) -> Any:
    fig = _figure()
    ax = fig.add_subplot()
    ts = report.get("timeseries", {})
    t = ts.get("t_s", [])
    if not t:
        _empty(ax, "no data")
        return fig
    edges = [0.0, *t]
    errors = ts.get("errors_per_s", [])
    if any(errors):
        ax.stairs(errors, edges, fill=True, color="tab:red", alpha=0.35, label="errors/s")
    ax.stairs(ts.get("steps_per_s", []), edges, color="tab:green", lw=2, label="steps/s")
    devices = ts.get("device_steps_per_s", {})
    if sum(1 for rates in devices.values() if any(rates)) > 1:
        for d, rates in devices.items():
            ax.stairs(rates, edges, lw=1, alpha=0.8, label=f"device {d}")
    if report.get("offered_rate"):
        ax.axhline(report["offered_rate"], color="black", ls=":", lw=1, label="offered rate")
    _sending_stopped(ax, report)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("time since start (s), by completion")
    ax.set_ylabel(f"per second ({ts.get('window_s')} s windows)")
    ax.set_title(f"Throughput over time: {_subtitle(report)}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize=8)
    return fig


def plot_token_latencies(report: Mapping[str, Any]) -> Any:
    """CDFs of a model run's TTFT, TPOT-free ITL and request latency (vLLM's figures)."""
    fig = _figure(10.0, 4.0)
    left, right = fig.subplots(1, 2)
    s = report.get("serving") or {}
    samples = s.get("samples", {})
    for ax, key, title, color in (
        (left, "ttft_ms", "Time to first token", "tab:blue"),
        (right, "itl_ms", "Inter-token latency", "tab:green"),
    ):
        values = sorted(samples.get(key, []))
        if not values:
            _empty(ax, "no completed requests")
            continue
        n = len(values)
        ax.step(values, [(i + 1) / n for i in range(n)], where="post", color=color)
        stats = s.get(key, {})
        for stat, ls in (("mean", "--"), ("median", ":"), ("p99", "-.")):
            v = stats.get(stat)
            if v is not None:
                ax.axvline(v, color="grey", ls=ls, lw=1, label=f"{stat} {v:.2f} ms")
        _log_if_wide(ax, values, "x")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction at or below")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{title} ({n} {'requests' if key == 'ttft_ms' else 'gaps'})", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    return fig


def plot_ttft_over_time(report: Mapping[str, Any]) -> Any:
    """Each completed request's TTFT and latency by its arrival time."""
    fig = _figure()
    ax = fig.add_subplot()
    samples = (report.get("serving") or {}).get("samples", {})
    t = samples.get("arrival_s", [])
    if not t:
        _empty(ax, "no completed requests")
        return fig
    ax.scatter(t, samples.get("e2el_ms", []), s=8, alpha=0.5, color="tab:grey",
               label="request latency", linewidths=0)  # fmt: skip
    ax.scatter(t, samples.get("ttft_ms", []), s=8, alpha=0.7, color="tab:blue",
               label="time to first token", linewidths=0)  # fmt: skip
    _log_if_wide(ax, [*samples.get("ttft_ms", []), *samples.get("e2el_ms", [])])
    _sending_stopped(ax, report)
    ax.set_xlabel("arrival time since start (s)")
    ax.set_ylabel("ms")
    ax.set_title(f"TTFT and latency by arrival: {_subtitle(report)}", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    return fig


#: A model run's plots (after the others).
_SERVING_DRAWERS: dict[str, tuple[str, Callable[[Mapping[str, Any]], Any]]] = {
    "token_latency.png": ("TTFT and ITL distributions", plot_token_latencies),
    "ttft_over_time.png": ("TTFT over time", plot_ttft_over_time),
}
#: Plot file name -> (title, drawer), in page order.
_DRAWERS: dict[str, tuple[str, Callable[[Mapping[str, Any]], Any]]] = {
    "latency_over_time.png": ("Latency over time", plot_latency_over_time),
    "latency_cdf.png": ("Latency distribution", plot_latency_cdf),
    "throughput_over_time.png": ("Throughput over time", plot_throughput),
}
#: Plot file name -> title, in page order.
PLOTS = {name: title for name, (title, _) in _DRAWERS.items()}


# ---------------------------------------------------------------------------- html
_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1050px; color: #222; }
h1 { margin-bottom: 0.2em; } .sub { color: #666; margin-top: 0; }
.verdict { padding: 0.6em 1em; border-radius: 6px; font-weight: 600; }
.ok { background: #e6f4ea; color: #1e6b34; } .bad { background: #fce8e6; color: #a52714; }
table { border-collapse: collapse; margin: 0.8em 0 1.6em; }
th, td { padding: 0.3em 0.9em; border-bottom: 1px solid #ddd; text-align: left; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.summary th { width: 14em; }
.err { color: #a52714; font-weight: 600; }
img { max-width: 100%; border: 1px solid #eee; margin-bottom: 1.5em; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _rows(rows: Sequence[tuple[str, str]]) -> str:
    return "\n".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "\n".join(
        "<tr>"
        + "".join(
            f'<td class="num">{_e(c)}</td>' if isinstance(c, (int, float)) else f"<td>{_e(c)}</td>"
            for c in row
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>\n{body}</table>"


def _sequence_rows(report: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The summary rows of a run of sequences (none for independent calls)."""
    if report.get("load") != "sequences":
        return []
    seqs = report.get("sequences", {})
    rb = report.get("request_bytes", {})
    rows = [
        ("tokens", _e(f"{report.get('tokens')} ({report.get('tokens_per_s', 0):.1f}/s)")),
        ("batch occupancy",
         _e(f"{report.get('occupancy')} (mean batch {report.get('mean_batch')})")),
        ("sequences", _e(", ".join(f"{v} {k.replace('_', ' ')}" for k, v in seqs.items()))),
        ("state lost", _e(report.get("state_lost", 0))),
    ]  # fmt: skip
    if rb.get("mean") is not None:
        rows.append(("request bytes/step", _e(f"mean {rb['mean']:.0f}, min {rb['min']}, "
                                              f"max {rb['max']}")))  # fmt: skip
    if "blocks_reused" in report:
        rows.append(("blocks reused", _e(report["blocks_reused"])))
    s = report.get("serving")
    if s is not None:
        rows.append(("requests", _e(f"{s['completed']} completed, {s['failed']} failed, "
                                    f"{s['cut']} cut, in {s['duration_s']} s")))  # fmt: skip
        rows.append((
            "request / token throughput",
            f"<b>{s['request_throughput']:.2f}</b> req/s, output <b>"
            f"{s['output_throughput']:.1f}</b> tok/s, total {s['total_token_throughput']:.1f}"
            " tok/s",
        ))  # fmt: skip
        for key, name in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms (excl. 1st token)"),
                          ("itl_ms", "ITL ms"), ("e2el_ms", "request latency ms")):  # fmt: skip
            m = s[key]
            rows.append((name, " &nbsp; ".join(f"{k} <b>{_ms(m.get(k))}</b>"
                                               for k in ("mean", "median", "p99"))))  # fmt: skip
    return rows


def render_html(report: Mapping[str, Any], plots: Mapping[str, str]) -> str:
    cfg = report.get("config", {})
    lat = report.get("latency_ms", {})
    verdict = report.get("verdict", {"ok": True, "reasons": []})
    ok = bool(verdict.get("ok"))
    errors = report.get("errors", {})
    verdict_text = "PASS" if ok else "FAIL: " + "; ".join(verdict.get("reasons", []))
    if ok and errors:
        verdict_text += f" (with {report.get('errors_total', 0)} retryable errors)"
    errors_text = (
        '<span class="err">'
        + _e(", ".join(f"{k}: {v}" for k, v in errors.items()))
        + f"</span> ({report.get('errors_total', 0)} in all)"
        if errors
        else "none"
    )
    how = load_text(report)
    rows: list[tuple[str, str]] = [
        ("load", _e(how)),
        ("endpoint", _e(cfg.get("endpoint"))),
        ("program / devices", _e(f"{cfg.get('program')} on devices {cfg.get('devices')}")),
        ("batch sizes", _e(cfg.get("batch_sizes") or "the live sequences of each step")),
        (
            "time",
            _e(
                f"sent for {report.get('sending_s')} s"
                + (
                    f" (interrupted; asked for {report.get('duration_s')} s)"
                    if report.get("interrupted")
                    else ""
                )
                + f", finished after {report.get('elapsed_s')} s"
            ),
        ),
        ("steps", _e(f"{report.get('steps')} succeeded of {report.get('sent')} sent")),
        ("throughput", f"<b>{report.get('throughput', 0):.1f}</b> steps/s"),
        (
            f"latency ms ({report.get('latency_basis', 'send time')})",
            " &nbsp; ".join(
                f"{k} <b>{_ms(lat.get(k))}</b>" for k in ("p50", "p90", "p99", "p99.9", "max")
            ),
        ),
    ]
    if "send_lag_ms" in report:
        lag = report["send_lag_ms"]
        rows.append(
            (
                "send lag ms (behind schedule)",
                f"p50 {_ms(lag.get('p50'))} &nbsp; p99 {_ms(lag.get('p99'))} &nbsp; "
                f"max {_ms(lag.get('max'))}",
            )
        )
    rows += _sequence_rows(report)
    rows.append(("errors", errors_text))
    text = verify_text(report)
    if text is not None:
        failures = report.get("verify_failures", 0)
        rows.append(("verified", f'<span class="err">{_e(text)}</span>' if failures else _e(text)))
    rows.append(("server", _e(report.get("server", {}).get("server"))))
    rows.append(("started", _e(report.get("started_at"))))

    images = "\n".join(
        f'<h2>{_e(title)}</h2>\n<img src="{_e(name)}" alt="{_e(title)}">'
        for name, title in plots.items()
    )
    per_device = _table(
        ["device", "steps", "p50 ms", "p99 ms", "errors", "verified", "wrong"],
        [
            [
                d,
                s.get("steps", 0),
                _ms(s.get("p50_ms")),
                _ms(s.get("p99_ms")),
                ", ".join(f"{k}: {v}" for k, v in s.get("errors", {}).items()) or "none",
                s.get("verified", 0),
                s.get("verify_failures", 0),
            ]
            for d, s in report.get("per_device", {}).items()
        ],
    )
    per_batch = _table(
        ["batch size", "steps", "p50 ms", "p99 ms"],
        [
            [b, s.get("steps", 0), _ms(s.get("p50_ms")), _ms(s.get("p99_ms"))]
            for b, s in report.get("per_batch", {}).items()
        ],
    )
    examples = report.get("error_examples", {})
    error_table = (
        "<h2>Errors</h2>\n"
        + _table(
            ["code", "count", "example message"],
            [[k, errors.get(k, 0), examples.get(k, "")] for k in errors],
        )
        if errors
        else ""
    )
    config_json = json.dumps(cfg, indent=2, sort_keys=True)
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>graphlane loadtest: {_e(how)}</title>
<style>{_CSS}</style>
</head>
<body>
<h1>graphlane loadtest</h1>
<p class="sub">{_e(report.get("tool", ""))}, {_e(report.get("started_at", ""))}</p>
<p class="verdict {"ok" if ok else "bad"}">{_e(verdict_text)}</p>
<table class="summary">
{_rows(rows)}
</table>
{images}
<h2>Per device</h2>
{per_device}
<h2>Per batch size</h2>
{per_batch}
{error_table}
<details><summary>Configuration</summary>
<pre>{_e(config_json)}</pre>
</details>
<p class="sub">Data: <a href="report.json">report.json</a></p>
</body>
</html>
"""
