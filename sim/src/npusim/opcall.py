"""One device op call, as a stream runs it: the op and its CPU-level arguments."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import cube

# Custom device ops that graph updates re-issue (registered by ops.py): a task of
# one of these re-issued eagerly with its captured tensors was meant as an update.
PATCHABLE_OPS: set[Any] = set()

# Issue-time argument checks of the sim's own ops (registered by ops.py): the op's
# meta kernel as a Python function, called with the CPU-level arguments instead of
# meta tensors made for the call (it reads shapes, strides and dtypes, never data,
# and must not modify its arguments). Same checks, same errors, without the
# dispatcher round trip and the meta tensors.
HOST_CHECKS: dict[Any, Callable[..., Any]] = {}


# Keyword tensor arguments of an op that a patch may replace by another tensor: they
# are parameters of the task, not memory its captured footprint names (the workspace
# of ``_npu_paged_attention``: vllm-ascend's full-graph update passes the workspace it
# holds now, ATB re-binds it).
PATCH_PARAMETERS: dict[Any, frozenset[str]] = {}

_AS_IS = (type(None), str)


def _check_key_part(v: Any) -> Any:
    t = type(v)
    if t in _AS_IS:
        return v
    if isinstance(v, torch.Tensor):
        return ("T", v.shape, v.stride(), v.dtype)
    if isinstance(v, (list, tuple)):
        return (t, *map(_check_key_part, v))
    if isinstance(v, (bool, int, float)):
        return (t, v)
    return v


_UNKNOWN = object()


class RememberedCheck:
    """An issue-time check whose passing is remembered (a ``HOST_CHECKS`` entry).

    ``full(*args, **kwargs)`` runs every check and returns what ``rest`` needs;
    ``rest(token, values)`` runs the checks of the ``varying`` arguments alone (their
    values in the order of ``varying``; given by name, or at ``positions``). Once a
    call passed ``full``, a call equal to it in all the checks read (shapes, strides,
    dtypes and values) but the varying arguments gets ``rest`` alone: the same checks
    with the same errors, provided ``full`` checks the varying arguments after all
    that can fail for the others.
    """

    MAX = 4096

    def __init__(
        self,
        full: Callable[..., Any],
        rest: Callable[[Any, list[Any]], None],
        varying: tuple[str, ...],
        positions: tuple[int, ...] = (),
    ) -> None:
        """``positions``: where the varying arguments are when passed positionally, in
        the order of ``varying`` (none: they are keyword-only)."""
        self.full, self.rest = full, rest
        self.varying = frozenset(varying)
        self.names = varying
        self._at = dict(zip(positions, range(len(positions)), strict=True))
        self._passed: dict[Any, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        at = self._at
        key: Any = (
            tuple(
                [
                    "V" if i in at else (v if v is None else _check_key_part(v))
                    for i, v in enumerate(args)
                ]
            ),
            tuple((k, _check_key_part(v)) for k, v in kwargs.items() if k not in self.varying),
        )
        try:
            hash(key)
        except TypeError:
            key = None
        values = [kwargs.get(name) for name in self.names]
        for i, slot in self._at.items():
            if i < len(args):
                values[slot] = args[i]
        self.check(key, values, args, kwargs)

    def check(
        self, key: Any, values: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Check a call whose ``key`` (None: unknown) summarises all the checks read of
        it but the varying arguments, whose ``values`` are given."""
        token = self._passed.get(key, _UNKNOWN) if key is not None else _UNKNOWN
        if token is _UNKNOWN:
            token = self.full(*args, **kwargs)
            if key is not None and token is not None:  # None: check this call in full
                if len(self._passed) >= self.MAX:
                    self._passed.clear()
                self._passed[key] = token
            return
        self.rest(token, values)


# Op arguments are values or lists/tuples of values (a schema's Tensor[] or int[]);
# these one-level walks replace torch's pytree, which costs ~10x more per call.


def map_value(fn: Callable[[Any], Any], v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return type(v)(fn(e) for e in v)
    return fn(v)


def map_args(fn: Callable[[Any], Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(map_value(fn, a) for a in args)


def map_kwargs(fn: Callable[[Any], Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: map_value(fn, v) for k, v in kwargs.items()}


def flat(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[Any]:
    for v in (*args, *kwargs.values()):
        if isinstance(v, (list, tuple)):
            yield from v
        else:
            yield v


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Where a tensor is and how it is laid out: (address, storage offset, shape, stride,
    dtype). The address with the offset and dtype names the same storage position as
    the storage's own address would; ``t.shape`` is a torch.Size, equal to the tuple."""
    return (t.data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)


def _layout(key: tuple[Any, ...]) -> tuple[Any, ...]:
    return (tuple(key[2]), key[3], key[4])


class OpCall:
    """``op(*args, **kwargs)`` over CPU tensors that alias the device tensors' storage.

    ``outs`` holds the CPU storage allocated for a functional op's results when
    it was issued; running the call copies the results there, so that the
    tensors handed to the host at issue time receive them.
    """

    __slots__ = ("_keys", "_tensors", "args", "host", "kwargs", "label", "op", "outs")

    def __init__(
        self,
        op: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        outs: list[torch.Tensor] | None = None,
        host: set[int] | None = None,
    ) -> None:
        self.op = op
        self.args = args
        self.kwargs = kwargs
        self.outs = outs
        # ids of host tensors among the arguments: values a patch may change, not memory
        self.host = host or set()
        self.label = str(getattr(op, "__name__", op))
        self._keys: list[tuple[Any, ...]] | None = None
        # The device tensors' CPU views in the order of their keys, when the binding that
        # made the call knew them (:mod:`.direct`): see :meth:`same_tensors`.
        self._tensors: list[torch.Tensor] | None = None

    def execute(self) -> Any:
        op = self.op
        if op in cube.GEMMS:  # float16 products accumulate in float32, as the Cube unit does
            return self.deliver(cube.run(op, self.args, self.kwargs))
        return self.deliver(op(*self.args, **self.kwargs))

    def deliver(self, result: Any) -> Any:
        """``result`` (the op's return) copied into ``outs``, the tensors allocated for it
        at issue; returned."""
        if self.outs is not None:
            values = result if isinstance(result, (list, tuple)) else (result,)
            produced = [r for r in values if isinstance(r, torch.Tensor)]
            for dst, src in zip(self.outs, produced, strict=True):
                dst.copy_(src)
        return result

    def tensor_keys(self) -> list[tuple[Any, ...]]:
        """The key of every device tensor argument (host tensors are values a patch may
        change, not memory), taken at the first call and kept: a captured call's keys are
        those of capture time (the graph holds those addresses and layouts), a patch's
        those of its issue, whatever happens to the tensors later."""
        keys = self._keys
        if keys is None:
            host = self.host
            tensors: list[torch.Tensor] = []
            skip = PATCH_PARAMETERS.get(self.op)
            kwargs = (
                self.kwargs.values()
                if skip is None
                else [v for k, v in self.kwargs.items() if k not in skip]
            )
            for v in (*self.args, *kwargs):  # flat(), inline
                if isinstance(v, torch.Tensor):
                    if id(v) not in host:
                        tensors.append(v)
                elif isinstance(v, (list, tuple)):
                    tensors += [e for e in v if isinstance(e, torch.Tensor) and id(e) not in host]
            keys = [_tensor_key(t) for t in (*tensors, *(self.outs or ()))]
            self._keys = keys
        return keys

    def same_tensors(self, other: OpCall) -> bool:
        """``other`` is this op over the very tensor objects of this call, in the same
        order (both calls bound by :mod:`.direct`): their keys are equal unless a tensor's
        metadata was changed in place between the two (``set_``, ``resize_``), which is
        not checked. Performance mode's match of a patch (its checks are off)."""
        mine, theirs = self._tensors, other._tensors
        return (
            other.op is self.op
            and mine is not None
            and theirs is not None
            and len(mine) == len(theirs)
            and all(map(operator.is_, mine, theirs))
        )

    def mismatch(self, other: OpCall) -> str:
        """Why ``other`` cannot patch this captured call ('' when it can).

        What CANN's task update asks of a re-issued op: the same op, giving the same
        number and kind of tasks, which for the sim's ops means the same tensor arguments
        in the same shape, stride and dtype (a tensor of another shape is another tiling,
        maybe another task count). A tensor's address is a parameter of the task like a
        length: the patched task reads and writes the tensor the update passed
        (vllm-ascend's EAGLE draft graph passes a fresh block table to each update);
        :meth:`moves` tells the caller so."""
        if other.op is not self.op:
            return f"op {other.label} instead of {self.label} (an update re-issues its op)"
        mine, theirs = self.tensor_keys(), other.tensor_keys()
        if mine == theirs:  # the common case, compared in C
            return ""
        if len(mine) != len(theirs):
            return (
                f"{len(theirs)} tensor arguments instead of {len(mine)} (another task layout: "
                "pass every tensor argument the capture passed)"
            )
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            if _layout(a) != _layout(b):
                return (
                    f"tensor argument {i} has shape/stride/dtype {_layout(b)} instead of "
                    f"{_layout(a)} (another tiling: CANN updates a task only with the shapes "
                    "it was captured with; pad the tensor to the captured shape)"
                )
        return ""

    def moves(self, other: OpCall) -> bool:
        """``other``, which passed :meth:`mismatch`, names another tensor (an address)
        than this call for some argument."""
        return self.tensor_keys() != other.tensor_keys()
