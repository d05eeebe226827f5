"""Issuing one of the sim's own ops without a round trip through torch's dispatcher.

``torch.ops.npu.<op>(...)`` on npu tensors goes Python -> the C++ dispatcher
(which parses every argument against the schema and releases the interpreter
lock) -> ``NpuTensor.__torch_dispatch__`` (which takes it again) ->
:func:`.tensor.dispatch` -> :func:`.tensor.issue`, which walks every argument
again (41 for the fused attention op) to unwrap them, check them and key them.
That is most of the host cost of a task-group patch.

:func:`call` issues the call itself when it is plain: keyword arguments only, each
of the plain Python type its schema asks for (an npu tensor for a Tensor, an
``int`` for an int, a list of ``int`` for an int[] ...), for an op of the sim that
returns nothing, or only the ``out`` tensors it writes (then it returns None: the
caller has them), and has an issue-time check (``HOST_CHECKS``). It walks only the
arguments given, binds them as the dispatcher would (schema order, keyword-only
ones as keywords, defaults filled in), runs the op's issue-time check and routes
the call as :func:`.tensor.issue` does. Anything else (positional arguments, another
type the dispatcher might convert or refuse, an unknown or missing argument, a
host tensor, an active dispatch or function mode) takes the dispatcher's path, so
the result and the errors are the dispatcher's whenever the fast path does not
apply.

Used by the fused update binding (:mod:`.fused`), the simulated
``torch_npu._C._npu_fused_infer_attention_score_out_graph``: on the NPU that
binding goes straight to C++ too.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch

from .allocation import note_uses
from .opcall import HOST_CHECKS, OpCall, RememberedCheck, _tensor_key
from .routing import route
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
        self.ok = self.check is not None and (not schema.returns or writes_out)
        check = self.check
        self.varying = check.varying if isinstance(check, RememberedCheck) else frozenset()
        self.slots: dict[str, tuple[int, int, bool, type | None]] = {}  # name -> slot, kind
        self.defaults: list[Any] = []
        self.keyword: list[str] = []
        self.required: set[str] = set()
        for slot, a in enumerate(schema.arguments):
            kind = _kind(a.type)
            if kind is None:
                self.ok = False
                return
            self.slots[a.name] = (slot, *kind)
            if not a.has_default_value():
                self.required.add(a.name)
            if a.kwarg_only:
                self.keyword.append(a.name)
            else:
                self.defaults.append(a.default_value if a.has_default_value() else None)
        # By the names of a call, in its order: what _layout says of them.
        self._layouts: dict[tuple[str, ...], _Layout | None] = {}

    def _layout(self, names: tuple[str, ...]) -> _Layout | None:
        """How a call naming ``names`` (in that order) binds: each name's slot and kind,
        and the keyword-only ones among them in schema order; None when a name is not
        the op's or a required one is missing (the dispatcher's path then)."""
        if names in self._layouts:
            return self._layouts[names]
        layout: _Layout | None = None
        if self.required.issubset(names) and all(n in self.slots for n in names):
            specs = tuple((n, *self.slots[n]) for n in names)
            keyword = tuple(n for n in self.keyword if n in names)
            layout = _Layout(specs, keyword)
        if len(self._layouts) >= _LAYOUTS_MAX:
            self._layouts.clear()
        self._layouts[names] = layout
        return layout

    def issue(self, func: Any, kwargs: dict[str, Any], started: float) -> bool:
        """Issue ``func(**kwargs)`` if the call is plain; False (nothing done) if not."""
        layout = self._layout(tuple(kwargs))
        if layout is None:
            return False
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
                    return False
                cpu: Any = None
                values.append((name, None))
            elif kind == _SCALAR:
                if type(v) is not scalar:
                    return False
                cpu = v
                values.append((name, v))
            elif kind == _TENSOR:
                if type(v) is not NpuTensor:
                    return False
                cpu = v._data
                tensors.append((slot, 0, cpu, v))
            elif kind == _INT_LIST:
                if type(v) not in (list, tuple) or not all(type(e) is int for e in v):
                    return False
                cpu = list(v)  # the values of issue time, as the dispatcher's copy
                if name not in varying:
                    values.append((name, tuple(cpu)))
            else:  # _TENSOR_LIST
                if type(v) not in (list, tuple) or not all(type(e) is NpuTensor for e in v):
                    return False
                cpu = [e._data for e in v]
                tensors += [(slot, j, c, e) for j, (c, e) in enumerate(zip(cpu, v, strict=True))]
            checked[name] = cpu
            if slot < n_pos:
                cpu_pos[slot] = cpu
        if not tensors:
            return False
        # Keyword-only arguments in schema order, as the dispatcher passes them.
        cpu_kw = {name: checked[name] for name in layout.keyword}
        tensors.sort(key=_SCHEMA_ORDER)  # as the call flattens them
        keys = [_tensor_key(t[2]) for t in tensors]
        check = self.check
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
        first = tensors[0][3]
        stream = current_stream(first.device.index or 0)
        route(stream, call, func, started)
        note_uses(stream, (), kwargs)  # memory used on another stream than its own
        return True


_BINDINGS: dict[Any, _Binding] = {}


def _modes_active() -> bool:
    return bool(torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled())


def call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], started: float) -> Any:
    """``func(*args, **kwargs)`` for an op of the sim, without the dispatcher when the
    call is plain (see the module docstring). ``started``: when the host began this
    op's dispatch (a timed patch is charged from there)."""
    binding = _BINDINGS.get(func)
    if binding is None:
        binding = _BINDINGS[func] = _Binding(func)
    if binding.ok and not args and not _modes_active() and binding.issue(func, kwargs, started):
        return None
    return func(*args, **kwargs)
