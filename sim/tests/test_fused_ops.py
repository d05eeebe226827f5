"""The field's fused ops (npusim.fused_ops) against references written here with plain torch
in float64, in every dtype torch_npu's documentation allows (float16, bfloat16, float32),
their refusals of what the documentation refuses, and their place in the device model: one
task each, captured and replayed like any op, their cache writes seen by the race tracking.
"""

from __future__ import annotations

import math

import pytest
import torch
from npusim import DeviceFaultError, HazardError, SimUsageError, atb_rotary, torch_npu

npu = torch.npu
Tensor = torch.Tensor
G = torch.Generator().manual_seed(11)
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# One rounding of a float32 result to the output dtype, plus float32's own error.
TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
       torch.float32: dict(atol=1e-5, rtol=1e-5)}  # fmt: skip


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=G).to(dtype)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want.double(), **TOL[dtype])


# ================================================================ norms
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_over_gammas_dims(dtype: torch.dtype) -> None:
    x, g1, g2 = rand(3, 4, 64, dtype=dtype), rand(64, dtype=dtype), rand(4, 64, dtype=dtype)
    for gamma in (g1, g2):  # gamma [D] normalises the last dim, [4, D] the last two
        y, rstd = torch_npu.npu_rms_norm(x.npu(), gamma.npu(), epsilon=1e-5)
        want = torch.nn.functional.rms_norm(x.double(), list(gamma.shape), gamma.double(), 1e-5)
        close(y.cpu(), want, dtype)
        dims = tuple(range(3 - gamma.dim(), 3))
        want_rstd = 1 / (x.double().square().mean(dims, keepdim=True) + 1e-5).sqrt()
        assert rstd.dtype == torch.float32 and rstd.shape == want_rstd.shape
        torch.testing.assert_close(rstd.cpu().double(), want_rstd, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_y_rstd_and_the_sum(dtype: torch.dtype) -> None:
    x1, x2, gamma = rand(5, 128, dtype=dtype), rand(5, 128, dtype=dtype), rand(128, dtype=dtype)
    y, rstd, x_sum = torch_npu.npu_add_rms_norm(x1.npu(), x2.npu(), gamma.npu())
    s = x1.double() + x2.double()
    assert torch.equal(x_sum.cpu(), s.to(dtype))  # the sum, rounded once
    close(y.cpu(), torch.nn.functional.rms_norm(s, [128], gamma.double(), 1e-6), dtype)
    assert list(rstd.shape) == [5, 1] and rstd.dtype == torch.float32


def test_norm_refusals() -> None:
    x, gamma = rand(4, 64).npu(), rand(64).npu()
    with pytest.raises(SimUsageError, match="gamma \\[32\\] must equal the trailing dims"):
        torch_npu.npu_rms_norm(x, rand(32).npu())
    with pytest.raises(SimUsageError, match=r"gamma is torch\.float16 but must have"):
        torch_npu.npu_rms_norm(x, gamma.half())
    with pytest.raises(SimUsageError, match="x1 \\[4, 64\\] and x2 \\[2, 64\\] must have the same"):
        torch_npu.npu_add_rms_norm(x, rand(2, 64).npu(), gamma)


# ================================================================ rotary
def ref_rotary(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, mode: str) -> torch.Tensor:
    """r1 * x + r2 * rotated(x), element by element from the documented index rule."""
    x, c, s = x.double(), c.double().expand(x.shape), s.double().expand(x.shape)
    out = torch.empty_like(x)
    d = x.shape[-1]
    for j in range(d):
        if mode == "half":
            partner, sign = (j + d // 2, -1) if j < d // 2 else (j - d // 2, 1)
        else:
            partner, sign = (j + 1, -1) if j % 2 == 0 else (j - 1, 1)
        out[..., j] = c[..., j] * x[..., j] + sign * s[..., j] * x[..., partner]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul_both_modes(dtype: torch.dtype, mode: str) -> None:
    x = rand(2, 3, 4, 32, dtype=dtype)  # BSND
    c, s = rand(1, 3, 1, 32, dtype=dtype), rand(1, 3, 1, 32, dtype=dtype)  # 1S1D
    got = torch_npu.npu_rotary_mul(x.npu(), c.npu(), s.npu(), mode)
    close(got.cpu(), ref_rotary(x, c, s, mode), dtype)


def test_rotary_mul_with_a_rotate_matrix_equals_half_mode() -> None:
    d = 16
    rotate = torch.zeros(d, d)
    rotate[: d // 2, d // 2 :] = torch.eye(d // 2)
    rotate[d // 2 :, : d // 2] = -torch.eye(d // 2)
    x, c, s = rand(1, 2, 3, d), rand(1, 1, 3, d), rand(1, 1, 3, d)
    got = torch_npu.npu_rotary_mul(x.npu(), c.npu(), s.npu(), "half", rotate.npu())
    close(got.cpu(), ref_rotary(x, c, s, "half"), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_apply_rotary_pos_emb_updates_query_and_key_in_place(dtype: torch.dtype,
                                                            layout: str) -> None:  # fmt: skip
    lead = (2, 3) if layout == "BSND" else (6,)
    q, k = rand(*lead, 4, 64, dtype=dtype), rand(*lead, 2, 64, dtype=dtype)
    c, s = rand(*lead, 1, 64, dtype=dtype), rand(*lead, 1, 64, dtype=dtype)
    qd, kd = q.npu(), k.npu()
    q_out, k_out = torch_npu.npu_apply_rotary_pos_emb(qd, kd, c.npu(), s.npu(), layout=layout)
    assert q_out.data_ptr() == qd.data_ptr() and k_out.data_ptr() == kd.data_ptr()
    close(qd.cpu(), ref_rotary(q, c, s, "half"), dtype)
    close(kd.cpu(), ref_rotary(k, c, s, "half"), dtype)


def ref_rope_cache(x: torch.Tensor, pos: list[int], cache: torch.Tensor, hs: int,
                   mode: str) -> torch.Tensor:  # fmt: skip
    """Per token and head: the first rotary_dim of the head rotated by the cache row's
    cos (first half) and sin (second half); the rest of the head unchanged."""
    r = cache.shape[1]
    out = x.double().clone().reshape(x.shape[0], -1, hs)
    for t, p in enumerate(pos):
        cos, sin = cache[p, : r // 2].double(), cache[p, r // 2 :].double()
        c = cos.repeat(2) if mode == "half" else cos.repeat_interleave(2)
        s = sin.repeat(2) if mode == "half" else sin.repeat_interleave(2)
        out[t, :, :r] = ref_rotary(out[t, :, :r], c, s, mode)
    return out.reshape(x.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_mrope_in_rope_mode_with_partial_rotary(dtype: torch.dtype, mode: str) -> None:
    hs, rot, tokens = 64, 32, 5
    pos = [3, 0, 7, 7, 1]
    q, k = rand(tokens, 4 * hs, dtype=dtype), rand(tokens, 2 * hs, dtype=dtype)
    cache = rand(8, rot, dtype=dtype)
    positions = torch.tensor(pos).npu()
    q_out, k_out = torch_npu.npu_mrope(positions, q.npu(), k.npu(), cache.npu(), hs,
                                       mrope_section=[0, 0, 0], rotary_mode=mode)  # fmt: skip
    close(q_out.cpu(), ref_rope_cache(q, pos, cache, hs, mode), dtype)
    close(k_out.cpu(), ref_rope_cache(k, pos, cache, hs, mode), dtype)


def test_mrope_sections_rotate_by_their_own_positions() -> None:
    hs, tokens, section = 64, 3, [8, 12, 12]  # sums to rotary_dim / 2
    pos = torch.tensor([[0, 1, 2], [5, 6, 7], [9, 3, 4]])
    q, k, cache = rand(tokens, 2 * hs), rand(tokens, hs), rand(10, hs)
    q_out, _ = torch_npu.npu_mrope(pos.npu(), q.npu(), k.npu(), cache.npu(), hs,
                                   mrope_section=section)  # fmt: skip
    owner = [a for a, w in enumerate(section) for _ in range(w)]  # frequency -> axis
    want = torch.empty(tokens, 2 * hs, dtype=torch.float64)
    for t in range(tokens):
        row = torch.stack([cache[int(pos[owner[f], t])] for f in range(hs // 2)])
        cos = torch.stack([row[f, f] for f in range(hs // 2)])
        sin = torch.stack([row[f, hs // 2 + f] for f in range(hs // 2)])
        want[t] = ref_rope_cache(q[t : t + 1], [0], torch.cat([cos, sin])[None], hs, "half")[0]
    close(q_out.cpu(), want, torch.float32)


def test_rotary_refusals() -> None:
    x, c = rand(2, 3, 4, 32).npu(), rand(1, 3, 1, 32).npu()
    with pytest.raises(SimUsageError, match="rotary_mode must be 'half' or 'interleave'"):
        torch_npu.npu_rotary_mul(x, c, c, "quarter")
    with pytest.raises(SimUsageError, match="r1 \\[1, 5, 1, 32\\] must be 4-D with D 32"):
        torch_npu.npu_rotary_mul(x, rand(1, 5, 1, 32).npu(), rand(1, 5, 1, 32).npu())
    with pytest.raises(SimUsageError, match="input must be 4-D"):
        torch_npu.npu_rotary_mul(rand(3, 4, 32).npu(), c, c)
    q, cs = rand(1, 2, 4, 64).npu(), rand(1, 2, 1, 64).npu()
    with pytest.raises(SimUsageError, match="Atlas 350 only; Atlas A2 takes 'half'"):
        torch_npu.npu_apply_rotary_pos_emb(q, q.clone(), cs, cs, rotary_mode="interleave")
    with pytest.raises(SimUsageError, match="layout BNSD runs on the Atlas 350 only"):
        torch_npu.npu_apply_rotary_pos_emb(q, q.clone(), cs, cs, layout="BNSD")
    with pytest.raises(SimUsageError, match="D of query must be 64 or 128"):
        torch_npu.npu_apply_rotary_pos_emb(x, x.clone(), c, c)
    with pytest.raises(SimUsageError, match="rotary_mode only support half or interleave"):
        torch_npu.npu_mrope(
            torch.zeros(2, dtype=torch.int64).npu(),
            rand(2, 64).npu(),
            rand(2, 64).npu(),
            rand(4, 64).npu(),
            64,
            rotary_mode="interleaved",
        )
    with pytest.raises(SimUsageError, match="mrope_section \\[8, 8, 8\\] must be 3 numbers"):
        torch_npu.npu_mrope(
            torch.zeros(3, 2, dtype=torch.int64).npu(),
            rand(2, 64).npu(),
            rand(2, 64).npu(),
            rand(4, 64).npu(),
            64,
            mrope_section=[8, 8, 8],
        )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
def test_atb_rotary_embedding_in_place_by_the_cache_rows(dtype: torch.dtype, neox: bool) -> None:
    atb_rotary.reset_tables()
    hs, pos = 32, [4, 0, 2]
    q, k, cache = rand(3, 2 * hs, dtype=dtype), rand(3, hs, dtype=dtype), rand(5, hs, dtype=dtype)
    qd, kd = q.npu(), k.npu()
    torch_npu._npu_rotary_embedding(torch.tensor(pos).npu(), qd, kd, hs, cache.npu(), neox)
    mode = "half" if neox else "interleave"
    close(qd.cpu(), ref_rope_cache(q, pos, cache, hs, mode), dtype)
    close(kd.cpu(), ref_rope_cache(k, pos, cache, hs, mode), dtype)


def test_atb_rotary_embedding_keeps_the_first_calls_cache_and_is_three_tasks() -> None:
    """op-plugin RopeAtb.cpp builds its cos/sin tables from the first call's cache, once per
    process; each call is two gathers and the rope kernel."""
    atb_rotary.reset_tables()
    hs, pos = 16, [1, 3]
    first, second = rand(4, hs).npu(), rand(4, hs).npu()
    q, k = rand(2, hs), rand(2, hs)
    torch_npu._npu_rotary_embedding(torch.tensor(pos).npu(), q.npu(), k.npu(), hs, first, True)
    qd, kd, positions = q.npu(), k.npu(), torch.tensor(pos).npu()
    npu.synchronize()
    g = npu.NPUGraph()
    with pytest.warns(UserWarning, match="rotates by the first call's"), npu.graph(g):
        torch_npu._npu_rotary_embedding(positions, qd, kd, hs, second, True)
    assert [n.label for n in g.nodes] == [
        "index_select.default", "index_select.default",
        "_npusim_atb_rope.default",
    ]  # fmt: skip
    g.replay()
    close(qd.cpu(), ref_rope_cache(q, pos, first.cpu(), hs, "half"), torch.float32)


def test_atb_rotary_embedding_refusals() -> None:
    q, cache = rand(2, 32).npu(), rand(4, 32).npu()
    pos = torch.tensor([0, 1]).npu()
    with pytest.raises(SimUsageError, match="cos_sin_cache must be \\[max_position, head_size=16"):
        torch_npu._npu_rotary_embedding(pos, q, q.clone(), 16, cache, True)
    with pytest.raises(SimUsageError, match="query must be \\[num_tokens=2, heads"):
        torch_npu._npu_rotary_embedding(pos, rand(3, 32).npu(), q, 32, cache, True)


# ================================================================ SwiGLU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [-1, 0])
def test_swiglu_silu_of_the_first_half_times_the_second(dtype: torch.dtype, dim: int) -> None:
    x = rand(6, 3, 16, dtype=dtype)
    a, b = x.double().chunk(2, dim=dim)
    got = torch_npu.npu_swiglu(x.npu(), dim=dim)
    close(got.cpu(), a / (1 + torch.exp(-a)) * b, dtype)


def test_swiglu_refusals() -> None:
    with pytest.raises(SimUsageError, match="has size 7: it must split in two halves"):
        torch_npu.npu_swiglu(rand(2, 7).npu())
    with pytest.raises(SimUsageError, match="input must be contiguous"):
        torch_npu.npu_swiglu(rand(8, 4).npu().t())


# ================================================================ KV-cache writes
def ref_cache(cache: torch.Tensor, rows: torch.Tensor, slots: list[int], nz: bool) -> torch.Tensor:
    out = cache.clone()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        if nz:
            bs = cache.shape[2]
            out[slot // bs, :, slot % bs, :] = rows[t].reshape(cache.shape[1], cache.shape[3])
        else:
            out[slot // cache.shape[1], slot % cache.shape[1]] = rows[t]
    return out


SLOTS = [5, 17, -1, 0, 31]  # across blocks; -1: a padding token, skipped


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["Norm", "PA_NZ"])
def test_scatter_pa_kv_cache_writes_each_token_at_its_slot(dtype: torch.dtype, mode: str) -> None:
    nb, bs, n, dk, dv = 4, 8, 2, 16, 32
    key, value = rand(5, n, dk, dtype=dtype), rand(5, n, dv, dtype=dtype)
    if mode == "Norm":
        kc, vc = rand(nb, bs, n, dk, dtype=dtype), rand(nb, bs, n, dv, dtype=dtype)
    else:
        c0 = 32 // key.element_size()
        kc = rand(nb, n * dk // c0, bs, c0, dtype=dtype)
        vc = rand(nb, n * dv // c0, bs, c0, dtype=dtype)
    kcd, vcd = kc.npu(), vc.npu()
    slots = torch.tensor(SLOTS, dtype=torch.int32).npu()
    torch_npu.npu_scatter_pa_kv_cache(key.npu(), value.npu(), kcd, vcd, slots, cache_mode=mode)
    assert torch.equal(kcd.cpu(), ref_cache(kc, key, SLOTS, mode == "PA_NZ"))
    assert torch.equal(vcd.cpu(), ref_cache(vc, value, SLOTS, mode == "PA_NZ"))


def test_reshape_and_cache_writes_the_nd_cache() -> None:
    key, value = rand(5, 2, 16, dtype=torch.float16), rand(5, 2, 16, dtype=torch.float16)
    kc, vc = (
        torch.zeros(4, 8, 2, 16, dtype=torch.float16),
        torch.zeros(4, 8, 2, 16, dtype=torch.float16),
    )
    kcd, vcd = kc.npu(), vc.npu()
    slots = torch.tensor(SLOTS, dtype=torch.int32).npu()
    torch_npu._npu_reshape_and_cache(key=key.npu(), value=value.npu(), key_cache=kcd,
                                     value_cache=vcd, slot_indices=slots)  # fmt: skip
    assert torch.equal(kcd.cpu(), ref_cache(kc, key, SLOTS, False))
    assert torch.equal(vcd.cpu(), ref_cache(vc, value, SLOTS, False))


def test_cache_write_refusals() -> None:
    key, kc = rand(5, 2, 16).npu(), rand(4, 8, 2, 16).npu()
    slots = torch.tensor(SLOTS, dtype=torch.int32).npu()
    with pytest.raises(SimUsageError, match="key_cache must be \\[num_blocks, 4, block_size, 8\\]"):
        torch_npu.npu_scatter_pa_kv_cache(key, key, kc, kc.clone(), slots)  # PA_NZ by default
    with pytest.raises(SimUsageError, match="slot_mapping must be \\[num_tokens=5\\]"):
        torch_npu.npu_scatter_pa_kv_cache(key, key, kc, kc.clone(), slots[:3], cache_mode="Norm")
    with pytest.raises(SimUsageError, match="are not implemented by the simulated NPU"):
        torch_npu.npu_scatter_pa_kv_cache(key, key, kc, kc.clone(), slots, seq_lens=slots,
                                          cache_mode="Norm")  # fmt: skip
    with pytest.raises(SimUsageError, match=r"value_cache is torch\.float16"):
        torch_npu._npu_reshape_and_cache(key, key, kc, kc.half(), slots)
    with pytest.raises(SimUsageError, match="slot_indices must be int32 or int64"):
        torch_npu._npu_reshape_and_cache(key, key, kc, kc.clone(), slots.float())


def test_a_slot_outside_the_cache_faults_the_device() -> None:
    key, kc = rand(1, 2, 16).npu(), rand(4, 8, 2, 16).npu()
    slots = torch.tensor([32], dtype=torch.int32).npu()  # 4 blocks of 8: slots 0..31
    torch_npu.npu_scatter_pa_kv_cache(key, key, kc, kc.clone(), slots, cache_mode="Norm")
    with pytest.raises(DeviceFaultError, match="slot 32 is outside the cache's 32 slots"):
        npu.synchronize()


def test_a_cache_write_racing_a_replay_that_reads_the_cache_is_reported() -> None:
    """scatter_pa_kv_cache writes key_cache (its schema's Tensor(a!)): issued on another
    stream while a replay reads the cache, unfenced, it is a race; fenced, it is not."""
    for fenced in (True, False):
        S, U = npu.Stream(), npu.Stream()
        key = rand(2, 2, 16).npu()
        kc, vc = torch.zeros(4, 8, 2, 16).npu(), torch.zeros(4, 8, 2, 16).npu()
        slots = torch.tensor([3, 9], dtype=torch.int32).npu()
        out = torch.zeros(4, 8, 2, 16).npu()
        npu.synchronize()
        g = npu.NPUGraph()
        with npu.graph(g, stream=S):
            torch.mul(kc, 2, out=out)  # the replay reads the cache
        with npu.stream(S):
            g.replay()
        if fenced:
            U.wait_stream(S)
        with npu.stream(U):
            torch_npu.npu_scatter_pa_kv_cache(key, key, kc, vc, slots, cache_mode="Norm")
        if fenced:
            npu.synchronize()
            continue
        with pytest.raises(HazardError, match="race on npu memory") as err:
            npu.synchronize()
        assert err.value.kind == "race"


# ================================================================ top-k / top-p
def ref_top_k_top_p(logits: torch.Tensor, p: list[float] | None,
                    k: list[int] | None) -> torch.Tensor:  # fmt: skip
    """Row by row: keep values >= the k-th largest; then, over what is kept, drop the
    smallest while the probability mass of the dropped (smallest first) stays <= 1 - p."""
    out = logits.double().clone()
    for b in range(out.shape[0]):
        row = out[b]
        if k is not None:
            kth = sorted(row.tolist())[-k[b]]
            row[row < kth] = -math.inf
        if p is not None:
            probs = torch.softmax(row, 0)
            mass, keep_from = 0.0, None
            order = sorted(range(row.numel()), key=lambda i: row[i].item())
            for rank, i in enumerate(order):
                mass += probs[i].item()
                if mass > 1 - p[b] or rank == len(order) - 1:
                    keep_from = rank
                    break
            for i in order[:keep_from]:
                row[i] = -math.inf
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["both", "k", "p"])
def test_top_k_top_p_masks_rows_to_minus_inf(dtype: torch.dtype, which: str) -> None:
    logits = (torch.randperm(48, generator=G).reshape(3, 16).float() / 4).to(dtype)  # no ties
    k = [4, 16, 1] if which != "p" else None
    p = [0.5, 0.9, 0.3] if which != "k" else None
    got = torch_npu.npu_top_k_top_p(
        logits.npu(),
        p=torch.tensor(p, dtype=dtype).npu() if p else None,
        k=torch.tensor(k, dtype=torch.int32).npu() if k else None,
    )
    want = ref_top_k_top_p(logits, [float(torch.tensor(x, dtype=dtype)) for x in p] if p else None,
                           k)  # fmt: skip
    assert got.dtype == dtype
    assert torch.equal(got.cpu().double(), want)  # kept values are the logits, bit for bit


def test_top_k_top_p_refusals() -> None:
    logits = rand(2, 16).npu()
    with pytest.raises(SimUsageError, match="k must be int32"):
        torch_npu.npu_top_k_top_p(logits, k=torch.tensor([1, 2]).npu())
    with pytest.raises(SimUsageError, match="p must be \\[batch=2\\]"):
        torch_npu.npu_top_k_top_p(logits, p=torch.tensor([0.5]).npu())
    with pytest.raises(SimUsageError, match="logits must be a non-empty \\[batch, vocab\\]"):
        torch_npu.npu_top_k_top_p(rand(16).npu(), p=torch.tensor([0.5]).npu())


# ================================================================ the op namespace
def test_every_fused_op_is_a_torch_ops_npu_op() -> None:
    for name in ("npu_rms_norm", "npu_add_rms_norm", "npu_rotary_mul", "npu_apply_rotary_pos_emb",
                 "npu_mrope", "npu_swiglu", "npu_scatter_pa_kv_cache", "_npu_reshape_and_cache",
                 "npu_top_k_top_p", "_npu_rotary_embedding",
                 "_npu_flash_attention_qlens"):  # fmt: skip
        assert getattr(torch_npu, name) is getattr(torch.ops.npu, name)


# ================================================================ a decode layer, captured
class DecodeLayer:
    """One dense Llama/Qwen2 decode layer as vllm-ascend builds it on Atlas A2, from the
    fused ops: add_rms_norm, QKV matmul, rotary, scatter_pa_kv_cache into an ND paged
    cache, paged FIA (BSH, block_table), o matmul, add_rms_norm, gate_up, swiglu, down."""

    B, N, NKV, D, HID, FF, NB, BS = 3, 4, 2, 64, 128, 96, 6, 16

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        w = lambda *s: (rand(*s) / math.sqrt(s[0])).to(dtype).npu()  # noqa: E731
        n_qkv = (self.N + 2 * self.NKV) * self.D
        self.w_in, self.w_post = (
            rand(self.HID, dtype=dtype).npu(),
            rand(self.HID, dtype=dtype).npu(),
        )
        self.w_qkv, self.w_o = w(self.HID, n_qkv), w(self.N * self.D, self.HID)
        self.w_gate_up, self.w_down = w(self.HID, 2 * self.FF), w(self.FF, self.HID)
        self.table = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32).npu()
        self.lens = [5, 17, 30]  # each sequence's new token is at position len - 1
        self.slots = torch.tensor(
            [int(self.table[b, (n - 1) // self.BS]) * self.BS + (n - 1) % self.BS
             for b, n in enumerate(self.lens)], dtype=torch.int32).npu()  # fmt: skip

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.NB, self.BS, self.NKV, self.D)
        g = torch.Generator().manual_seed(3)
        return tuple(torch.randn(*shape, generator=g).to(self.dtype).npu() for _ in range(2))  # type: ignore[return-value]

    def __call__(
        self, h: Tensor, res: Tensor, cos: Tensor, sin: Tensor, kc: Tensor, vc: Tensor
    ) -> tuple[Tensor, Tensor]:
        B, N, NKV, D = self.B, self.N, self.NKV, self.D
        x, _, res = torch_npu.npu_add_rms_norm(h, res, self.w_in)
        q, k, v = (x @ self.w_qkv).split([N * D, NKV * D, NKV * D], dim=-1)
        q, k = q.reshape(B, 1, N, D).contiguous(), k.reshape(B, 1, NKV, D).contiguous()
        torch_npu.npu_apply_rotary_pos_emb(q, k, cos, sin)  # in place
        v = v.reshape(B, NKV, D).contiguous()
        torch_npu.npu_scatter_pa_kv_cache(k.view(B, NKV, D), v, kc, vc, self.slots,
                                          cache_mode="Norm")  # fmt: skip
        attn, _ = torch_npu.npu_fused_infer_attention_score(
            q.reshape(B, 1, N * D), kc.view(self.NB, self.BS, NKV * D),
            vc.view(self.NB, self.BS, NKV * D), block_table=self.table, block_size=self.BS,
            actual_seq_lengths_kv=self.lens, num_heads=N, num_key_value_heads=NKV,
            input_layout="BSH", scale=1 / math.sqrt(D),
        )  # fmt: skip
        y, _, res = torch_npu.npu_add_rms_norm(attn.reshape(B, N * D) @ self.w_o, res, self.w_post)
        return torch_npu.npu_swiglu(y @ self.w_gate_up) @ self.w_down, res

    def inputs(self) -> list[torch.Tensor]:
        B, D, dt = self.B, self.D, self.dtype
        angle = torch.rand(B, 1, 1, D // 2, generator=G).repeat(1, 1, 1, 2) * 3
        return [rand(B, self.HID, dtype=dt), rand(B, self.HID, dtype=dt),
                angle.cos().to(dt), angle.sin().to(dt)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_captured_decode_layer_of_fused_ops_replays_as_eager(dtype: torch.dtype) -> None:
    layer = DecodeLayer(dtype)
    static = [t.npu() for t in layer.inputs()]
    kc_g, vc_g = layer.caches()
    S = npu.Stream()
    npu.synchronize()
    g = npu.NPUGraph()
    with npu.graph(g, stream=S):
        out_g, res_g = layer(*static, kc_g, vc_g)
    fused = [n.label for n in g.nodes if n.label.startswith("npu_")]
    assert fused == [  # one task each, in the order issued
        "npu_add_rms_norm.default", "npu_apply_rotary_pos_emb.default",
        "npu_scatter_pa_kv_cache.default", "npu_fused_infer_attention_score.default",
        "npu_add_rms_norm.default", "npu_swiglu.default",
    ]  # fmt: skip
    for _ in range(2):  # each replay on new inputs, against an eager run on the same caches
        step = layer.inputs()
        kc_e, vc_e = kc_g.clone(), vc_g.clone()
        out_e, res_e = layer(*[t.npu() for t in step], kc_e, vc_e)
        for dst, src in zip(static, step, strict=True):
            dst.copy_(src.npu())
        g.replay()
        npu.synchronize()
        assert torch.equal(out_g.cpu(), out_e.cpu()) and torch.equal(res_g.cpu(), res_e.cpu())
        assert torch.equal(kc_g.cpu(), kc_e.cpu()) and torch.equal(vc_g.cpu(), vc_e.cpu())
        assert out_g.cpu().isfinite().all()


# ================================================================ sglang's paged prefill
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attention_qlens_attends_causally_to_the_paged_context(dtype: torch.dtype) -> None:
    """Each batch's new tokens are the last of its context: query i of a batch with q_len
    new tokens among kv_len sees context positions 0 .. kv_len - q_len + i."""
    n, nkv, d, bs, nb = 4, 2, 16, 8, 6
    q_lens, kv_lens = [3, 1, 5], [10, 4, 5]
    table = torch.tensor([[4, 0], [2, 1], [5, 3]], dtype=torch.int32)
    kc, vc = rand(nb, bs, nkv, d, dtype=dtype), rand(nb, bs, nkv, d, dtype=dtype)
    q = rand(sum(q_lens), n * d, dtype=dtype)
    out = torch.zeros(sum(q_lens), n * d, dtype=dtype).npu()
    torch_npu._npu_flash_attention_qlens(
        query=q.npu(), key_cache=kc.npu(), value_cache=vc.npu(), block_table=table.npu(),
        mask=torch.zeros(128, 128, dtype=dtype).npu(),
        seq_len=torch.tensor(q_lens, dtype=torch.int32),
        context_lens=torch.tensor(kv_lens, dtype=torch.int32), num_kv_heads=nkv, num_heads=n,
        scale_value=0.25, out=out,
    )  # fmt: skip
    want = torch.zeros(sum(q_lens), n, d, dtype=torch.float64)
    row = 0
    for b, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        pos = [(int(table[b, j // bs]), j % bs) for j in range(kl)]
        for i in range(ql):
            for h in range(n):
                g = h // (n // nkv)
                seen = range(kl - ql + i + 1)
                s = torch.stack([q[row, h * d : (h + 1) * d].double() @ kc[pos[j]][g].double()
                                 for j in seen]) * 0.25  # fmt: skip
                p = torch.softmax(s, 0)
                want[row, h] = sum(p[j] * vc[pos[j]][g].double() for j in seen)
            row += 1
    close(out.cpu().reshape(-1, n, d), want, dtype)


def test_flash_attention_qlens_refusals() -> None:
    kc = rand(4, 8, 2, 16, dtype=torch.float16).npu()
    args = dict(query=rand(4, 64, dtype=torch.float16).npu(), key_cache=kc, value_cache=kc,
                block_table=torch.zeros(2, 2, dtype=torch.int32).npu(),
                mask=torch.zeros(128, 128, dtype=torch.float16).npu(),
                seq_len=torch.tensor([2, 2], dtype=torch.int32),
                context_lens=torch.tensor([3, 2], dtype=torch.int32), num_kv_heads=2,
                num_heads=4, scale_value=1.0,
                out=torch.zeros(4, 64, dtype=torch.float16).npu())  # fmt: skip
    torch_npu._npu_flash_attention_qlens(**args)  # the valid call
    bad = {
        "seq_len must be a host \\(CPU\\) int32 tensor": {"seq_len": args["seq_len"].npu()},
        "seq_len sums to 3 but query has 4 tokens": {
            "seq_len": torch.tensor([1, 2], dtype=torch.int32)},
        "batch 0: need 0 < seq_len \\(2\\) <= context_lens \\(1\\)": {
            "context_lens": torch.tensor([1, 2], dtype=torch.int32)},
        "out must be \\[4, 64\\]": {"out": torch.zeros(4, 32, dtype=torch.float16).npu()},
    }  # fmt: skip
    for message, change in bad.items():
        with pytest.raises(SimUsageError, match=message):
            torch_npu._npu_flash_attention_qlens(**(args | change))
