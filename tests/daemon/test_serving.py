"""A real daemon serving many concurrent pipelined steps across devices, with
numerics checked; the client's concurrency, cancellation and sync variant;
status from the CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from daemons import SMALL, RunningDaemon, until
from reference import decode_stack

import graphlane
from graphlane.client import Client, SyncClient

L, N, NKV, D, MAXKV = (
    SMALL["layers"],
    SMALL["num_heads"],
    SMALL["num_kv_heads"],
    SMALL["head_dim"],
    SMALL["max_kv_len"],
)


def make_step(gen: torch.Generator, batch: int) -> tuple[list[int], dict[str, torch.Tensor]]:
    lengths = torch.randint(1, MAXKV + 1, (batch,), generator=gen).tolist()
    inputs = {
        "query": torch.randn(batch, N, 1, D, dtype=torch.float16, generator=gen),
        "key": torch.randn(L, batch, NKV, MAXKV, D, dtype=torch.float16, generator=gen),
        "value": torch.randn(L, batch, NKV, MAXKV, D, dtype=torch.float16, generator=gen),
    }
    return lengths, inputs


def expected(lengths: list[int], inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return decode_stack(inputs["query"], list(inputs["key"]), list(inputs["value"]), lengths)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_concurrent_steps_across_devices_match_the_reference(start_daemon, transport: str) -> None:
    d: RunningDaemon = start_daemon(transport, devices=2, depth=2)

    async def main() -> None:
        gen = torch.Generator().manual_seed(11)
        async with graphlane.Client(d.endpoint, timeout=60) as c:
            calls, cases = [], []
            for i in range(48):
                batch = 1 + i % 4
                lengths, inputs = make_step(gen, batch)
                device = i % 2
                calls.append(
                    c.step("attention", device, {"actual_seq_lengths_kv": lengths}, inputs)
                )
                cases.append((lengths, inputs, batch, device))
            replies = await asyncio.gather(*calls)  # all 48 in flight at once
        for r, (lengths, inputs, batch, device) in zip(replies, cases, strict=True):
            assert r.device == device
            assert r.bucket == min(b for b in SMALL["buckets"] if b >= batch)
            out = r.outputs["out"]
            assert out.shape == (batch, N, 1, D)
            torch.testing.assert_close(out, expected(lengths, inputs), atol=2e-3, rtol=2e-3)

    asyncio.run(main())
    st = d.status()
    assert st["ready"] and all(w["restarts"] == 0 for w in st["workers"])


def test_calls_made_together_go_as_bundles_and_each_gets_its_own_answer(shared_daemon) -> None:
    """Steps without data frames made in one turn of the loop travel to the worker as
    bundles; every call still gets the reply for its own batch, and calls made one
    after another are not bundled."""
    d = shared_daemon(devices=1)

    async def main() -> None:
        async with Client(d.endpoint) as c:
            before = (await c.worker_status(0))["counters"]["bundles"]
            for _ in range(3):
                await c.step("attention", 0, {"actual_seq_lengths_kv": [1]})
            assert (await c.worker_status(0))["counters"]["bundles"] == before
            batches = [1 + i % 4 for i in range(32)]
            calls = [
                c.step("attention", 0, {"actual_seq_lengths_kv": [1 + j % MAXKV for j in range(b)]})
                for b in batches
            ]
            replies = await asyncio.gather(*calls)
            for r, batch in zip(replies, batches, strict=True):
                assert r.bucket == min(b for b in SMALL["buckets"] if b >= batch)
                assert r.outputs["out"].shape == (batch, N, 1, D)
            assert (await c.worker_status(0))["counters"]["bundles"] > before

    asyncio.run(main())


def test_large_calls_made_together_are_each_answered(shared_daemon) -> None:
    """Requests of 600 kB made together would make a bundle over the worker's 1 MiB
    envelope limit, refused whole: large requests go alone, smaller ones in bundles
    that fit, and each gets its own answer (here BAD_REQUEST: no such parameter)."""
    d = shared_daemon(devices=1)

    async def main() -> None:
        async with Client(d.endpoint, timeout=10) as c:
            for junk in (["x" * 50_000] * 12, "x" * 6_000):  # alone; several to a bundle
                calls = [
                    c.step("attention", 0, {"actual_seq_lengths_kv": [1], "junk": junk})
                    for _ in range(16)
                ]
                results = await asyncio.gather(*calls, return_exceptions=True)
                assert all(
                    isinstance(r, graphlane.GraphlaneError) and r.code == "BAD_REQUEST"
                    for r in results
                ), results

    asyncio.run(main())


def test_split_update_then_replay_and_status(shared_daemon) -> None:
    d = shared_daemon(devices=1)

    async def main() -> None:
        gen = torch.Generator().manual_seed(5)
        lengths, inputs = make_step(gen, 3)
        async with Client(d.endpoint) as c:
            up = await c.update("attention", 0, {"actual_seq_lengths_kv": lengths}, inputs)
            assert up.outputs == {} and up.patched == L
            r = await c.replay("attention", 0, batch=3)
            torch.testing.assert_close(
                r.outputs["out"], expected(lengths, inputs), atol=2e-3, rtol=2e-3
            )
            ws = await c.worker_status(0)
            assert ws["state"] == "ready" and ws["steps"] >= 2

    asyncio.run(main())


def test_cancelled_call_loses_nothing_and_the_client_stays_usable(start_daemon) -> None:
    d = start_daemon(devices=1, sim={"mode": "timed", "task_us": 20000.0, "patch_us": 100.0})

    async def main() -> None:
        async with Client(d.endpoint, timeout=30) as c:
            slow = asyncio.ensure_future(c.step("attention", 0, {"actual_seq_lengths_kv": [4]}))
            await until(lambda: bool(c._workers) and bool(c._workers[0].pending))
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            # The connection keeps working; the cancelled call's reply is dropped on arrival.
            replies = await asyncio.gather(
                *(c.step("attention", 0, {"actual_seq_lengths_kv": [i + 1]}) for i in range(3))
            )
            assert [r.outputs["out"].shape[0] for r in replies] == [1, 1, 1]
            assert c._workers[0].late_replies == 1
            assert not c._workers[0].pending

    asyncio.run(main())


def test_sync_client_is_the_async_client(shared_daemon) -> None:
    d = shared_daemon(devices=1)
    with SyncClient(d.endpoint, timeout=30) as c:
        r = c.step("attention", 0, {"actual_seq_lengths_kv": [3, 9]})
        assert r.outputs["out"].shape == (2, N, 1, D)
        assert c.status()["ready"]
        with pytest.raises(graphlane.GraphlaneError) as err:
            c.step("attention", 0, {"actual_seq_lengths_kv": [0]})
        assert err.value.code == "BAD_REQUEST"


def test_status_cli(shared_daemon) -> None:
    d = shared_daemon(devices=2)
    cli = [sys.executable, "-m", "graphlane", "status", "--connect", d.endpoint]
    out = subprocess.run(
        [*cli, "--json", "--wait", "30"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert [w["state"] for w in st["workers"]] == ["ready", "ready"]
    for w in st["workers"]:
        assert {"device", "pid", "state", "restarts", "programs"} <= set(w)
        assert "attention" in w["programs"]
    text = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert text.returncode == 0 and "device 1: ready" in text.stdout


def test_status_wait_fails_at_the_deadline_when_nothing_answers(tmp_path) -> None:
    nobody = f"ipc://{tmp_path}/nobody.sock"
    cli = [sys.executable, "-m", "graphlane", "status", "--connect", nobody]
    cli += ["--wait", "0.5", "--timeout", "0.2"]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "TIMEOUT" in out.stderr


def test_one_client_across_two_daemons_acting_as_two_hosts(shared_daemon) -> None:
    a = shared_daemon("tcp", devices=1)
    b = shared_daemon("tcp", devices=2)

    async def main() -> None:
        async with Client([a.endpoint, b.endpoint], timeout=30) as c:
            assert c.hosts == [a.endpoint, b.endpoint]
            r0 = await c.step("attention", (0, 0), {"actual_seq_lengths_kv": [2]})
            r1 = await c.step("attention", (b.endpoint, 1), {"actual_seq_lengths_kv": [2, 3]})
            assert (r0.host, r0.device) == (a.endpoint, 0)
            assert (r1.host, r1.device, r1.outputs["out"].shape[0]) == (b.endpoint, 1, 2)
            with pytest.raises(graphlane.GraphlaneError) as err:
                await c.step("attention", 0, {"actual_seq_lengths_kv": [2]})  # which host?
            assert err.value.code == "UNKNOWN_DEVICE"
            st = await c.status()
            assert st["ready"] and [len(h["workers"]) for h in st["hosts"]] == [1, 2]

    asyncio.run(main())
    cli = [sys.executable, "-m", "graphlane", "status"]
    out = subprocess.run(
        [*cli, "--connect", f"{a.endpoint},{b.endpoint}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("daemon running") == 2 and out.stdout.count(": ready") == 3


def test_close_with_calls_still_resolving_their_worker_does_not_hang(shared_daemon) -> None:
    """close() while steps are still finding their worker's socket closes every socket
    (a socket left open would make close() wait forever)."""
    d = shared_daemon(devices=2)

    async def main() -> None:
        c = Client(d.endpoint, timeout=30)
        await c.connect()
        calls = [
            asyncio.ensure_future(c.step("attention", i % 2, {"actual_seq_lengths_kv": [1]}))
            for i in range(6)
        ]
        await asyncio.sleep(0)  # the steps start resolving their workers
        await c.close()
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(
            isinstance(r, graphlane.GraphlaneError) or hasattr(r, "outputs") for r in results
        )

    asyncio.run(main())


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_an_idle_worker_sleeps_after_serving(shared_daemon) -> None:
    """After a burst answered from the completion thread (the sim's steps are not done
    when issued), the worker's loop goes back to sleep: a lost or stale wake-up would
    spin it, burning a core while nothing happens."""
    d: RunningDaemon = shared_daemon(devices=1)
    pid = d.worker(0)["pid"]

    async def burst() -> None:
        async with graphlane.Client(d.endpoint, timeout=60) as c:
            await asyncio.gather(
                *(c.step("attention", 0, {"actual_seq_lengths_kv": [1 + i % 8]}) for i in range(64))
            )

    asyncio.run(burst())
    # The baseline: a thread spinning through the same window gets what a spinning
    # worker would get of this machine, however busy it is (a fixed share of a core
    # would not hold on a loaded host, nor catch a spin there).
    stop, spun = threading.Event(), []

    def spin() -> None:
        t = time.thread_time()
        while not stop.is_set():
            pass
        spun.append(time.thread_time() - t)

    spinner = threading.Thread(target=spin)
    before = _cpu_seconds(pid)
    spinner.start()
    time.sleep(1.0)  # an observation window, not a wait for something to happen
    stop.set()
    spinner.join()
    used = _cpu_seconds(pid) - before
    assert used < spun[0] / 4, f"the idle worker used {used:.2f} s of CPU, a spin {spun[0]:.2f}"


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


@pytest.mark.skipif(
    not os.path.exists("/proc/self/stat"), reason="counts page faults in Linux's /proc"
)
def test_large_inputs_do_not_page_fault_the_worker_step_after_step(start_daemon) -> None:
    """Two 8 MiB input frames per step: the worker reuses the pages of the last
    step's frames (its malloc keeps them, see workers/memory.py) instead of
    mapping 4 000 fresh pages every other step."""
    wide = {"name": "attention", "layers": 2, "num_heads": 2, "num_kv_heads": 1,
            "head_dim": 64, "max_kv_len": 8192, "buckets": [4]}  # fmt: skip
    d = start_daemon(devices=1, backend="null", programs=[wide])
    pid = d.worker(0)["pid"]
    shape = (2, 4, 1, 8192, 64)
    inputs = {"key": torch.ones(shape, dtype=torch.float16),
              "value": torch.ones(shape, dtype=torch.float16)}  # fmt: skip

    async def steps() -> list[int]:
        faults = []
        async with Client(d.endpoint, timeout=60) as c:
            for _ in range(12):
                before = _minor_faults(pid)
                await c.step("attention", 0, {"actual_seq_lengths_kv": [3] * 4}, inputs)
                faults.append(_minor_faults(pid) - before)
        return faults

    faults = asyncio.run(steps())
    # The baseline is this run's first step, which maps its frames' pages (4 096 or
    # more); without the malloc settings every other step maps them again. A busy host
    # may make an odd step map one frame anew: a share of the steps, not one of them.
    first, later = faults[0], faults[2:]
    remapped = [f for f in later if f > first / 4]
    assert len(remapped) <= len(later) // 4, faults


def _threads(pid: int) -> dict[int, str]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            out[int(tid)] = f.read().strip()
    return out


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 or not os.path.exists("/proc/self/task"),
    reason="pinning needs two cores to choose from, and Linux's /proc to look at threads",
)
def test_each_sim_worker_runs_on_a_core_of_its_own_unless_told_not_to(start_daemon) -> None:
    """cpu_affinity = "auto" (the default): every thread of a sim worker is on the one
    core status names, under SCHED_BATCH, but ZeroMQ's I/O threads, which are on every
    core; the two workers have different cores. "off": nothing is pinned."""
    every = set(os.sched_getaffinity(0))
    d = start_daemon(devices=2)
    workers = d.status()["workers"]
    cores = [tuple(w["cpus"]) for w in workers]
    assert all(len(c) == 1 for c in cores) and cores[0] != cores[1], cores
    for w in workers:
        threads = _threads(w["pid"])
        io = [t for t, name in threads.items() if name.startswith("ZMQbg/IO")]
        assert io, threads
        for tid, name in threads.items():
            if name.startswith("ZMQbg/"):
                assert os.sched_getaffinity(tid) == every, (name, os.sched_getaffinity(tid))
                assert os.sched_getscheduler(tid) == os.SCHED_OTHER
        # the main thread and those it started: the engine's update and completion
        # threads, the simulated streams' (Python's thread names do not reach /proc)
        pinned = [t for t in threads if os.sched_getaffinity(t) == set(w["cpus"])]
        assert w["pid"] in pinned and len(pinned) >= 5, (pinned, threads)
        assert os.sched_getscheduler(w["pid"]) == os.SCHED_BATCH
    asyncio.run(_one_step(d))  # and they serve

    off = start_daemon(devices=1, cpu_affinity="off")
    w = off.worker(0)
    assert w["cpus"] is None
    assert os.sched_getaffinity(w["pid"]) == every
    assert os.sched_getscheduler(w["pid"]) == os.SCHED_OTHER


async def _one_step(d: RunningDaemon) -> None:
    async with Client(d.endpoint, timeout=60) as c:
        for device in (0, 1):
            r = await c.step("attention", device, {"actual_seq_lengths_kv": [3]})
            assert r.outputs["out"].shape[0] == 1
