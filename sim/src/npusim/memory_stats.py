"""torch's memory statistics of a simulated device (:mod:`.memory` keeps the counts)."""

from __future__ import annotations

from .blocks import FREE, BlockPool
from .memory import ALLOC_STATS, METRICS, POOLS, DeviceMemory


def stats_of(dm: DeviceMemory) -> dict[str, int]:
    """torch's memory_stats of one device. Caller holds ``LOCK``."""
    split = [[0, 0] for _ in POOLS]  # inactive split blocks: scanned, not tracked
    for pool in (dm.small, dm.large, *_private_pools(dm)):
        for seg in pool.segments:
            b, run = seg.head, 0  # a run of free blocks is one (merged) block
            while b is not None:
                if b.state == FREE:
                    run += b.size
                if run and (b.next is None or b.next.state != FREE):
                    if run < seg.size:
                        for i in (0, 1 if pool.small else 2):
                            split[i][0] += 1
                            split[i][1] += run
                    run = 0
                b = b.next
    for name, k in (("inactive_split", 0), ("inactive_split_bytes", 1)):
        for i, arr in enumerate(dm.stats[name]):
            arr[0] = split[i][k]
            arr[1] = max(arr[1], arr[0])
    for k, name in enumerate(ALLOC_STATS):
        for row, arr in enumerate(dm.stats[name]):
            pools = (0, 1) if row == 0 else (row - 1,)
            arr[0] = sum(dm.cur[i][k] for i in pools)
            arr[1] = dm.peak[2 if row == 0 else row - 1][k]
            arr[2] = sum(dm.cum[i][k] for i in pools)
            arr[3] = sum(dm.freed[i][k] for i in pools)
    out: dict[str, int] = {}
    for name, arrays in dm.stats.items():
        for pool_name, arr in zip(POOLS, arrays, strict=True):
            for metric, value in zip(METRICS, arr, strict=True):
                out[f"{name}.{pool_name}.{metric}"] = value
    out.update(dm.counters)
    out["num_sync_all_streams"] = 0
    out["max_split_size"] = -1
    for name in ("oversize_allocations", "oversize_segments"):
        for metric in METRICS:
            out[f"{name}.{metric}"] = 0
    return dict(sorted(out.items()))


def _private_pools(dm: DeviceMemory) -> list[BlockPool]:
    return [bp for p in dm.private.values() for bp in (p.small, p.large)]


def reset_peak(dm: DeviceMemory) -> None:
    for arrays in dm.stats.values():
        for arr in arrays:
            arr[1] = arr[0]
    for i in range(2):
        dm.peak[i][:] = dm.cur[i]
    dm.peak[2][:] = [a + b for a, b in zip(dm.cur[0], dm.cur[1], strict=True)]


def reset_accumulated(dm: DeviceMemory) -> None:
    for arrays in dm.stats.values():
        for arr in arrays:
            arr[2] = arr[3] = 0
    for i in range(2):
        dm.cum[i][:] = dm.freed[i][:] = [0] * 5
    for k in ("num_alloc_retries", "num_ooms"):
        dm.counters[k] = 0
