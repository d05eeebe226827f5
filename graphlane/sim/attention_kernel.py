"""CPU reference kernel for Ascend's ``torch_npu.npu_fused_infer_attention_score``.

This is the kernel that graphlane's simulated NPU runs on the CPU. It works on plain CPU
tensors and imports nothing from graphlane.

Source of the semantics: the Ascend op-plugin documentation,
``docs/context/torch_npu-npu_fused_infer_attention_score.md`` (repository Ascend/op-plugin).
The points of that document this module follows are:

* Formula: ``attention_out = softmax(scale * (query @ key^T) + atten_mask) @ value``.
  ``pse_shift`` (when given) is added to the scaled scores before the mask is applied.
* Branches: when the query S is 1 the op takes the IncreFlashAttention (IFA) branch,
  otherwise the PromptFlashAttention (PFA) branch. In the IFA branch
  ``actual_seq_lengths`` "is invalid" (ignored): only its type is checked.
* Layouts: ``BNSD``, ``BSND`` and ``BSH`` are implemented, with ``D = H / N``. The other
  documented layouts (``TND``, ``BNSD_BSND``, ``BSH_NBSD``, ...) raise
  :class:`AttentionArgumentError` as not implemented.
* ``num_heads`` must equal the query N axis (BNSD/BSND) and, for BSH, divide H.
* ``num_key_value_heads == 0`` means "same as ``num_heads``"; ``num_heads`` must be divisible
  by it and the ratio must not exceed 64 (GQA: query head ``n`` uses key/value head
  ``n // (num_heads // num_key_value_heads)``). For BNSD/BSND it must equal the key/value N
  axis.
* key and value shapes must match, except that value's D may differ; ``attention_out`` has
  query's shape and layout with the last D taken from value.
* ``actual_seq_lengths`` / ``actual_seq_lengths_kv``: a list of length 1 applies to every
  batch; a list at least as long as the batch uses its first B entries; other lengths are
  rejected. Each valid length must not exceed the corresponding S (and must be >= 0).
  Key positions beyond the kv length are excluded from the softmax; query rows beyond the
  query length (PFA branch only) produce zeros.
* Empty key/value (S2 == 0, here also a kv length of 0 for one batch) fills
  ``attention_out`` with zeros.
* ``pse_shift`` shape is ``(B, N, Q_S, KV_S)`` or ``(1, N, Q_S, KV_S)``; the document allows
  the last two dims to be padded (Q_S / KV_S "must be >=" the query / key S), so larger
  trailing dims are accepted and sliced. Its dtype must match query's (float16 with float16,
  bfloat16 with bfloat16; float32 with the simulator's float32 extension).
* ``atten_mask``: dtype bool/int8/uint8, nonzero means "do not attend". Shapes
  ``(Q_S, KV_S)``, ``(B, Q_S, KV_S)``, ``(1, Q_S, KV_S)``, ``(B, 1, Q_S, KV_S)``,
  ``(1, 1, Q_S, KV_S)``, and for Q_S == 1 also ``(B, KV_S)``, ``(B, 1, KV_S)``,
  ``(B, 1, 1, KV_S)``. The last two dims may be padded up to alignment; the mask is sliced to
  ``[:Q_S, :KV_S]``.
* ``sparse_mode`` 0 (defaultMask) and 1 (allMask) both apply the full user mask;
  ``pre_tokens`` / ``next_tokens`` are ignored in these modes (the document says mode 0
  without a mask and mode 1 ignore them; this kernel ignores them in mode 0 with a mask too).
  Modes 2, 3, 4 (optimised 2048x2048 causal/band masks) are not implemented; other values
  are invalid.
* ``inner_precise`` accepts 0..3. It only selects precision/performance and "row invalid"
  correction on hardware; this kernel always computes in float32 and always applies the
  row correction (see below), so the value does not change the result.
* ``softmax_lse_flag``: True gives a float32 ``(B, N, Q_S, 1)`` tensor holding
  ``logsumexp`` of the scaled, shifted and masked scores; False gives a float32 tensor of
  shape ``[1]`` holding 0.
* Quantisation, page attention (``block_table``), left padding, shared prefix, MLA rope and
  the antiquant arguments are not implemented: passing any of them (a value other than None,
  or other than 0 for ``block_size`` and the ``*_mode`` ints) through ``unsupported`` raises.

Choices made where the document is silent:

* query dtype float32 is accepted in addition to float16/bfloat16 (simulator extension);
  computation is always in float32 and the output is cast back to query's dtype.
* A query row that has no key to attend to (every key masked, kv length 0, or the row lies
  beyond the query length) produces zeros in ``attention_out`` and 0 (not ``-inf``) in the
  softmax lse. No NaN is produced.
* A 2-D mask with Q_S == 1 whose first dim equals B is read as ``(B, KV_S)``; otherwise a
  2-D mask is read as ``(Q_S, KV_S)``.
* Non-contiguous inputs are accepted (the hardware op rejects them); inputs are never
  modified.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import index as _as_index

import torch

__all__ = [
    "AttentionArgumentError",
    "check_arguments",
    "check_lengths",
    "fused_infer_attention",
    "output_shapes",
    "workspace_bytes",
]

_IMPLEMENTED_LAYOUTS = ("BNSD", "BSH", "BSND")
_DOCUMENTED_LAYOUTS = (
    "BNSD_BSND",
    "BSH_NBSD",
    "BSND_NBSD",
    "BNSD_NBSD",
    "TND",
    "TND_NTD",
    "NTD_TND",
)
_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)
_MAX_GQA_RATIO = 64
_INT32_MAX = 2147483647
# Arguments that fused_infer_attention takes directly; they must not be passed via
# ``unsupported``.
_DIRECT_ARGUMENTS = frozenset(
    {
        "query",
        "key",
        "value",
        "pse_shift",
        "atten_mask",
        "actual_seq_lengths",
        "actual_seq_lengths_kv",
        "num_heads",
        "scale",
        "pre_tokens",
        "next_tokens",
        "input_layout",
        "num_key_value_heads",
        "sparse_mode",
        "inner_precise",
        "softmax_lse_flag",
    }
)
_WORKSPACE_BASE_BYTES = 64 * 1024
_WORKSPACE_ALIGN_BYTES = 512


class AttentionArgumentError(ValueError):
    """An argument of the fused inference attention op is invalid or not implemented.

    The message always starts with (or names) the offending argument.
    """


@dataclass(frozen=True)
class _Dims:
    """Logical sizes of one call, independent of the layout."""

    batch: int
    num_heads: int
    num_kv_heads: int
    q_seq: int
    kv_seq: int
    head_dim: int
    value_dim: int


def _fail(argument: str, message: str) -> AttentionArgumentError:
    return AttentionArgumentError(f"{argument}: {message}")


def _check_int(name: str, value: object, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, f"expected an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise _fail(name, f"must be >= {minimum}, got {value}")
    return value


def _check_layout(input_layout: object) -> str:
    if not isinstance(input_layout, str):
        raise _fail("input_layout", f"expected a str, got {type(input_layout).__name__}")
    if input_layout in _IMPLEMENTED_LAYOUTS:
        return input_layout
    if input_layout in _DOCUMENTED_LAYOUTS:
        raise _fail(
            "input_layout",
            f"layout {input_layout!r} is not implemented by graphlane's simulated NPU "
            f"(implemented: {', '.join(_IMPLEMENTED_LAYOUTS)})",
        )
    raise _fail(
        "input_layout",
        f"unknown layout {input_layout!r} (implemented: {', '.join(_IMPLEMENTED_LAYOUTS)})",
    )


def _check_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise _fail(name, f"expected a torch.Tensor, got {type(value).__name__}")
    return value


def _heads(num_heads: object, num_key_value_heads: object) -> tuple[int, int]:
    n = _check_int("num_heads", num_heads, minimum=1)
    nkv_arg = _check_int("num_key_value_heads", num_key_value_heads, minimum=0)
    nkv = n if nkv_arg == 0 else nkv_arg
    if n % nkv != 0:
        raise _fail(
            "num_key_value_heads",
            f"num_heads ({n}) must be divisible by num_key_value_heads ({nkv})",
        )
    if n // nkv > _MAX_GQA_RATIO:
        raise _fail(
            "num_key_value_heads",
            f"num_heads / num_key_value_heads = {n // nkv} exceeds {_MAX_GQA_RATIO}",
        )
    return n, nkv


def _expect_rank(name: str, tensor: torch.Tensor, rank: int, layout: str) -> None:
    if tensor.dim() != rank:
        raise _fail(
            name,
            f"layout {layout} expects a {rank}-D tensor, got shape {tuple(tensor.shape)}",
        )


def _split_hidden(name: str, hidden: int, heads: int, heads_name: str) -> int:
    if hidden % heads != 0:
        raise _fail(name, f"hidden size {hidden} is not divisible by {heads_name} ({heads})")
    return hidden // heads


def _dims(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: str,
    num_heads: object,
    num_key_value_heads: object,
) -> _Dims:
    """Validate query/key/value shapes against the layout and return the logical sizes."""
    n, nkv = _heads(num_heads, num_key_value_heads)
    rank = 3 if layout == "BSH" else 4
    _expect_rank("query", query, rank, layout)
    _expect_rank("key", key, rank, layout)
    _expect_rank("value", value, rank, layout)
    qs, ks, vs = tuple(query.shape), tuple(key.shape), tuple(value.shape)

    if layout == "BSH":
        b, sq, h = qs
        d = _split_hidden("query", h, n, "num_heads")
        kb, skv, hk = ks
        dk = _split_hidden("key", hk, nkv, "num_key_value_heads")
        vb, vskv, hv = vs
        dv = _split_hidden("value", hv, nkv, "num_key_value_heads")
    else:
        if layout == "BNSD":
            b, qn, sq, d = qs
            kb, kn, skv, dk = ks
            vb, vn, vskv, dv = vs
        else:  # BSND
            b, sq, qn, d = qs
            kb, skv, kn, dk = ks
            vb, vskv, vn, dv = vs
        if qn != n:
            raise _fail(
                "num_heads",
                f"num_heads ({n}) must equal the N axis of query ({qn}) for layout {layout}",
            )
        if kn != nkv:
            raise _fail(
                "num_key_value_heads",
                f"the N axis of key ({kn}) must equal num_key_value_heads ({nkv}; 0 means "
                f"num_heads) for layout {layout}",
            )
        if vn != kn:
            raise _fail("value", f"N axis ({vn}) must equal key's N axis ({kn})")

    if kb != b:
        raise _fail("key", f"batch size {kb} differs from query's batch size {b}")
    if vb != b:
        raise _fail("value", f"batch size {vb} differs from query's batch size {b}")
    if dk != d:
        raise _fail("key", f"head dim {dk} differs from query's head dim {d}")
    if vskv != skv:
        raise _fail("value", f"sequence length {vskv} differs from key's sequence length {skv}")
    return _Dims(b, n, nkv, sq, skv, d, dv)


def _check_dtypes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    if query.dtype not in _QUERY_DTYPES:
        raise _fail("query", f"dtype {query.dtype} is not float16, bfloat16 or float32")
    if key.dtype != query.dtype:
        raise _fail("key", f"dtype {key.dtype} differs from query's dtype {query.dtype}")
    if value.dtype != query.dtype:
        raise _fail("value", f"dtype {value.dtype} differs from query's dtype {query.dtype}")


def _check_unsupported(unsupported: object) -> None:
    if unsupported is None:
        return
    if not isinstance(unsupported, Mapping):
        raise _fail("unsupported", f"expected a dict, got {type(unsupported).__name__}")
    for name, arg in unsupported.items():
        if not isinstance(name, str):
            raise _fail("unsupported", f"argument names must be str, got {name!r}")
        if name in _DIRECT_ARGUMENTS:
            raise _fail(name, "pass it as a regular argument, not through 'unsupported'")
        if arg is None:
            continue
        int_default = name == "block_size" or name.endswith("_mode")
        if int_default and isinstance(arg, int) and not isinstance(arg, bool) and arg == 0:
            continue
        raise AttentionArgumentError(f"graphlane's simulated NPU does not implement {name}")


def _check_sparse_mode(sparse_mode: object) -> None:
    mode = _check_int("sparse_mode", sparse_mode)
    if mode in (0, 1):
        return
    if mode in (2, 3, 4):
        raise _fail(
            "sparse_mode",
            f"sparse_mode {mode} is not implemented by graphlane's simulated NPU "
            "(implemented: 0, 1)",
        )
    raise _fail("sparse_mode", f"invalid sparse_mode {mode} (documented: 0..4)")


def _lengths_type(name: str, lengths: object) -> list[int] | None:
    if lengths is None:
        return None
    if not isinstance(lengths, (list, tuple)):
        raise _fail(name, f"expected a list or tuple of ints, got {type(lengths).__name__}")
    values: list[int] = []
    for i, item in enumerate(lengths):
        if isinstance(item, bool):
            raise _fail(name, f"entry {i} is a bool, expected an int")
        try:
            values.append(_as_index(item))
        except TypeError:
            raise _fail(name, f"entry {i} is {type(item).__name__}, expected an int") from None
    return values


def _resolve_lengths(name: str, lengths: object, batch: int, limit: int) -> list[int]:
    """Per-batch valid lengths following the doc's length-1 / first-B rule."""
    values = _lengths_type(name, lengths)
    if values is None:
        return [limit] * batch
    if len(values) == 1:
        values = values * batch
    elif len(values) >= batch:
        values = values[:batch]
    else:
        raise _fail(
            name,
            f"has {len(values)} entries; expected 1 or at least the batch size ({batch})",
        )
    for b, v in enumerate(values):
        if not 0 <= v <= limit:
            raise _fail(name, f"value {v} for batch {b} is outside [0, {limit}]")
    return values


def _check_pse(pse_shift: object, query: torch.Tensor, dims: _Dims) -> None:
    if pse_shift is None:
        return
    pse = _check_tensor("pse_shift", pse_shift)
    if pse.dtype != query.dtype:
        raise _fail("pse_shift", f"dtype {pse.dtype} differs from query's dtype {query.dtype}")
    shape = tuple(pse.shape)
    ok = (
        len(shape) == 4
        and shape[0] in (dims.batch, 1)
        and shape[1] == dims.num_heads
        and shape[2] >= dims.q_seq
        and shape[3] >= dims.kv_seq
    )
    if not ok:
        raise _fail(
            "pse_shift",
            f"shape {shape} is not (B, N, Q_S, KV_S) or (1, N, Q_S, KV_S) with "
            f"B={dims.batch}, N={dims.num_heads}, Q_S>={dims.q_seq}, KV_S>={dims.kv_seq}",
        )


def _mask_is_batch_rows(shape: tuple[int, ...], dims: _Dims) -> bool:
    """True when a 2-D mask is read as (B, KV_S) (only for Q_S == 1)."""
    return len(shape) == 2 and dims.q_seq == 1 and shape[0] == dims.batch


def _check_mask(atten_mask: object, dims: _Dims) -> None:
    if atten_mask is None:
        return
    mask = _check_tensor("atten_mask", atten_mask)
    if mask.dtype not in _MASK_DTYPES:
        raise _fail("atten_mask", f"dtype {mask.dtype} is not bool, int8 or uint8")
    shape = tuple(mask.shape)
    b, sq, skv = dims.batch, dims.q_seq, dims.kv_seq
    if len(shape) == 2:
        ok = shape[1] >= skv and (_mask_is_batch_rows(shape, dims) or shape[0] >= sq)
    elif len(shape) == 3:
        ok = shape[0] in (b, 1) and shape[1] >= sq and shape[2] >= skv
    elif len(shape) == 4:
        ok = shape[0] in (b, 1) and shape[1] == 1 and shape[2] >= sq and shape[3] >= skv
    else:
        ok = False
    if not ok:
        accepted = "(Q_S, KV_S), (B|1, Q_S, KV_S), (B|1, 1, Q_S, KV_S)"
        if sq == 1:
            accepted += ", (B, KV_S)"
        raise _fail(
            "atten_mask",
            f"shape {shape} is not one of {accepted} with B={b}, Q_S>={sq}, KV_S>={skv}",
        )


def check_arguments(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: Sequence[int] | None = None,
    actual_seq_lengths_kv: Sequence[int] | None = None,
    *,
    num_heads: int = 1,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    unsupported: Mapping[str, object] | None = None,
) -> _Dims:
    """Validate the arguments at shape level (no tensor data is read, no compute).

    Raises :class:`AttentionArgumentError` naming the offending argument. Returns the
    logical sizes. Only shapes, ranks and dtypes of the tensors are read, and the
    lengths are checked last but for pse_shift and atten_mask, which do not depend on
    them: arguments equal in all of that but the lengths pass or fail the same checks
    before :func:`check_lengths`.
    """
    _check_unsupported(unsupported)
    layout = _check_layout(input_layout)
    _check_sparse_mode(sparse_mode)
    q = _check_tensor("query", query)
    k = _check_tensor("key", key)
    v = _check_tensor("value", value)
    _check_dtypes(q, k, v)
    dims = _dims(q, k, v, layout, num_heads, num_key_value_heads)
    check_lengths(actual_seq_lengths, actual_seq_lengths_kv, dims)
    _check_pse(pse_shift, q, dims)
    _check_mask(atten_mask, dims)
    return dims


def check_lengths(
    actual_seq_lengths: Sequence[int] | None,
    actual_seq_lengths_kv: Sequence[int] | None,
    dims: _Dims,
) -> None:
    """The length checks of :func:`check_arguments`, for arguments whose other checks
    passed with these ``dims`` (what check_arguments returned)."""
    _resolve_lengths("actual_seq_lengths_kv", actual_seq_lengths_kv, dims.batch, dims.kv_seq)
    if dims.q_seq == 1:
        # IFA branch: the doc says actual_seq_lengths is ignored; only its type is checked.
        _lengths_type("actual_seq_lengths", actual_seq_lengths)
    else:
        _resolve_lengths("actual_seq_lengths", actual_seq_lengths, dims.batch, dims.q_seq)


def _output_shape(dims: _Dims, layout: str) -> tuple[int, ...]:
    if layout == "BNSD":
        return (dims.batch, dims.num_heads, dims.q_seq, dims.value_dim)
    if layout == "BSND":
        return (dims.batch, dims.q_seq, dims.num_heads, dims.value_dim)
    return (dims.batch, dims.q_seq, dims.num_heads * dims.value_dim)


def _lse_shape(dims: _Dims, softmax_lse_flag: bool) -> tuple[int, ...]:
    if softmax_lse_flag:
        return (dims.batch, dims.num_heads, dims.q_seq, 1)
    return (1,)


def output_shapes(
    query: torch.Tensor,
    value: torch.Tensor,
    *,
    num_heads: int,
    input_layout: str,
    num_key_value_heads: int = 0,
    softmax_lse_flag: bool = False,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return ``(attention_out shape, softmax_lse shape)`` for the given query and value."""
    layout = _check_layout(input_layout)
    q = _check_tensor("query", query)
    v = _check_tensor("value", value)
    n, nkv = _heads(num_heads, num_key_value_heads)
    rank = 3 if layout == "BSH" else 4
    _expect_rank("query", q, rank, layout)
    _expect_rank("value", v, rank, layout)
    if layout == "BSH":
        b, sq, h = q.shape
        _split_hidden("query", h, n, "num_heads")
        dv = _split_hidden("value", v.shape[2], nkv, "num_key_value_heads")
    else:
        if layout == "BNSD":
            b, qn, sq, _ = q.shape
        else:
            b, sq, qn, _ = q.shape
        if qn != n:
            raise _fail("num_heads", f"num_heads ({n}) must equal the N axis of query ({qn})")
        dv = v.shape[3]
    dims = _Dims(int(b), n, nkv, int(sq), 0, 0, int(dv))
    return _output_shape(dims, layout), _lse_shape(dims, bool(softmax_lse_flag))


def workspace_bytes(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    num_heads: int,
    input_layout: str,
    num_key_value_heads: int = 0,
) -> int:
    """A deterministic, plausible workspace size in bytes (always >= 64 KiB).

    64 KiB of fixed system workspace plus float32 buffers for the score and probability
    matrices and float32 copies of query and key, rounded up to 512 bytes.
    """
    layout = _check_layout(input_layout)
    q = _check_tensor("query", query)
    k = _check_tensor("key", key)
    n, _ = _heads(num_heads, num_key_value_heads)  # validated; kv heads do not change sizes
    rank = 3 if layout == "BSH" else 4
    _expect_rank("query", q, rank, layout)
    _expect_rank("key", k, rank, layout)
    b = int(q.shape[0])
    if layout == "BNSD":
        sq, skv = int(q.shape[2]), int(k.shape[2])
    else:
        sq, skv = int(q.shape[1]), int(k.shape[1])
    f32 = 4
    scores = 2 * b * n * sq * skv * f32
    upcast = (q.numel() + k.numel()) * f32
    total = _WORKSPACE_BASE_BYTES + scores + upcast
    return -(-total // _WORKSPACE_ALIGN_BYTES) * _WORKSPACE_ALIGN_BYTES


def _to_bnsd(tensor: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """float32 ``tensor`` in BNSD order; may alias the input, so never modify it in place."""
    t = tensor.to(torch.float32)
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.permute(0, 2, 1, 3)
    b, s, h = t.shape
    return t.reshape(b, s, heads, h // heads).permute(0, 2, 1, 3)


def _from_bnsd(out: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return out.contiguous()
    if layout == "BSND":
        return out.permute(0, 2, 1, 3).contiguous()
    b, n, s, d = out.shape
    return out.permute(0, 2, 1, 3).reshape(b, s, n * d)


def _masked_out(atten_mask: torch.Tensor, dims: _Dims) -> torch.Tensor:
    """Boolean "do not attend" tensor of shape (B or 1, 1, Q_S, KV_S)."""
    sq, skv = dims.q_seq, dims.kv_seq
    shape = tuple(atten_mask.shape)
    if len(shape) == 2:
        if _mask_is_batch_rows(shape, dims):
            m = atten_mask[:, :skv].reshape(shape[0], 1, 1, skv)
        else:
            m = atten_mask[:sq, :skv].reshape(1, 1, sq, skv)
    elif len(shape) == 3:
        m = atten_mask[:, :sq, :skv].unsqueeze(1)
    else:
        m = atten_mask[:, :, :sq, :skv]
    return m != 0


def _check_cpu(name: str, tensor: torch.Tensor | None) -> None:
    if tensor is not None and tensor.device.type != "cpu":
        raise _fail(name, f"expected a CPU tensor, got device {tensor.device}")


def fused_infer_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    pse_shift: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    actual_seq_lengths: Sequence[int] | None = None,
    actual_seq_lengths_kv: Sequence[int] | None = None,
    *,
    num_heads: int = 1,
    scale: float = 1.0,
    pre_tokens: int = _INT32_MAX,
    next_tokens: int = _INT32_MAX,
    input_layout: str = "BSH",
    num_key_value_heads: int = 0,
    sparse_mode: int = 0,
    inner_precise: int = 0,
    softmax_lse_flag: bool = False,
    unsupported: Mapping[str, object] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute ``(attention_out, softmax_lse)`` like ``npu_fused_infer_attention_score``.

    See the module docstring for the semantics followed. Inputs are never modified and may
    be non-contiguous; all computation is done in float32 on the CPU.
    """
    check_arguments(
        query,
        key,
        value,
        pse_shift,
        atten_mask,
        actual_seq_lengths,
        actual_seq_lengths_kv,
        num_heads=num_heads,
        input_layout=input_layout,
        num_key_value_heads=num_key_value_heads,
        sparse_mode=sparse_mode,
        unsupported=unsupported,
    )
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise _fail("scale", f"expected a float, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise _fail("scale", f"must be finite, got {scale}")
    # pre_tokens / next_tokens are ignored for sparse_mode 0 and 1 (see module docstring).
    _check_int("pre_tokens", pre_tokens)
    _check_int("next_tokens", next_tokens)
    precise = _check_int("inner_precise", inner_precise)
    if not 0 <= precise <= 3:
        raise _fail("inner_precise", f"must be 0, 1, 2 or 3, got {precise}")
    if not isinstance(softmax_lse_flag, bool):
        raise _fail("softmax_lse_flag", f"expected a bool, got {type(softmax_lse_flag).__name__}")
    for name, tensor in (
        ("query", query),
        ("key", key),
        ("value", value),
        ("pse_shift", pse_shift),
        ("atten_mask", atten_mask),
    ):
        _check_cpu(name, tensor)

    layout = input_layout
    dims = _dims(query, key, value, layout, num_heads, num_key_value_heads)
    b, n, nkv = dims.batch, dims.num_heads, dims.num_kv_heads
    sq, skv, dv = dims.q_seq, dims.kv_seq, dims.value_dim
    group = n // nkv

    kv_lens = _resolve_lengths("actual_seq_lengths_kv", actual_seq_lengths_kv, b, skv)
    if sq == 1:
        q_lens = [sq] * b  # IFA branch ignores actual_seq_lengths
    else:
        q_lens = _resolve_lengths("actual_seq_lengths", actual_seq_lengths, b, sq)

    # keep[b, 0, i, j]: query row i of batch b may attend key j.
    kv_len_t = torch.tensor(kv_lens, dtype=torch.int64).reshape(b, 1, 1, 1)
    q_len_t = torch.tensor(q_lens, dtype=torch.int64).reshape(b, 1, 1, 1)
    key_pos = torch.arange(skv, dtype=torch.int64).reshape(1, 1, 1, skv)
    row_pos = torch.arange(sq, dtype=torch.int64).reshape(1, 1, sq, 1)
    keep = (key_pos < kv_len_t) & (row_pos < q_len_t)
    if atten_mask is not None:
        keep = keep & ~_masked_out(atten_mask, dims)

    q32 = _to_bnsd(query, layout, n).reshape(b, nkv, group, sq, dims.head_dim)
    k32 = _to_bnsd(key, layout, nkv).unsqueeze(2)
    v32 = _to_bnsd(value, layout, nkv).unsqueeze(2)

    # GQA: query heads [g * group, (g + 1) * group) share key/value head g.
    scores = torch.matmul(q32, k32.transpose(-1, -2)).reshape(b, n, sq, skv) * float(scale)
    if pse_shift is not None:
        scores = scores + pse_shift[:, :, :sq, :skv].to(torch.float32)
    scores = scores.masked_fill(~keep, float("-inf"))

    if skv == 0:
        row_max = torch.zeros(b, n, sq, 1, dtype=torch.float32)
    else:
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - row_max)  # masked positions: exp(-inf) == 0
    denom = exp.sum(dim=-1, keepdim=True)
    has_keys = denom > 0
    probs = exp / torch.where(has_keys, denom, torch.ones_like(denom))
    out = torch.matmul(probs.reshape(b, nkv, group, sq, skv), v32).reshape(b, n, sq, dv)

    attention_out = _from_bnsd(out, layout).to(query.dtype)
    if softmax_lse_flag:
        safe_denom = torch.where(has_keys, denom, torch.ones_like(denom))
        lse = torch.where(has_keys, torch.log(safe_denom) + row_max, torch.zeros_like(denom))
    else:
        lse = torch.zeros(1, dtype=torch.float32)
    return attention_out, lse
