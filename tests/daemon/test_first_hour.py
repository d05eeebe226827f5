"""What a new user meets in the first hour (issue 16): each mistake or failure gets a
clear one-line answer, never a traceback, a hang or a wrong "ok"."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from daemons import SMALL, wait_for

from graphlane.orchestrator.loadtest import LoadConfig, run_load
from graphlane.orchestrator.loadtest_availability import BACKOFF_CAP_S, Backoff, DeviceBackoff

SHAPE = {k: SMALL[k] for k in ("layers", "num_heads", "num_kv_heads", "head_dim", "max_kv_len")}


# ---------------------------------------------------------------------------- 1. load test
def test_backoff_doubles_with_jitter_up_to_its_cap() -> None:
    import random

    b = Backoff(random.Random(1), first_s=0.01, cap_s=1.0)
    delays = [b.next_delay() for _ in range(12)]
    for i, d in enumerate(delays):
        top = min(1.0, 0.01 * 2**i)
        assert top / 2 <= d <= top
    b.success()
    assert b.next_delay() <= 0.01

    held = DeviceBackoff(random.Random(2))
    held.failure(1, now=100.0)
    assert held.held(1, 100.0) and not held.held(0, 100.0)
    assert held.all_held((0, 1), 100.0) is None  # device 0 serves: draw it instead
    held.failure(0, now=100.0)
    release = held.all_held((0, 1), 100.0)
    assert release is not None and 100.0 < release <= 100.01
    held.success(1)
    assert not held.held(1, 100.0) and held.all_held((0, 1), 100.0) is None


def test_a_load_test_against_a_daemon_that_dies_fails_and_backs_off(
    start_daemon, tmp_path: Path
) -> None:
    d = start_daemon(devices=1)
    concurrency = 4
    config = LoadConfig(
        d.endpoint, 120.0, concurrency=concurrency, shape=SHAPE, progress=False,
        timeout_s=5.0, report_dir=str(tmp_path / "report"),
    )  # fmt: skip
    stop = asyncio.Event()

    async def scenario() -> dict:
        t0 = time.monotonic()
        run = asyncio.create_task(run_load(config, stop=stop))
        # Kill the daemon once it has served steps (the worker reports its count).
        await asyncio.to_thread(wait_for, lambda: d.worker(0)["steps"] > 0, 60, "steps served")
        t_kill = time.monotonic()
        d.send_signal(signal.SIGINT)
        await asyncio.to_thread(d.proc.wait, 60)
        # Keep sending while the server is gone for twice as long as it served.
        gone = 2 * (t_kill - t0) + 1.0
        await asyncio.to_thread(
            wait_for, lambda: time.monotonic() - t_kill > gone, 600, "the outage to last"
        )
        stop.set()
        return await run

    report = asyncio.run(scenario())
    assert d.stop() == 0  # the SIGINT drained it cleanly
    verdict = report["verdict"]
    assert report["steps"] > 0
    assert verdict["exit_code"] == 1 and not verdict["ok"], verdict
    assert any("unavailable" in r for r in verdict["reasons"]), verdict
    assert report["unavailable_share"] > report["max_unavailable"]
    # Bounded by the backoff: a few fast retries per caller, then one per half cap.
    bound = concurrency * (12 + report["unavailable_s"] / (BACKOFF_CAP_S / 2) + 2)
    assert report["errors_total"] <= bound, (report["errors"], report["unavailable_s"])
