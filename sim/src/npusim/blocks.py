"""The pieces the simulated device memory is cut into (:mod:`.memory` cuts them).

A :class:`Segment` is one reservation from the device, a CPU buffer; its blocks
(:class:`Block`), in address order, are each allocated, pending (freed, waiting
for ``record_stream`` work), free (cached for a stream) or merged away. A
:class:`BlockPool` caches the free blocks of one size class per stream, a
:class:`PrivatePool` is a graph's pair of them; :func:`block_at` finds the block
at a device address through the index of segments by address.
"""

from __future__ import annotations

import bisect
from typing import Any, Protocol

import torch

from .runtime import Clock


class DeviceMemory(Protocol):
    """The device memory a pool's blocks go back to (:class:`.memory.DeviceMemory`,
    which cuts them)."""

    def free(self, block: Block, observed: list[Clock]) -> None: ...

ALLOCATED, PENDING, FREE, DEAD = 0, 1, 2, 3


class Segment:
    """One reservation from the device: a CPU buffer cut into blocks."""

    __slots__ = ("base", "bytes", "head", "pool", "size", "storage")

    def __init__(self, size: int, pool: BlockPool) -> None:
        self.bytes = torch.empty(size, dtype=torch.uint8)
        self.base = self.bytes.data_ptr()
        self.size = size
        self.pool = pool
        self.head: Block | None = None
        self.storage = self.bytes.untyped_storage()

    def tensor(
        self, ptr: int, size: int, shape: Any, stride: Any, dtype: torch.dtype
    ) -> torch.Tensor:
        """A CPU tensor over the ``size`` bytes of the segment at ``ptr``, on a storage of
        their own (a slice of the segment's): its ``untyped_storage()`` is the block, so
        what keys memory by storage (the sim's access tracking) sees one allocation, not
        the whole segment."""
        off = ptr - self.base
        block = self.storage[off : off + size]
        return torch.empty(0, dtype=dtype).set_(block, 0, shape, stride)


class Block:
    """A piece of a segment, allocated or cached free for ``stream``."""

    __slots__ = (
        "events", "hazards", "next", "pool", "prev", "ptr", "recorded", "requested",
        "segment", "seq", "size", "state", "stream", "uses",
    )  # fmt: skip

    def __init__(self, segment: Segment, ptr: int, size: int, stream: Any) -> None:
        self.segment, self.ptr, self.size, self.stream = segment, ptr, size, stream
        self.pool = segment.pool
        self.prev: Block | None = None
        self.next: Block | None = None
        self.state = FREE
        self.seq = 0  # which allocation holds it (changes at every allocation)
        self.requested = 0
        self.uses: dict[Any, Any] | None = None  # other stream -> its latest entry using it
        self.recorded: list[Any] | None = None  # record_stream streams
        self.events: list[Any] | None = None  # their latest entries at the free
        self.hazards: list[tuple[int, int, Any, Any]] | None = None  # (lo, hi, stream, entry)


class BlockPool:
    """Cached free blocks of one size class, per stream: exact-size bins, sizes sorted."""

    def __init__(self, small: bool, device: DeviceMemory, owner: PrivatePool | None) -> None:
        self.small = small
        self.device = device
        self.owner = owner
        self.bins: dict[Any, dict[int, list[Block]]] = {}
        self.sizes: dict[Any, list[int]] = {}
        self.segments: list[Segment] = []

    def insert(self, block: Block) -> None:
        block.state = FREE
        bins = self.bins.setdefault(block.stream, {})
        same = bins.get(block.size)
        if same is None:
            bins[block.size] = [block]
            bisect.insort(self.sizes.setdefault(block.stream, []), block.size)
        else:
            same.append(block)

    def remove(self, block: Block) -> None:
        bins = self.bins[block.stream]
        same = bins[block.size]
        same.remove(block)
        if not same:
            del bins[block.size]
            sizes = self.sizes[block.stream]
            del sizes[bisect.bisect_left(sizes, block.size)]

    def coalesce(self, stream: Any) -> bool:
        """Merge adjacent free blocks of ``stream`` (frees cache blocks as they are, so
        that the next allocation of the same size takes the same block at once; CUDA
        merges at every free, to the same effect). True if anything merged."""
        merged = False
        for seg in self.segments:
            b = seg.head
            while b is not None:
                nb = b.next
                if nb is not None and b.state == FREE and nb.state == FREE and b.stream is stream:
                    self.remove(b)
                    self.remove(nb)
                    b.size += nb.size
                    b.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = b
                    if nb.hazards:
                        b.hazards = (b.hazards or []) + nb.hazards
                    nb.state, nb.seq = DEAD, -1
                    self.insert(b)
                    merged = True
                    continue
                b = nb
        return merged

    def take(self, stream: Any, size: int) -> Block | None:
        """The smallest cached block of ``stream`` that fits (lowest address first)."""
        sizes = self.sizes.get(stream)
        if not sizes:
            return None
        i = bisect.bisect_left(sizes, size)
        if i == len(sizes):
            return None
        same = self.bins[stream][sizes[i]]
        block = same[0] if len(same) == 1 else min(same, key=_ptr)
        self.remove(block)
        return block


def _ptr(b: Block) -> int:
    return b.ptr


class PrivatePool:
    """A graph's private memory pool (one per pool id, shared through ``pool=``)."""

    def __init__(self, pool_id: Any, device: DeviceMemory) -> None:
        self.id = pool_id
        self.use_count = 0
        self.small = BlockPool(True, device, self)
        self.large = BlockPool(False, device, self)


# ---------------------------------------------------------------- segments by address
_BASES: list[int] = []
_SEGMENTS: dict[int, Segment] = {}


def add_segment(seg: Segment) -> None:
    bisect.insort(_BASES, seg.base)
    _SEGMENTS[seg.base] = seg


def drop_segment(seg: Segment) -> None:
    del _BASES[bisect.bisect_left(_BASES, seg.base)]
    del _SEGMENTS[seg.base]


def block_at(ptr: int) -> Block | None:
    """The block (allocated or free) holding device address ``ptr``."""
    i = bisect.bisect_right(_BASES, ptr) - 1
    if i < 0:
        return None
    seg = _SEGMENTS[_BASES[i]]
    if ptr >= seg.base + seg.size:
        return None
    b = seg.head
    while b is not None and not (b.ptr <= ptr < b.ptr + b.size):
        b = b.next
    return b


def live_overlap(lo: int, hi: int) -> Block | None:
    ptr = lo
    while ptr < hi:
        b = block_at(ptr)
        if b is None:
            return None
        if b.state in (ALLOCATED, PENDING):
            return b
        ptr = b.ptr + b.size
    return None
