"""``graphlane demo``: the daemon on simulated NPUs, driven as a scheduler would.

Starts ``graphlane serve`` as a child process on a private ipc endpoint, waits
until its workers are ready, runs a closed-loop load test against every device
(random batch sizes and sequence lengths; a share of the steps carry their own
query/key/value and their outputs are checked against eager attention),
prints the summary and where the HTML report is, then stops the daemon with
SIGTERM and exits: 0 when every verified output was right and the daemon
stopped cleanly.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from graphlane.client import Client

from .loadtest import LoadConfig, run_load
from .loadtest_cli import print_summary


async def _wait_ready(endpoint: str, daemon: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 300
    while True:
        if daemon.poll() is not None:
            raise RuntimeError(f"the daemon exited with status {daemon.returncode}")
        try:
            async with Client(endpoint, timeout=2) as c:
                st = await c.wait_ready(min(60.0, max(1.0, deadline - time.monotonic())))
                for w in st["workers"]:
                    print(f"  device {w['device']}: worker pid {w['pid']} ready at {w['endpoint']}")
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def run(
    devices: int = 2,
    duration_s: float = 20.0,
    concurrency: int = 8,
    verify: float = 0.25,
    report_dir: str | None = None,
) -> int:
    report = Path(report_dir or f"reports/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    with tempfile.TemporaryDirectory(prefix="graphlane-demo-") as tmp:
        endpoint = f"ipc://{tmp}/daemon.sock"
        serve_args = ["--listen", endpoint, "--devices", str(devices), "--log-level", "WARNING"]
        cmd = [sys.executable, "-m", "graphlane", "serve", *serve_args]
        print(f"starting: graphlane serve --listen {endpoint} --devices {devices} (simulated NPUs)")
        daemon = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            asyncio.run(_wait_ready(endpoint, daemon))
            print(
                f"load test: {duration_s:g} s, {concurrency} calls in flight, "
                f"{verify:.0%} of outputs verified against eager attention"
            )
            config = LoadConfig(
                endpoint=endpoint,
                duration_s=duration_s,
                concurrency=concurrency,
                verify=verify,
                report_dir=str(report),
                progress=sys.stderr.isatty(),
            )
            result = asyncio.run(run_load(config))
        except BaseException:
            daemon.kill()
            daemon.wait()
            raise
        print_summary(result)
        print(f"report: {report.resolve() / 'report.html'} (and report.json)")
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(timeout=120)
        print(f"daemon stopped with exit code {code}")
    verdict = int(result["verdict"]["exit_code"])
    return 0 if verdict == 0 and code == 0 else 1
