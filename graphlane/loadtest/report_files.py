"""The files of a report (:func:`write_report`): ``report.json``, PNG plots drawn on
matplotlib's Agg canvas (no display, no pyplot state), and ``report.html``: the verdict
and :func:`.report.summary_rows`, the plots (by relative path), the tables, the config."""

from __future__ import annotations

import html
import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .report import load_text, summary_rows


def write_report(report: Mapping[str, Any], directory: str | Path) -> tuple[Path, Path]:
    """Write the report's JSON, plots and HTML into ``directory``; returns (json, html)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    drawers = {**PLOTS, **(SERVING_PLOTS if report.get("serving") is not None else {})}
    for name, (_, draw) in drawers.items():
        draw(report).savefig(out / name, format="png")
    plots = {name: title for name, (title, _) in drawers.items()}
    data = {**report, "plots": plots}
    json_path, html_path = out / "report.json", out / "report.html"
    json_path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    html_path.write_text(render_html(data, plots))
    return json_path, html_path


# ---------------------------------------------------------------------------- plots
def _figure(width: float = 9.0, height: float = 4.0, panels: int = 1) -> tuple[Any, list[Any]]:
    # matplotlib loads in about a second: only a run that writes a report pays for it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, panels, squeeze=False)[0])


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _log_if_wide(ax: Any, values: Sequence[float], axis: str = "y") -> None:
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if positive and max(positive) / min(positive) > 30:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")


def _finish(ax: Any, report: Mapping[str, Any], title: str, x: str, y: str, legend: str) -> None:
    """Labels, title, grid, legend; over time (``x`` "time..."): the line where sending
    stopped, and the axis ending where the run ended."""
    over_time = x.startswith(("time", "arrival"))
    if over_time:
        stopped = report.get("sending_s", report.get("duration_s"))
        if stopped:
            ax.axvline(stopped, color="grey", ls="--", lw=1, label="sending stopped")
        end = max(report.get("elapsed_s") or 0.0, stopped or 0.0)
        ax.set_xlim(0, end * 1.02 if end > 0 else None)
    cfg = report.get("config", {})
    subtitle = f"{cfg.get('program')} on devices {cfg.get('devices')}, {load_text(report)}"
    ax.set(xlabel=x, ylabel=y, title=f"{title}: {subtitle}" if over_time else title)
    ax.title.set_fontsize(10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc=legend, fontsize=8)


def plot_latency_over_time(report: Mapping[str, Any]) -> Any:
    fig, (ax,) = _figure()
    ts, samples = report.get("timeseries", {}), report.get("latency_samples", {})
    sx, sy = samples.get("t_s", []), samples.get("latency_ms", [])
    if not sx:
        _empty(ax, "no successful steps")
        return fig
    ax.scatter(sx, sy, s=6, alpha=0.35, color="tab:grey", label="steps (sample)", linewidths=0)
    t = [(a + b) / 2 for a, b in itertools.pairwise([0.0, *ts.get("t_s", [])])]
    for key, color in (("p50", "tab:blue"), ("p99", "tab:orange"), ("max", "tab:red")):
        values = [math.nan if v is None else v for v in ts.get(f"{key}_ms", [])]
        ax.plot(t, values, label=f"{key} per {ts.get('window_s')} s", color=color)
    _log_if_wide(ax, list(sy))
    _finish(ax, report, "Latency over time", "time since start (s), by completion",
            f"latency (ms, from {report.get('latency_basis', 'send')})", "upper left")
    return fig


def plot_latency_cdf(report: Mapping[str, Any]) -> Any:
    fig, (left, right) = _figure(10.0, 4.0, 2)
    cdf = report.get("latency_cdf", {})
    pct, lat = cdf.get("percentile", []), cdf.get("latency_ms", [])
    if not lat:
        _empty(left, "no successful steps")
        _empty(right, "no successful steps")
        return fig
    left.step(lat, [p / 100 for p in pct], where="post", color="tab:blue")
    left.set(xlabel="latency (ms)", ylabel="fraction of steps at or below", ylim=(0, 1.02),
             title="Latency CDF")  # fmt: skip
    left.grid(True, alpha=0.3)
    # The tail on a "nines" axis (x = 1 / (1 - p)).
    tail = [(1 / (1 - p / 100), v) for p, v in zip(pct, lat, strict=True) if p < 100]
    right.plot([x for x, _ in tail], [v for _, v in tail], color="tab:purple")
    right.set_xscale("log")
    right.set_xticks([2, 10, 100, 1000, 10000], ["50%", "90%", "99%", "99.9%", "99.99%"])
    right.minorticks_off()
    summary = report.get("latency_ms", {})
    for key, color in (("p50", "tab:blue"), ("p99", "tab:orange"), ("p99.9", "tab:red"),
                       ("max", "black")):  # fmt: skip
        if summary.get(key) is not None:
            v = summary[key]
            right.axhline(v, color=color, ls=":", lw=1, label=f"{key} {v:.2f} ms")
    _log_if_wide(right, [v for _, v in tail])
    _finish(right, report, "Latency by percentile (tail)", "percentile", "latency (ms)",
            "upper left")
    return fig


def plot_throughput(report: Mapping[str, Any]) -> Any:
    fig, (ax,) = _figure()
    ts = report.get("timeseries", {})
    if not ts.get("t_s"):
        _empty(ax, "no data")
        return fig
    edges = [0.0, *ts["t_s"]]
    if any(ts.get("errors_per_s", [])):
        ax.stairs(ts["errors_per_s"], edges, fill=True, color="tab:red", alpha=0.35,
                  label="errors/s")  # fmt: skip
    ax.stairs(ts.get("steps_per_s", []), edges, color="tab:green", lw=2, label="steps/s")
    devices = ts.get("device_steps_per_s", {})
    if sum(1 for rates in devices.values() if any(rates)) > 1:
        for d, rates in devices.items():
            ax.stairs(rates, edges, lw=1, alpha=0.8, label=f"device {d}")
    if report.get("offered_rate"):
        ax.axhline(report["offered_rate"], color="black", ls=":", lw=1, label="offered rate")
    ax.set_ylim(bottom=0)
    _finish(ax, report, "Throughput over time", "time since start (s), by completion",
            f"per second ({ts.get('window_s')} s windows)", "lower left")
    return fig


def plot_token_latencies(report: Mapping[str, Any]) -> Any:
    """CDFs of a model run's TTFT and ITL (vLLM's figures)."""
    fig, axes = _figure(10.0, 4.0, 2)
    s = report.get("serving") or {}
    for ax, key, title, color in ((axes[0], "ttft_ms", "Time to first token", "tab:blue"),
                                  (axes[1], "itl_ms", "Inter-token latency", "tab:green")):
        values = sorted(s.get("samples", {}).get(key, []))  # fmt: skip
        if not values:
            _empty(ax, "no completed requests")
            continue
        n = len(values)
        ax.step(values, [(i + 1) / n for i in range(n)], where="post", color=color)
        for stat, ls in (("mean", "--"), ("median", ":"), ("p99", "-.")):
            v = s.get(key, {}).get(stat)
            if v is not None:
                ax.axvline(v, color="grey", ls=ls, lw=1, label=f"{stat} {v:.2f} ms")
        _log_if_wide(ax, values, "x")
        ax.set_ylim(0, 1.02)
        what = "requests" if key == "ttft_ms" else "gaps"
        _finish(ax, report, f"{title} ({n} {what})", "ms", "fraction at or below", "lower right")
    return fig


def plot_ttft_over_time(report: Mapping[str, Any]) -> Any:
    """Each completed request's TTFT and latency by its arrival time."""
    fig, (ax,) = _figure()
    samples = (report.get("serving") or {}).get("samples", {})
    t = samples.get("arrival_s", [])
    if not t:
        _empty(ax, "no completed requests")
        return fig
    for key, label, color in (("e2el_ms", "request latency", "tab:grey"),
                              ("ttft_ms", "time to first token", "tab:blue")):  # fmt: skip
        ax.scatter(t, samples.get(key, []), s=8, alpha=0.6, color=color, label=label,
                   linewidths=0)  # fmt: skip
    _log_if_wide(ax, [*samples.get("ttft_ms", []), *samples.get("e2el_ms", [])])
    _finish(ax, report, "TTFT and latency by arrival", "arrival time since start (s)", "ms",
            "upper left")
    return fig


Drawer = Callable[[Mapping[str, Any]], Any]
#: Plot file name -> (title, drawer), in page order; a model run adds SERVING_PLOTS.
PLOTS: dict[str, tuple[str, Drawer]] = {
    "latency_over_time.png": ("Latency over time", plot_latency_over_time),
    "latency_cdf.png": ("Latency distribution", plot_latency_cdf),
    "throughput_over_time.png": ("Throughput over time", plot_throughput),
}
SERVING_PLOTS: dict[str, tuple[str, Drawer]] = {
    "token_latency.png": ("TTFT and ITL distributions", plot_token_latencies),
    "ttft_over_time.png": ("TTFT over time", plot_ttft_over_time),
}


# ---------------------------------------------------------------------------- html
_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1050px; color: #222; }
.sub { color: #666; } .verdict { padding: 0.6em 1em; border-radius: 6px; font-weight: 600; }
.ok { background: #e6f4ea; color: #1e6b34; } .bad { background: #fce8e6; color: #a52714; }
table { border-collapse: collapse; margin: 0.8em 0 1.6em; }
th, td { padding: 0.3em 0.9em; border-bottom: 1px solid #ddd; text-align: left; }
th { background: #f4f4f4; } img { max-width: 100%; border: 1px solid #eee; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _table(first: str, rows: Mapping[str, Mapping[str, Any]]) -> str:
    """A table of ``rows`` (name -> their figures), ms rounded, counts by code joined."""
    keys = list(next(iter(rows.values()), {}))
    head = "".join(f"<th>{_e(h)}</th>" for h in [first, *keys])

    def cell(v: Any) -> str:
        if isinstance(v, Mapping):
            return ", ".join(f"{k}: {n}" for k, n in v.items()) or "none"
        return _ms(v) if isinstance(v, float) or v is None else str(v)

    body = "\n".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in
                                       [name, *map(cell, r.values())]) + "</tr>"
                     for name, r in rows.items())  # fmt: skip
    return f"<table><tr>{head}</tr>\n{body}</table>"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def render_html(report: Mapping[str, Any], plots: Mapping[str, str]) -> str:
    verdict = report.get("verdict", {"ok": True, "reasons": []})
    ok, errors = bool(verdict.get("ok")), report.get("errors", {})
    verdict_text = "PASS" if ok else "FAIL: " + "; ".join(verdict.get("reasons", []))
    if ok and errors:
        verdict_text += f" (with {report.get('errors_total', 0)} retryable errors)"
    rows = [*summary_rows(report), ("server", str(report.get("server", {}).get("server")))]
    summary = "\n".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    images = "\n".join(f'<h2>{_e(title)}</h2>\n<img src="{_e(name)}" alt="{_e(title)}">'
                       for name, title in plots.items())  # fmt: skip
    examples = report.get("error_examples", {})
    tables = [("Per device", "device", report.get("per_device", {})),
              ("Per batch size", "batch size", report.get("per_batch", {})),
              ("Errors", "code", {k: {"count": n, "example message": examples.get(k, "")}
                                  for k, n in errors.items()})]  # fmt: skip
    tables_html = "\n".join(f"<h2>{t}</h2>\n{_table(first, rows)}"
                            for t, first, rows in tables if rows)  # fmt: skip
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>graphlane loadtest: {_e(load_text(report))}</title><style>{_CSS}</style></head>
<body>
<h1>graphlane loadtest</h1>
<p class="sub">{_e(report.get("tool", ""))}, {_e(report.get("started_at", ""))}</p>
<p class="verdict {"ok" if ok else "bad"}">{_e(verdict_text)}</p>
<table class="summary">
{summary}
</table>
{images}
{tables_html}
<details><summary>Configuration</summary>
<pre>{_e(json.dumps(report.get("config", {}), indent=2, sort_keys=True))}</pre></details>
<p class="sub">Data: <a href="report.json">report.json</a></p>
</body></html>
"""
