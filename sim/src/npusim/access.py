"""Happens-before over every device memory access of the simulated NPU.

Every device op, eager or a task of a replayed graph, and every host read or copy
(they run on a stream, as on the NPU) declares its *footprint*: per device tensor
argument, the storage, the byte range and whether it writes. When a stream runs the
op it checks the footprint against what other streams did to those bytes: two
accesses that overlap, at least one of them a write, and that are not ordered by
happens-before (the vector clocks of :mod:`.runtime`) are a race, reported as a
``HazardError`` that names both accesses and the fence that would order them.

Granularity: storage *byte ranges*. A view covers the bytes from its first to its
last element (a strided view counts the gaps between its elements too), so disjoint
slices of one buffer (layer l of a per-layer input, rows 0..b of a batch buffer) are
separate: a pipeline that refills layer l+1 while a replay reads layer l is correct and
runs clean. Storage is keyed by its base address; an allocation of the sim forgets what
was recorded at its address (the memory is new), so plain CPU allocator address reuse
never pairs a new tensor with a dead one.

Deciding, not timing: each access is recorded with its stream and that stream's own
clock entry at the access (an *epoch*, as in FastTrack); a later access is ordered
after it iff its clock has seen that epoch. Whichever of two unordered accesses runs
second finds the first one's record, so an unordered pair is reported on every run,
whatever the interleaving, and the message names them in issue order. Records that
a later access makes redundant (same bytes, ordered before it, a write covering
anything, a read covering reads) are dropped, so a buffer used the same way every
step keeps one or two records and a check costs a dict lookup and an integer
comparison per argument.

Reads by many streams are never a race; write-read, read-write and write-write pairs
are, unless ordered.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .errors import HazardError
from .runtime import RUNTIME

if TYPE_CHECKING:
    from .opcall import OpCall
    from .streams import Stream

#: One device tensor argument of an op: (storage key, first byte, end byte, writes?,
#: argument name, the tensor).
Item = tuple[int, int, int, bool, str, torch.Tensor]
Footprint = tuple[Item, ...]
#: Who accessed: (issue number, the op's label or (task label, launch), the stream).
Desc = tuple[int, Any, "Stream"]

#: Issue order of device work that accesses memory (messages name a pair in it).
ISSUED = itertools.count(1)

#: Records a storage may hold before same-stream records are merged (conservatively).
LIMIT = 32


class Accesses:
    """What was recorded on one storage (``recs``, see below), valid in device epoch
    ``gen`` (a device reset forgets them); ``last``: the stream that checked it last."""

    __slots__ = ("gen", "last", "nbytes", "recs", "ref", "v")

    def __init__(self, t: torch.Tensor) -> None:
        self.gen = -1
        self.last = 0
        self.v = 0  # bumped when ``recs`` change other than by an epoch refresh
        self.recs: list[list[Any]] = []
        self.nbytes = t.untyped_storage().nbytes()
        root = t._base if t._base is not None else t
        self.ref = weakref.ref(root)


_STATE: dict[int, Accesses] = {}
_prune_at = 4096


def fresh(t: torch.Tensor) -> None:
    """``t`` was just allocated: its memory holds no history (on the CPU the address
    may be a freed tensor's)."""
    _STATE.pop(t.data_ptr(), None)


def _holder(key: int, t: torch.Tensor) -> Accesses:
    global _prune_at
    h = _STATE[key] = Accesses(t)
    # Forget storages whose first-seen tensor (the allocation, which its views keep
    # alive) is gone. A storage kept alive only by an alias that is not a view of it
    # (``detach()``, a tensor rebuilt from its storage) loses its history here: a
    # missed race at worst, never a false one.
    if len(_STATE) > _prune_at:
        for k, v in list(_STATE.items()):
            if v.ref() is None and v is not h:
                _STATE.pop(k, None)
        _prune_at = max(4096, 2 * len(_STATE))
    return h


# ---------------------------------------------------------------- footprints
def item(t: torch.Tensor, write: bool, name: str) -> Item | None:
    """The bytes ``t`` (a CPU tensor viewing device memory) covers; None when empty."""
    if not t.nbytes:
        return None
    lo = t.data_ptr()
    if t.is_contiguous():
        hi = lo + t.nbytes
    else:
        span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        hi = lo + span * t.element_size()
    return (t.untyped_storage().data_ptr(), lo, hi, write, name, t)


_SCHEMAS: dict[Any, tuple[tuple[str, ...], frozenset[str]]] = {}


def _schema(op: Any) -> tuple[tuple[str, ...], frozenset[str]]:
    """(argument names, names of the arguments the op writes) of ``op``'s schema."""
    info = _SCHEMAS.get(op)
    if info is None:
        schema = getattr(op, "_schema", None)
        arguments = list(schema.arguments) if schema is not None else []
        info = _SCHEMAS[op] = (
            tuple(a.name for a in arguments),
            frozenset(
                a.name
                for a in arguments
                if a.alias_info is not None and a.alias_info.is_write
            ),
        )
    return info


def _arg(
    items: list[Item], name: str, a: Any, write: bool, device_type: type | None, host: set[int]
) -> None:
    if isinstance(a, (list, tuple)):
        for j, e in enumerate(a):
            _arg(items, f"{name}[{j}]", e, write, device_type, host)
        return
    if device_type is not None:
        if type(a) is not device_type:
            return
        a = a._data  # type: ignore[attr-defined]  # the npu tensor's CPU view
    elif not isinstance(a, torch.Tensor) or id(a) in host:
        return
    it = item(a, write, name)
    if it is not None:
        items.append(it)


def _collect(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    outs: list[torch.Tensor] | None,
    device_type: type | None,
    host: set[int],
) -> Footprint:
    """Device tensors among ``args``/``kwargs``: instances of ``device_type`` (their
    ``_data``), or with ``device_type`` None every tensor whose id is not in ``host``."""
    names, written = _schema(op)
    items: list[Item] = []
    n = len(names)
    for i, a in enumerate(args):
        if a is not None and type(a) not in _SCALARS:
            name = names[i] if i < n else f"#{i}"
            _arg(items, name, a, name in written, device_type, host)
    for name, a in kwargs.items():
        if a is not None and type(a) not in _SCALARS:
            _arg(items, name, a, name in written, device_type, host)
    if outs:
        for j, t in enumerate(outs):
            it = item(t, True, "result" if len(outs) == 1 else f"result {j}")
            if it is not None:
                items.append(it)
    return tuple(items)


_SCALARS = {int, float, bool, str}


def of_op(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    outs: list[torch.Tensor] | None,
    device_type: type,
) -> Footprint:
    """The footprint of ``op`` called with ``args``/``kwargs`` as issued: its arguments
    of ``device_type`` (the npu tensor; host tensors are not device memory), written
    where the schema says ``Tensor(a!)``, and ``outs``, the results allocated for it."""
    return _collect(op, args, kwargs, outs, device_type, set())


def of_call(call: OpCall) -> Footprint:
    """The footprint of a call whose tensors are all device memory but ``call.host``."""
    return _collect(call.op, call.args, call.kwargs, call.outs, None, call.host)


# ---------------------------------------------------------------- work
class AccessWork:
    """An eager device op (or host read, or copy) whose footprint is checked when a
    stream runs it; ``footprint()`` is built there, off the host's issue path."""

    __slots__ = ("fn", "footprint", "label", "seq")

    def __init__(self, label: str, fn: Callable[[], Any], footprint: Callable[[], Footprint]):
        self.label = label
        self.fn = fn
        self.footprint = footprint
        self.seq = next(ISSUED)

    def run(self, ex: Stream) -> None:
        if RUNTIME.config.perf:  # performance mode keeps no clocks to check against
            ex.tick()
            self.fn()
            return
        fp = self.footprint()
        ex.tick()
        if fp:
            with RUNTIME.cond:
                epoch, gen = ex.clock[ex.actor], RUNTIME.epoch
                desc = (self.seq, self.label, ex)
                for it in fp:
                    touch(ex, epoch, gen, it, desc)
        self.fn()


class TaskAccess:
    """The footprint of a captured task (set at capture, replaced by a patch that names
    other tensors), with the records its last run on a stream made: a run on the same
    stream that finds their storages unchanged since only refreshes their epochs."""

    __slots__ = ("actor", "cache", "items")

    def __init__(self, items: Footprint) -> None:
        self.items = items
        self.actor = 0
        self.cache: list[tuple[Accesses, int, list[Any]]] = []

    def __bool__(self) -> bool:
        return bool(self.items)

    def touch_locked(self, ex: Stream, desc: Desc) -> None:
        """Stream ``ex`` runs the task now. Caller holds the runtime lock."""
        actor = ex.actor
        epoch, gen = ex.clock[actor], RUNTIME.epoch
        cache = self.cache
        if self.actor == actor:
            for i, (h, v, r) in enumerate(cache):
                if h.v == v and h.gen == gen:  # nobody else touched it since
                    it = self.items[i]
                    if it[3]:
                        r[3], r[4], r[5], r[7] = epoch, 0, desc, it[4]
                    else:
                        r[4], r[6], r[8] = epoch, desc, it[4]
                else:
                    h, r = touch(ex, epoch, gen, self.items[i], desc)
                    cache[i] = (h, h.v, r)
            return
        self.actor = actor
        self.cache = []
        for it in self.items:
            h, r = touch(ex, epoch, gen, it, desc)
            self.cache.append((h, h.v, r))


# ---------------------------------------------------------------- the check
# A record is a list [lo, hi, stream actor, write epoch, read epoch, write desc, read
# desc, write name, read name]: the latest write and the latest read of bytes lo..hi by
# one stream (an epoch of 0: none), so a stream that writes and reads a buffer every
# step keeps one record per range.
_W, _R = 3, 4


def touch(ex: Stream, epoch: int, gen: int, it: Item, desc: Desc) -> tuple[Accesses, list[Any]]:
    """Stream ``ex``, at its clock entry ``epoch``, accesses ``it`` now: report what that
    races with, record it; returns the storage's records and this access's record.
    Caller holds the runtime lock."""
    key, lo, hi, write, name, t = it
    actor = ex.actor
    h = _STATE.get(key)
    if h is None or h.gen != gen:
        if h is None:
            h = _holder(key, t)
        r = _new(lo, hi, actor, epoch, write, desc, name)
        h.gen, h.last, h.recs = gen, actor, [r]
        h.v += 1
        return h, r
    if h.last == actor:
        # This stream checked the storage last: every other stream's record was
        # ordered before it then (or reported), and still is (clocks only grow).
        for r in h.recs:
            if r[2] == actor and r[0] == lo and r[1] == hi:
                if write:
                    r[3], r[4], r[5], r[7] = epoch, 0, desc, name
                else:
                    r[4], r[6], r[8] = epoch, desc, name
                return h, r
    return h, _check(h, key, lo, hi, actor, epoch, write, desc, name, ex.clock)


def _new(lo: int, hi: int, actor: int, epoch: int, write: bool, desc: Desc, name: str) -> list[Any]:
    if write:
        return [lo, hi, actor, epoch, 0, desc, None, name, None]
    return [lo, hi, actor, 0, epoch, None, desc, None, name]


def _check(
    h: Accesses,
    key: int,
    lo: int,
    hi: int,
    actor: int,
    epoch: int,
    write: bool,
    desc: Desc,
    name: str,
    clock: dict[int, int],
) -> list[Any]:
    mine = None
    keep = []
    for r in h.recs:
        rlo, rhi = r[0], r[1]
        if rlo >= hi or lo >= rhi:
            keep.append(r)
            continue
        covered = lo <= rlo and rhi <= hi
        if r[2] == actor:  # program order
            if rlo == lo and rhi == hi:
                mine = r
            elif covered and (write or not r[_W]):
                continue
            keep.append(r)
            continue
        seen = clock.get(r[2], 0)
        w_ok, r_ok = seen >= r[_W], seen >= r[_R]
        if not w_ok:
            _report(h, key, r, _W, lo, hi, write, desc, name)
        elif write and not r_ok:
            _report(h, key, r, _R, lo, hi, write, desc, name)
        if covered and r_ok and ((write and w_ok) or not r[_W]):
            continue  # whatever races with it races with this access
        if covered and r_ok and not write:
            r[_R], r[6], r[8] = 0, None, None  # its read is covered by this one
        keep.append(r)
    if mine is None:
        mine = _new(lo, hi, actor, epoch, write, desc, name)
        keep.append(mine)
    elif write:
        mine[3], mine[4], mine[5], mine[7] = epoch, 0, desc, name
    else:
        mine[4], mine[6], mine[8] = epoch, desc, name
    if len(keep) > LIMIT:
        keep = _coarsen(keep)
        mine = next(r for r in keep if r[2] == actor)
    h.recs = keep
    h.last = actor
    h.v += 1
    return mine


def _coarsen(recs: list[list[Any]]) -> list[list[Any]]:
    """Merge each stream's records into one spanning them, at their latest epochs: never
    misses a race, may report an access ordered after an earlier record of the merged
    range (a storage used through more than LIMIT ranges at once)."""
    merged: dict[int, list[Any]] = {}
    for r in recs:
        m = merged.get(r[2])
        if m is None:
            merged[r[2]] = list(r)
            continue
        m[0], m[1] = min(m[0], r[0]), max(m[1], r[1])
        if r[_W] > m[_W]:
            m[_W], m[5], m[7] = r[_W], r[5], r[7]
        if r[_R] > m[_R]:
            m[_R], m[6], m[8] = r[_R], r[6], r[8]
    return list(merged.values())


# ---------------------------------------------------------------- the report
def _who(write: bool, desc: Desc, name: str) -> str:
    _, what, ex = desc
    kind = "write" if write else "read"
    if isinstance(what, tuple):
        label, launch = what
        return (
            f"the {kind} of `{name}` by {label} in replay #{launch.number} of "
            f"{launch.graph_name} on {ex.name}"
        )
    return f"the {kind} of `{name}` by {what} on {ex.name}"


def _op(desc: Desc) -> str:
    _, what, _ = desc
    if isinstance(what, tuple):
        label, launch = what
        return f"replay #{launch.number} of {launch.graph_name} ({label})"
    return str(what)


def _report(
    h: Accesses,
    key: int,
    r: list[Any],
    part: int,
    lo: int,
    hi: int,
    write: bool,
    desc: Desc,
    name: str,
) -> None:
    """Report the race of a record's write (``part`` _W) or read (_R) with an access."""
    old = (part == _W, r[5] if part == _W else r[6], r[7] if part == _W else r[8], r[0], r[1])
    new = (write, desc, name, lo, hi)
    first, second = (old, new) if old[1][0] <= new[1][0] else (new, old)
    a, b = first[1][2].name, second[1][2].name
    RUNTIME.report(
        HazardError(
            f"race on npu memory: {_who(*first[:3])} and {_who(*second[:3])} are not "
            f"ordered (storage {key:#x} of {h.nbytes} bytes, bytes {first[3] - key}.."
            f"{first[4] - key} and {second[3] - key}..{second[4] - key}); which runs first "
            "depends on timing, and so does what is read or kept. Order them: after issuing "
            f"{_op(first[1])} and before issuing {_op(second[1])}, make {b} wait for {a} "
            "(B.wait_stream(A), or an Event recorded on A and waited on B, with "
            f"A = {a} and B = {b}).",
            kind="race",
        )
    )
