"""``graphlane bench``: progress on stderr while it measures, and its goals with
pass/fail and a word on noise after.

The goals are the README's (control plane on the ``null`` device, where the
ratio is graphlane's own cost): a step round trip within 1.15x of the raw
pyzmq+msgpack round trip, windowed steps/s at least 0.9x the raw messages/s,
tensor input bandwidth at least 1.0x raw (issue 15); pipelined paged decode at
least 0.95 of the timed sim's limit and 1.8x the serial mode (issue 19); for each
pipeline profile through a daemon at the default config, at least 0.95 of the
limit and a lone step's latency within 1.1x the floor, and the balanced ones at
least 1.8x the serial mode (issue 20); for each profile of the model program's decode
(:mod:`.decode`, issue 32), decoding ahead through a daemon at least 0.95 of the
modelled limit, 1.0x the field's in-process loop and 1.3x the same daemon when the
scheduler waits for each step's tokens, and a lone step within 1.25x the in-process
loop's; issue 42's at the field's costs on npusim's performance mode (:mod:`.field`:
decoding ahead against the vllm-ascend loop and the threaded loop with 0 and 2 ms of
scheduler work, a lone step, the worker's and the client's own CPU per step, the
control plane's round trip on ``null``). The windowed figures are medians of five
repeats; when the repeats of a rate spread by more than :data:`NOISY_SPREAD` of
their median, the machine was too noisy for that ratio to mean much, and the
report says so instead of a bare pass or fail.

Not every goal can be judged on every machine (:func:`unjudgeable`): an absolute rate
depends on the machine's CPU as much as on graphlane, and every ratio compares
measurements taken one after the other, which other work on the cores skews; the
1-minute load average before the run began is in the report (``machine``), and above
:data:`BUSY_LOAD_PER_CORE` per core no goal is judged. A goal not judged is still
measured and printed, marked so, and its failure is exit status 3, not 1.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

#: (label, where in the report, comparison, goal)
GOALS = (
    ("step round trip vs raw", ("control_plane", "null", "step_rtt_vs_raw"), "<=", 1.15),
    ("windowed steps/s vs raw", ("control_plane", "null", "windowed_vs_raw"), ">=", 0.9),
    ("tensor inputs MB/s vs raw", ("bandwidth", "null", "bandwidth_vs_raw"), ">=", 1.0),
    # Issue 19: pipelined paged decode through a daemon on the timed sim.
    ("paged decode vs limit", ("paged", "pipeline", "pipelined_vs_limit"), ">=", 0.95),
    ("paged decode vs serial", ("paged", "pipeline", "pipelined_vs_serial"), ">=", 1.8),
    # Issue 20: the simulator is not the bottleneck (steps/s, not a ratio).
    ("zero-cost steps/s", ("zero_cost", "steps_s"), ">=", 2000.0),
)
#: A spread over repeats above this share of the median makes a rate figure noise.
NOISY_SPREAD = 0.25
#: A 1-minute load average above this per core, before bench starts its own processes,
#: means other work shares the cores (the quiet runs of docs/performance.md: 1.2-1.5 on
#: 2 cores, while measuring).
BUSY_LOAD_PER_CORE = 0.5
#: Goals in absolute units: what they measure is the machine as much as graphlane.
ABSOLUTE = ("zero-cost steps/s",)


@contextlib.contextmanager
def progress(what: str) -> Iterator[None]:
    """One line on stderr when a part starts and one when it ends, with its time."""
    print(f"graphlane bench: measuring {what} ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    yield
    print(f"graphlane bench:   done in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)


#: Issue 20, for each profile of the pipeline table: (label, figure, comparison, goal).
PIPELINE_GOALS = (
    ("vs limit", "pipelined_vs_limit", ">=", 0.95),
    ("vs serial", "pipelined_vs_serial", ">=", 1.8),  # balanced profiles only
    ("latency vs floor", "latency_vs_floor", "<=", 1.1),
)


#: Issue 32, item 4, for each profile of the decode table: (label, figure, comparison, goal).
DECODE_GOALS = (
    ("decoding ahead vs limit", "ahead_vs_limit", ">=", 0.95),
    ("decoding ahead vs in-process", "ahead_vs_inprocess", ">=", 1.0),
    ("decoding ahead vs waiting", "ahead_vs_waiting", ">=", 1.3),
    ("lone step vs in-process", "latency_vs_inprocess", "<=", 1.25),
)


def _decode_goals(report: dict[str, Any]) -> list[tuple[str, float, str, float]]:
    """(label, value, comparison, goal) of each decode profile's goals."""
    out = []
    for row in report.get("decode", []):
        for label, key, op, goal in DECODE_GOALS:
            value = row.get(key)
            if isinstance(value, (int, float)):
                out.append((f"model {row.get('profile', '?')} {label}", value, op, goal))
    return out


def _pipeline_goals(report: dict[str, Any]) -> list[tuple[str, float, str, float]]:
    """(label, value, comparison, goal) of each pipeline profile's goals."""
    out = []
    for row in report.get("pipeline", []):
        profile = row.get("profile", "?")
        for label, key, op, goal in PIPELINE_GOALS:
            if key == "pipelined_vs_serial" and not profile.startswith("balanced"):
                continue
            value = row.get(key)
            # A serial figure of 0: the run had no serial daemon (pipeline.depths).
            if isinstance(value, (int, float)) and (value or key != "pipelined_vs_serial"):
                out.append((f"{profile} {label}", value, op, goal))
    return out


def machine() -> dict[str, Any]:
    """What ``graphlane bench`` records of the machine before it starts measuring."""
    return {"load_average_1m": round(os.getloadavg()[0], 2), "cpu_cores": os.cpu_count() or 1}


def unjudgeable(label: str, report: dict[str, Any]) -> str:
    """Why this machine cannot judge the goal ``label`` in ``report``, or ""."""
    if label in ABSOLUTE:
        return ("an absolute rate: it says as much about this machine's CPU as about "
                "graphlane; compare it with docs/performance.md's machine")  # fmt: skip
    m = report.get("machine") or {}
    load, cores = m.get("load_average_1m"), m.get("cpu_cores") or 1
    if isinstance(load, (int, float)) and load > BUSY_LOAD_PER_CORE * cores:
        return (f"load average {load:g} on {cores} cores when the run began: other work "
                "skews a ratio of measurements taken one after the other; run again when "
                "it is quiet")  # fmt: skip
    return ""


def _verdict(label: str, value: float, op: str, goal: float, note: str = "") -> dict[str, Any]:
    met = value <= goal if op == "<=" else value >= goal
    return {"goal": label, "value": value, "op": op, "target": goal, "met": met,
            "noisy": bool(note), "note": note, "judged": not note}  # fmt: skip


def _judged(verdict: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    why = unjudgeable(verdict["goal"], report)
    if why and verdict["judged"]:
        verdict.update(judged=False, note=why)
    return verdict


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal with its value, whether it was met, whether this machine could judge
    it, and a note on why not (noise, load, an absolute figure)."""
    return [_judged(v, report) for v in _goals(report)]


def _goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    from .field import field_goals

    out = [_verdict(*g) for g in (*_pipeline_goals(report), *_decode_goals(report),
                                  *field_goals(report))]  # fmt: skip
    for label, path, op, goal in GOALS:
        value: Any = report
        for key in path:
            value = value.get(key, {}) if isinstance(value, dict) else {}
        if not isinstance(value, (int, float)):
            continue
        note = ""
        spread = report.get("control_plane", {}).get("null", {}).get("windowed_spread")
        if path[-1] == "windowed_vs_raw" and spread is not None and spread > NOISY_SPREAD:
            note = (
                f"repeats spread by {100 * spread:.0f}% of their median: too noisy a machine "
                "for this figure to mean much; run again when it is quiet"
            )
        out.append(_verdict(label, value, op, goal, note))
    return out


#: Exit status of ``graphlane bench``: every goal met; a goal this machine could judge
#: failed; the only goals that failed were ones it could not judge (noise, load, an
#: absolute figure: see the notes printed under them).
EXIT_MET, EXIT_FAILED, EXIT_NOISY = 0, 1, 3


def exit_status(verdicts: list[dict[str, Any]]) -> int:
    """The exit status of a bench run from :func:`goals`' verdicts."""
    failed = [g for g in verdicts if not g["met"]]
    if not failed:
        return EXIT_MET
    return EXIT_FAILED if any(g.get("judged", True) for g in failed) else EXIT_NOISY


def format_goals(report: dict[str, Any]) -> list[str]:
    lines = [
        "goals (control plane on the null device; the pipeline profiles, paged decode, "
        "the model's decode and the zero-cost rate on the timed sim):"
    ]
    listed = goals(report)
    m = report.get("machine")
    if m:
        lines.insert(0, f"machine: load average {m['load_average_1m']:g} on {m['cpu_cores']} "
                        "cores when the run began")  # fmt: skip
    width = max([28, *(len(g["goal"]) for g in listed)])
    for g in listed:
        verdict = "PASS" if g["met"] else "FAIL"
        if g["noisy"]:
            verdict += " (noisy)"
        elif not g.get("judged", True):
            verdict += " (not judged here)"
        if g["goal"].endswith("steps/s"):
            value, target = f"{g['value']:.0f}", f"{g['target']:.0f}"
        elif g["goal"].endswith(", us"):
            value, target = f"{g['value']:.0f} us", f"{g['target']:.0f} us"
        else:
            # Two decimals, more where two would round a figure onto its goal.
            digits = 2
            while (
                digits < 5
                and g["value"] != g["target"]
                and f"{g['value']:.{digits}f}" == f"{g['target']:.{digits}f}"
            ):
                digits += 1
            value, target = f"{g['value']:.{digits}f}x", f"{g['target']}x"
        lines.append(f"  {g['goal']:<{width}} {value}, goal {g['op']} {target}: {verdict}")
        if g["note"]:
            lines.append(f"    {g['note']}")
    return lines
