"""``graphlane demo``: the daemon on simulated NPUs, driven as a scheduler would.

Starts ``graphlane serve`` as a child process on a private ipc endpoint with two
programs (:data:`DEMO_CONFIG`: ``attention`` and ``paged_attention``), waits until
its workers are ready, and drives every device for half the duration each:

1. a closed-loop load test of ``attention`` (random batch sizes and sequence
   lengths; a share of the steps carry their own query/key/value and their
   outputs are checked against eager attention);
2. the continuous-batching decode loop of ``paged_attention``
   (:mod:`graphlane.loadtest.paged`):
   sequences prefilled through ``kv_write``, continuously batched decode steps,
   blocks reused, a share of the steps checked against
   ``scaled_dot_product_attention`` over the demo's own copy of the KV.

3. then a tiny Llama served by the ``model`` program (:mod:`.demo_model`): a
   continuous-batching generation loop per device, decoding ahead (each step sent
   before the previous one's tokens are back), a share of the sequences checked
   against transformers' ``generate``, its tokens/s printed.

It prints the summaries and where the reports are, then stops the daemon with
SIGTERM and exits: 0 when every verified output and token was right and the
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
import shutil
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
from graphlane.demo_model import PROGRAM_TOML, print_model_summary, run_model
from graphlane.loadtest.cli import print_summary
from graphlane.loadtest.config import LoadConfig
from graphlane.loadtest.driver import run_load

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


class _Watchdog:
    """The one thread that ends the demo early, whatever the main thread is in.

    Past the deadline it reports the phase and exits :data:`EXIT_DEADLINE`; on
    :meth:`interrupt` (SIGINT, SIGTERM, SIGHUP) it exits 128+signal. Either way it
    first stops the daemon and removes the demo's temporary directory; the main
    thread creates those under :attr:`registering`, so a signal that arrives while
    one exists but is not registered yet is acted on once it is. The signal
    handler only hands the signal over: an exception raised from a handler lands in
    whichever asyncio task happens to be running, and asyncio keeps a non-exit
    ``BaseException`` in that task's result instead of propagating it, so the
    load test would run on to its end (CI saw a SIGTERM ignored for over a minute).
    """

    def __init__(self, seconds: float, phase: _Phase) -> None:
        self.seconds = seconds
        self.phase = phase
        self.daemon: subprocess.Popen[bytes] | None = None
        self.tmp: str | None = None
        #: Held by the main thread from creating the daemon or the directory to
        #: setting ``daemon`` or ``tmp``; the watchdog takes it before it reads them.
        self.registering = threading.Lock()
        self._wake = threading.Condition()
        self._done = False
        self._signum = 0
        self._thread = threading.Thread(target=self._watch, name="demo-watchdog", daemon=True)

    def __enter__(self) -> _Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._wake:
            self._done = True
            self._wake.notify()
        self._thread.join()  # an interrupt under way ends the process from there

    def interrupt(self, signum: int) -> None:
        with self._wake:
            self._signum = self._signum or signum
            self._wake.notify()

    def _watch(self) -> None:
        end = time.monotonic() + self.seconds
        with self._wake:
            while not self._signum and not self._done and time.monotonic() < end:
                self._wake.wait(end - time.monotonic())
            signum = self._signum
            if self._done and not signum:
                return
        if signum:
            message = f"interrupted by {signal.Signals(signum).name}; stopping the daemon"
            code = 128 + signum
        else:
            waited = time.monotonic() - self.phase.since
            message = (
                f"gave up after {self.seconds:g} s (--deadline): still waiting for "
                f"{self.phase.what} ({waited:.0f} s)"
            )
            code = EXIT_DEADLINE
        print(f"graphlane demo: {message}", file=sys.stderr, flush=True)
        with self.registering:  # never taken by the signal handler: no deadlock
            daemon, tmp = self.daemon, self.tmp
        if daemon is not None:
            _stop(daemon, grace=_STOP_GRACE_S if signum else 5.0)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(code)


@contextlib.contextmanager
def _signals_to(watchdog: _Watchdog) -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP go to the watchdog, which stops the daemon and ends
    the process (SIGINT too: left to asyncio.run, Ctrl-C only cancels the main task,
    and a loaded machine showed code under way holding that up past a minute). The
    previous handlers come back afterwards."""

    def handler(signum: int, frame: FrameType | None) -> None:
        watchdog.interrupt(signum)

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
    with _Watchdog(deadline, phase) as watchdog, _signals_to(watchdog):
        return _run(devices, duration_s, concurrency, verify, report_dir, phase, watchdog)


def _run(
    devices: int,
    duration_s: float,
    concurrency: int,
    verify: float,
    report_dir: str | None,
    phase: _Phase,
    watchdog: _Watchdog,
) -> int:
    report = Path(report_dir or f"reports/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    with watchdog.registering:
        temporary = tempfile.TemporaryDirectory(prefix="graphlane-demo-")
        watchdog.tmp = temporary.name
    with temporary as tmp:
        endpoint = f"ipc://{tmp}/daemon.sock"
        config_path = Path(tmp, "demo.toml")
        head = f'listen = "{endpoint}"\ndevices = {devices}\n'
        config_path.write_text(head + DEMO_CONFIG + PROGRAM_TOML)
        cmd = [sys.executable, "-m", "graphlane", "serve", "--config", str(config_path),
               "--log-level", "WARNING"]  # fmt: skip
        print(f"starting: graphlane serve --listen {endpoint} --devices {devices} (simulated NPUs)")
        with watchdog.registering:
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
            paged_config = LoadConfig(
                endpoint=endpoint,
                duration_s=half,
                concurrency=PAGED_SEQUENCES,
                program="paged_attention",
                verify=verify,
                report_dir=str(report / "paged"),
                progress=sys.stderr.isatty(),
            )
            phase("the paged decode load test to finish")
            paged = asyncio.run(run_load(paged_config))
            print_summary(paged)
            print(f"report: {(report / 'paged').resolve() / 'report.html'} (and report.json)")
            print(
                "generation: a tiny Llama (model program), continuously batched, decoding "
                f"ahead; {verify:.0%} of sequences checked against transformers' generate"
            )
            phase("the model's generation loop to finish")
            model = asyncio.run(run_model(endpoint, devices, verify))
            print_model_summary(model)
            phase("the daemon to stop")
            code = _stop(daemon)
            print(f"daemon stopped with exit code {code}")
        finally:
            if code is None:  # interrupted or failed: the daemon goes too
                _stop(daemon)
    verdicts = (int(result["verdict"]["exit_code"]), int(paged["verdict"]["exit_code"]))
    return 0 if verdicts == (0, 0) and not model["wrong"] and code == 0 else 1
