"""``graphlane loadtest`` of a stateless program (independent calls) against real daemons:
closed and open loop, verification, errors of a drained device, the report files, and
``main`` through its own parser. (A program with device state: test_loadtest_paged.)"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from daemons import SMALL
from reference import decode_stack

from graphlane.client import Client
from graphlane.loadtest import LoadConfig, run_load
from graphlane.loadtest.attention import SHAPE_KEYS, AttentionWorkload
from graphlane.loadtest.cli import add_parser, main
from graphlane.loadtest.record import Recorder
from graphlane.loadtest.report import assess, build_report
from graphlane.loadtest.report_files import write_report
from graphlane.loadtest.run import close_to
from graphlane.workers.programs.attention import AttentionConfig

SHAPE = {k: SMALL[k] for k in ("layers", "num_heads", "num_kv_heads", "head_dim", "max_kv_len")}
PNG = b"\x89PNG\r\n\x1a\n"
PERCENTILES = ("min", "p50", "p90", "p99", "p99.9", "max")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graphlane")
    add_parser(p.add_subparsers(dest="command", required=True))
    return p


def check_report_files(directory: Path, report: dict[str, Any]) -> dict[str, Any]:
    """report.json holds the report; report.html shows a summary, then existing PNG plots."""
    on_disk = json.loads((directory / "report.json").read_text())
    for key in ("steps", "throughput", "latency_ms", "errors", "config", "verified"):
        assert on_disk[key] == report[key], key
    page = (directory / "report.html").read_text()
    images = re.findall(r'<img src="([^"]+)"', page)
    assert len(images) == 3
    for name in images:
        assert "/" not in name  # next to the HTML, by relative path
        assert (directory / name).read_bytes()[:8] == PNG, name
    assert page.index('class="summary"') < page.index("<img")
    return on_disk


def check_latency(lat: dict[str, Any]) -> None:
    values = [lat[k] for k in PERCENTILES]
    assert all(v is not None and v > 0 for v in values), lat
    assert values == sorted(values), lat


# ---------------------------------------------------------------------------- real daemons
def test_closed_loop_with_verification_writes_a_sane_report(shared_daemon, tmp_path: Path) -> None:
    d = shared_daemon(devices=2)
    out = tmp_path / "report"
    config = LoadConfig(
        d.endpoint, 2.0, concurrency=4, verify=0.5, report_dir=str(out), shape=SHAPE,
        progress=False,
    )  # fmt: skip
    report = asyncio.run(run_load(config))
    # Bounded: it stopped sending by itself at the duration, as the run measured it
    # (a wall-clock bound here failed on a busy host; pytest's timeout catches a hang).
    assert 0 < report["sending_s"] <= config.duration_s <= report["elapsed_s"]

    assert report["steps"] > 0 and report["sent"] == report["steps"]
    assert report["errors"] == {} and report["errors_total"] == 0
    assert report["throughput"] > 0
    assert 0 < report["verified"] <= report["steps"] and report["verify_failures"] == 0
    check_latency(report["latency_ms"])
    assert report["latency_ms"]["count"] == report["steps"]
    assert report["load"] == "calls" and report["config"]["verify"] == 0.5
    assert report["config"]["mode"] == "closed" and report["config"]["concurrency"] == 4
    assert report["config"]["devices"] == [0, 1]
    assert report["config"]["batch_sizes"] == SMALL["buckets"]  # default: hello's buckets
    assert report["config"]["shape"]["layers"] == SMALL["layers"]
    assert report["preflight"] == {"0": "ok", "1": "ok"}
    assert sum(s["steps"] for s in report["per_device"].values()) == report["steps"]
    assert all(s["steps"] > 0 for s in report["per_device"].values())
    assert set(report["per_batch"]) <= {str(b) for b in SMALL["buckets"]}
    ts = report["timeseries"]
    assert sum(ts["steps"]) == report["steps"]
    assert len({len(ts[k]) for k in ("t_s", "steps", "errors", "steps_per_s", "p50_ms")}) == 1
    assert report["verdict"] == {"exit_code": 0, "ok": True, "reasons": []}

    check_report_files(out, report)


def block_event_loop(seconds: float) -> None:
    """A client stall: nothing on this event loop runs for ``seconds``."""
    time.sleep(seconds)


async def stall_client_when_serving(
    endpoint: str, load: asyncio.Task[Any], min_steps: int, seconds: float
) -> None:
    async with Client(endpoint, timeout=10) as c:
        deadline = time.monotonic() + 30
        while (await c.worker_status(0))["steps"] < min_steps and not load.done():
            if time.monotonic() > deadline:
                pytest.fail("the load test sent no steps")
            await asyncio.sleep(0.01)
    block_event_loop(seconds)


def test_open_loop_keeps_the_arrival_rate_and_measures_from_the_schedule(
    shared_daemon,
) -> None:
    d = shared_daemon(devices=1)
    config = LoadConfig(
        d.endpoint, 2.0, rate=50, shape=SHAPE, progress=False, verify=0.2, batch_sizes=(1, 3)
    )
    stall_s = 0.5

    async def scenario() -> dict[str, Any]:
        async with Client(d.endpoint, timeout=10) as c:
            before = (await c.worker_status(0))["steps"]  # the daemon may have served others
        load = asyncio.create_task(run_load(config))
        # The client stalls for 0.5 s once steps flow (preflight = 1 step): the ~25 arrivals
        # scheduled meanwhile are sent late, and their latency counts from their schedule.
        await stall_client_when_serving(d.endpoint, load, before + 1 + 3, stall_s)
        return await load

    report = asyncio.run(scenario())
    expected = config.rate * config.duration_s  # type: ignore[operator]
    assert 0.4 * expected <= report["arrivals"] <= 1.6 * expected
    assert report["sent"] == report["arrivals"]  # none dropped by the cap
    assert report["steps"] == report["sent"] and report["errors"] == {}
    assert report["verified"] > 0 and report["verify_failures"] == 0
    assert report["config"]["batch_sizes"] == [1, 3] and set(report["per_batch"]) <= {"1", "3"}
    assert report["latency_basis"] == "scheduled arrival time"
    check_latency(report["latency_ms"])
    lag, lat = report["send_lag_ms"], report["latency_ms"]
    # Arrivals in the stall's first half were sent >= 250 ms after their scheduled time
    # (about 12 of ~100: more than 1 %), and that lag is part of their latency.
    assert lag["p99"] >= 250 and lag["max"] >= 250
    assert lat["p99"] >= lag["p99"] and lat["max"] >= lag["max"]
    assert report["verdict"]["exit_code"] == 0


def test_main_with_a_drained_device_counts_shutting_down_and_completes(
    start_daemon, tmp_path: Path, capsys
) -> None:
    d = start_daemon(devices=2)

    async def drain() -> None:
        async with Client(d.endpoint, timeout=10) as c:
            await c.drain(device=1)

    asyncio.run(drain())
    out = tmp_path / "cli"
    # No --shape: the daemon describes its program's shapes in hello.
    common = ["loadtest", "--connect", d.endpoint, "--no-progress"]
    args = parser().parse_args(
        [*common, "--concurrency", "2", "--duration", "1", "--verify", "0.2",
         "--report", str(out), "--seed", "3", "--max-unavailable", "1"]
    )  # fmt: skip
    # SHUTTING_DOWN is retryable: the run still passes. (Availability is not what this
    # test checks: on a loaded machine a 1 s run can pass 0.2 s without a step served.)
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "throughput" in printed and "SHUTTING_DOWN" in printed and "p99.9" in printed
    report = json.loads((out / "report.json").read_text())
    check_report_files(out, report)
    assert report["config"]["devices"] == [0, 1] and report["config"]["seed"] == 3
    assert set(report["errors"]) == {"SHUTTING_DOWN"} and report["errors"]["SHUTTING_DOWN"] > 0
    assert report["errors_total"] == report["errors"]["SHUTTING_DOWN"]
    assert report["non_retryable_errors"] == 0
    assert report["preflight"] == {"0": "ok", "1": "SHUTTING_DOWN"}
    dev0, dev1 = report["per_device"]["0"], report["per_device"]["1"]
    assert dev0["steps"] == report["steps"] > 0 and dev0["errors"] == {}
    assert dev1["steps"] == 0 and dev1["errors"] == {"SHUTTING_DOWN": report["errors_total"]}
    assert report["sent"] == report["steps"] + report["errors_total"]
    assert report["verified"] > 0 and report["verify_failures"] == 0
    assert sum(report["timeseries"]["errors"]) == report["errors_total"]
    assert report["verdict"]["exit_code"] == 0

    # A shape the daemon's program does not have: refused before the run, exit 2, naming
    # the flag (the daemon's hello says the program's head_dim).
    wrong = parser().parse_args(
        ["loadtest", "--connect", d.endpoint, "--shape", "head_dim=32", "--no-progress",
         "--rate", "10", "--duration", "1", "--devices", "0", "--report", str(tmp_path / "wrong")]
    )  # fmt: skip
    assert main(wrong) == 2
    err = capsys.readouterr().err
    assert "--shape: head_dim=32" in err
    # A device the daemon does not serve.
    absent = parser().parse_args([*common, "--devices", "7", "--rate", "5", "--duration", "1",
                                  "--report", str(tmp_path / "absent")])  # fmt: skip
    assert main(absent) == 2
    assert "--devices" in capsys.readouterr().err
    # A setting of sequences, for a program without device state: refused, naming it.
    seqs = parser().parse_args([*common, "--rate", "5", "--duration", "1", "--decode-tokens",
                                "2,3", "--report", str(tmp_path / "seqs")])  # fmt: skip
    assert main(seqs) == 2
    assert "--decode-tokens" in capsys.readouterr().err
    for name in ("wrong", "absent", "seqs"):
        assert not (tmp_path / name).exists()


# ---------------------------------------------------------------------------- no daemon
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": 0.0}, "--rate must be > 0"),
        ({"rate": float("nan")}, "--rate must be > 0"),
        ({"concurrency": 0}, "--concurrency must be"),
        ({}, "exactly one of --concurrency"),
        ({"concurrency": 2, "rate": 5.0}, "exactly one of --concurrency"),
        ({"rate": 5.0, "duration_s": 0}, "--duration must be > 0"),
        ({"rate": 5.0, "verify": 1.5}, "--verify must be a fraction"),
        ({"rate": 5.0, "timeout_s": -1.0}, "--timeout must be > 0"),
        ({"rate": 5.0, "devices": ()}, "--devices"),
        ({"rate": 5.0, "devices": (0, 0)}, "--devices"),
        ({"rate": 5.0, "batch_sizes": (0,)}, "--batch-sizes"),
        ({"rate": 5.0, "shape": {"heads": 4}}, "--shape: unknown key"),
        ({"rate": 5.0, "shape": {"num_heads": 6, "num_kv_heads": 4}}, "--shape.num_kv_heads"),
        ({"rate": 5.0, "max_outstanding": 0}, "--max-outstanding"),
        ({"rate": 5.0, "prompt_lens": (3, 2)}, "--prompt-lens"),
        ({"rate": 5.0, "decode_tokens": (0, 2)}, "--decode-tokens"),
    ],
)
def test_config_validation_names_the_flag(kwargs: dict[str, Any], message: str) -> None:
    kwargs.setdefault("duration_s", 1.0)
    with pytest.raises(ValueError, match=re.escape(message)):
        LoadConfig("ipc:///nowhere", **kwargs)


def test_parser_help_and_flag_errors(capsys) -> None:
    p = parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    loadtest = sub.choices["loadtest"]
    for action in loadtest._actions:
        assert action.help, f"{action.option_strings} has no help text"
    with pytest.raises(SystemExit) as exit_:
        p.parse_args(["loadtest", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    flags = "connect concurrency rate duration program devices batch-sizes verify report shape"
    for flag in [*flags.split(), "timeout", "max-outstanding", "seed", "progress"]:
        assert f"--{flag}" in text
    with pytest.raises(SystemExit):
        p.parse_args(["loadtest", "--rate", "5", "--concurrency", "2", "--duration", "1",
                      "--report", "x"])  # fmt: skip
    assert "not allowed with" in capsys.readouterr().err
    args = p.parse_args(["loadtest", "--rate", "0", "--duration", "1", "--report", "x"])
    assert main(args) == 2
    assert "--rate must be > 0" in capsys.readouterr().err


def test_verification_reference_and_exit_status(tmp_path: Path) -> None:
    shape = AttentionConfig(**SHAPE)
    work = AttentionWorkload(shape, (0,), (1, 3), (1, 2, 4), seed=1, verify=1.0)
    call = work.checked(0, 3)
    assert call.expected is not None
    assert work.checked(0, 3).expected is not call.expected  # cases take turns
    q, k, v = call.inputs["query"], call.inputs["key"], call.inputs["value"]
    lengths = call.params["actual_seq_lengths_kv"]
    # The client's eager reference agrees with the tests' independent one.
    torch.testing.assert_close(
        call.expected, decode_stack(q, list(k), list(v), lengths), atol=2e-3, rtol=2e-3
    )
    assert work.check(call, call.expected.clone()) == 0.0
    assert close_to(call.expected + 0.5, call.expected, torch.float16) is None
    assert work.check(call, call.expected[:1]) is None

    # A run in which nothing succeeded still makes a full report, with exit status 1.
    config = LoadConfig("ipc:///nowhere", 1.0, rate=5.0, progress=False)
    rec = Recorder(start=100.0, window_s=0.25, seed=0)
    rec.sent = rec.arrivals = 3
    for _ in range(3):
        rec.error("SHUTTING_DOWN", 100.3, device=0, retryable=True)
    resolved = {"devices": [0], "batch_sizes": [1, 3], "buckets": [1, 2, 4],
                "shape": work.describe()["shape"]}  # fmt: skip
    report = build_report(
        config, rec, {}, load="calls", resolved=resolved, tolerance=1e-2,
        preflight={"0": "SHUTTING_DOWN"}, started_at="now", start=100.0, end=101.0,
    )  # fmt: skip
    assert report["latency_ms"]["p50"] is None and report["steps"] == 0
    assert report["verdict"] == {"exit_code": 1, "ok": False, "reasons": ["no step succeeded"]}
    json_path, html_path = write_report(report, tmp_path / "empty")
    assert json.loads(json_path.read_text())["errors"] == {"SHUTTING_DOWN": 3}
    for name in re.findall(r'<img src="([^"]+)"', html_path.read_text()):
        assert (tmp_path / "empty" / name).read_bytes()[:8] == PNG

    base = {"steps": 10, "verified": 4, "verify_failures": 0, "non_retryable_errors": 0}
    assert assess({**base, "errors": {"BUSY": 3, "TIMEOUT": 1}}) == (0, [])
    code, why = assess({**base, "verify_failures": 1})
    assert code == 1 and "differ from the reference" in why[0]
    code, why = assess({**base, "errors": {"INTERNAL": 2}, "non_retryable_errors": 2})
    assert code == 1 and "INTERNAL" in why[0]
    assert set(SHAPE) <= set(SHAPE_KEYS)


def test_plots_of_a_run_stopped_early_end_where_it_ended() -> None:
    """Issue 43: a run that ended at 15.4 s of 60 plotted 60 s of axes, its "sending
    stopped" line at 60 s. Every plot over time ends with the run, the line where
    sending stopped."""
    from graphlane.loadtest.report_files import plot_latency_over_time, plot_throughput
    from graphlane.loadtest.run import Call

    config = LoadConfig("ipc:///nowhere", 60.0, concurrency=1, progress=False)
    rec = Recorder(start=100.0, window_s=0.5, seed=0)
    for i in range(30):  # steps until 15.4 s, then the run was stopped
        rec.sent += 1
        rec.ok(Call(0, 1, {}, {}), 100.0 + i * 0.5, 100.0 + i * 0.5 + 0.01)
    report = build_report(
        config, rec, {}, load="calls", resolved={"devices": [0], "shape": {}}, tolerance=1e-2,
        preflight={}, started_at="now", start=100.0, end=115.5, sent_until=115.4,
        interrupted=True,
    )  # fmt: skip
    assert report["sending_s"] == 15.4 and report["elapsed_s"] == 15.5
    for draw in (plot_latency_over_time, plot_throughput):
        ax = draw(report).axes[0]
        assert ax.get_xlim()[1] < 1.1 * report["elapsed_s"], draw.__name__
        stopped = [line.get_xdata()[0] for line in ax.get_lines()
                   if line.get_label() == "sending stopped"]  # fmt: skip
        assert stopped == [report["sending_s"]], draw.__name__
