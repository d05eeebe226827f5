"""What the registered attention ops share: argument binding by schema, cached plans,
the workspace and output checks, and the errors they raise.

Checks run at issue time (the ops' meta kernels and :func:`tensor.register_host_op`
handlers), so a bad call or a too-small workspace is refused at the call that makes
it, before anything runs. A workspace's size follows the shapes, not the lengths (what
``_get_max_workspace`` returns for the captured arguments holds every update).
Plans are cached by shapes and values: a replayed task does not re-validate.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import fia_kernel
from .errors import SimUsageError
from .fia_args import AttentionArgumentError, out_shape, split_layout
from .fia_layout import Plan, Room, lengths, plan, query_dims

_PLANS: dict[Any, Plan] = {}
_PLANS_MAX = 4096


class Signature:
    """Argument names and defaults of one registered schema, read once."""

    def __init__(self, op_name: str, schema: torch._C.FunctionSchema) -> None:
        self.op_name = op_name
        self.names = [a.name for a in schema.arguments]
        self.positional = sum(1 for a in schema.arguments if not a.kwarg_only)
        self.defaults = {
            a.name: a.default_value for a in schema.arguments if a.has_default_value()
        }

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if len(args) > self.positional:
            raise SimUsageError(
                f"{self.op_name}() takes {self.positional} positional arguments but "
                f"{len(args)} were given: the arguments after them are keyword-only"
            )
        bound = dict(self.defaults)
        bound.update(zip(self.names, args, strict=False))
        for name, value in kwargs.items():
            if name not in bound and name not in self.names:
                raise SimUsageError(f"{self.op_name}() got an unexpected keyword argument {name!r}")
            bound[name] = value
        return bound


def _key_part(v: Any) -> Any:
    t = type(v)
    if t is int or t is str or t is float or t is bool:
        return v
    if isinstance(v, torch.Tensor):
        return ("T", tuple(v.shape), v.dtype, v.device.type)
    if t is list or t is tuple:
        return tuple([_key_part(e) for e in v])
    return v


_UNKEYED = frozenset(("out", "workspace"))  # checked against the plan, not part of it


Names = Mapping[str, str] | None


def usage_error(op_name: str, exc: AttentionArgumentError, names: Names) -> SimUsageError:
    """The SimUsageError of a refused call. Planning names v1's arguments; ``names`` maps
    them to the op's own (v2's ``actual_seq_kvlen``, paged attention's ``context_lens``),
    so that the error names an argument the caller passed."""
    message = str(exc)
    if names:
        words = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
        message = re.sub(rf"\b({words})\b", lambda m: names[m.group(1)], message)
    return SimUsageError(f"{op_name}: {message}")


def planned(op_name: str, a: dict[str, Any], names: Names = None) -> Plan:
    """The validated plan of a (v1-named) call, from the cache when seen before;
    errors name the arguments through ``names`` (see :func:`usage_error`)."""
    # None arguments are left out of the key: every call binds the same names, so the
    # names that are there say which were None.
    key: Any = tuple(
        [(k, _key_part(v)) for k, v in a.items() if v is not None and k not in _UNKEYED]
    )
    try:
        hit = _PLANS.get(key)
    except TypeError:
        key, hit = None, None
    if hit is not None:
        return hit
    try:
        p = plan(a)
    except AttentionArgumentError as exc:
        raise usage_error(op_name, exc, names) from exc
    if key is not None:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = p
    return p


def refuse(op_name: str, a: dict[str, Any], names: tuple[str, ...]) -> None:
    """Arguments the sim does not implement: refused unless None (or 0 for modes)."""
    for name in names:
        v = a.get(name)
        if v is None or (isinstance(v, int) and not isinstance(v, bool) and v == 0):
            continue
        raise SimUsageError(
            f"{op_name}: {name} is not implemented by graphlane's simulated NPU "
            "(quantisation, left padding and shared prefixes are refused; see sim/README.md)"
        )


def check_workspace(op_name: str, workspace: Any, needed: int, getter: str) -> None:
    if workspace is None:
        return
    if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.uint8:
        what = workspace.dtype if isinstance(workspace, torch.Tensor) else type(workspace).__name__
        raise SimUsageError(
            f"{op_name}: workspace must be the uint8 tensor {getter} returns, got {what}"
        )
    have = workspace.numel()
    if have < needed:
        refuse_short_workspace(op_name, have, needed, getter)


def refuse_short_workspace(op_name: str, have: int, needed: int, getter: str) -> None:
    if have < needed:
        raise SimUsageError(
            f"{op_name}: workspace holds {have} bytes but this call needs {needed} ({getter} "
            "for these shapes): get it with the shapes the call uses."
        )


def check_out(op_name: str, out: Any, p: Plan, dtype: torch.dtype) -> list[torch.Tensor]:
    if not isinstance(out, (list, tuple)) or len(out) != 2:
        raise SimUsageError(
            f"{op_name}: out must have 2 tensors (attention_out, softmax_lse), got {out!r}"
        )
    o, lse = out
    if tuple(o.shape) != p.out_shape() or o.dtype != dtype:
        raise SimUsageError(
            f"{op_name}: attention_out must be {list(p.out_shape())} {dtype}, "
            f"got {list(o.shape)} {o.dtype}"
        )
    if p.softmax_lse and tuple(lse.shape) != p.lse_shape():
        raise SimUsageError(
            f"{op_name}: softmax_lse must be {list(p.lse_shape())}, got {list(lse.shape)}"
        )
    return list(out)


Outputs = tuple[torch.Tensor, torch.Tensor]


class Kernels:
    """The CPU and Meta kernels of one FIA op and its ``.out`` overload.

    v1 and v2 differ only in how a call is bound and in the argument names: ``v1``
    takes a bound call, refuses what the sim does not implement and returns the
    arguments under v1's names, which planning and the kernel read.
    """

    def __init__(
        self,
        op_name: str,
        bind: Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]],
        v1: Callable[[dict[str, Any]], dict[str, Any]],
        workspace_getter: str,
        names: Names = None,
    ) -> None:
        self.op_name, self.out_name = op_name, op_name + ".out"
        self.bind, self.v1, self.workspace_getter = bind, v1, workspace_getter
        self.names = names

    def planned(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Plan, dict[str, Any]]:
        a = self.v1(self.bind(args, kwargs))
        return planned(self.op_name, a, self.names), a

    def cpu(self, *args: Any, **kwargs: Any) -> Outputs:
        return fia_kernel.compute(*self.planned(args, kwargs))

    def meta(self, *args: Any, **kwargs: Any) -> Outputs:
        p, a = self.planned(args, kwargs)
        q = a["query"]
        return (
            torch.empty(p.out_shape(), dtype=q.dtype, device=q.device),
            torch.empty(p.lse_shape(), dtype=torch.float32, device=q.device),
        )

    def out_cpu(self, *args: Any, **kwargs: Any) -> Outputs:
        p, a = self.planned(args, kwargs)
        o, lse = fia_kernel.compute(p, a)
        out = a["out"]
        out[0].copy_(o)
        if a["softmax_lse_flag"]:
            out[1].copy_(lse)
        else:
            out[1].zero_()
        return out[0], out[1]

    def out_meta(self, *args: Any, **kwargs: Any) -> Outputs:
        p, a = self.planned(args, kwargs)
        return self.check_out_call(p, a)

    def out_check(self, *args: Any, **kwargs: Any) -> Room | None:
        """The ``.out`` op's issue-time check (its ``HOST_CHECKS`` entry, remembered:
        :class:`.opcall.RememberedCheck`): ``out_meta``'s checks. Returns the plan's
        :class:`.fia_layout.Room` (None: the lengths decide more), with which a later
        call equal to this one but for its lengths is checked by :meth:`out_recheck`."""
        p, a = self.planned(args, kwargs)
        self.check_out_call(p, a)
        return p.room

    def out_recheck(self, room: Room, values: list[Any]) -> None:
        """The plan's length checks (:func:`.fia_layout.lengths`, the same code) for a
        call whose all else passed :meth:`out_check`; ``values``: its two length lists.
        The workspace needs no recheck: its size follows the shapes alone."""
        try:
            lengths(room, *values)
        except AttentionArgumentError as exc:
            raise usage_error(self.op_name, exc, self.names) from exc

    def check_out_call(self, p: Plan, a: dict[str, Any]) -> Outputs:
        """The ``.out`` op's checks beyond the plan: workspace and outputs."""
        check_workspace(self.out_name, a.get("workspace"), p.workspace_bytes(),
                        self.workspace_getter)  # fmt: skip
        o, lse = check_out(self.out_name, a.get("out"), p, a["query"].dtype)
        return o, lse


def inferred_outputs(op_name: str, query: torch.Tensor, value: torch.Tensor,
                     a: dict[str, Any], names: Names = None) -> Outputs:  # fmt: skip
    """Empty (attention_out, softmax_lse) for the ``*_infer_output`` helpers, from the
    (v1-named) arguments ``a``."""
    try:
        shape, lse = output_shapes(query, value, a)
    except AttentionArgumentError as exc:
        raise usage_error(op_name, exc, names) from exc
    return (
        torch.empty(shape, dtype=query.dtype, device=query.device),
        torch.empty(lse, dtype=torch.float32, device=query.device),
    )


def output_shapes(
    query: torch.Tensor, value: torch.Tensor, a: dict[str, Any]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(attention_out, softmax_lse) shapes from query and value alone, as the
    ``*_infer_output`` helpers give them (value may be a paged cache)."""
    layout_in, layout_out = split_layout(a.get("input_layout", "BSH"))
    n = int(a.get("num_heads", 1))
    nkv = int(a.get("num_key_value_heads", 0)) or n
    b_or_t, s, _ = query_dims(query, layout_in, n)
    if a.get("block_table") is not None or layout_in == "BSH":
        dv = value.shape[-1] if value.dim() == 4 else value.shape[-1] // nkv
    else:
        dv = value.shape[-1]
    t = b_or_t if layout_in in ("TND", "NTD") else 0
    o = out_shape(layout_out, b_or_t, n, s, dv, t)
    if not a.get("softmax_lse_flag", False):
        return o, (1,)
    return o, ((t, n, 1) if t else (b_or_t, n, s, 1))
