"""``graphlane demo``: the daemon on simulated NPUs, driven as a scheduler would.

Starts ``graphlane serve`` as a child process on a private ipc endpoint with two
programs (:data:`DEMO_CONFIG`: ``attention`` and ``paged_attention``), waits until
its workers are ready, and drives every device for half the duration each:

1. a closed-loop load test of ``attention`` (random batch sizes and sequence
   lengths; a share of the steps carry their own query/key/value and their
   outputs are checked against eager attention);
2. the paged decode workload of ``paged_attention`` (:mod:`.loadtest_paged`):
   sequences prefilled through ``kv_write``, continuously batched decode steps,
   blocks reused, a share of the steps checked against
   ``scaled_dot_product_attention`` over the demo's own copy of the KV.

It prints both summaries and where the reports are, then stops the daemon with
SIGTERM and exits: 0 when every verified output of both was right and the
daemon stopped cleanly, 1 otherwise.

The demo cannot hang and leaves nothing behind: the whole run has a deadline
(``deadline_s``; when it passes, the demo says what it was waiting for, stops
the daemon and exits 3), and SIGINT, SIGTERM or SIGHUP stop the daemon (SIGTERM,
then SIGKILL after ``_STOP_GRACE_S``) before the demo exits 128+signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from graphlane.client import Client

from .loadtest import run_load
from .loadtest_cli import print_summary
from .loadtest_config import LoadConfig
from .loadtest_paged import PagedLoadConfig, print_paged_summary, run_paged

_STOP_GRACE_S = 10.0  # from the daemon's SIGTERM to its SIGKILL

#: The daemon's config (``listen`` and ``devices`` are added): the default ``attention``
#: and a small ``paged_attention`` (16 blocks of 128 tokens per device, sequences of up
#: to 512), so that sequences compete for blocks and blocks are reused.
DEMO_CONFIG = """\
[[programs]]
name = "attention"
[[programs]]
name = "paged_attention"
layers = 2
num_heads = 8
num_kv_heads = 2
head_dim = 64
block_size = 128
num_blocks = 16
max_blocks_per_seq = 4
buckets = [1, 2, 4, 8]
"""
PAGED_SEQUENCES = 12  # live sequences of the paged workload, over all devices
EXIT_DEADLINE = 3


class _Phase:
    """What the demo is waiting for now, for the deadline's message."""

    def __init__(self) -> None:
        self.what = "starting"
        self.since = time.monotonic()

    def __call__(self, what: str) -> None:
        self.what, self.since = what, time.monotonic()


def _stop(daemon: subprocess.Popen[bytes], grace: float = _STOP_GRACE_S) -> int:
    """SIGTERM the daemon, SIGKILL it after ``grace`` s; its exit code."""
    if daemon.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            daemon.send_signal(signal.SIGTERM)
        try:
            return daemon.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                daemon.kill()
    return daemon.wait()


class _Deadline:
    """A watchdog thread: past the deadline, report the phase, stop the daemon and
    end the process, whatever the main thread is blocked in."""

    def __init__(self, seconds: float, phase: _Phase) -> None:
        self.seconds = seconds
        self.phase = phase
        self.daemon: subprocess.Popen[bytes] | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="demo-deadline", daemon=True)

    def __enter__(self) -> _Deadline:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        if self._done.wait(self.seconds):
            return
        waited = time.monotonic() - self.phase.since
        print(
            f"graphlane demo: gave up after {self.seconds:g} s (--deadline): still waiting "
            f"for {self.phase.what} ({waited:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
        if self.daemon is not None:
            _stop(self.daemon, grace=5.0)
        os._exit(EXIT_DEADLINE)


class _Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived: unwinds the run from wherever it is."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_end_the_run() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP end the run at once: the exception unwinds through the
    ``finally`` that stops the daemon. (SIGINT too: left to asyncio.run, Ctrl-C only
    cancels the main task, and a loaded machine showed code under way holding that
    up past a minute.) The previous handlers come back afterwards."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise _Interrupted(signum)

    ending = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {sig: signal.signal(sig, handler) for sig in ending}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


async def _wait_ready(endpoint: str, daemon: subprocess.Popen[bytes], phase: _Phase) -> None:
    while True:
        if daemon.poll() is not None:
            raise RuntimeError(f"the daemon exited with status {daemon.returncode}")
        phase("the daemon to answer at " + endpoint)
        try:
            async with Client(endpoint, timeout=2) as c:
                phase("the workers to capture their graphs and report ready")
                st = await c.wait_ready(60.0)
                for w in st["workers"]:
                    print(f"  device {w['device']}: worker pid {w['pid']} ready at {w['endpoint']}")
                return
        except Exception:
            await asyncio.sleep(0.2)


def run(
    devices: int = 2,
    duration_s: float = 20.0,
    concurrency: int = 8,
    verify: float = 0.25,
    report_dir: str | None = None,
    deadline_s: float | None = None,
) -> int:
    """The demo; its exit code. ``deadline_s`` defaults to the load's duration plus
    five minutes for start-up (graph capture) and shutdown."""
    deadline = duration_s + 300.0 if deadline_s is None else deadline_s
    phase = _Phase()
    signum = 0
    try:
        with _Deadline(deadline, phase) as watchdog, _signals_end_the_run():
            return _run(devices, duration_s, concurrency, verify, report_dir, phase, watchdog)
    except KeyboardInterrupt:
        signum = signal.SIGINT
    except _Interrupted as exc:
        signum = exc.signum
    name = signal.Signals(signum).name
    print(f"graphlane demo: interrupted by {name}; the daemon was stopped", file=sys.stderr)
    return 128 + signum


def _run(
    devices: int,
    duration_s: float,
    concurrency: int,
    verify: float,
    report_dir: str | None,
    phase: _Phase,
    watchdog: _Deadline,
) -> int:
    report = Path(report_dir or f"reports/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    with tempfile.TemporaryDirectory(prefix="graphlane-demo-") as tmp:
        endpoint = f"ipc://{tmp}/daemon.sock"
        config_path = Path(tmp, "demo.toml")
        config_path.write_text(f'listen = "{endpoint}"\ndevices = {devices}\n' + DEMO_CONFIG)
        cmd = [sys.executable, "-m", "graphlane", "serve", "--config", str(config_path),
               "--log-level", "WARNING"]  # fmt: skip
        print(f"starting: graphlane serve --listen {endpoint} --devices {devices} (simulated NPUs)")
        daemon = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        watchdog.daemon = daemon
        code: int | None = None
        try:
            asyncio.run(_wait_ready(endpoint, daemon, phase))
            half = duration_s / 2
            print(
                f"load test: attention for {half:g} s, {concurrency} calls in flight, "
                f"{verify:.0%} of outputs verified against eager attention"
            )
            config = LoadConfig(
                endpoint=endpoint,
                duration_s=half,
                concurrency=concurrency,
                verify=verify,
                report_dir=str(report),
                progress=sys.stderr.isatty(),
            )
            phase("the attention load test to finish")
            result = asyncio.run(run_load(config))
            print_summary(result)
            print(f"report: {report.resolve() / 'report.html'} (and report.json)")
            print(
                f"load test: paged_attention decode for {half:g} s, {PAGED_SEQUENCES} live "
                f"sequences, {verify:.0%} of steps verified against SDPA over the demo's KV copy"
            )
            paged_config = PagedLoadConfig(
                endpoint=endpoint,
                duration_s=half,
                concurrency=PAGED_SEQUENCES,
                verify=verify,
                report_dir=str(report / "paged"),
            )
            phase("the paged decode load test to finish")
            paged = asyncio.run(run_paged(paged_config))
            print_paged_summary(paged)
            phase("the daemon to stop")
            code = _stop(daemon)
            print(f"daemon stopped with exit code {code}")
        finally:
            if code is None:  # interrupted or failed: the daemon goes too
                _stop(daemon)
    verdicts = (int(result["verdict"]["exit_code"]), int(paged["verdict"]["exit_code"]))
    return 0 if verdicts == (0, 0) and code == 0 else 1
