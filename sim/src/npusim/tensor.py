"""The "npu" tensor: a PyTorch PrivateUse1 backend written in Python.

An ``NpuTensor`` is a wrapper subclass whose ``_data`` is a CPU tensor viewing
the device storage. Every op on npu tensors comes through :func:`dispatch`
(``__torch_dispatch__``), and factory ops naming ``device="npu"`` come through
the backend's PrivateUse1 kernels (:func:`backend_kernel`), so *any* torch op
behaves as on a device:

- view ops change metadata only and run on the host at once;
- allocations (``torch.empty``, ``empty_like``, ``empty_strided``, ``new_empty``)
  take memory at issue time and are never device work: inside a capture they
  record no task, inside a task group or an update they are no task of it;
- other ops are queued on the current stream (or recorded into the graph it
  captures, or turned into a task patch while it is between
  ``graph_task_update_begin/end``: :mod:`.routing`); their outputs are allocated
  at issue time (shapes from the op's meta kernel: :mod:`.opmeta`) and filled
  when the stream runs them;
- host reads (``.cpu()``, ``.item()``, ``torch.equal``, printing) queue the read
  on the current stream and wait for it, as a blocking device-to-host copy does;
  ``non_blocking`` copies do not wait. Ops whose output shape depends on the data
  (``nonzero``, ``unique``, a boolean mask) read it the same way. Both are refused
  on a stream that captures: the host cannot wait for a captured stream.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from . import access, capture_rules, rng
from .allocation import allocate, note_uses, storage_of
from .errors import SimError, SimUsageError
from .opcall import HOST_CHECKS, PATCHABLE_OPS, OpCall, flat, map_args, map_kwargs, map_value
from .opmeta import (
    aliased_result,
    check_meta,
    is_view,
    meta_like,
    returns_tensors,
    schema,
    written_args,
)
from .opsupport import ISSUE_CHECKS, UNSEEN, issue_check
from .routing import route
from .runtime import RUNTIME
from .streams import Stream, current_stream
from .streamuse import record_stream

aten = torch.ops.aten


class NpuTensor(torch.Tensor):
    """A tensor on the simulated NPU."""

    _data: torch.Tensor
    _alloc: Any  # memory.Allocation: the memory it views, freed with its last tensor
    __slots__ = ("_alloc", "_data")

    @staticmethod
    def __new__(cls, data: torch.Tensor, index: int = 0, alloc: Any = None) -> NpuTensor:
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=torch.device("npu", index),
            requires_grad=False,
        )
        r._data = data
        r._alloc = alloc
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        return dispatch(func, args, kwargs or {})

    def data_ptr(self) -> int:
        return self._data.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        """The storage the device memory is: the host storage it is simulated in (its
        ``data_ptr()`` and ``nbytes()`` are the device allocation's; its ``device`` is
        the CPU). The wrapper's own storage holds no memory, so torch's would refuse
        ``data_ptr()`` (torchair's ``get_tensor_metadata`` reads it)."""
        alloc = self._alloc
        if alloc is None:
            return self._data.untyped_storage()
        return storage_of(alloc)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """``Tensor.to``; ``x.to("cpu")`` and ``x.to("cpu", non_blocking=...)``, the copy
        back of every step's output, skip the dispatcher round trip to what its
        ``_to_copy`` ends in (:func:`_to_host`), unless a mode must see the op. What
        it buys: ``to(cpu)`` of ``python -m npusim.bench`` costs 1.26x as much through
        the dispatcher (sim/README.md)."""
        if (
            len(args) == 1
            and (not kwargs or kwargs.keys() == {"non_blocking"})
            and (args[0] == "cpu" if type(args[0]) is str else _is_cpu_device(args[0]))
            and not _modes_active()
        ):
            return _to_host(self, bool(kwargs.get("non_blocking", False)))
        return super().to(*args, **kwargs)

    def copy_(self, src: Any, non_blocking: bool = False) -> Any:
        """``Tensor.copy_``; in performance mode a copy from host memory skips the
        dispatcher round trip to :func:`_copy_` (on the NPU, ``aclrtMemcpyAsync`` is a
        C call of a few microseconds: the sim's own Python is what a step's eager input
        copies would otherwise cost the host)."""
        if (
            RUNTIME.config.perf
            and type(src) is torch.Tensor
            and not src.requires_grad
            and not _modes_active()
        ):
            return _copy_(None, (self, src, non_blocking), {})
        return super().copy_(src, non_blocking)

    def cpu(self, memory_format: Any = torch.preserve_format) -> torch.Tensor:
        """``Tensor.cpu``: a blocking copy to new host memory, as :meth:`to` makes it."""
        if _modes_active():
            return super().cpu(memory_format=memory_format)
        return _to_host(self, False)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        host = self.cpu()
        text = repr(host)
        return text[:-1] + f", device='{self.device}')"

    __str__ = __repr__

    def tolist(self) -> Any:
        return self.cpu().tolist()

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return self.item().__format__(spec)
        return repr(self)

    def __reduce_ex__(self, proto: Any) -> Any:
        raise TypeError("npu tensors cannot be pickled; move them to the CPU first")


def _modes_active() -> bool:
    """A dispatch or function mode is on: ops must go through the dispatcher to reach it."""
    return bool(torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled())


def _index(t: NpuTensor) -> int:
    return t.device.index or 0


# ---------------------------------------------------------------- conversions
def _unwrap(x: Any) -> Any:
    return x._data if isinstance(x, NpuTensor) else x


def _cpu_device(x: Any) -> Any:
    if isinstance(x, torch.device) and x.type == "npu":
        return torch.device("cpu")
    return x


def _first_npu(args: Any, kwargs: Any) -> NpuTensor | None:
    for x in flat(args, kwargs):
        if isinstance(x, NpuTensor):
            return x
    return None


# ---------------------------------------------------------------- dispatch
def dispatch(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], started: float | None = None
) -> Any:
    if started is None:
        started = time.perf_counter()
    special = _SPECIAL.get(func)
    if special is not None:
        return special(func, args, kwargs)
    first = _first_npu(args, kwargs)
    index = _index(first) if first is not None else 0
    if is_view(func):
        result = func(*map_args(_unwrap, args), **map_kwargs(_unwrap, kwargs))
        alloc = first._alloc if first is not None else None

        def wrap(r: Any) -> Any:
            return NpuTensor(r, index, alloc) if isinstance(r, torch.Tensor) else r

        if (
            first is not None
            and first.is_inference() != torch.is_inference_mode_enabled()
            and func is not aten.view.dtype  # torch's makes a tensor of the current mode
        ):
            # torch's rule: a view is an inference tensor if its base is, whatever the
            # mode (autograd gives a view of a normal tensor its base's version counter,
            # which an inference tensor cannot take). Only the wrapper is made here.
            with torch.inference_mode(first.is_inference()):
                return map_value(wrap, result)
        return map_value(wrap, result)
    stream = current_stream(index)
    if not returns_tensors(func) and schema(func).n_returns:
        return _host_read(stream, func, args, kwargs)
    return issue(stream, func, args, kwargs, index, started)


def issue(
    stream: Stream,
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    index: int,
    started: float | None = None,
) -> Any:
    """Queue, capture or patch one op on ``stream``; return its (future) result."""
    info = schema(func)
    # One pass, inline: most arguments are None, scalars or npu tensors.
    cpu_args = tuple(
        [
            a._data
            if type(a) is NpuTensor
            else (map_value(_unwrap, a) if isinstance(a, (list, tuple)) else a)
            for a in args
        ]
    )
    cpu_kwargs = map_kwargs(_unwrap_cpu, kwargs)
    outs: list[torch.Tensor] | None = None
    result: Any
    # what torch_npu on an A2 refuses of this op (:mod:`.opsupport`): one lookup per op
    support_check = ISSUE_CHECKS.get(func, UNSEEN)
    if support_check is not None:
        if support_check is UNSEEN:
            support_check = issue_check(func)
        if support_check is not None:
            support_check(stream, cpu_args, cpu_kwargs)
    host_check = HOST_CHECKS.get(func)
    if host_check is not None:
        meta = map_value(meta_like, host_check(*cpu_args, **cpu_kwargs))
    else:
        try:
            meta = check_meta(func, args, kwargs)
        except (NotImplementedError, RuntimeError) as exc:
            if not info.dynamic_shape or isinstance(exc, SimError):
                raise
            # Its output's shape depends on the data (nonzero, unique, a boolean mask):
            # no meta kernel can give it, the device must be read, as on the NPU.
            return _data_dependent(stream, func, args, kwargs, index)
    if info.written and info.aliased and written_args(func, args, kwargs):
        result = aliased_result(func, args, kwargs)
    else:
        allocated: list[torch.Tensor] = []

        def alloc(m: Any) -> Any:
            if not isinstance(m, torch.Tensor):
                return m
            t = _new_tensor(m.shape, m.stride(), m.dtype, index, stream)
            allocated.append(t._data)
            return t

        result = map_value(alloc, meta)
        outs = allocated
    host: set[int] = set()
    if func in PATCHABLE_OPS:
        # Host tensors (context_lens of paged attention) are parameters the dispatch
        # reads at issue time, as on the NPU: snapshot them, and let a patch change them.
        cpu_args, cpu_kwargs = (
            _snapshot_host(args, cpu_args),
            {k: _snapshot_host((kwargs[k],), (v,))[0] for k, v in cpu_kwargs.items()},
        )
        host = {id(t) for t in flat(cpu_args, cpu_kwargs) if getattr(t, "_sim_host", False)}
    call = OpCall(func, cpu_args, cpu_kwargs, outs, host)
    philox = None
    if info.random:  # its numbers: the generator's (seed, offset) now (:mod:`.rng`)
        philox = rng.default_generator(index).state.take(stream)
        call = rng.SeededCall(call, philox)
    footprint = None
    if stream.capturing is None and stream.updating is None and RUNTIME.config.perf:
        # Performance mode checks no eager op's accesses (AccessWork.run): none is
        # built. Run after the mode is left, such an op is not checked either.
        footprint = _NO_FOOTPRINT
    elif stream.updating is None:  # a patch touches no memory (its task's footprint holds)
        # Taken now, of the CPU views: queued work must not hold the npu tensors, whose
        # last reference frees their memory (as on the device, queued work or not).
        fp = access.of_op(func, args, kwargs, outs, NpuTensor)
        if philox is not None:  # a captured one reads its capture's seed and offset first
            fp = philox.footprint() + fp
        footprint = lambda: fp  # noqa: E731
    route(stream, call, func, started, footprint)
    note_uses(stream, args, kwargs)
    return result


def _NO_FOOTPRINT() -> access.Footprint:
    return ()


def _snapshot_host(orig: tuple[Any, ...], cpu: tuple[Any, ...]) -> tuple[Any, ...]:
    out = []
    for o, c in zip(orig, cpu, strict=True):
        if isinstance(o, torch.Tensor) and not isinstance(o, NpuTensor):
            c = c.clone()
            c._sim_host = True
        out.append(c)
    return tuple(out)


def _unwrap_cpu(v: Any) -> Any:
    return _cpu_device(_unwrap(v))


def _host_read(stream: Stream, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An op that gives the host a value computed from device data (``.item()``,
    ``torch.equal``): queued on ``stream`` and waited for."""
    _refuse_host_sync(stream, func, "reads device data on the host")
    cargs, ckwargs = map_args(_unwrap, args), map_kwargs(_unwrap, kwargs)
    result: list[Any] = []
    fp = access.of_op(func, args, kwargs, None, NpuTensor)  # see issue(): no npu tensors held
    footprint = lambda: fp  # noqa: E731
    stream.issue(
        access.AccessWork(
            f"host read {func}", lambda: result.append(func(*cargs, **ckwargs)), footprint
        )
    )
    stream.synchronize()
    return result[0]


def _refuse_host_sync(stream: Stream, func: Any, what: str) -> None:
    """A host read synchronizes ``stream``: refused while it captures, as on the NPU."""
    cap = stream.capturing
    if cap is None:
        return
    raise SimUsageError(
        f"{func} {what}, which waits for {stream.name} while it captures {cap.graph.name}: "
        "a captured stream cannot be synchronized (on the NPU torch_npu fails with CANN "
        "runtime error 107027, 'Not allow to synchronize captured-stream'). Run it before "
        "the capture, or compute it from data the host already has"
    )


def _data_dependent(
    stream: Stream, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], index: int
) -> Any:
    """An op whose output shape depends on the data (torch's ``dynamic_output_shape``
    tag: nonzero, unique, masked_select, indexing with a boolean mask, ...). As on the
    NPU the host waits for the data to learn the shape: the op runs on ``stream`` once
    the work before it ran, and its results are copied into new device memory of their
    shapes. Refused while ``stream`` captures (a host synchronization)."""
    _refuse_host_sync(stream, func, "has an output shape that depends on device data")
    if schema(func).written and written_args(func, args, kwargs):
        raise SimUsageError(
            f"{func} writes an output whose shape depends on device data: the simulated "
            "NPU cannot resize device tensors; use the op's functional form"
        )
    host = _host_read(stream, func, args, kwargs)

    def to_device(r: Any) -> Any:
        if not isinstance(r, torch.Tensor):
            return r
        out = _new_tensor(r.shape, _contiguous(r.shape), r.dtype, index, stream)
        # r is the host's own memory, written by nobody else: no staging, no wait (on
        # the NPU the result is device memory already: the copy is the sim's own)
        r._sim_pinned = True  # type: ignore[attr-defined]
        _cross_copy(stream, out._data, r, True, _H2D, write=True)
        return out

    result = map_value(to_device, host)
    note_uses(stream, args, kwargs)
    return result


# ---------------------------------------------------------------- copies
def _copy_(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    dst, src = args[0], args[1]
    non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
    if isinstance(dst, NpuTensor) and isinstance(src, NpuTensor):
        return issue(current_stream(_index(dst)), func, args, kwargs, _index(dst))
    if isinstance(dst, NpuTensor):  # host to device
        if src.device.type != "cpu":
            raise SimUsageError(f"copy to npu from {src.device} is not supported")
        stream = current_stream(_index(dst))
        staged = src
        if non_blocking and stream.capturing is None:
            staged = src.clone()  # pageable host memory is staged at issue time
        _cross_copy(stream, dst._data, staged, non_blocking, _H2D, write=True)
        note_uses(stream, (dst,), {})
        return dst
    stream = current_stream(_index(src))  # device to host
    _cross_copy(stream, dst, src._data, non_blocking, "copy npu->host", write=False)
    note_uses(stream, (src,), {})
    return dst


_H2D = "copy host->npu"


def _cross_copy(
    stream: Stream,
    dst: torch.Tensor,
    src: torch.Tensor,
    non_blocking: bool,
    label: str,
    *,
    write: bool,
) -> None:
    """A copy between host and device memory: queued, captured, and waited for if
    blocking. ``write``: it writes device memory (``dst``), else it reads it (``src``)."""
    if (non_blocking and RUNTIME.config.perf and stream.capturing is None
            and stream.updating is None and not capture_rules.LIVE):  # fmt: skip
        copy = _PerfCopy(dst, src, label)
        stream.issue(copy)
        if copy.now:  # its data, off the runtime lock (_PerfCopy)
            dst.copy_(src)
        return
    if stream.capturing is not None or capture_rules.LIVE:
        host = src if label == _H2D else dst
        capture_rules.check_host_copy(stream, label, non_blocking, host)
    if not non_blocking and stream.capturing is not None:
        raise SimUsageError(
            f"a blocking {label} on {stream.name} while it captures "
            f"{stream.capturing.graph.name}; capture non_blocking copies only"
        )
    call = OpCall(aten.copy_.default, (dst, src), {})
    call.label = label
    device = access.item(dst, True, "self") if write else access.item(src, False, "src")
    footprint: access.Footprint = (device,) if device is not None else ()
    route(stream, call, None, None, lambda: footprint)
    if not non_blocking:
        stream.synchronize()


class _PerfCopy:
    """Performance mode: an eager copy between host and device memory as one stream
    entry with no footprint to build or check (its correctness checks are off), run at
    its issue when the stream is idle, as a record is, or when only replays and
    records are queued before it (``run_early``: they touch no memory in this mode),
    so a step's input copies and its tokens' copy cost the stream's thread nothing.

    Run at its issue, the entry moves the stream's state under the runtime lock and
    marks itself ``now``; the issuing thread copies the data after the lock is released
    (:func:`_cross_copy`), before it returns to the program: torch's copy lets the
    interpreter lock go, and a thread that took the interpreter lock then would wait for
    the runtime lock, then for the interpreter lock again, behind Python the copy's
    thread runs on (an update thread's patch held up by another thread's input copy).
    Nothing can see the copy undone: work that reads it follows it in this thread's
    program order (a record after it, a read on the same stream), as on an NPU."""

    __slots__ = ("dst", "label", "now", "src")

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, label: str) -> None:
        self.dst, self.src, self.label = dst, src, label
        self.now = False

    def run(self, ex: Stream) -> None:
        ex.tick()
        self.dst.copy_(self.src)

    def run_now_locked(self, ex: Stream) -> bool:
        ex.tick()
        self.now = True
        return True

    def run_early(self) -> None:
        self.now = True


def _to_copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = args[0]
    device = kwargs.get("device")
    target = torch.device(device) if device is not None else x.device
    if target.type == "npu" and isinstance(x, NpuTensor):
        index = target.index if target.index is not None else _index(x)
        return issue(current_stream(index), func, args, kwargs, index)
    dtype = kwargs.get("dtype") or x.dtype
    non_blocking = bool(kwargs.get("non_blocking", False))
    if target.type == "npu":  # host to device
        index = target.index or 0
        out = _new_tensor(x.shape, _contiguous(x.shape), dtype, index, current_stream(index))
        _copy_(aten.copy_.default, (out, x, non_blocking), {})
        return out
    if target.type != "cpu":
        raise SimUsageError(f"copy from npu to {target} is not supported")
    if dtype == x.dtype:
        return _to_host(x, non_blocking)
    out_cpu = torch.empty(x.shape, dtype=dtype)
    out_cpu._sim_pinned = non_blocking  # type: ignore[attr-defined]  # as _to_host's
    _copy_(aten.copy_.default, (out_cpu, x, non_blocking), {})
    return out_cpu


def _is_cpu_device(d: Any) -> bool:
    return type(d) is torch.device and d.type == "cpu"


def _to_host(x: NpuTensor, non_blocking: bool) -> torch.Tensor:
    """A copy of ``x`` in new host memory: queued on the current stream, waited for
    unless ``non_blocking``."""
    out = torch.empty(x.shape, dtype=x.dtype)
    if non_blocking:  # torch's _to_copy pins the output of a non_blocking copy to the host
        out._sim_pinned = True  # type: ignore[attr-defined]
    stream = current_stream(_index(x))
    _cross_copy(stream, out, x._data, non_blocking, "copy npu->host", write=False)
    note_uses(stream, (x,), {})
    return out


def _resize_(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    t, size = args[0], list(args[1])
    if list(t.shape) != size:
        raise SimUsageError(
            f"resizing an npu tensor from {list(t.shape)} to {size} is not supported by the "
            "simulator; allocate the output with the right shape"
        )
    return t


def _allocate(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An allocation: memory now, no device work. On the NPU it comes from the caching
    allocator when the host asks, so inside a capture it is not a task of the graph
    (a replay does not re-allocate or overwrite it), inside a task group or an update
    it is not a task of the group, and its contents are undefined until written."""
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "npu":
        return func(*map_args(_unwrap, args), **map_kwargs(_unwrap, kwargs))
    if device is not None and torch.device(device).index is not None:
        index = torch.device(device).index
    else:
        first = _first_npu(args, kwargs)
        index = _index(first) if first is not None else 0
    m = check_meta(func, args, kwargs)
    return _new_tensor(m.shape, m.stride(), m.dtype, index, current_stream(index))


def _new_tensor(
    shape: Any, stride: Any, dtype: torch.dtype, index: int, stream: Stream
) -> NpuTensor:
    """A device tensor in new memory from the caching allocator (``stream``'s); the
    access history of whatever held that memory before is forgotten."""
    cpu, alloc = allocate(shape, stride, dtype, index, stream)
    access.fresh(cpu)
    return NpuTensor(cpu, index, alloc)


def _contiguous(shape: Any) -> tuple[int, ...]:
    strides, n = [], 1
    for d in reversed(tuple(shape)):
        strides.append(n)
        n *= max(d, 1)
    return tuple(reversed(strides))


_SPECIAL: dict[Any, Any] = {
    aten.copy_.default: _copy_,
    aten._to_copy.default: _to_copy,
    aten.resize_.default: _resize_,
    aten.record_stream.default: record_stream,
    aten.empty_like.default: _allocate,
    aten.new_empty.default: _allocate,
    aten.new_empty_strided.default: _allocate,
    aten.empty_strided.default: _allocate,
    aten.empty.memory_format: _allocate,
}


def register_host_op(func: Any, handler: Any) -> None:
    """An op that runs on the host at issue time, never on a stream (workspace-size and
    output-shape helpers: on the NPU they compute on the host and allocate)."""
    _SPECIAL[func] = handler


# ---------------------------------------------------------------- PrivateUse1 kernel
def backend_kernel(op: Any, *args: Any, **kwargs: Any) -> Any:
    """What the npu backend (the PrivateUse1 key) runs: ops that reach it without going
    through ``NpuTensor.__torch_dispatch__``.

    - Factories (no npu tensor argument, ``device="npu"``): ``torch.arange``,
      ``torch.eye``, ``torch.full``, ... An allocation takes memory; any other factory is
      one device op whose output has the shape its meta kernel gives (torch's own
      composites of ``arange`` or ``eye`` allocate an empty tensor and resize it in an
      ``out=`` op, which a device tensor of the sim cannot do).
    - Ops on npu tensors while torch keeps Python dispatch off: ``torch.tensor(data,
      device="npu")``, ``torch.as_tensor`` and ``Tensor.new_tensor`` copy their data to
      the device that way. They are dispatched as ``__torch_dispatch__`` would.
    """
    device = kwargs.get("device")  # the dispatcher passes a torch.device
    index = (device.index or 0) if isinstance(device, torch.device) else 0
    if op is aten.empty.memory_format or op is aten.empty_strided.default:  # the common case
        m = check_meta(op, args, kwargs)
        return _new_tensor(m.shape, m.stride(), m.dtype, index, current_stream(index))
    if _first_npu(args, kwargs) is not None:
        return dispatch(op, args, kwargs)
    special = _SPECIAL.get(op)
    if special is not None:
        return special(op, args, kwargs)
    return issue(current_stream(index), op, args, kwargs, index)


def backend_op_names() -> list[str]:
    """Every aten op the npu backend takes (the ``name.overload`` of each): all but the
    composites torch decomposes before a backend sees them. A kernel of the backend's
    own, rather than only a fallback, takes precedence over torch's backend-independent
    composites (``arange`` and ``eye`` would resize their output), and torch's Python
    dispatcher finds it when it calls the backend with npu tensors (it looks kernels up
    per op; a fallback fails an internal assert there)."""
    names = []
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") and not torch._C._dispatch_has_kernel_for_dispatch_key(
            name, "CompositeImplicitAutograd"
        ):
            names.append(name[len("aten::") :])
    return names


def backend_kernel_of(name: str) -> Any:
    """:func:`backend_kernel` for the aten op ``name`` ("arange.start_step", "eye")."""
    packet, _, overload = name.partition(".")
    resolved: list[Any] = []

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if not resolved:  # resolving every op's overload up front costs ~0.1 s
            resolved.append(getattr(getattr(aten, packet), overload or "default"))
        return backend_kernel(resolved[0], *args, **kwargs)

    return kernel
