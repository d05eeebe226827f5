"""What the rest of the sim asks of device memory (:mod:`.memory`): a tensor's memory,
the uses that decide when freed memory may be reused, graph pools, and the
``torch.npu`` memory functions (``memory_allocated``, ``memory_stats``,
``mem_get_info``, ``empty_cache``, ...).
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .blocks import ALLOCATED, FREE, Block, PrivatePool, block_at, live_overlap
from .device import device_index
from .errors import HazardError
from .memory import LOCK, RELEASED, Allocation, device_memory, drain_locked, observe
from .memory_stats import reset_accumulated, reset_peak, stats_of
from .runtime import RUNTIME, Clock

_pool_handles = itertools.count(1)


def allocate(
    shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype, index: int, stream: Any
) -> tuple[torch.Tensor, Allocation | None]:
    """CPU memory for a device tensor allocated on ``stream`` (its graph's pool while it
    captures), and the handle its npu tensors hold; raises ``torch.OutOfMemoryError``."""
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))
    nbytes = 0 if 0 in shape else dtype.itemsize * span
    if nbytes == 0:
        return torch.empty_strided(shape, stride, dtype=dtype), None
    dm = device_memory(index)
    observed: list[Clock] = []
    with LOCK:
        drain_locked(observed)
        block = dm.malloc(nbytes, stream)
    if observed:
        observe(observed)
    return block.segment.tensor(block.ptr, block.size, shape, stride, dtype), Allocation(block)


def storage_of(alloc: Allocation) -> torch.UntypedStorage:
    """The allocation's bytes as a storage of their own (``untyped_storage()``)."""
    block = alloc.block
    seg = block.segment
    off = block.ptr - seg.base
    return seg.bytes.untyped_storage()[off : off + block.requested]


def note_uses(stream: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """Work just queued on ``stream`` uses these tensors: remember uses on a stream other
    than the allocation's (a free does not wait for them), and check the first use of
    memory reused while such a use was unordered with it. Performance mode checks no
    use after free: it remembers nothing."""
    if stream.capturing is not None or stream.updating is not None or RUNTIME.config.perf:
        return
    for v in (*args, *kwargs.values()):
        if isinstance(v, (list, tuple)):
            for e in v:
                alloc = getattr(e, "_alloc", None)
                if alloc is not None:
                    _use(stream, alloc.block)
            continue
        alloc = getattr(v, "_alloc", None)
        if alloc is not None:
            _use(stream, alloc.block)


def _use(stream: Any, block: Block) -> None:
    if block.stream is stream and not block.hazards:
        return
    entry = stream._last
    with LOCK:
        hazards = block.hazards
        block.hazards = None
        if block.stream is not stream and block.state == ALLOCATED:
            if block.uses is None:
                block.uses = {}
            block.uses[stream] = entry
    if hazards:
        stream.issue(FreeHazardCheck(hazards, entry.work.label, block.stream))


class FreeHazardCheck:
    """Queued after the first use of reused memory: reports when work of another stream
    that used the memory before its free is not ordered before this point."""

    def __init__(self, hazards: list[Any], label: str, owner: Any) -> None:
        self.hazards = hazards
        self.label = f"check of {label}"
        self.use = label
        self.owner = owner

    def run(self, ex: Any, launch: Any = None) -> None:
        with RUNTIME.cond:
            for _lo, _hi, s, e in self.hazards:
                if e.epoch != RUNTIME.epoch:
                    continue  # before a device reset: finished or dropped since
                tick = e.done_clock.get(s.actor) if e.done else None
                if tick is not None and ex.clock.get(s.actor, 0) >= tick:
                    continue
                RUNTIME.report(
                    HazardError(
                        f"use after free: {self.use} on {ex.name} uses memory that a tensor "
                        f"freed by the host was still used by {e.work.label} on {s.name}, "
                        "and that work is not ordered before this use: the allocator gave "
                        f"the memory back to {self.owner.name} at the free without waiting "
                        f"for {s.name}. Call tensor.record_stream(s) with s = {s.name} "
                        "before freeing a tensor used on a stream it was not allocated on "
                        f"(or make {self.owner.name} wait for {s.name} before the free)",
                        kind="use-after-free",
                    )
                )
                return


def record_stream(tensor: Any, stream: Any) -> None:
    """``tensor.record_stream(stream)`` (a sim stream, :mod:`.streamuse` checks it): the
    memory is not reused until the work queued on ``stream`` when the tensor is freed
    has run."""
    alloc = getattr(tensor, "_alloc", None)
    if alloc is None:
        return
    block = alloc.block
    with LOCK:
        if stream is not block.stream:
            if block.recorded is None:
                block.recorded = []
            if stream not in block.recorded:
                block.recorded.append(stream)


# ---------------------------------------------------------------- graph pools
def graph_pool_handle() -> tuple[int, int]:
    """``torch.npu.graph_pool_handle()``: an id for a pool that captures may share."""
    return (0, next(_pool_handles))


def capture_begin(graph: Any, pool: Any, stream: Any) -> Any:
    """Allocations on ``stream`` while it captures ``graph`` come from the pool ``pool``
    (a pool id; None: the graph's own). Returns the pool id (``NPUGraph.pool()``)."""
    pool_id = tuple(pool) if pool is not None else graph._pool
    dm = device_memory(stream.device_index)
    with LOCK:
        private = dm.private.get(pool_id)
        if private is None:
            private = dm.private[pool_id] = PrivatePool(pool_id, dm)
        private.use_count += 1
    graph._mempool = private
    graph._mempool_release = weakref.finalize(graph, _release, private)
    return pool_id


def _release(private: PrivatePool) -> None:
    RELEASED.append(private)  # may run inside the allocator (a graph collected by the GC)


Refs = dict[Block, tuple[int, int, int]]  # a block a task uses: (seq, ptr, size) then


def _refs_of(call: Any) -> Refs:
    """The allocations a call's tensors are in. Caller holds ``LOCK``."""
    refs: Refs = {}
    for v in (*call.args, *call.kwargs.values(), *(call.outs or ())):
        for t in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(t, torch.Tensor) and t.numel():
                b = block_at(t.data_ptr())
                if b is not None and b.state == ALLOCATED:
                    refs[b] = (b.seq, b.ptr, b.size)
    return refs


def _flatten(node_refs: dict[Any, Refs]) -> list[tuple[Block, int, int, int, bool]]:
    """Every allocation the tasks use, flagged True where only tasks of task groups use
    it: an update issued after a replay, which that replay waits for, may repoint them,
    so their check waits for the task to run (:func:`check_task_memory_locked`)."""
    fixed: Refs = {}
    patchable: Refs = {}
    for node, r in node_refs.items():
        (patchable if getattr(node, "group", None) is not None else fixed).update(r)
    out = [(b, *r, False) for b, r in fixed.items()]
    return out + [(b, *r, True) for b, r in patchable.items() if b not in fixed]


def capture_end(graph: Any) -> None:
    """Remember the allocations the captured work uses (what a replay checks), per task."""
    node_refs: dict[Any, Refs] = {}
    with LOCK:
        branches = getattr(graph, "branches", ())  # fork/join capture: side-stream nodes
        for node in (*graph.nodes, *(n for b in branches for n in b.nodes)):
            call = getattr(node, "call", None)
            if call is not None:
                node_refs[node] = _refs_of(call)
    graph._node_refs = node_refs
    graph._mem_refs = _flatten(node_refs)


def task_patched(graph: Any, node: Any, call: Any, moved: bool) -> None:
    """A patch of the task ``node`` of ``graph`` was issued with ``call``: the task uses
    the memory of its tensors from then on. They may be other tensors than the task's
    (``moved``), or the same addresses in memory freed and allocated again since (a
    capture's temporary block table whose memory the update's fresh one took): both
    make the task's allocations those of ``call``. As for captured tensors, nothing
    keeps them allocated; a task that runs after they were freed and their memory
    reused is reported. Caller holds RUNTIME.cond."""
    node_refs = getattr(graph, "_node_refs", None)
    if node_refs is None:
        return
    refs = node_refs.get(node)
    # The common case: the task's memory is where the capture found it. (A read of seq
    # and state without LOCK: a block freed meanwhile is found stale when the task runs,
    # whose check holds it.)
    if (not moved and refs is not None
            and all(b.seq == r[0] and b.state == ALLOCATED for b, r in refs.items())):  # fmt: skip
        return
    with LOCK:
        node_refs[node] = _refs_of(call)
    graph._mem_refs = _flatten(node_refs)


def replay_issued_locked(graph: Any, stream: Any) -> None:
    """A replay of ``graph`` was just queued on ``stream``: remember its uses of memory
    for the use-after-free checks, and check its memory was not freed and reused.
    Performance mode checks neither (a walk of every tensor the graph holds per
    replay, about 100 us for a 20-layer model). Caller holds RUNTIME.cond."""
    refs = getattr(graph, "_mem_refs", None)
    if not refs or RUNTIME.config.perf:
        return
    entry = stream._last
    own = getattr(graph, "_mempool", None)
    observed: list[Clock] = []
    with LOCK:
        drain_locked(observed)
        for block, seq, ptr, size, patchable in refs:
            if block.seq == seq and block.state == ALLOCATED:
                if block.stream is not stream:
                    if block.uses is None:
                        block.uses = {}
                    block.uses[stream] = entry
                continue
            if patchable or (own is not None and block.pool.owner is own):
                continue  # checked when its task runs; the graph's pool keeps it
            if _report_reuse(ptr, size, f"replay #{graph.replays} of {graph.name} on "
                             f"{stream.name}"):  # fmt: skip
                break
    observe(observed, runtime_locked=True)


def check_task_memory_locked(node: Any, what: str) -> None:
    """The task ``node`` of a task group starts (``what``: its replay and stream): report
    memory it uses that was freed and now belongs to another tensor. Caller holds
    RUNTIME.cond."""
    node_refs = getattr(node.group.graph, "_node_refs", None)
    refs = node_refs.get(node) if node_refs else None
    if not refs:
        return
    if all(b.seq == r[0] and b.state == ALLOCATED for b, r in refs.items()):
        return
    own = getattr(node.group.graph, "_mempool", None)
    with LOCK:
        for block, (seq, ptr, size) in refs.items():
            if block.seq == seq and block.state == ALLOCATED:
                continue
            if own is not None and block.pool.owner is own:
                continue
            if _report_reuse(ptr, size, f"{node.label} in {what}"):
                return


def _report_reuse(ptr: int, size: int, who: str) -> bool:
    """Report ``who``'s use of the freed memory at ``ptr`` if another tensor holds it now.
    Caller holds RUNTIME.cond and LOCK."""
    other = live_overlap(ptr, ptr + size)
    if other is None:
        return False
    RUNTIME.report(
        HazardError(
            f"use after free: {who} uses {size} bytes at {ptr:#x} of a tensor it captured "
            "or a task update passed, but that tensor was freed after the capture or update "
            f"and the memory now belongs to another tensor (allocated on "
            f"{other.stream.name}). A graph keeps alive only what its capture allocated: keep "
            "a reference to every tensor a captured graph or an update of its task groups "
            "uses (static inputs and outputs) for as long as the graph is replayed",
            kind="use-after-free",
        )
    )
    return True


def graph_reset(graph: Any) -> None:
    """``NPUGraph.reset()``: the graph no longer uses its pool (freed when unused)."""
    release = getattr(graph, "_mempool_release", None)
    if release is not None:
        release()
    graph._mempool = graph._mempool_release = graph._mem_refs = graph._node_refs = None


# ---------------------------------------------------------------- torch.npu functions
def _dm(device: Any) -> Any:
    return device_memory(device_index(device))


def _synced_stats(device: Any) -> dict[str, int]:
    dm = _dm(device)
    observed: list[Clock] = []
    with LOCK:
        drain_locked(observed)
        stats = stats_of(dm)
    observe(observed)
    return stats


def memory_stats(device: Any = None) -> dict[str, int]:
    """torch_npu's statistics, flat and sorted ("allocated_bytes.all.current", ...)."""
    return _synced_stats(device)


def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in _synced_stats(device).items():
        parts = key.split(".")
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = value
    return out


def memory_allocated(device: Any = None) -> int:
    return _synced_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device: Any = None) -> int:
    return _synced_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device: Any = None) -> int:
    return _synced_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device: Any = None) -> int:
    return _synced_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: Any = None) -> None:
    _synced_stats(device)
    with LOCK:
        reset_peak(_dm(device))


def reset_accumulated_memory_stats(device: Any = None) -> None:
    with LOCK:
        reset_accumulated(_dm(device))


def reset_max_memory_allocated(device: Any = None) -> None:
    warnings.warn(
        "torch_npu.npu.reset_max_memory_allocated now calls torch_npu.npu.reset_peak_memory_stats, "
        "which resets /all/ peak memory stats.",
        DeprecationWarning,
        stacklevel=2,
    )
    reset_peak_memory_stats(device)


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the simulated device: total is ``SimConfig.device_memory``,
    free what the allocator has not reserved."""
    dm = _dm(device)
    total = RUNTIME.config.device_memory
    return max(0, total - dm.reserved), total


def empty_cache() -> None:
    """Give the cached free segments back to the device (every device index)."""
    observed: list[Clock] = []
    with LOCK:
        drain_locked(observed)
        for i in range(RUNTIME.device_count):
            device_memory(i).release_cached()
    observe(observed)


def memory_snapshot(mempool_id: Any = None) -> list[dict[str, Any]]:
    """torch_npu's ``memory_snapshot``: the allocator's segments on every device, as
    ``torch.cuda.memory_snapshot`` lists them (``_npu_memorySnapshot(...)["segments"]``);
    with ``mempool_id`` only the segments of that graph pool. No allocation history is
    recorded, so ``frames`` are empty."""
    want = None if mempool_id is None else tuple(mempool_id)
    observed: list[Clock] = []
    out: list[dict[str, Any]] = []
    with LOCK:
        drain_locked(observed)
        for i in range(RUNTIME.device_count):
            dm = device_memory(i)
            pools = [((0, 0), dm.small), ((0, 0), dm.large)]
            for pid, private in dm.private.items():
                pools += [(tuple(pid), private.small), (tuple(pid), private.large)]
            for pid, pool in pools:
                if want is None or pid == want:
                    out += [_segment_dict(i, pid, pool.small, seg) for seg in pool.segments]
    observe(observed)
    return sorted(out, key=lambda s: (s["device"], s["address"]))


_STATES = {ALLOCATED: "active_allocated", FREE: "inactive"}


def _segment_dict(device: int, pool_id: tuple[int, ...], small: bool, seg: Any) -> dict[str, Any]:
    blocks, b = [], seg.head
    while b is not None:
        state = _STATES.get(b.state, "active_pending_free")
        blocks.append({"address": b.ptr, "size": b.size, "state": state, "frames": [],
                       "requested_size": b.requested if b.state == ALLOCATED else 0})  # fmt: skip
        b = b.next
    stream = seg.head.stream if seg.head is not None else None
    allocated = sum(x["size"] for x in blocks if x["state"] == "active_allocated")
    return {
        "device": device,
        "address": seg.base,
        "total_size": seg.size,
        "allocated_size": allocated,
        "active_size": sum(x["size"] for x in blocks if x["state"] != "inactive"),
        "requested_size": sum(x["requested_size"] for x in blocks),
        "stream": getattr(stream, "npu_stream", 0),
        "segment_type": "small" if small else "large",
        "segment_pool_id": pool_id,
        "is_expandable": False,
        "frames": [],
        "blocks": blocks,
    }
