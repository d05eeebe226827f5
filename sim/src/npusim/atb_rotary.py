"""``torch_npu._npu_rotary_embedding`` (ATB RopeOperation), as op-plugin's RopeAtb.cpp runs it.

    _npu_rotary_embedding(positions, query(a!) [T, Nq * head_size], key(a!) [T, Nk * head_size],
                          head_size, cos_sin_cache [max_pos, head_size], is_neox_style) -> ()

Unlike the fused ops of :mod:`.fused_ops` it is not one kernel. op-plugin keeps four
process-wide tables built from the ``cos_sin_cache`` of the first call (cos and sin halves,
each doubled: repeated for NeoX, interleaved otherwise) and never rebuilds them, so every
later call rotates by the first call's cache whatever it passes; each call then gathers
the tables' rows at ``positions`` (two ``index_select`` ops) and runs the ATB rope kernel,
in place on query and key. The sim issues the same device work: the four table ops on the
first call, then two gathers and one rope task per call, each on the current stream and
seen by the race tracking; a later call that passes another cache is warned about, and
rotates by the first one, as on the NPU.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .errors import SimUsageError
from .fused_ops import rotate_half, rotate_interleaved
from .streams import current_stream
from .tensor import issue, register_host_op

NAME = "_npu_rotary_embedding"
_lib = torch.library.Library("npu", "FRAGMENT")
_lib.define(
    f"{NAME}(Tensor positions, Tensor(a!) query, Tensor(b!) key, int head_size, "
    "Tensor cos_sin_cache, bool is_neox_style) -> ()"
)
# The rope task the op ends in: ATB's kernel, with the gathered rows (sim-internal name).
_lib.define(
    "_npusim_atb_rope(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin, int head_size, "
    "bool is_neox_style) -> ()"
)


def _rope_cpu(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              head_size: int, is_neox_style: bool) -> None:  # fmt: skip
    turn = rotate_half if is_neox_style else rotate_interleaved
    c, s = cos.float()[:, None], sin.float()[:, None]
    for t in (q, k):
        heads = t.float().reshape(t.shape[0], -1, head_size)
        t.copy_((heads * c + turn(heads) * s).reshape(t.shape))


def _rope_meta(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               head_size: int, is_neox_style: bool) -> None:  # fmt: skip
    return None


_lib.impl("_npusim_atb_rope", _rope_cpu, "CPU")
_lib.impl("_npusim_atb_rope", _rope_meta, "Meta")
rotary_embedding = getattr(torch.ops.npu, NAME)
_rope = torch.ops.npu._npusim_atb_rope.default


class _Tables:
    """op-plugin's static cos/sin tables: built once, from the first call's cache."""

    source: Any = None  # (data_ptr, shape, dtype) of the cache they were built from
    neox: tuple[torch.Tensor, torch.Tensor] | None = None
    paired: tuple[torch.Tensor, torch.Tensor] | None = None


def _check(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_size: int,
           cache: torch.Tensor) -> None:  # fmt: skip
    tokens = positions.numel()
    if positions.dtype not in (torch.int32, torch.int64):
        raise SimUsageError(f"torch_npu.{NAME}: positions must be int32 or int64, got "
                            f"{positions.dtype}")  # fmt: skip
    for name, t in (("query", q), ("key", k)):
        if t.dim() != 2 or t.shape[0] != tokens or head_size <= 0 or t.shape[1] % head_size:
            raise SimUsageError(
                f"torch_npu.{NAME}: {name} must be [num_tokens={tokens}, heads * head_size="
                f"{head_size}], got {list(t.shape)}"
            )
        if not t.is_contiguous():
            raise SimUsageError(f"torch_npu.{NAME}: {name} must be contiguous (it is updated in "
                                "place): pass .contiguous()")  # fmt: skip
    if cache.dim() != 2 or cache.shape[1] != head_size or head_size % 2:
        raise SimUsageError(
            f"torch_npu.{NAME}: cos_sin_cache must be [max_position, head_size={head_size}] "
            f"(cos then sin halves), got {list(cache.shape)}"
        )
    for name, t in (("key", k), ("cos_sin_cache", cache)):
        if t.dtype != q.dtype:
            raise SimUsageError(f"torch_npu.{NAME}: {name} is {t.dtype} but must have query's "
                                f"dtype {q.dtype}")  # fmt: skip


def _tables(cache: torch.Tensor, is_neox_style: bool) -> tuple[torch.Tensor, torch.Tensor]:
    source = (cache.data_ptr(), tuple(cache.shape), cache.dtype)
    if _Tables.source is None:
        cos, sin = cache.chunk(2, dim=-1)
        _Tables.paired = (cos.repeat_interleave(2, 1), sin.repeat_interleave(2, 1))
        _Tables.neox = (cos.repeat(1, 2), sin.repeat(1, 2))
        _Tables.source = source
    elif source != _Tables.source:
        warnings.warn(
            f"torch_npu.{NAME}: this cos_sin_cache is not the one of the first call; the op "
            "rotates by the first call's (op-plugin RopeAtb.cpp builds its tables once per "
            "process), on the NPU as here",
            UserWarning,
            stacklevel=3,
        )
    tables = _Tables.neox if is_neox_style else _Tables.paired
    assert tables is not None
    return tables


def _issue(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    names = ("positions", "query", "key", "head_size", "cos_sin_cache", "is_neox_style")
    bound = dict(zip(names, args, strict=False)) | kwargs
    positions, q, k = bound["positions"], bound["query"], bound["key"]
    head_size, cache, neox = bound["head_size"], bound["cos_sin_cache"], bound["is_neox_style"]
    _check(positions, q, k, head_size, cache)
    cos_table, sin_table = _tables(cache, neox)
    flat = positions.flatten()
    cos, sin = cos_table.index_select(0, flat), sin_table.index_select(0, flat)
    index = q.device.index or 0
    issue(current_stream(index), _rope, (q, k, cos, sin, head_size, neox), {}, index)


def reset_tables() -> None:
    """Forget the tables (a new process on the NPU): the next call builds them again."""
    _Tables.source = _Tables.neox = _Tables.paired = None


register_host_op(rotary_embedding.default, _issue)
