"""What dispatch reads of an op before it runs it: its schema and its meta kernel.

- The schema, read once per op (:func:`schema`): whether the op is a view, what it
  returns, which arguments it writes (``Tensor(a!)``); a mutating op's result is
  its written inputs (:func:`aliased_result`).
- The meta kernel (:func:`check_meta`): run on meta tensors at issue time, it
  validates the arguments and gives the output shapes, cached by shapes, strides,
  dtypes and the other argument values.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import SimUsageError
from .opcall import map_args, map_kwargs, map_value


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device) and x.type == "npu":
        return torch.device("meta")
    return x


# ---------------------------------------------------------------- schema helpers
class _Schema:
    """What dispatch needs of an op's schema, read once per op: reading a schema
    through its bindings costs microseconds per argument, on every issue."""

    __slots__ = (
        "aliased",
        "dynamic_shape",
        "is_view",
        "n_returns",
        "random",
        "returns_tensors",
        "written",
    )

    def __init__(self, func: Any) -> None:
        rets = func._schema.returns
        self.n_returns = len(rets)
        self.is_view = bool(rets) and all(
            r.alias_info is not None and not r.alias_info.is_write for r in rets
        )
        self.returns_tensors = any("Tensor" in str(r.type) for r in rets)
        # Its results are the arguments it writes (add_, out= ops; a custom op's
        # keyword-only out= whatever its returns say), or it returns none: not so an op
        # that writes a positional argument besides new results (rrelu_with_noise writes
        # its noise, native_batch_norm its running statistics).
        self.aliased = all(r.alias_info is not None and r.alias_info.is_write for r in rets) or any(
            a.kwarg_only
            for a in func._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write
        )
        # torch's tag for ops whose output shape may depend on the input data (nonzero,
        # unique, masked_select, index with a boolean mask, ...): no meta kernel can say it.
        self.dynamic_shape = torch.Tag.dynamic_output_shape in getattr(func, "tags", ())
        # A random op: it takes a generator, or torch tags it as drawing from the
        # default one (rand, randn, randint, randperm, native_dropout, ...): :mod:`.rng`.
        self.random = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()) or any(
            a.name == "generator" for a in func._schema.arguments
        )
        # (position, name, keyword-only) of each argument the op writes (Tensor(a!)).
        self.written = tuple(
            (i, a.name, a.kwarg_only)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )


_SCHEMAS: dict[Any, _Schema] = {}


def schema(func: Any) -> _Schema:
    info = _SCHEMAS.get(func)
    if info is None:
        info = _SCHEMAS[func] = _Schema(func)
    return info


def is_view(func: Any) -> bool:
    return schema(func).is_view


def returns_tensors(func: Any) -> bool:
    return schema(func).returns_tensors


def written_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments the op writes (``Tensor(a!)``), in schema order."""
    out = []
    for i, name, kwarg_only in schema(func).written:
        v = kwargs.get(name) if kwarg_only or i >= len(args) else args[i]
        if v is not None:
            out.append(v)
    return out


def aliased_result(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Result of a mutating op: the written inputs, shaped like the schema's returns."""
    n = schema(func).n_returns
    if not n:
        return None
    written: list[Any] = []
    for v in written_args(func, args, kwargs):  # a Tensor(a!)[] out gives its tensors
        written.extend(v if isinstance(v, (list, tuple)) else [v])
    if n == 1:
        return written[0]
    return tuple(written[:n])


# ---------------------------------------------------------------- meta kernels
_META_CACHE: dict[Any, Any] = {}
_META_CACHE_MAX = 4096


_KEY_SCALARS = frozenset({bool, int, float, complex})


def _meta_key_part(v: Any) -> Any:
    t = type(v)
    if t in _KEY_SCALARS:  # (the common case first: it runs for every argument of every op)
        return (t, v)  # 2, 2.0 and True give different result dtypes
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), v.stride(), v.dtype)
    if isinstance(v, (list, tuple)):
        return tuple([_meta_key_part(e) for e in v])
    if isinstance(v, torch.device):
        return ("D", v.type)
    if isinstance(v, (bool, int, float, complex)):  # a subclass (an IntEnum)
        return (type(v), v)
    return v


def check_meta(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the op's meta kernel: validates arguments at issue time and gives output shapes
    (meta tensors shared by every call that hits the cache: read, never written).

    Results depend only on shapes, strides, dtypes and the other argument values,
    so they are cached by those (a meta run costs ~300 us of Python). An op that
    would resize a tensor it writes is refused: a device tensor's shape is fixed.
    """
    try:
        key = (func, _meta_key_part(args), _meta_key_part(tuple(kwargs.items())))
        hash(key)
    except TypeError:
        key = None
    hit = _META_CACHE.get(key) if key is not None else None
    if hit is None:
        meta_args, meta_kwargs = map_args(_to_meta, args), map_kwargs(_to_meta, kwargs)
        meta = func(*meta_args, **meta_kwargs)
        before = _written_tensors(func, args, kwargs)
        after = _written_tensors(func, meta_args, meta_kwargs)
        resized = [tuple(m.shape) for t, m in zip(before, after, strict=True) if t.shape != m.shape]
        hit = (map_value(meta_like, meta), resized)
        if key is not None:
            if len(_META_CACHE) >= _META_CACHE_MAX:
                _META_CACHE.clear()
            _META_CACHE[key] = hit
    result, resized = hit
    if resized:
        raise SimUsageError(
            f"{func} would resize a device tensor it writes to {list(resized[0])}: the "
            "simulated NPU cannot resize device tensors; allocate the output with its final "
            "shape, or build the data on the CPU and move it with .npu()"
        )
    return result  # the cached meta tensors: callers read their shapes, strides, dtypes


def _written_tensors(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for v in written_args(func, args, kwargs):
        out.extend(v if isinstance(v, (list, tuple)) else [v])
    return out


def meta_like(m: Any) -> Any:
    if isinstance(m, torch.Tensor):
        return torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device="meta")
    return m
