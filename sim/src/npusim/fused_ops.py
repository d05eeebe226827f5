"""The fused ops of torch_npu 2.14 that the field's decode and prefill layers are built from.

Norms (``npu_rms_norm``, ``npu_add_rms_norm``), rotary embeddings (``npu_rotary_mul``,
``npu_apply_rotary_pos_emb``, ``npu_mrope``), the gated activation (``npu_swiglu``), the
paged KV-cache writes (``npu_scatter_pa_kv_cache``, ``_npu_reshape_and_cache``) and the
sampling filter (``npu_top_k_top_p``), registered as ``torch.ops.npu.*`` with the wheel's
schemas (checked by sim/tests/test_npu_schemas.py).

Each call is one device op on the current stream: captured as one task, its reads and
writes known to the race tracking from its schema (the cache writes and the in-place
rotary declare ``Tensor(a!)``). The Meta kernels check shapes and arguments at issue
time, with the rules of torch_npu's documentation and op-plugin's source (the table in
sim/README.md says which commit); dtype allow-lists are not repeated here. The CPU
kernels compute in float32 and round once to the op's output dtype, as the NPU's vector
units do for float16 and bfloat16 (the float32 intermediates are the sim's choice where
the kernels' sources are not public).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .errors import SimUsageError

_lib = torch.library.Library("npu", "FRAGMENT")


def _register(schema: str, cpu: Callable[..., Any], meta: Callable[..., Any]) -> Any:
    """Define ``torch.ops.npu.<name>`` with its CPU kernel and its Meta (issue-time) check."""
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    _lib.impl(name, cpu, "CPU")
    _lib.impl(name, meta, "Meta")
    return getattr(torch.ops.npu, name)


def _refuse(op: str, message: str) -> SimUsageError:
    return SimUsageError(f"torch_npu.{op}: {message}")


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


def _same_dtype(op: str, x: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.dtype != x.dtype:
            raise _refuse(op, f"{name} is {t.dtype} but must have the input's dtype {x.dtype}")


def _contiguous(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not t.is_contiguous():
            raise _refuse(op, f"{name} must be contiguous (the op does not take strided "
                              "inputs): pass .contiguous()")  # fmt: skip


def _empty_like_meta(x: torch.Tensor, shape: Any = None, dtype: Any = None) -> torch.Tensor:
    return torch.empty(_shape(x) if shape is None else shape, dtype=dtype or x.dtype,
                       device=x.device)  # fmt: skip


# ================================================================ RMS norms
def _rstd_shape(op: str, x: torch.Tensor, gamma: torch.Tensor, first: str) -> list[int]:
    """op-plugin's ``rms_norm_npu_output_size``: x's leading dims, 1 for each of gamma's."""
    if not 1 <= x.dim() <= 8:
        raise _refuse(op, f"{first} must have 1 to 8 dims, got {_shape(x)}")
    g = gamma.dim()
    if g < 1 or g > x.dim() or _shape(gamma) != _shape(x)[x.dim() - g :]:
        raise _refuse(
            op, f"gamma {_shape(gamma)} must equal the trailing dims of {first} {_shape(x)} "
                "(the dims it normalises)",
        )  # fmt: skip
    if x.numel() == 0:
        raise _refuse(op, f"{first} is empty; the op does not take empty tensors")
    _same_dtype(op, x, gamma=gamma)
    return _shape(x)[: x.dim() - g] + [1] * g


def _normalised(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    """(y in float32, rstd in float32) of RMSNorm over gamma's dims, x in float32."""
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    rstd = torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
    return x * rstd * gamma.float(), rstd


def _rms_norm_meta(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> Any:
    rstd = _rstd_shape("npu_rms_norm", x, gamma, "input")
    return _empty_like_meta(x), _empty_like_meta(x, rstd, torch.float32)


def _rms_norm_cpu(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> Any:
    y, rstd = _normalised(x.float(), gamma, epsilon)
    return y.to(x.dtype), rstd


def _add_rms_norm_meta(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor,
                       epsilon: float = 1e-6) -> Any:  # fmt: skip
    op = "npu_add_rms_norm"
    if _shape(x1) != _shape(x2):
        raise _refuse(op, f"x1 {_shape(x1)} and x2 {_shape(x2)} must have the same shape")
    _same_dtype(op, x1, x2=x2)
    rstd = _rstd_shape(op, x1, gamma, "x1")
    return _empty_like_meta(x1), _empty_like_meta(x1, rstd, torch.float32), _empty_like_meta(x1)


def _add_rms_norm_cpu(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor,
                      epsilon: float = 1e-6) -> Any:  # fmt: skip
    # The sum is normalised before it is rounded to x1's dtype; x_sum is the rounded sum.
    x = x1.float() + x2.float()
    y, rstd = _normalised(x, gamma, epsilon)
    return y.to(x1.dtype), rstd, x.to(x1.dtype)


rms_norm = _register(
    "npu_rms_norm(Tensor input, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    _rms_norm_cpu, _rms_norm_meta,
)  # fmt: skip
add_rms_norm = _register(
    "npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) "
    "-> (Tensor, Tensor, Tensor)",
    _add_rms_norm_cpu, _add_rms_norm_meta,
)  # fmt: skip


# ================================================================ rotary embeddings
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(-x2, x1) of the two halves of the last dim (GPT-NeoX)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """(-x1, x0) of each pair of the last dim (GPT-J)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


_ROTATIONS = {"half": rotate_half, "interleave": rotate_interleaved}


MaybeTensor = torch.Tensor | None


def _rotary_mul_meta(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor,
                     rotary_mode: str = "half", rotate: MaybeTensor = None) -> Any:  # fmt: skip
    op = "npu_rotary_mul"
    if rotary_mode not in _ROTATIONS:
        raise _refuse(op, f"rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    if x.dim() != 4:
        raise _refuse(op, f"input must be 4-D (BNSD, BSND or SBND), got {_shape(x)}")
    d = x.shape[-1]
    if d % 2 or d >= 896:
        raise _refuse(op, f"the last dim D of input must be even and below 896, got {d}")
    for name, r in (("r1", r1), ("r2", r2)):
        ok = r.dim() == 4 and r.shape[-1] == d
        ok = ok and all(rd in (1, xd) for rd, xd in zip(r.shape[:3], x.shape[:3], strict=True))
        if not ok:
            raise _refuse(op, f"{name} {_shape(r)} must be 4-D with D {d} and each other dim 1 "
                              f"or input's {_shape(x)}")  # fmt: skip
    if _shape(r1) != _shape(r2):
        raise _refuse(op, f"r1 {_shape(r1)} and r2 {_shape(r2)} must have the same shape")
    if rotary_mode == "interleave" and sum(n > 1 for n in r1.shape[:3]) > 1:
        raise _refuse(op, f"in 'interleave' mode r1/r2 broadcast over all but S (11SD, 1S1D or "
                          f"S11D), got {_shape(r1)}")  # fmt: skip
    if rotate is not None and _shape(rotate) != [d, d]:
        raise _refuse(op, f"rotate must be [D, D] = [{d}, {d}], got {_shape(rotate)}")
    _same_dtype(op, x, r1=r1, r2=r2, rotate=rotate)
    return _empty_like_meta(x)


def _rotary_mul_cpu(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor,
                    rotary_mode: str = "half", rotate: MaybeTensor = None) -> Any:  # fmt: skip
    xf = x.float()
    turned = xf @ rotate.float() if rotate is not None else _ROTATIONS[rotary_mode](xf)
    return (r1.float() * xf + r2.float() * turned).to(x.dtype)


rotary_mul = _register(
    "npu_rotary_mul(Tensor input, Tensor r1, Tensor r2, str rotary_mode='half', "
    "Tensor? rotate=None) -> Tensor",
    _rotary_mul_cpu, _rotary_mul_meta,
)  # fmt: skip


_APPLY = "npu_apply_rotary_pos_emb"


def _apply_rotary_meta(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       layout: str = "BSND", rotary_mode: str = "half") -> Any:  # fmt: skip
    op = _APPLY
    if rotary_mode not in ("half", "quarter", "interleave"):
        raise _refuse(op, f"rotary_mode must be half, quarter or interleave, got {rotary_mode!r}")
    if rotary_mode != "half":
        raise _refuse(op, f"rotary_mode {rotary_mode!r} runs on the Atlas 350 only; Atlas A2 "
                          "takes 'half'")  # fmt: skip
    if layout in ("SBND", "BNSD"):
        raise _refuse(op, f"layout {layout} runs on the Atlas 350 only; Atlas A2 takes BSND "
                          "(4-D) or TND (3-D)")  # fmt: skip
    dims = 3 if layout == "TND" else 4  # op-plugin reads any other string as BSND
    lead = dims - 2  # T, or B and S
    for name, t in (("query", q), ("key", k), ("cos", cos), ("sin", sin)):
        if t.dim() != dims or t.numel() == 0:
            raise _refuse(op, f"{name} must be a non-empty {dims}-D tensor for layout "
                              f"{layout}, got {_shape(t)}")  # fmt: skip
        if t.shape[-1] not in (64, 128):
            raise _refuse(op, f"the last dim D of {name} must be 64 or 128 on Atlas A2, got "
                              f"{t.shape[-1]}")  # fmt: skip
        if _shape(t)[:lead] != _shape(q)[:lead]:
            raise _refuse(op, f"{name} {_shape(t)} and query {_shape(q)} must agree in their "
                              f"first {lead} dims")  # fmt: skip
    if k.shape[-1] != q.shape[-1] or cos.shape[-1] != q.shape[-1]:
        raise _refuse(op, f"query, key, cos and sin must have one D, got {q.shape[-1]}, "
                          f"{k.shape[-1]}, {cos.shape[-1]}")  # fmt: skip
    if _shape(cos) != _shape(sin) or cos.shape[-2] != 1:
        raise _refuse(op, f"cos {_shape(cos)} and sin {_shape(sin)} must be equal, with N 1")
    _same_dtype(op, q, key=k, cos=cos, sin=sin)
    return q, k


def _apply_rotary_cpu(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      layout: str = "BSND", rotary_mode: str = "half") -> Any:  # fmt: skip
    c, s = cos.float(), sin.float()
    for t in (q, k):
        tf = t.float()
        t.copy_(tf * c + rotate_half(tf) * s)
    return q, k


# torch_npu's schema declares no writes, but the op updates query and key in place
# (op-plugin ApplyRotaryPosEmbNpuOpApi.cpp returns them): the sim says so, so that the race
# tracking sees the writes (sim/tests/test_npu_schemas.py lists the added annotations).
apply_rotary_pos_emb = _register(
    f"{_APPLY}(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin, str layout='BSND', "
    "str rotary_mode='half') -> (Tensor(a!), Tensor(b!))",
    _apply_rotary_cpu, _apply_rotary_meta,
)  # fmt: skip


_MROPE = "npu_mrope"


def _mrope_checks(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  cache: torch.Tensor, head_size: int, mrope_section: Any,
                  rotary_mode: str | None, cache_mode: str | None) -> list[int]:  # fmt: skip
    """op-plugin RopeWithSinCosCacheKernelNpuOpApi.cpp and the documented shape rules;
    returns the mrope section ([0, 0, 0]: plain rope)."""
    op = _MROPE
    if (rotary_mode or "half") not in ("half", "interleave"):
        raise _refuse(op, f"rotary_mode only support half or interleave, got {rotary_mode!r}")
    if (cache_mode or "default") not in ("default", "interleave"):
        raise _refuse(op, f"cache_mode only support default or interleave, got {cache_mode!r}")
    if (cache_mode or "default") != "default":
        raise _refuse(op, "cache_mode 'interleave' is not implemented by the simulated NPU")
    section = list(mrope_section) if mrope_section is not None else [0, 0, 0]
    rope = not any(section)
    if positions.dim() != (1 if rope else 2) or (not rope and positions.shape[0] != 3):
        want = "[num_tokens]" if rope else "[3, num_tokens] (mrope_section is set)"
        raise _refuse(op, f"positions must be {want}, got {_shape(positions)}")
    if positions.dtype not in (torch.int32, torch.int64):
        raise _refuse(op, f"positions must be int32 or int64, got {positions.dtype}")
    tokens = positions.shape[-1]
    for name, t in (("query", q), ("key", k)):
        if t.dim() != 2 or t.shape[0] != tokens or head_size <= 0 or t.shape[1] % head_size:
            raise _refuse(op, f"{name} must be [num_tokens={tokens}, heads * head_size="
                              f"{head_size}], got {_shape(t)}")  # fmt: skip
    if cache.dim() != 2:
        raise _refuse(op, f"cos_sin_cache must be [max_seq_len, rotary_dim], got {_shape(cache)}")
    rotary = cache.shape[1]
    align = 16 if q.dtype == torch.float32 else 32
    if rotary % align or rotary > head_size:
        raise _refuse(op, f"rotary_dim {rotary} must be a multiple of {align} for {q.dtype} and "
                          f"at most head_size {head_size}")  # fmt: skip
    if not rope and (len(section) != 3 or sum(section) != rotary // 2):
        raise _refuse(op, f"mrope_section {section} must be 3 numbers summing to rotary_dim/2 = "
                          f"{rotary // 2}")  # fmt: skip
    _same_dtype(op, q, key=k, cos_sin_cache=cache)
    return section


def _mrope_meta(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor,
                head_size: int, *, mrope_section: Any = None, rotary_mode: str | None = "half",
                cache_mode: str | None = "default") -> Any:  # fmt: skip
    _mrope_checks(positions, q, k, cache, head_size, mrope_section, rotary_mode, cache_mode)
    return _empty_like_meta(q), _empty_like_meta(k)


def _mrope_cos_sin(positions: torch.Tensor, cache: torch.Tensor,
                   section: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """[tokens, rotary_dim/2] cos and sin: the cache's rows at the positions; with mrope,
    frequencies of section i from the rows of positions[i]."""
    pos = positions.long()
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= cache.shape[0]):
        raise IndexError(f"npu_mrope: a position is outside cos_sin_cache's {cache.shape[0]} rows")
    cos, sin = cache.float()[pos].chunk(2, dim=-1)  # [tokens, r/2], or [3, tokens, r/2]
    if any(section):  # section i of the frequencies rotates by positions[i]
        cos = torch.cat([part[i] for i, part in enumerate(cos.split(section, dim=-1))], -1)
        sin = torch.cat([part[i] for i, part in enumerate(sin.split(section, dim=-1))], -1)
    return cos, sin


def _mrope_cpu(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor,
               head_size: int, *, mrope_section: Any = None, rotary_mode: str | None = "half",
               cache_mode: str | None = "default") -> Any:  # fmt: skip
    section = list(mrope_section) if mrope_section is not None else [0, 0, 0]
    cos, sin = _mrope_cos_sin(positions, cache, section)
    rotary = cache.shape[1]
    if (rotary_mode or "half") == "half":
        cos, sin, turn = cos.repeat(1, 2), sin.repeat(1, 2), rotate_half
    else:
        cos, sin = cos.repeat_interleave(2, 1), sin.repeat_interleave(2, 1)
        turn = rotate_interleaved
    outs = []
    for t in (q, k):
        heads = t.float().reshape(t.shape[0], -1, head_size).clone()
        rot = heads[..., :rotary]  # the rest of each head passes through
        heads[..., :rotary] = rot * cos[:, None] + turn(rot) * sin[:, None]
        outs.append(heads.reshape(t.shape).to(t.dtype))
    return outs[0], outs[1]


mrope = _register(
    f"{_MROPE}(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, int head_size, "
    "*, int[]? mrope_section=None, str? rotary_mode='half', str? cache_mode='default') "
    "-> (Tensor, Tensor)",
    _mrope_cpu, _mrope_meta,
)  # fmt: skip


# ================================================================ SwiGLU
def _swiglu_meta(x: torch.Tensor, dim: int = -1) -> Any:
    op = "npu_swiglu"
    if not 1 <= x.dim() <= 8 or x.numel() == 0:
        raise _refuse(op, f"input must be a non-empty tensor of 1 to 8 dims, got {_shape(x)}")
    if not -x.dim() <= dim < x.dim():
        raise _refuse(op, f"dim {dim} is out of range for a {x.dim()}-D input")
    if x.shape[dim] % 2:
        raise _refuse(op, f"input's dim {dim} has size {x.shape[dim]}: it must split in two "
                          "halves")  # fmt: skip
    _contiguous(op, input=x)
    shape = _shape(x)
    shape[dim] //= 2
    return _empty_like_meta(x, shape)


def _swiglu_cpu(x: torch.Tensor, dim: int = -1) -> Any:
    # The first half goes through SiLU, the second gates it (the docs' A and B).
    a, b = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


swiglu = _register("npu_swiglu(Tensor input, int dim=-1) -> Tensor", _swiglu_cpu, _swiglu_meta)


# ================================================================ paged KV-cache writes
class _CacheWrite:
    """Where one KV-cache write op puts token t: at ``slot = slot_mapping[t]``, block
    ``slot // block_size``, row ``slot % block_size``. ``nz``: the PA_NZ layout
    [num_blocks, heads * D // c0, block_size, c0] with c0 = 32 bytes of the dtype; else
    the ND layout [num_blocks, block_size, heads, D]."""

    def __init__(self, op: str, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slots: torch.Tensor, slots_name: str,
                 nz: bool) -> None:  # fmt: skip
        self.op, self.nz = op, nz
        if key.dim() != 3 or value.dim() != 3 or key.shape[:2] != value.shape[:2]:
            raise _refuse(op, f"key {_shape(key)} and value {_shape(value)} must be "
                              "[num_tokens, num_heads, head_size] with the same tokens and "
                              "heads")  # fmt: skip
        if slots.dim() != 1 or slots.shape[0] != key.shape[0]:
            raise _refuse(op, f"{slots_name} must be [num_tokens={key.shape[0]}], got "
                              f"{_shape(slots)}")  # fmt: skip
        if slots.dtype not in (torch.int32, torch.int64):
            raise _refuse(op, f"{slots_name} must be int32 or int64, got {slots.dtype}")
        _same_dtype(op, key, value=value, key_cache=key_cache, value_cache=value_cache)
        _contiguous(op, key=key, value=value, key_cache=key_cache, value_cache=value_cache)
        self.blocks, self.block_size = self._layout("key_cache", key_cache, key)
        if self._layout("value_cache", value_cache, value) != (self.blocks, self.block_size):
            raise _refuse(op, f"key_cache {_shape(key_cache)} and value_cache "
                              f"{_shape(value_cache)} must have the same blocks")  # fmt: skip

    def _layout(self, name: str, cache: torch.Tensor, rows: torch.Tensor) -> tuple[int, int]:
        width = rows.shape[1] * rows.shape[2]
        c0 = 32 // rows.element_size()
        if self.nz:
            want = f"[num_blocks, {max(width // c0, 1)}, block_size, {c0}] (PA_NZ)"
            ok = cache.dim() == 4 and cache.shape[3] == c0 and cache.shape[1] * c0 == width
        else:
            want = f"[num_blocks, block_size, {rows.shape[1]}, {rows.shape[2]}] (ND)"
            ok = cache.dim() == 4 and cache.shape[2] * cache.shape[3] == width
        if not ok:
            raise _refuse(self.op, f"{name} must be {want} for a {name[:-6]} of "
                                   f"{_shape(rows)}, got {_shape(cache)}")  # fmt: skip
        return cache.shape[0], cache.shape[2] if self.nz else cache.shape[1]

    @staticmethod
    def write(op: str, rows: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
              nz: bool) -> None:  # fmt: skip
        """Write token rows into their slots; a negative slot is a padding token, skipped."""
        block_size = cache.shape[2] if nz else cache.shape[1]
        capacity = cache.shape[0] * block_size
        s = slots.long()
        if s.numel() and int(s.max()) >= capacity:
            raise IndexError(f"{op}: slot {int(s.max())} is outside the cache's {capacity} "
                             "slots")  # fmt: skip
        keep = (s >= 0).nonzero().squeeze(1)
        block, row = s[keep] // block_size, s[keep] % block_size
        flat = rows[keep].reshape(keep.numel(), -1)
        if nz:
            cache[block, :, row, :] = flat.reshape(keep.numel(), cache.shape[1], cache.shape[3])
        else:
            cache.view(cache.shape[0], block_size, -1)[block, row] = flat


_SCATTER = "npu_scatter_pa_kv_cache"


def _scatter_nz(op: str, cache_mode: str | None) -> bool:
    if cache_mode in (None, "Norm"):
        return False
    if cache_mode == "PA_NZ":
        return True
    raise _refuse(op, f"cache_mode must be 'PA_NZ' or 'Norm' (or None), got {cache_mode!r}")


def _scatter_meta(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                  compress_lens: Any = None, compress_seq_offsets: Any = None,
                  seq_lens: Any = None, cache_mode: str | None = "PA_NZ") -> None:  # fmt: skip
    if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
        raise _refuse(_SCATTER, "compress_lens, compress_seq_offsets and seq_lens (the "
                                "compressing 4-D form) are not implemented by the simulated "
                                "NPU")  # fmt: skip
    nz = _scatter_nz(_SCATTER, cache_mode)
    _CacheWrite(_SCATTER, key, value, key_cache, value_cache, slot_mapping, "slot_mapping", nz)


def _scatter_cpu(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                 compress_lens: Any = None, compress_seq_offsets: Any = None,
                 seq_lens: Any = None, cache_mode: str | None = "PA_NZ") -> None:  # fmt: skip
    nz = _scatter_nz(_SCATTER, cache_mode)
    _CacheWrite.write(_SCATTER, key, key_cache, slot_mapping, nz)
    _CacheWrite.write(_SCATTER, value, value_cache, slot_mapping, nz)


scatter_pa_kv_cache = _register(
    f"{_SCATTER}(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping, *, Tensor? compress_lens=None, Tensor? compress_seq_offsets=None, "
    "Tensor? seq_lens=None, str? cache_mode='PA_NZ') -> ()",
    _scatter_cpu, _scatter_meta,
)  # fmt: skip


_RESHAPE = "_npu_reshape_and_cache"


def _reshape_meta(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, slot_indices: torch.Tensor) -> None:  # fmt: skip
    # The sim's caches are ND (get_npu_format is ND): ATB's NZ configuration never applies.
    _CacheWrite(_RESHAPE, key, value, key_cache, value_cache, slot_indices, "slot_indices", False)


def _reshape_cpu(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_indices: torch.Tensor) -> None:  # fmt: skip
    _CacheWrite.write(_RESHAPE, key, key_cache, slot_indices, False)
    _CacheWrite.write(_RESHAPE, value, value_cache, slot_indices, False)


reshape_and_cache = _register(
    f"{_RESHAPE}(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_indices) -> ()",
    _reshape_cpu, _reshape_meta,
)  # fmt: skip


# ================================================================ top-k / top-p filter
_TOPKP = "npu_top_k_top_p"


def _top_k_top_p_meta(logits: torch.Tensor, p: torch.Tensor | None = None,
                      k: torch.Tensor | None = None) -> Any:  # fmt: skip
    op = _TOPKP
    if logits.dim() != 2 or logits.numel() == 0:
        raise _refuse(op, f"logits must be a non-empty [batch, vocab], got {_shape(logits)}")
    batch = logits.shape[0]
    for name, t in (("p", p), ("k", k)):
        if t is not None and _shape(t) != [batch]:
            raise _refuse(op, f"{name} must be [batch={batch}] (one value per row), got "
                              f"{_shape(t)}")  # fmt: skip
    _same_dtype(op, logits, p=p)
    return _empty_like_meta(logits)


def _top_k_top_p_cpu(logits: torch.Tensor, p: torch.Tensor | None = None,
                     k: torch.Tensor | None = None) -> Any:  # fmt: skip
    """The documented algorithm: sort each row ascending (stable); top-k keeps the values
    not below the k-th largest (ties included); top-p then drops, smallest first, the
    values whose cumulative softmax (of what top-k kept) is at most 1 - p, keeping the
    largest always; dropped values become -inf, in the original order."""
    vocab = logits.shape[1]
    values, order = logits.float().sort(dim=-1, stable=True)
    if k is not None:
        kk = k.long()
        if kk.numel() and (int(kk.min()) < 1 or int(kk.max()) > vocab):
            raise IndexError(f"{_TOPKP}: k must be within [1, {vocab}] (the vocab size)")
        kth = values.gather(-1, (vocab - kk).unsqueeze(-1))
        values = values.masked_fill(values < kth, float("-inf"))
    if p is not None:
        cumulative = values.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - p.float()).unsqueeze(-1)
        drop[:, -1] = False
        values = values.masked_fill(drop, float("-inf"))
    out = torch.empty_like(values).scatter_(-1, order, values)
    return out.to(logits.dtype)


top_k_top_p = _register(
    f"{_TOPKP}(Tensor logits, Tensor? p=None, Tensor? k=None) -> Tensor",
    _top_k_top_p_cpu, _top_k_top_p_meta,
)  # fmt: skip
