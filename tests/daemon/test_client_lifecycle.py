"""No graphlane client can freeze the process that holds it.

Each scenario runs in a child interpreter with a deadline: a hang fails the test
(with the child's output) instead of stalling the suite. The scenarios are what
a scheduler process meets: a connect that fails, times out or is cancelled; an
exception or cancellation inside ``async with``; clients never closed, closed
twice, closed from another thread, dropped and collected; interpreter exit with
calls in flight; a malformed endpoint; and the reproduction of the hang that
froze the README's main job (a failed connect, then ``gc.collect()``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from daemons import RunningDaemon, wait_for

from graphlane.client import Client

DEADLINE_S = 30.0
NOBODY = "tcp://127.0.0.1:1"  # nothing listens there: every hello times out

pytestmark = pytest.mark.timeout(180)


def run_child(code: str, *args: str, deadline: float = DEADLINE_S) -> str:
    """Run ``code`` in a fresh interpreter; its output. Fails the test if the child
    does not finish within ``deadline`` s or exits non-zero."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the child hung (> {deadline:g} s); its output:\n{out}")
    assert proc.returncode == 0, f"the child exited {proc.returncode}:\n{out}"
    return out


# ------------------------------------------------------------ no daemon needed
def test_the_reported_reproduction_finishes_including_gc_collect() -> None:
    out = run_child(
        """
        import asyncio, gc, graphlane
        async def main():
            try:
                async with graphlane.Client("tcp://127.0.0.1:1", timeout=0.5):
                    pass
            except graphlane.GraphlaneError as e:
                print("connect failed:", e.code)
        asyncio.run(main())
        gc.collect()
        print("collected")
        """
    )
    assert "connect failed: TIMEOUT" in out and "collected" in out


def test_a_failed_sync_connect_then_gc_collect_finishes() -> None:
    out = run_child(
        """
        import gc, threading, graphlane
        for _ in range(3):
            try:
                graphlane.SyncClient("tcp://127.0.0.1:1", timeout=0.3)
            except graphlane.GraphlaneError as e:
                print("connect failed:", e.code)
        gc.collect()
        alive = [t.name for t in threading.enumerate() if t.name == "graphlane-sync-client"]
        print("loop threads left:", len(alive))
        """
    )
    assert out.count("connect failed: TIMEOUT") == 3 and "loop threads left: 0" in out


def test_a_cancelled_connect_leaves_no_socket_and_may_be_retried() -> None:
    out = run_child(
        """
        import asyncio, gc, graphlane
        async def main():
            c = graphlane.Client("tcp://127.0.0.1:1", timeout=5)
            for _ in range(2):
                task = asyncio.ensure_future(c.connect())
                while not len(c._sockets):  # connect has opened its channel: it awaits hello
                    await asyncio.sleep(0)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    print("cancelled; sockets open:", len(c._sockets))
            try:
                await asyncio.wait_for(c.connect(), 0.1)
            except TimeoutError:
                print("timed out; sockets open:", len(c._sockets))
        asyncio.run(main())
        gc.collect()
        print("done")
        """
    )
    assert out.count("sockets open: 0") == 3 and "done" in out


@pytest.mark.parametrize(
    "endpoint", ["127.0.0.1:7450", "localhost:7450", "foo", "tcp://host", "tcp://h:99999", ""]
)
def test_an_endpoint_without_its_form_is_an_immediate_error(endpoint: str) -> None:
    out = run_child(
        """
        import sys, graphlane
        for make in (graphlane.Client, graphlane.SyncClient):
            try:
                make(sys.argv[1])
            except ValueError as e:
                assert isinstance(e, graphlane.GraphlaneError) and e.code == "BAD_REQUEST"
                print("refused:", e.message)
        """,
        endpoint,
    )
    assert out.count("refused:") == 2, out
    assert "tcp://HOST:PORT" in out, out


@pytest.mark.parametrize("endpoint", ["127.0.0.1:7450", "foo"])
def test_the_cli_answers_a_malformed_endpoint_in_one_line(endpoint: str) -> None:
    # The refusal's words prove it came before any connection was tried (a wait would
    # end in TIMEOUT); the subprocess timeout only keeps a hang from stalling the suite.
    proc = subprocess.run(
        [sys.executable, "-m", "graphlane.cli", "status", "--connect", endpoint],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "tcp://HOST:PORT" in lines[0], proc.stderr
    assert "TIMEOUT" not in proc.stderr, proc.stderr


# ------------------------------------------------------------ against a daemon
@pytest.fixture
def daemon(shared_daemon) -> RunningDaemon:
    d: RunningDaemon = shared_daemon(transport="tcp", devices=1)
    return d


@pytest.fixture
def hung_daemon(start_daemon) -> RunningDaemon:
    """A daemon whose device never finishes a step: calls stay in flight."""
    d: RunningDaemon = start_daemon(
        transport="tcp",
        devices=1,
        hang_timeout_s=120.0,
        shutdown_timeout_s=2.0,
        faults={"hang_device_after": 0},
    )
    return d


def test_exception_and_cancellation_inside_async_with_close_everything(daemon) -> None:
    out = run_child(
        """
        import asyncio, gc, sys, graphlane
        ep = sys.argv[1]
        async def main():
            try:
                async with graphlane.Client(ep, timeout=10) as c:
                    await c.step("attention", 0, {"actual_seq_lengths_kv": [3]})
                    raise KeyError("in the block")
            except KeyError:
                print("raised; sockets open:", len(c._sockets))
            async def block():
                async with graphlane.Client(ep, timeout=10) as c2:
                    holder.append(c2)
                    await c2.step("attention", 0, {"actual_seq_lengths_kv": [3]})
                    await asyncio.sleep(60)
            holder = []
            task = asyncio.ensure_future(block())
            while not holder or not holder[0]._workers:
                await asyncio.sleep(0.01)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                print("cancelled; sockets open:", len(holder[0]._sockets))
        asyncio.run(main())
        gc.collect()
        print("done")
        """,
        daemon.endpoint,
    )
    assert out.count("sockets open: 0") == 2 and "done" in out, out


def test_clients_never_closed_dropped_or_closed_twice_do_not_block(daemon) -> None:
    out = run_child(
        """
        import asyncio, gc, sys, threading, graphlane
        ep = sys.argv[1]
        async def main():
            c = graphlane.Client(ep, timeout=10)
            await c.connect()
            await c.step("attention", 0, {"actual_seq_lengths_kv": [3]})
            kept = graphlane.Client(ep, timeout=10)   # never closed, alive at exit
            await kept.connect()
            await kept.step("attention", 0, {"actual_seq_lengths_kv": [3]})
            globals()["kept"] = kept
            del c                                    # dropped unclosed
            gc.collect()
            twice = graphlane.Client(ep, timeout=10)
            await twice.connect()
            await twice.close()
            await twice.close()
        asyncio.run(main())
        gc.collect()
        s = graphlane.SyncClient(ep, timeout=10)
        s.step("attention", 0, {"actual_seq_lengths_kv": [3]})
        closer = threading.Thread(target=s.close)    # closed from another thread
        closer.start(); closer.join()
        s.close()                                    # and twice
        try:
            s.status()
        except graphlane.GraphlaneError as e:
            print("after close:", e.code)
        dropped = graphlane.SyncClient(ep, timeout=10)
        dropped.status()
        del dropped
        gc.collect()
        left = graphlane.SyncClient(ep, timeout=10)   # alive at interpreter exit
        left.status()
        print("done")
        """,
        daemon.endpoint,
    )
    assert "after close: WORKER_LOST" in out and "done" in out, out


def test_interpreter_exit_with_calls_in_flight_does_not_block(hung_daemon) -> None:
    out = run_child(
        """
        import asyncio, sys, threading, graphlane
        ep = sys.argv[1]
        async def main():
            c = graphlane.Client(ep, timeout=60)
            await c.connect()
            calls = [asyncio.ensure_future(c.step("attention", 0, {"actual_seq_lengths_kv": [3]}))
                     for _ in range(16)]
            while not c._workers or len(c._workers[0].pending) < 16:  # all 16 are on the wire
                await asyncio.sleep(0.01)
            await asyncio.sleep(0)  # the end of this turn sends the queued bundle
            print("in flight:", sum(not f.done() for f in calls))
            globals()["c"] = c    # never closed; asyncio.run cancels the calls
        asyncio.run(main())
        s = graphlane.SyncClient(ep, timeout=60)
        for _ in range(4):
            threading.Thread(
                target=s.step, args=("attention", 0, {"actual_seq_lengths_kv": [3]}), daemon=True
            ).start()
        print("exiting")
        """,
        hung_daemon.endpoint,
    )
    assert "in flight: 16" in out and "exiting" in out, out


# ------------------------------------------------------------ vanished schedulers
def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


_VANISHING = """
import asyncio, sys, graphlane, torch
async def main():
    c = graphlane.Client(sys.argv[1], timeout=60)
    await c.connect()
    q = torch.randn(4, 4, 1, 16, dtype=torch.float16)
    calls = [asyncio.ensure_future(c.step("attention", 0, {"actual_seq_lengths_kv": [5] * 4},
                                          inputs={"query": q}))
             for _ in range(64)]
    await asyncio.sleep(0)
    print("sent", flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


def test_schedulers_killed_mid_call_leave_the_worker_serving_the_others(daemon) -> None:
    worker = daemon.worker(0)["pid"]

    def vanish() -> None:
        proc = subprocess.Popen(
            [sys.executable, "-c", _VANISHING, daemon.endpoint],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "sent"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()

    async def steady(c: Client, n: int) -> None:
        for i in range(n):
            await c.step("attention", 0, {"actual_seq_lengths_kv": [i % 30 + 1]})

    async def main() -> tuple[list[int], list[float]]:
        fds, rss = [], []
        async with Client(daemon.endpoint, timeout=20) as c:
            for round_ in range(6):
                await asyncio.to_thread(vanish)
                await steady(c, 20)  # the others are served
                if round_ >= 1:  # after the first round's warm-up
                    fds.append(_fds(worker))
                    rss.append(_rss_mib(worker))
        return fds, rss

    fds, rss = asyncio.run(main())
    assert daemon.worker(0)["pid"] == worker  # never restarted
    # Connections of killed peers are closed by the kernel; zmq drops their pipes.
    wait_for(lambda: _fds(worker) <= fds[0], 10, f"worker fds back to {fds[0]} (were {fds})")
    # Against the worker's own size after warm-up: a leak per vanished peer grows
    # it round after round; a tenth would be ~30 MiB in a ~300 MiB worker.
    assert rss[-1] < 1.1 * rss[0], f"worker RSS grew: {rss}"
