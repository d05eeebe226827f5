"""The sim's "hccl" backend: collectives as device tasks, across real rank processes.

One run of rank processes (``collective_ranks.py``, joined through a file store) goes
through the scenarios in order, each rank printing what it saw; the tests check those
results. Every process is killed if the run fails or times out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from npusim import SimUsageError, graph_profile, torch_npu

RANKS = Path(__file__).with_name("collective_ranks.py")
# The rank that skips a collective must be last: its group's ranks fall out of step.
SCENARIOS = ["eager", "large", "row_parallel", "async_wait", "async_no_wait", "race",
             "race_fenced", "mismatch", "timed", "timed_bytes", "store_calls", "handoff",
             "perf_handoff", "skip"]  # fmt: skip


def run_ranks(
    init: Path, scenarios: list[str], world: int, watchdog_s: float = 3.0, timeout: float = 120
) -> dict[str, list[dict[str, Any]]]:
    """Run ``scenarios`` on ``world`` rank processes: each scenario's results, by rank."""
    env = {**os.environ, "NPUSIM_WATCHDOG_S": str(watchdog_s)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(RANKS), ",".join(scenarios), str(rank), str(world), str(init)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]
    try:
        results: dict[str, list[dict[str, Any]]] = {s: [] for s in scenarios}
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"rank {rank} exited with {p.returncode}:\n{err[-3000:]}"
            for line in out.strip().splitlines():
                r = json.loads(line)
                results[r.pop("scenario")].append(r)
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return run_ranks(tmp_path_factory.mktemp("hccl") / "init", SCENARIOS, world=2)


def _check_eager(results: list[dict[str, Any]], world: int) -> None:
    assert [r["rank"] for r in results] == list(range(world))
    total = float(sum(range(1, world + 1)))
    summed = [sum(j + i for i in range(world)) for j in range(2 * world)]
    for rank, r in enumerate(results):
        assert r["sum"] == [total] * 4
        assert r["max"] == [world - 1.0, 0.0]
        assert r["gather"] == [float(i) for i in range(world) for _ in range(2)]
        assert r["scatter"] == [float(v) for v in summed[2 * rank : 2 * rank + 2]]
        assert r["broadcast"] == [world - 1.0] * 3


def test_eager_collectives_give_every_rank_the_result(two_ranks: Any) -> None:
    _check_eager(two_ranks["eager"], 2)


def test_inputs_over_the_inline_size_go_through_shared_memory_exactly(two_ranks: Any) -> None:
    for r in two_ranks["large"]:
        assert r["sum_exact"] and r["gather_exact"], r
        assert r["shared"] == 2, r  # one shared copy per collective, whatever the peers


def test_eager_collectives_on_four_ranks_and_groups_of_two(tmp_path: Path) -> None:
    results = run_ranks(tmp_path / "init", ["eager", "large", "pairs"], world=4)
    _check_eager(results["eager"], 4)
    for r in results["large"]:
        assert r["sum_exact"] and r["gather_exact"], r
    for rank, r in enumerate(results["pairs"]):
        pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert r["global_ranks"] == pair
        assert r["pair_sum"] == [float(sum(p + 1 for p in pair))] * 2
        assert r["world_sum"] == [4.0]


def test_captured_row_parallel_linear_replays_the_unsharded_result(two_ranks: Any) -> None:
    for r in two_ranks["row_parallel"]:
        assert len(r["errors"]) == 3
        assert max(r["errors"]) < 1e-4, r
        assert r["collectives"] == 1  # one task per captured collective


def test_async_work_wait_orders_the_current_stream_after_the_collective(two_ranks: Any) -> None:
    for r in two_ranks["async_wait"]:
        assert r["y"] == [6.0] * 4
    for r in two_ranks["async_no_wait"]:
        assert (r["error"], r["kind"]) == ("HazardError", "race"), r
        assert "hccl all_reduce" in r["message"]


def test_a_replayed_collectives_handoff_does_not_go_through_the_store(two_ranks: Any) -> None:
    """The store serves the group's creation; a collective's data and rendezvous go over
    the group's link, so replaying a graph of 8 collectives calls the store no more than a
    graph of 1 does (three replays each), and the sums are still right."""
    for r in two_ranks["store_calls"]:
        assert r["1"] == r["8"] == 0, r
        assert r["value1"] == 2.0**3 and r["value8"] == 2.0**24


def test_a_collectives_handoff_wakes_the_waiting_rank_directly(two_ranks: Any) -> None:
    """The handoff between the ranks' processes goes through no transport thread: a group's
    link adds no thread to the process (a ZeroMQ link added its context's I/O and reaper
    threads, and each message woke an I/O thread at each end), one datagram per peer per
    collective, and a replayed all_reduce costs the process at most about one voluntary
    context switch (the waiting rank blocking in its poll) beyond the same graph without
    its collectives, counted by the kernel, whatever the machine's load."""
    for r in two_ranks["handoff"]:
        assert r["threads_added"] == 0, r
        assert r["sent"] == 16 * 4, r  # k collectives x replays, one peer
        assert r["switches"] - r["switches_base"] <= 1.5, r


def test_perf_mode_replays_a_collective_without_waiting_for_the_tasks_before_it(
    two_ranks: Any,
) -> None:
    """Performance mode keeps a collective's cost in modelled time (each replay at least
    its tasks' and collectives' costs in a row) while the stream waits in wall time only
    for the peers' parts: about one voluntary context switch per collective or less (on
    d292955 about two: a sleep for the tasks before it, the wait, a sleep after it)."""
    for r in two_ranks["perf_handoff"]:
        assert r["modelled_ms"] >= r["floor_ms"] * (1 - 1e-6), r
        assert r["switches"] <= 1.25, r


def test_a_rank_that_never_joins_is_a_deadlock_naming_it(two_ranks: Any) -> None:
    r0, r1 = two_ranks["skip"]
    assert r1 == {"rank": 1, "skipped": True}
    assert (r0["error"], r0["kind"]) == ("DeadlockError", "watchdog"), r0
    assert "all_reduce #" in r0["message"] and "of process group '0'" in r0["message"]
    assert "rank 1 (global rank 1), which never joined it" in r0["message"]


def test_an_unfenced_write_racing_a_replayed_collective_is_reported(two_ranks: Any) -> None:
    for r in two_ranks["race"]:
        assert (r["error"], r["kind"]) == ("HazardError", "race"), r
        assert "hccl all_reduce in replay #1" in r["message"]
        assert "copy host->npu" in r["message"]
    for r in two_ranks["race_fenced"]:
        assert r["error"] is None and r["x"] == [5.0] * 4


def test_timed_mode_charges_each_collective_its_modelled_cost(two_ranks: Any) -> None:
    for r in two_ranks["timed"]:
        assert r["elapsed_ms"] >= 50.0, r  # collective_us = 50 ms, in modelled time


def test_timed_mode_charges_a_collective_its_bytes_over_the_link_bandwidth(
    two_ranks: Any,
) -> None:
    for r in two_ranks["timed_bytes"]:
        # 1 MB, 2(2-1)/2 of it sent, at 0.02 GB/s: 50 ms of modelled time, no latency
        assert r["elapsed_ms"] >= 50.0, r


def test_a_collectives_cost_is_latency_plus_its_ring_bytes_over_the_bandwidth() -> None:
    from npusim.collectives import collective_cost_us as cost

    mb = 1_000_000
    assert cost("all_reduce", mb, 2, 10.0, 0.0) == 10.0  # no bandwidth: latency only
    assert cost("all_reduce", mb, 1, 10.0, 50.0) == 10.0  # one rank sends nothing
    assert cost("all_reduce", mb, 2, 10.0, 50.0) == 10.0 + 20.0  # 2(N-1)/N = 1
    assert cost("all_reduce", mb, 4, 10.0, 50.0) == 10.0 + 30.0  # 2(N-1)/N = 1.5
    assert cost("all_gather_into_tensor", mb, 4, 0.0, 50.0) == 15.0  # (N-1)/N
    assert cost("reduce_scatter_tensor", mb, 4, 0.0, 50.0) == 15.0
    assert cost("broadcast", mb, 4, 0.0, 50.0) == 20.0


def test_ranks_running_different_collectives_are_reported(two_ranks: Any) -> None:
    for r in two_ranks["mismatch"]:
        assert r["error"] == "DeviceFaultError", r
        assert "collective mismatch" in r["message"]
        assert "all_reduce sum" in r["message"] and "broadcast root 0" in r["message"]


@pytest.fixture
def lone_rank(tmp_path: Path) -> Iterator[None]:
    """A group of one rank in this process."""
    dist.init_process_group("hccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:.*all_gather_into_tensor.*:FutureWarning")
def test_what_hccl_does_not_take_is_refused_at_the_call(lone_rank: None) -> None:
    assert dist.is_hccl_available() and torch_npu.distributed.is_hccl_available()
    assert dist.get_backend() == "hccl"
    with pytest.raises(SimUsageError, match=r"takes npu tensors; the all_reduce tensor is on cpu"):
        dist.all_reduce(torch.ones(2))
    with pytest.raises(SimUsageError, match=r"ReduceOp BAND is not modelled"):
        dist.all_reduce(torch.ones(2).npu(), op=dist.ReduceOp.BAND)
    with pytest.raises(SimUsageError, match=r"output must hold world size \(1\) times"):
        dist.all_gather_into_tensor(torch.empty(3).npu(), torch.ones(2).npu())


def test_a_captured_collective_issues_nothing_until_replayed(lone_rank: None) -> None:
    x = torch.ones(2).npu()
    s = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    group = dist.distributed_c10d._get_default_group()
    with torch.npu.stream(s):
        with torch.npu.graph(g, stream=s):
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        issued = group.issued
        for _ in range(3):
            g.replay()
    torch.npu.synchronize()
    assert issued == 0 and group.issued == 3  # one collective number per replay
    assert graph_profile(g).kernels == {"hccl all_reduce": 1}


def test_a_tensor_freed_while_its_collective_runs_on_another_stream_is_held(
    lone_rank: None,
) -> None:
    """ProcessGroupHCCL records a collective's tensors on the stream it runs on (its
    record_stream): the host may free them after an async_op without waiting, and the
    allocator holds the memory until the collective has run. So here: no use-after-free
    when the default stream's next tensor would reuse that memory."""
    side = torch.npu.Stream()
    for _ in range(3):
        x = torch.full((1024,), 2.0).npu()
        side.wait_stream(torch.npu.current_stream())
        with torch.npu.stream(side):
            gathered = torch.empty(1024).npu()
            dist.all_reduce(x, async_op=True)
            dist.all_gather_single(gathered, x, async_op=True)
        del x, gathered  # freed by the host, the collectives maybe still to run
        y = torch.zeros(1024).npu()
        y.add_(1.0)
        torch.npu.synchronize()
        assert y.cpu().eq(1.0).all()
