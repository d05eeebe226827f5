"""Issuing one of the sim's own ops without a round trip through torch's dispatcher.

``torch.ops.npu.<op>(...)`` on npu tensors goes Python -> the C++ dispatcher
(which parses every argument against the schema and releases the interpreter
lock) -> ``NpuTensor.__torch_dispatch__`` (which takes it again) ->
:func:`.tensor.dispatch` -> :func:`.tensor.issue`, which walks every argument
again (41 for the fused attention op) to unwrap them, check them and key them.
That is most of the host cost of a task-group patch.

:func:`call` binds a call itself, as a C++ binding does, for an op of the sim that
returns nothing, or only the ``out`` tensors it writes (the caller has them), and has
an issue-time check (``HOST_CHECKS``): positional arguments in schema order, then
keywords, each of the Python type its schema asks for (an npu tensor for a Tensor, an
``int`` for an int, an ``int`` or ``float`` for a float, a list or tuple of ``int``
for an int[] ...), defaults filled in. It walks only the arguments given, runs the
op's issue-time check and routes the call as :func:`.tensor.issue` does. What it
cannot bind is refused: a TypeError for an unknown, missing or mistyped argument, a
SimUsageError for a host tensor. It never falls back to the dispatcher, so torch's
dispatch and function modes do not see the call, as they do not see the NPU's
binding.

The only path of the fused update binding (:mod:`.fused`), the simulated
``torch_npu._C._npu_fused_infer_attention_score_out_graph``: on the NPU that binding
goes straight to C++ too. It is there for what it buys: a step of
``python -m npusim.bench`` (4 layers, timed at 0 us) costs about 1.6 times as much
host time with the binding going through the dispatcher.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch

from .allocation import note_uses
from .errors import SimUsageError
from .opcall import HOST_CHECKS, OpCall, RememberedCheck, _tensor_key
from .routing import route
from .runtime import RUNTIME
from .streams import current_stream
from .tensor import NpuTensor

# What the fast path accepts for an argument, by schema type.
_TENSOR, _TENSOR_LIST, _INT_LIST, _SCALAR = range(4)
_SCALARS = {"int": int, "SymInt": int, "float": float, "bool": bool, "str": str}


def _kind(t: Any) -> tuple[int, bool, type | None] | None:
    """(kind, optional, scalar type) of a schema type, or None when not covered."""
    optional = isinstance(t, torch.OptionalType)
    if optional:
        t = t.getElementType()
    if isinstance(t, torch.ListType):
        inner = str(t.getElementType())
        if inner == "Tensor":
            return (_TENSOR_LIST, optional, None)
        if inner in ("int", "SymInt"):
            return (_INT_LIST, optional, None)
        return None
    name = str(t)
    if name == "Tensor":
        return (_TENSOR, optional, None)
    if name in _SCALARS:
        return (_SCALAR, optional, _SCALARS[name])
    return None


class _Layout(NamedTuple):
    specs: tuple[tuple[str, int, int, bool, type | None], ...]  # name, slot, kind, ...
    keyword: tuple[str, ...]  # the keyword-only names given, in schema order


_LAYOUTS_MAX = 64  # call layouts remembered per op (a caller has one or a few)
_SCHEMA_ORDER = operator.itemgetter(0, 1)  # a tensor's (slot, index in its list)


class _Binding:
    """How to bind a keyword call of one op, read once from its schema."""

    _MISSING = object()

    def __init__(self, func: Any) -> None:
        schema = func._schema
        self.check = HOST_CHECKS.get(func)
        # An op that returns nothing, or only what it wrote into its ``out`` argument
        # (an ``.out`` overload: the caller holds those tensors already).
        writes_out = any(
            a.name == "out" and a.alias_info is not None and a.alias_info.is_write
            for a in schema.arguments
        )
        self.name = str(func)
        if self.check is None or (schema.returns and not writes_out):
            raise SimUsageError(f"{func} returns what a binding cannot: it takes the dispatcher")
        check = self.check
        self.varying = check.varying if isinstance(check, RememberedCheck) else frozenset()
        self.slots: dict[str, tuple[int, int, bool, type | None]] = {}  # name -> slot, kind
        self.defaults: list[Any] = []
        self.keyword: list[str] = []
        self.positional: list[str] = []
        self.required: set[str] = set()
        for slot, a in enumerate(schema.arguments):
            kind = _kind(a.type)
            if kind is None:
                raise SimUsageError(f"{func} takes a {a.type} ({a.name}): no binding binds it")
            self.slots[a.name] = (slot, *kind)
            if not a.has_default_value():
                self.required.add(a.name)
            if a.kwarg_only:
                self.keyword.append(a.name)
            else:
                self.positional.append(a.name)
                self.defaults.append(a.default_value if a.has_default_value() else None)
        # By the names of a call, in its order: what _layout says of them.
        self._layouts: dict[tuple[str, ...], _Layout] = {}
        self._as_before: dict[tuple[str, ...], _AsBefore] = {}  # performance mode

    def by_name(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by name: ``args`` in schema order, then ``kwargs``."""
        if not args:
            return kwargs
        if len(args) > len(self.positional):
            raise TypeError(
                f"{self.name}() takes {len(self.positional)} positional arguments, "
                f"got {len(args)}"
            )
        named = dict(zip(self.positional, args, strict=False))
        for name in kwargs:
            if name in named:
                raise TypeError(f"{self.name}() got multiple values for argument {name!r}")
        named.update(kwargs)
        return named

    def _layout(self, names: tuple[str, ...]) -> _Layout:
        """How a call naming ``names`` (in that order) binds: each name's slot and kind,
        and the keyword-only ones among them in schema order."""
        layout = self._layouts.get(names)
        if layout is not None:
            return layout
        unknown = [n for n in names if n not in self.slots]
        if unknown:
            raise TypeError(f"{self.name}() got an unexpected keyword argument {unknown[0]!r}")
        missing = sorted(self.required.difference(names))
        if missing:
            raise TypeError(f"{self.name}() missing required argument {missing[0]!r}")
        specs = tuple((n, *self.slots[n]) for n in names)
        keyword = tuple(n for n in self.keyword if n in names)
        layout = _Layout(specs, keyword)
        if len(self._layouts) >= _LAYOUTS_MAX:
            self._layouts.clear()
        self._layouts[names] = layout
        return layout

    def _mistyped(self, name: str, wants: str, v: Any) -> TypeError:
        return TypeError(
            f"{self.name}(): argument {name!r} must be {wants}, not {type(v).__name__}"
        )

    def issue(
        self,
        func: Any,
        kwargs: dict[str, Any],
        started: float,
        stream: Any = None,
        release: Any = None,
    ) -> bool:
        """Issue ``func(**kwargs)``, or refuse what does not bind; ``stream``, ``release``
        and the result as :func:`call`'s."""
        names = tuple(kwargs)
        layout = self._layout(names)
        if RUNTIME.config.perf:
            bound = self._bind_as_before(func, names, kwargs)
            if bound is None:
                bound = self._bind_unchecked(func, layout, kwargs)
                self._learn(names, layout, kwargs)
            call, first = bound
            if stream is None:
                stream = current_stream(first.device.index or 0)
            released = route(stream, call, func, started, release=release)
            note_uses(stream, (), kwargs)  # memory used on another stream than its own
            return released
        n_pos = len(self.defaults)
        cpu_pos = list(self.defaults)
        checked: dict[str, Any] = {}  # the given arguments, unwrapped, for the check
        values: list[tuple[str, Any]] = []  # given non-tensor values the check reads
        varying = self.varying
        tensors: list[tuple[int, int, torch.Tensor, NpuTensor]] = []
        for (name, slot, kind, optional, scalar), v in zip(
            layout.specs, kwargs.values(), strict=True
        ):
            if v is None:
                if not optional:
                    raise self._mistyped(name, "given", v)
                cpu: Any = None
                values.append((name, None))
            elif kind == _SCALAR:
                if type(v) is not scalar:
                    if scalar is not float or type(v) is not int:
                        raise self._mistyped(name, getattr(scalar, "__name__", "?"), v)
                    v = float(v)  # an int for a float, as a binding converts it
                cpu = v
                values.append((name, v))
            elif kind == _TENSOR:
                if type(v) is not NpuTensor:
                    raise _not_npu(name, v)
                cpu = v._data
                tensors.append((slot, 0, cpu, v))
            elif kind == _INT_LIST:
                if type(v) not in (list, tuple) or not all(type(e) is int for e in v):
                    raise self._mistyped(name, "a list of int", v)
                cpu = list(v)  # the values of issue time, as the dispatcher's copy
                if name not in varying:
                    values.append((name, tuple(cpu)))
            else:  # _TENSOR_LIST
                if type(v) not in (list, tuple):
                    raise self._mistyped(name, "a list of tensors", v)
                for e in v:
                    if type(e) is not NpuTensor:
                        raise _not_npu(name, e)
                cpu = [e._data for e in v]
                tensors += [(slot, j, c, e) for j, (c, e) in enumerate(zip(cpu, v, strict=True))]
            checked[name] = cpu
            if slot < n_pos:
                cpu_pos[slot] = cpu
        if not tensors:
            raise SimUsageError(f"{self.name}: a call with no npu tensor has no stream")
        # Keyword-only arguments in schema order, as the dispatcher passes them.
        cpu_kw = {name: checked[name] for name in layout.keyword}
        tensors.sort(key=_SCHEMA_ORDER)  # as the call flattens them
        check = self.check
        keys = [_tensor_key(t[2]) for t in tensors]
        if isinstance(check, RememberedCheck):
            # What the check reads: every tensor's slot and layout (the key also holds
            # its address), every other value but the varying ones.
            key = ("direct", tuple((t[0], t[1]) for t in tensors), tuple(keys), tuple(values))
            check.check(key, [checked.get(n) for n in check.names], (), checked)
        else:
            assert check is not None
            check(**checked)
        call = OpCall(func, tuple(cpu_pos), cpu_kw)
        call._keys = keys
        if stream is None:
            stream = current_stream(tensors[0][3].device.index or 0)
        released = route(stream, call, func, started, release=release)
        note_uses(stream, (), kwargs)  # memory used on another stream than its own
        return released


    def _learn(self, names: tuple[str, ...], layout: _Layout, kwargs: dict[str, Any]) -> None:
        """Remember how a call that bound (performance mode) was made: its arguments'
        types and where each goes, for :meth:`_bind_as_before`."""
        values = tuple(kwargs.values())
        tensors, int_lists, tensor_lists, floats, pos, kw = [], [], [], [], [], {}
        specs = zip(layout.specs, values, strict=True)
        for i, ((name, slot, kind, _, scalar), v) in enumerate(specs):
            if v is None:
                pass
            elif kind == _TENSOR:
                tensors.append(i)
            elif kind == _INT_LIST:
                int_lists.append(i)
            elif kind == _TENSOR_LIST:
                tensor_lists.append(i)
            elif scalar is float and type(v) is int:
                floats.append(i)
            if slot < len(self.defaults):
                pos.append((i, slot))
            else:
                kw[name] = i
        if len(self._as_before) >= _LAYOUTS_MAX:
            self._as_before.clear()
        self._as_before[names] = _AsBefore(
            tuple(map(type, values)), tuple(tensors), tuple(int_lists), tuple(tensor_lists),
            tuple(floats), tuple(pos), tuple((n, kw[n]) for n in layout.keyword),
        )  # fmt: skip

    def _bind_as_before(
        self, func: Any, names: tuple[str, ...], kwargs: dict[str, Any]
    ) -> tuple[OpCall, NpuTensor] | None:
        """Performance mode's binding of a call made as one that bound before (the same
        names in the same order, each argument of the same type): what
        :meth:`_bind_unchecked` makes of it, without walking every argument in Python
        (list elements are still checked). None when it is not so made (or an element
        is wrong): :meth:`_bind_unchecked` then binds it, or refuses it."""
        before = self._as_before.get(names)
        values = tuple(kwargs.values())
        if before is None or tuple(map(type, values)) != before.types:
            return None
        cpu = list(values)
        tensors = [values[i]._data for i in before.tensors]
        for i, t in zip(before.tensors, tensors, strict=True):
            cpu[i] = t
        for i in before.int_lists:
            v = values[i]
            if not _INT.issuperset(map(type, v)):
                return None
            cpu[i] = list(v)  # the values of issue time, as the dispatcher's copy
        for i in before.tensor_lists:
            v = values[i]
            if not _NPU.issuperset(map(type, v)):
                return None
            cpu[i] = [e._data for e in v]
            tensors += cpu[i]
        for i in before.floats:
            cpu[i] = float(values[i])
        if not tensors:
            return None
        cpu_pos = list(self.defaults)
        for i, slot in before.pos:
            cpu_pos[slot] = cpu[i]
        call = OpCall(func, tuple(cpu_pos), {name: cpu[i] for name, i in before.kw})
        call._tensors = tensors
        first = values[before.tensors[0]] if before.tensors else values[before.tensor_lists[0]][0]
        return call, first

    def _bind_unchecked(
        self, func: Any, layout: _Layout, kwargs: dict[str, Any]
    ) -> tuple[OpCall, NpuTensor]:
        """Performance mode's binding of a call: the same refusals of what does not bind,
        no issue-time check and none of what it reads (sim/README.md), no tensor's key
        (a patch matches by its tensor objects: :meth:`.OpCall.same_tensors`). The call
        and its first npu tensor."""
        cpu_pos = list(self.defaults)
        n_pos = len(cpu_pos)
        by_name: dict[str, Any] = {}
        tensors: list[torch.Tensor] = []  # CPU views, in the order given
        first: NpuTensor | None = None
        for (name, slot, kind, optional, scalar), v in zip(
            layout.specs, kwargs.values(), strict=True
        ):
            if v is None:
                if not optional:
                    raise self._mistyped(name, "given", v)
                cpu: Any = None
            elif kind == _TENSOR:
                if type(v) is not NpuTensor:
                    raise _not_npu(name, v)
                cpu = v._data
                tensors.append(cpu)
                if first is None:
                    first = v
            elif kind == _SCALAR:
                if type(v) is not scalar:
                    if scalar is not float or type(v) is not int:
                        raise self._mistyped(name, getattr(scalar, "__name__", "?"), v)
                    v = float(v)
                cpu = v
            elif kind == _INT_LIST:
                if type(v) not in (list, tuple) or not _INT.issuperset(map(type, v)):
                    raise self._mistyped(name, "a list of int", v)
                cpu = list(v)
            else:  # _TENSOR_LIST
                if type(v) not in (list, tuple):
                    raise self._mistyped(name, "a list of tensors", v)
                cpu = []
                for e in v:
                    if type(e) is not NpuTensor:
                        raise _not_npu(name, e)
                    cpu.append(e._data)
                    if first is None:
                        first = e
                tensors += cpu
            if slot < n_pos:
                cpu_pos[slot] = cpu
            else:
                by_name[name] = cpu
        if first is None:
            raise SimUsageError(f"{self.name}: a call with no npu tensor has no stream")
        # Keyword-only arguments in schema order, as the dispatcher passes them.
        call = OpCall(func, tuple(cpu_pos), {name: by_name[name] for name in layout.keyword})
        call._tensors = tensors
        return call, first


_INT = frozenset((int,))
_NPU = frozenset((NpuTensor,))


class _AsBefore(NamedTuple):
    """How a call that bound was made (:meth:`_Binding._learn`): its arguments' types, the
    positions of its npu tensors, int lists, tensor lists and ints given for floats, and
    where each argument goes (positional slot, or keyword in schema order)."""

    types: tuple[type, ...]
    tensors: tuple[int, ...]
    int_lists: tuple[int, ...]
    tensor_lists: tuple[int, ...]
    floats: tuple[int, ...]
    pos: tuple[tuple[int, int], ...]
    kw: tuple[tuple[str, int], ...]


def _not_npu(name: str, v: Any) -> Exception:
    if isinstance(v, torch.Tensor):
        return SimUsageError(
            f"argument {name!r} is a tensor on {v.device}: the binding takes npu tensors"
        )
    return TypeError(f"argument {name!r} must be an npu tensor, not {type(v).__name__}")


_BINDINGS: dict[Any, _Binding] = {}


def bind_as_before(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpCall | None:
    """Performance mode: ``func(*args, **kwargs)`` bound, when a call made as it (the
    same names in the same order, of the same types) bound before; None otherwise (then
    :func:`call` binds it, or refuses it)."""
    binding = _BINDINGS.get(func)
    if binding is None:
        return None
    try:
        named = binding.by_name(args, kwargs)
    except TypeError:
        return None  # :func:`call` refuses it, after what it checks first
    bound = binding._bind_as_before(func, tuple(named), named)
    return None if bound is None else bound[0]


def call(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    started: float,
    stream: Any = None,
    release: Any = None,
) -> bool:
    """Issue ``func(*args, **kwargs)``, an op of the sim, bound here, never through the
    dispatcher (see the module docstring). ``started``: when the host began the call
    (a timed patch is charged from there); ``stream``: where (default: the current
    stream of its first tensor's device); ``release``: an ExternalEvent that the patch
    ending an update records (:func:`.routing.route`), True when it did."""
    binding = _BINDINGS.get(func)
    if binding is None:
        binding = _BINDINGS[func] = _Binding(func)
    return binding.issue(func, binding.by_name(args, kwargs), started, stream, release)
