"""The fused attention ``.out`` op's issue-time check, remembered across calls.

Every patch of a captured attention task re-issues the op with new lengths and
nothing else changed. Its full check (:meth:`.fia_ops.Kernels.out_meta`: bind,
plan, workspace and output checks) reads, of everything but the lengths, only
shapes, strides, dtypes and values; so once a call passed it, a call equal to it
in all of that (the :class:`.opcall.RememberedCheck` key) needs only what the
lengths decide checked again: their types, counts and ranges, the paged cache's
block count, and the workspace they need. :class:`Lengths` holds what that takes,
and :func:`recheck` raises the errors the full check raises, in its order.

Calls whose lengths decide more are never remembered (their full check runs every
time): the TND/NTD layouts (cumulative lengths set the batch and query rows), MLA
rope (its checks read the query lengths), and a paged cache with a mask or a
positional shift (whose shapes are checked against the lengths' block count).
"""

from __future__ import annotations

from typing import Any

from .fia_args import AttentionArgumentError, fail, int_list, per_batch
from .fia_layout import Plan, _kv_paged, workspace_bytes
from .fia_ops import Kernels, refuse_short_workspace, usage_error
from .opcall import RememberedCheck

LENGTHS = ("actual_seq_lengths", "actual_seq_lengths_kv")


class Lengths:
    """What a passed call fixed that the lengths are checked against."""

    __slots__ = (
        "batch",
        "block_size",
        "blocks",
        "capacity",
        "heads",
        "incremental",
        "kernels",
        "kv_limit",
        "q_seq",
        "roomy",
        "workspace",
    )  # fmt: skip

    def __init__(self, kernels: Kernels, p: Plan, a: dict[str, Any]) -> None:
        self.kernels = kernels
        self.batch, self.q_seq, self.incremental = p.batch, p.q_seq, p.incremental
        self.heads, self.block_size = p.num_heads, p.block_size
        self.kv_limit = p.kv_seq
        self.capacity = self.blocks = 0
        if p.paged:
            self.capacity = a["block_table"].shape[1] * p.block_size
            self.blocks = _kv_paged(a["key"], a["value"], p.layout_in, p.num_kv_heads,
                                    p.block_size, bool(a.get("value_d_free")))[0]  # fmt: skip
        workspace = a.get("workspace")
        self.workspace = None if workspace is None else workspace.numel()
        # The workspace lengths need grows with them: one that holds what the longest
        # lengths allowed need holds any, and the check per call can be skipped.
        longest = self.capacity if p.paged else self.kv_limit
        self.roomy = self.workspace is not None and self.workspace >= workspace_bytes(
            self.heads, (self.q_seq,) * self.batch, (longest,) * self.batch
        )


def full(kernels: Kernels) -> Any:
    """The full check: ``out_meta``; its token the call's :class:`Lengths`, or None
    (not remembered) when its lengths decide more than :func:`recheck` checks."""

    def check(*args: Any, **kwargs: Any) -> Lengths | None:
        p, a = kernels.planned(args, kwargs)
        kernels.check_out_call(p, a)
        if p.layout_in in ("TND", "NTD") or p.rope_dim or (p.paged and (p.mask or p.pse)):
            return None
        return Lengths(kernels, p, a)

    return check


def recheck(rule: Lengths, values: list[Any]) -> None:
    """The full check's length checks, for the lengths ``values`` (in LENGTHS order)."""
    k = rule.kernels
    b = rule.batch
    try:
        q = int_list(LENGTHS[0], values[0])
        kv = int_list(LENGTHS[1], values[1])
        q_lens = (rule.q_seq,) * b if rule.incremental else per_batch(LENGTHS[0], q, b, rule.q_seq)
        if rule.blocks:
            if kv is None:
                raise fail(LENGTHS[1], "is required with page attention")
            kv_lens = per_batch(LENGTHS[1], kv, b, rule.capacity)
            need = sum(-(-x // rule.block_size) for x in kv_lens)
            if need > rule.blocks:
                raise fail("key", f"blocknum {rule.blocks} is smaller than the {need} blocks the "
                           "batches' actual_seq_lengths_kv need")  # fmt: skip
        else:
            kv_lens = per_batch(LENGTHS[1], kv, b, rule.kv_limit)
    except AttentionArgumentError as exc:
        raise usage_error(k.op_name, exc, k.names) from exc
    if rule.workspace is not None and not rule.roomy:
        needed = workspace_bytes(rule.heads, q_lens, kv_lens)
        if rule.workspace < needed:
            refuse_short_workspace(k.out_name, rule.workspace, needed, k.workspace_getter)


def remembered_out_check(kernels: Kernels) -> RememberedCheck:
    """The ``HOST_CHECKS`` entry of ``kernels``' ``.out`` op (whose length lists are
    keyword-only arguments)."""
    return RememberedCheck(full(kernels), recheck, LENGTHS)


__all__ = ["LENGTHS", "Lengths", "recheck", "remembered_out_check"]
