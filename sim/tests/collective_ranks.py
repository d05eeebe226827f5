"""One rank of a test of the sim's "hccl" backend (run by test_collectives.py).

``python collective_ranks.py SCENARIOS RANK WORLD INIT_FILE``: joins the group through a
file store, runs the comma-separated scenarios in order, prints one JSON line per scenario
(what the test checks) and exits. After a scenario that faulted the device, every rank
resets it; a barrier starts each scenario in step.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import warnings
from datetime import timedelta
from typing import Any

import npusim
import torch
import torch.distributed as dist
from npusim import HazardError, SimError, graph_profile, torch_npu  # noqa: F401

warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor's rename notice


def eager(rank: int, world: int) -> dict[str, Any]:
    x = torch.full((4,), float(rank + 1)).npu()
    dist.all_reduce(x)
    m = torch.tensor([float(rank), -float(rank)]).npu()
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    gathered = torch.empty(2 * world).npu()
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank)).npu())
    scattered = torch.empty(2).npu()
    dist.reduce_scatter_tensor(scattered, (torch.arange(2.0 * world) + rank).npu())
    b = torch.full((3,), float(rank)).npu()
    dist.broadcast(b, src=world - 1)
    dist.barrier()
    return {
        "sum": x.cpu().tolist(),
        "max": m.cpu().tolist(),
        "gather": gathered.cpu().tolist(),
        "scatter": scattered.cpu().tolist(),
        "broadcast": b.cpu().tolist(),
    }


def large(rank: int, world: int) -> dict[str, Any]:
    """Inputs over the link's inline size (32 KiB) travel in shared memory: an all_reduce
    and an all_gather of 100 KB per rank, exact on every rank."""
    pg = dist.distributed_c10d._get_default_group()
    shared = pg.link.stats.shared
    n = 25_000
    x = (torch.arange(n, dtype=torch.float32) * (rank + 1)).npu()
    dist.all_reduce(x)
    gathered = torch.empty(n * world).npu()
    dist.all_gather_into_tensor(gathered, torch.full((n,), float(rank)).npu())
    want = torch.arange(n, dtype=torch.float32) * sum(range(1, world + 1))
    return {
        "sum_exact": bool(torch.equal(x.cpu(), want)),
        "gather_exact": bool(
            torch.equal(gathered.cpu(), torch.arange(world).float().repeat_interleave(n))
        ),
        "shared": pg.link.stats.shared - shared,
    }


def pairs(rank: int, world: int) -> dict[str, Any]:
    """Tensor-parallel groups of two inside the world (as vLLM's TP groups under DP/PP):
    each pair reduces on its own, the world group still works."""
    groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank makes all
    mine = groups[rank // 2]
    x = torch.full((2,), float(rank + 1)).npu()
    dist.all_reduce(x, group=mine)
    y = torch.ones(1).npu()
    dist.all_reduce(y)
    return {"pair_sum": x.cpu().tolist(), "world_sum": y.cpu().tolist(),
            "global_ranks": mine.global_ranks}  # fmt: skip


def row_parallel(rank: int, world: int) -> dict[str, Any]:
    """matmul + all_reduce + matmul captured once, replayed with new inputs: a row-parallel
    linear (vLLM's RowParallelLinear) followed by a replicated one."""
    gen = torch.Generator().manual_seed(0)  # every rank draws the same full weights
    w1, w2 = torch.randn(6, 8, generator=gen), torch.randn(5, 6, generator=gen)
    inputs = [torch.randn(3, 8, generator=gen) for _ in range(3)]
    part = 8 // world
    cols = slice(rank * part, (rank + 1) * part)
    w1_shard, w2_dev = w1[:, cols].contiguous().npu(), w2.npu()
    x = torch.zeros(3, part).npu()  # the static input buffer
    s = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    with torch.npu.stream(s):
        with torch.npu.graph(g, stream=s):
            y = x @ w1_shard.T
            dist.all_reduce(y)
            z = y @ w2_dev.T
        errors = []
        for full in inputs:
            x.copy_(full[:, cols])
            g.replay()
            want = (full @ w1.T) @ w2.T
            errors.append((z.cpu() - want).abs().max().item())
    profile = graph_profile(g)
    return {"errors": errors, "collectives": profile.kernels.get("hccl all_reduce", 0)}


class CountingStore:
    """A c10d store that counts the calls made to it (and passes them on)."""

    def __init__(self, store: Any) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


def store_calls(rank: int, world: int) -> dict[str, Any]:
    """The group's store calls while a graph of ``k`` all_reduces replays, for k = 1 and 8:
    the ranks' handoff of a collective goes over the group's link, not the store."""
    pg = dist.distributed_c10d._get_default_group()  # the sim's ProcessGroupHCCL
    calls = {}
    for k in (1, 8):
        x = torch.ones(4).npu()
        s = torch.npu.Stream()
        g = torch.npu.NPUGraph()
        with torch.npu.stream(s), torch.npu.graph(g, stream=s):
            for _ in range(k):
                dist.all_reduce(x)
        x.fill_(1.0)
        counting = CountingStore(pg.store)
        real, pg.store = pg.store, counting
        try:
            for _ in range(3):
                g.replay()
            torch.npu.synchronize()
        finally:
            pg.store = real
        calls[str(k)] = counting.calls
        calls[f"value{k}"] = x.cpu().tolist()[0]
    return calls


def _threads() -> int:
    """The process's OS threads (Python's and any library's)."""
    return len(os.listdir("/proc/self/task"))


def handoff(rank: int, world: int) -> dict[str, Any]:
    """What the ranks' handoff of a replayed collective costs the host, counted: the
    threads a group's link adds to the process, and the voluntary context switches (a
    thread blocking: in a poll, on a lock, in a sleep) of the whole process per replayed
    all_reduce, against the same graph without its collectives in the same run."""
    before = _threads()
    group = dist.new_group(list(range(world)))
    x = torch.ones(4).npu()
    dist.all_reduce(x, group=group)
    torch.npu.synchronize()
    added = _threads() - before
    k, replays = 16, 4
    stats = getattr(getattr(group, "link", None), "stats", None)  # the sim's ProcessGroupHCCL

    def per_task(collective: bool) -> tuple[float, int]:
        """Voluntary context switches per replayed task, and datagrams sent meanwhile."""
        y = torch.ones(4).npu()
        s = torch.npu.Stream()
        g = torch.npu.NPUGraph()
        with torch.npu.stream(s), torch.npu.graph(g, stream=s):
            for _ in range(k):
                if collective:
                    dist.all_reduce(y, group=group)
                else:
                    y.mul_(1.0)
        g.replay()  # the first replay sets up what later ones reuse
        torch.npu.synchronize()
        dist.barrier(group=group)
        sent = stats.sent if stats is not None else 0
        begin = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        for _ in range(replays):
            g.replay()
        torch.npu.synchronize()
        switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - begin
        return switches / (k * replays), (stats.sent if stats is not None else 0) - sent

    base, _ = per_task(False)
    switches, sent = per_task(True)
    return {"threads_added": added, "switches": switches, "switches_base": base,
            "sent": sent}  # fmt: skip


def perf_handoff(rank: int, world: int) -> dict[str, Any]:
    """Performance mode: a replayed graph of ``k`` x (a task, an all_reduce). Each
    replay's modelled time is at least the tasks' and the collectives' modelled costs in
    a row; the voluntary context switches per collective are counted (the stream waits
    in wall time only for the peers' parts, not for the tasks before each collective)."""
    old = npusim.configure()
    npusim.configure(mode="perf", task_us=50.0, collective_us=20.0)
    k, replays = 16, 4
    try:
        y = torch.ones(4).npu()
        s = torch.npu.Stream()
        g = torch.npu.NPUGraph()
        with torch.npu.stream(s), torch.npu.graph(g, stream=s):
            for _ in range(k):
                y.mul_(1.0)
                dist.all_reduce(y)
        with torch.npu.stream(s):
            g.replay()
        torch.npu.synchronize()
        dist.barrier()
        begin_ev, end_ev = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
        begin = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
        with torch.npu.stream(s):
            begin_ev.record()
            for _ in range(replays):
                g.replay()
            end_ev.record()
        end_ev.synchronize()
        switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - begin
        return {"switches": switches / (k * replays),
                "modelled_ms": begin_ev.elapsed_time(end_ev),
                "floor_ms": replays * k * (50.0 + 20.0) / 1000}  # fmt: skip
    finally:
        npusim.configure(mode=old.mode, task_us=old.task_us, collective_us=old.collective_us)


def async_wait(rank: int, world: int, wait: bool) -> dict[str, Any]:
    """An all_reduce issued on a side stream with async_op=True, then used on the default
    stream: ``work.wait()`` orders the use after it; without it the use races.

    The device is synchronized, not only ``y``'s stream: without the wait, ``y.cpu()``
    can finish before the side stream's collective has run (it waits for the other
    rank), so the race would be reported after this scenario, and ``x``, freed here
    while the collective still writes it, would be reused by the next scenario (its
    report then names that new tensor). Both accesses have run once the device is
    synchronized, so the race is reported here on every run, whatever the timing."""
    x = torch.full((4,), float(rank + 1)).npu()
    side = torch.npu.Stream()
    side.wait_stream(torch.npu.current_stream())
    with torch.npu.stream(side):
        work = dist.all_reduce(x, async_op=True)
    if wait:
        work.wait()
    y = x * 2
    try:
        torch.npu.synchronize()
        return {"y": y.cpu().tolist()}
    except HazardError as exc:
        return {"error": type(exc).__name__, "kind": exc.kind, "message": str(exc)}


def skip(rank: int, world: int) -> dict[str, Any]:
    """The last rank never joins the group's second all_reduce."""
    store = dist.distributed_c10d._get_default_store()
    x = torch.ones(2).npu()
    dist.all_reduce(x)
    if rank == world - 1:
        store.wait(["test/done"], timedelta(seconds=20))  # alive, but never joining
        return {"skipped": True}
    dist.all_reduce(x)
    try:
        torch.npu.synchronize()
        return {"error": None}
    except SimError as exc:
        return {"error": type(exc).__name__, "kind": getattr(exc, "kind", ""), "message": str(exc)}
    finally:
        store.add("test/reported", 1)
        if store.add("test/reported", 0) == world - 1:
            store.set("test/done", "1")


def race(rank: int, world: int, fenced: bool) -> dict[str, Any]:
    """A host copy into the captured all_reduce's buffer on another stream, ordered with
    the replay that reads it (``fenced``) or not."""
    x = torch.ones(4).npu()
    s, u = torch.npu.Stream(), torch.npu.Stream()
    g = torch.npu.NPUGraph()
    with torch.npu.stream(s):
        with torch.npu.graph(g, stream=s):
            dist.all_reduce(x)
        g.replay()
    try:
        with torch.npu.stream(u):
            if fenced:
                u.wait_stream(s)
            x.copy_(torch.full((4,), 5.0))  # unfenced: races the replay's collective
        torch.npu.synchronize()
        return {"error": None, "x": x.cpu().tolist()}
    except SimError as exc:
        return {"error": type(exc).__name__, "kind": getattr(exc, "kind", ""), "message": str(exc)}


def mismatch(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 all-reduces where the others broadcast: the same collective number."""
    x = torch.ones(2).npu()
    if rank == 0:
        dist.all_reduce(x)
    else:
        dist.broadcast(x, src=0)
    try:
        torch.npu.synchronize()
        return {"error": None}
    except SimError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}


def timed(rank: int, world: int) -> dict[str, Any]:
    """A replayed all_reduce in timed mode costs ``collective_us`` of modelled device time."""
    old = npusim.configure()
    npusim.configure(mode="timed", collective_us=50_000.0)
    try:
        x = torch.ones(4).npu()
        s = torch.npu.Stream()
        g = torch.npu.NPUGraph()
        with torch.npu.stream(s):
            with torch.npu.graph(g, stream=s):
                dist.all_reduce(x)
            begin, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
            begin.record()
            g.replay()
            end.record()
        end.synchronize()
        return {"elapsed_ms": begin.elapsed_time(end)}
    finally:
        npusim.configure(mode=old.mode, collective_us=old.collective_us)


def timed_bytes(rank: int, world: int) -> dict[str, Any]:
    """A replayed all_reduce costs its bytes over ``collective_gb_s`` on top of its latency:
    1 MB at 0.02 GB/s, 2(N-1)/N of it sent per rank, is 50 ms at two ranks."""
    old = npusim.configure()
    npusim.configure(mode="timed", collective_us=0.0, collective_gb_s=0.02)
    try:
        x = torch.ones(250_000).npu()  # 1 MB of float32
        s = torch.npu.Stream()
        g = torch.npu.NPUGraph()
        with torch.npu.stream(s):
            with torch.npu.graph(g, stream=s):
                dist.all_reduce(x)
            begin, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
            begin.record()
            g.replay()
            end.record()
        end.synchronize()
        return {"elapsed_ms": begin.elapsed_time(end)}
    finally:
        npusim.configure(mode=old.mode, collective_us=old.collective_us,
                         collective_gb_s=old.collective_gb_s)  # fmt: skip


SCENARIOS = {
    "timed_bytes": timed_bytes,
    "eager": eager,
    "pairs": pairs,
    "large": large,
    "row_parallel": row_parallel,
    "async_wait": lambda r, w: async_wait(r, w, True),
    "async_no_wait": lambda r, w: async_wait(r, w, False),
    "mismatch": mismatch,
    "store_calls": store_calls,
    "handoff": handoff,
    "perf_handoff": perf_handoff,
    "timed": timed,
    "skip": skip,
    "race": lambda r, w: race(r, w, False),
    "race_fenced": lambda r, w: race(r, w, True),
}


def main() -> None:
    scenarios, rank, world, init = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.npu.set_device(rank)
    dist.init_process_group("hccl", init_method=f"file://{init}", rank=rank, world_size=world)
    for scenario in scenarios.split(","):
        dist.barrier()
        result = SCENARIOS[scenario](rank, world)
        print(json.dumps({"scenario": scenario, "rank": rank, **result}), flush=True)
        if npusim.fault() is not None:
            npusim.reset_device()


if __name__ == "__main__":
    main()
