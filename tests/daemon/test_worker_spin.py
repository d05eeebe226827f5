"""A daemon's workers report the CPU they polled for their next request
(``idle_spin_us``; the poll's rules: tests/workers/test_idle_spin.py)."""

from __future__ import annotations

import asyncio

import pytest
from daemons import SMALL

from graphlane.client import Client


@pytest.mark.parametrize("spin_us", [0, 2000])
def test_a_daemon_reports_the_cpu_its_worker_polled(start_daemon, spin_us: int) -> None:
    d = start_daemon(devices=1, backend="null", programs=[SMALL], idle_spin_us=spin_us)

    async def main() -> float:
        async with Client(d.endpoint) as c:
            for _ in range(20):
                await c.step("attention", 0, {"actual_seq_lengths_kv": [2]})
            metrics = (await c.worker_status(0))["metrics"]
            return float(metrics["spin_seconds"])

    spun = asyncio.run(main())
    if spin_us:
        assert spun > 0  # its client sends the next step at once: it polled
    else:
        assert spun == 0.0
