"""The vocabulary of ``npu_fused_infer_attention_score``'s arguments, for :mod:`fia_layout`.

What reading an argument can raise (:class:`AttentionArgumentError`, made by
:func:`fail` with the argument's name first), the layouts (``input_layout``'s
input and output parts, :func:`split_layout`; the output shape of a layout,
:func:`out_shape`), and the readers of scalars (:func:`check_int`) and length
lists (:func:`int_list`; one entry or the first B per batch, :func:`per_batch`;
TND cumulative ends, :func:`cumulative`).
"""

from __future__ import annotations

from operator import index as _as_index

import torch

_IN_LAYOUTS = ("BSH", "BSND", "BNSD", "TND", "NTD")
_LAYOUTS = {
    "BSH": ("BSH", "BSH"),
    "BSND": ("BSND", "BSND"),
    "BNSD": ("BNSD", "BNSD"),
    "TND": ("TND", "TND"),
    "BNSD_BSND": ("BNSD", "BSND"),
    "BSH_NBSD": ("BSH", "NBSD"),
    "BSND_NBSD": ("BSND", "NBSD"),
    "BNSD_NBSD": ("BNSD", "NBSD"),
    "TND_NTD": ("TND", "NTD"),
    "NTD_TND": ("NTD", "TND"),
}


class AttentionArgumentError(ValueError):
    """An argument of the fused inference attention op is invalid or not implemented.

    The message starts with the offending argument's name.
    """


def fail(argument: str, message: str) -> AttentionArgumentError:
    return AttentionArgumentError(f"{argument}: {message}")


def out_shape(layout: str, b: int, n: int, s: int, dv: int, t: int) -> tuple[int, ...]:
    return {
        "BSH": (b, s, n * dv), "BSND": (b, s, n, dv), "BNSD": (b, n, s, dv),
        "NBSD": (n, b, s, dv), "TND": (t, n, dv), "NTD": (n, t, dv),
    }[layout]  # fmt: skip


def split_layout(input_layout: object) -> tuple[str, str]:
    if not isinstance(input_layout, str):
        raise fail("input_layout", f"expected a str, got {type(input_layout).__name__}")
    if input_layout not in _LAYOUTS:
        raise fail("input_layout", f"unknown layout {input_layout!r} (documented: "
                   f"{', '.join(_LAYOUTS)})")  # fmt: skip
    return _LAYOUTS[input_layout]


def check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(name, f"expected an int, got {type(value).__name__}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise fail(name, f"{value} is outside [{lo}, {hi}]")
    return value


def int_list(name: str, values: object) -> list[int] | None:
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        if values.device.type not in ("cpu", "meta") or values.dim() != 1:
            raise fail(name, "expected a list of ints (or a 1-D host tensor)")
        return [int(v) for v in values.tolist()]
    if not isinstance(values, (list, tuple)):
        raise fail(name, f"expected a list of ints, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool):
            raise fail(name, f"entry {i} is a bool, expected an int")
        try:
            out.append(_as_index(v))
        except TypeError:
            raise fail(name, f"entry {i} is {type(v).__name__}, expected an int") from None
    return out


def per_batch(name: str, values: list[int] | None, batch: int, limit: int) -> tuple[int, ...]:
    """The document's rule: one entry applies to every batch, else the first B entries."""
    if values is None:
        return (limit,) * batch
    if len(values) == 1:
        values = values * batch
    elif len(values) >= batch:
        values = values[:batch]
    else:
        raise fail(name, f"has {len(values)} entries; expected 1 or at least the batch size "
                   f"({batch})")  # fmt: skip
    for b, v in enumerate(values):
        if not 0 <= v <= limit:
            raise fail(name, f"value {v} for batch {b} is outside [0, {limit}]")
    return tuple(values)


def cumulative(name: str, values: list[int] | None, total: int) -> tuple[tuple[int, ...], ...]:
    """(lengths, starts) from TND cumulative ends."""
    if values is None:
        raise fail(name, "is required for the TND/NTD layouts (cumulative ends per batch)")
    if not values:
        raise fail(name, "must not be empty for the TND/NTD layouts")
    prev = 0
    lens, starts = [], []
    for i, v in enumerate(values):
        if v < prev:
            raise fail(name, f"entry {i} ({v}) is smaller than the entry before ({prev}): "
                       "TND lengths are cumulative and must not decrease")  # fmt: skip
        lens.append(v - prev)
        starts.append(prev)
        prev = v
    if prev > total:
        raise fail(name, f"the last cumulative end {prev} exceeds T = {total}")
    return tuple(lens), tuple(starts)
