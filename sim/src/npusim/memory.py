"""Device memory of the simulated NPU: torch_npu's caching allocator, with graph pools.

Device memory is cut from *segments*, CPU buffers reserved from a simulated device
of ``SimConfig.device_memory`` bytes, as torch_npu's NPUCachingAllocator (CUDA's)
cuts blocks from ``aclrtMalloc`` segments: sizes round up to 512 bytes; requests up
to 1 MiB share 2 MiB segments, up to 10 MiB 20 MiB segments, larger ones get their
own (rounded to 2 MiB); the smallest cached block that fits is split. (Segments,
blocks and the pools that cache free ones are in :mod:`.blocks`.)

- A freed block is cached for the stream it was allocated on and goes to the next
  allocation on that stream that fits, so addresses are reused and a reallocated
  tensor holds the old one's bytes. A block is freed when the last npu tensor
  viewing it goes away (:class:`Allocation`), even if queued work still uses it,
  as on the device: ``tensor.record_stream(s)`` holds it back until the work
  queued on ``s`` at the free has run.
- Allocations on a stream that captures a graph come from the graph's private
  pool (``torch.npu.graph(g, pool=...)`` shares one; :func:`graph_pool_handle`),
  whose memory only captures into that pool reuse until every graph using it is
  reset or gone: a capture temporary freed during the capture is reused by later
  allocations of the capture, and graphs sharing a pool alias each other's
  temporaries (replaying them out of capture order overwrites, as on hardware).
- Each segment's bytes are one CPU storage; each allocation gets its own storage
  object over its bytes, so ``untyped_storage()`` is the allocation's.

Reported (``HazardError``, kind "use-after-free"): a block freed while work queued
on another stream still used it, whose next owner's first use is not ordered
after that work (missing ``record_stream``); a graph replay that reads a tensor
freed since the capture whose memory another live tensor now holds.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Any

import torch

from .blocks import (
    ALLOCATED,
    DEAD,
    FREE,
    PENDING,
    Block,
    BlockPool,
    PrivatePool,
    Segment,
    add_segment,
    drop_segment,
)
from .runtime import RUNTIME, Clock

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20

LOCK = threading.Lock()  # never taken before RUNTIME.cond by the same thread
_FREED: deque[Block] = deque()  # blocks whose last tensor went away, not yet processed
RELEASED: deque[PrivatePool] = deque()  # pools a graph stopped using, not yet processed
_seqs = itertools.count(1)


class Allocation:
    """What npu tensors (a tensor and its views) hold of their memory: when the last
    one goes away, the block is freed (processed at the next allocator call)."""

    __slots__ = ("__weakref__", "block")

    def __init__(self, block: Block) -> None:
        self.block = block

    def __del__(self, _freed: deque[Block] = _FREED) -> None:  # bound: survives exit
        block = self.block
        if block.recorded:  # the "events" record_stream's free inserts on those streams
            block.events = [s._last for s in block.recorded]
        _freed.append(block)


_STATS = (
    "allocated", "allocated_bytes", "requested_bytes", "active", "active_bytes",
    "segment", "reserved_bytes", "inactive_split", "inactive_split_bytes",
)  # fmt: skip
ALLOC_STATS = ("allocated", "allocated_bytes", "requested_bytes", "active", "active_bytes")
POOLS = ("all", "small_pool", "large_pool")
METRICS = ("current", "peak", "allocated", "freed")


def _bump(stat: list[list[int]], small: bool, amount: int) -> None:
    for arr in (stat[0], stat[1 if small else 2]):
        arr[0] += amount
        if amount > 0:
            arr[2] += amount
            if arr[0] > arr[1]:
                arr[1] = arr[0]
        else:
            arr[3] -= amount


class DeviceMemory:
    """The allocator state of one device."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.small = BlockPool(True, self, None)
        self.large = BlockPool(False, self, None)
        self.private: dict[Any, PrivatePool] = {}
        self.deferred: list[Block] = []  # freed, waiting for record_stream work
        self.reserved = 0
        self.stats = {k: [[0, 0, 0, 0] for _ in POOLS] for k in _STATS}
        # The allocation statistics (ALLOC_STATS), kept apart as they change at every
        # malloc and free: current, allocated and freed of the small and large pools,
        # peaks of small, large and all.
        self.cur = [[0] * 5 for _ in range(2)]
        self.cum = [[0] * 5 for _ in range(2)]
        self.freed = [[0] * 5 for _ in range(2)]
        self.peak = [[0] * 5 for _ in range(3)]
        self.counters = dict.fromkeys(
            ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free"), 0
        )

    # ------------------------------------------------------------ malloc / free
    def malloc(self, nbytes: int, stream: Any) -> Block:
        """A block of at least ``nbytes`` for ``stream``. Caller holds ``LOCK``."""
        size = max(MIN_BLOCK, (nbytes + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK)
        small = size <= SMALL_SIZE
        cap = stream.capturing
        owner = _graph_pool(cap.graph) if cap is not None else None
        if owner is not None:
            pool = owner.small if small else owner.large
        else:
            pool = self.small if small else self.large
        block = pool.take(stream, size)
        if block is None and pool.coalesce(stream):
            block = pool.take(stream, size)
        if block is None:
            block = self._reserve(pool, stream, size, nbytes)
        rest = block.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            self._split(block, size)
        block.state = ALLOCATED
        block.seq = next(_seqs)
        block.requested = nbytes
        i = 0 if small else 1
        size = block.size
        c, a = self.cur[i], self.cum[i]
        c[0] += 1
        c[1] += size
        c[2] += nbytes
        c[3] += 1
        c[4] += size
        a[0] += 1
        a[1] += size
        a[2] += nbytes
        a[3] += 1
        a[4] += size
        peak, other, peak_all = self.peak[i], self.cur[1 - i], self.peak[2]
        for k in range(5):
            v = c[k]
            if v > peak[k]:
                peak[k] = v
            v += other[k]
            if v > peak_all[k]:
                peak_all[k] = v
        return block

    def _count_free(self, block: Block, allocated: bool, active: bool) -> None:
        i = 0 if block.pool.small else 1
        c, f, size = self.cur[i], self.freed[i], block.size
        if allocated:
            c[0] -= 1
            c[1] -= size
            c[2] -= block.requested
            f[0] += 1
            f[1] += size
            f[2] += block.requested
        if active:
            c[3] -= 1
            c[4] -= size
            f[3] += 1
            f[4] += size

    def _split(self, block: Block, size: int) -> None:
        rest = Block(block.segment, block.ptr + size, block.size - size, block.stream)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        if block.hazards:
            rest.hazards = _clip(block.hazards, rest.ptr, rest.ptr + rest.size)
            block.hazards = _clip(block.hazards, block.ptr, block.ptr + size)
        rest.pool.insert(rest)

    def _reserve(self, pool: BlockPool, stream: Any, size: int, nbytes: int) -> Block:
        """A new segment for ``size`` bytes: frees cached segments and retries when the
        device is full, then raises the NPU's out-of-memory error."""
        if size <= SMALL_SIZE:
            seg_size = SMALL_BUFFER
        elif size < MIN_LARGE_ALLOC:
            seg_size = LARGE_BUFFER
        else:
            seg_size = (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE
        total = RUNTIME.config.device_memory
        if self.reserved + seg_size > total:
            self.counters["num_alloc_retries"] += 1
            self.release_cached()
            if self.reserved + seg_size > total:
                self.counters["num_ooms"] += 1
                raise torch.OutOfMemoryError(self._oom_message(nbytes, total))
        seg = Segment(seg_size, pool)
        seg.head = block = Block(seg, seg.base, seg_size, stream)
        pool.segments.append(seg)
        add_segment(seg)
        self.reserved += seg_size
        self.counters["num_device_alloc"] += 1
        _bump(self.stats["segment"], pool.small, 1)
        _bump(self.stats["reserved_bytes"], pool.small, seg_size)
        return block

    def _oom_message(self, nbytes: int, total: int) -> str:
        allocated = self.cur[0][1] + self.cur[1][1]
        active = self.cur[0][4] + self.cur[1][4]
        return (
            f"NPU out of memory. Tried to allocate {format_size(nbytes)} (NPU {self.index}; "
            f"{format_size(total)} total capacity; {format_size(allocated)} already "
            f"allocated; {format_size(active)} current active; "
            f"{format_size(total - self.reserved)} free; {format_size(self.reserved)} reserved "
            "in total by PyTorch) If reserved memory is >> allocated memory try setting "
            "max_split_size_mb to avoid fragmentation."
        )

    def free(self, block: Block, observed: list[Clock]) -> None:
        """Free an allocated block. Caller holds ``LOCK``; ``observed`` collects the
        clocks of record_stream work the allocator saw complete (host observations)."""
        uses, recorded = block.uses, block.recorded
        if uses:
            lo, hi, covered = block.ptr, block.ptr + block.size, recorded or ()
            new = [(lo, hi, s, e) for s, e in uses.items() if s not in covered]
            block.hazards = (block.hazards or []) + new or None
        block.uses = block.recorded = None
        if block.events:
            self._count_free(block, True, False)
            block.state = PENDING
            self.deferred.append(block)
            self.process_events(observed)
            return
        self._count_free(block, True, True)
        block.pool.insert(block)  # coalesced with its free neighbours when needed

    def _cache(self, block: Block) -> None:
        """A deferred block whose record_stream work ran: cached like any free block."""
        self._count_free(block, False, True)
        block.pool.insert(block)

    def process_events(self, observed: list[Clock]) -> None:
        """Cache the deferred blocks whose record_stream work has run (the allocator's
        event queries: each one that completed is a host observation of that work)."""
        still = []
        for block in self.deferred:
            events = block.events or []
            if all(e is None or e.done for e in events):
                observed.extend(e.done_clock for e in events if e is not None)
                block.events = None
                self._cache(block)
            else:
                still.append(block)
        self.deferred = still

    def release_cached(self) -> None:
        """Give every segment with no allocated block back to the device (empty_cache)."""
        pools = [self.small, self.large]
        for p in self.private.values():
            if p.use_count == 0:
                pools += [p.small, p.large]
        for pool in pools:
            for stream in list(pool.bins):
                pool.coalesce(stream)
            keep = []
            for seg in pool.segments:
                head = seg.head
                if head is not None and head.state == FREE and head.next is None:
                    pool.remove(head)
                    head.state, head.seq = DEAD, -1
                    drop_segment(seg)
                    self.reserved -= seg.size
                    self.counters["num_device_free"] += 1
                    _bump(self.stats["segment"], pool.small, -1)
                    _bump(self.stats["reserved_bytes"], pool.small, -seg.size)
                else:
                    keep.append(seg)
            pool.segments = keep
        for pool_id in [k for k, p in self.private.items() if p.use_count == 0]:
            p = self.private[pool_id]
            if not (p.small.segments or p.large.segments):
                del self.private[pool_id]


def _clip(hazards: list[Any], lo: int, hi: int) -> list[Any] | None:
    return [h for h in hazards if h[0] < hi and lo < h[1]] or None


def format_size(n: int) -> str:
    """torch_npu's format_size (its out-of-memory message)."""
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1 << 20:
        return f"{n / 1024:.2f} KiB"
    if n <= 1 << 30:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / (1 << 30):.2f} GiB"


# ---------------------------------------------------------------- process-wide state
_DEVICES: dict[int, DeviceMemory] = {}


def device_memory(index: int) -> DeviceMemory:
    dm = _DEVICES.get(index)
    if dm is None:  # setdefault is atomic: no lock (callers may hold LOCK)
        dm = _DEVICES.setdefault(index, DeviceMemory(index))
    return dm


def drain_locked(observed: list[Clock]) -> None:
    """Process the frees since the last call, then deferred frees. Caller holds ``LOCK``."""
    while RELEASED:
        RELEASED.popleft().use_count -= 1
    while _FREED:
        block = _FREED.popleft()
        block.pool.device.free(block, observed)
    for dm in _DEVICES.values():
        if dm.deferred:
            dm.process_events(observed)


def observe(observed: list[Clock], runtime_locked: bool = False) -> None:
    """Publish the completions the allocator observed (its event queries)."""
    if not observed:
        return
    if runtime_locked:
        for c in observed:
            RUNTIME.host_join(c)
        return
    with RUNTIME.cond:
        for c in observed:
            RUNTIME.host_join(c)


def _graph_pool(graph: Any) -> PrivatePool | None:
    pool: PrivatePool | None = getattr(graph, "_mempool", None)
    return pool
