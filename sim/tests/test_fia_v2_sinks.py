"""``npu_fused_infer_attention_score_v2``'s ``learnable_sink`` (gpt-oss attention sinks), as
vllm-ascend's attention backend calls it: TND, paged KV, causal (sparse_mode 3) or a
sliding window (sparse_mode 4, pre_tokens the window, next_tokens 0), eagerly and as a
task group of a full graph whose lengths each step patches (its ``update_graph_params``
re-issues ``npu_fused_infer_attention_score_v2.out`` with ``learnable_sink=sinks``).

The reference is gpt-oss's own formulation of sink attention, written here in plain
torch: each head's sink is one more logit appended to the row of scaled scores before
the softmax, and its column is dropped afterwards. The op document's words for the
argument: bfloat16, shape (Q_N,), TND and NTD_TND only, value D up to 128.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from npusim import torch_npu
from npusim.errors import SimUsageError

V2 = torch_npu.npu_fused_infer_attention_score_v2
N, NKV, D, BS = 4, 2, 32, 128
MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                   scale: float, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One sequence: q [Sq, N, D], k/v [Skv, NKV, D] (the query's rows are the last Sq
    positions); ``window`` > 0 keeps the last ``window`` keys of each row (gpt-oss's
    sliding window). Returns (out [Sq, N, D], lse [Sq, N]) in float64."""
    sq, skv = q.shape[0], k.shape[0]
    kx = k.double().repeat_interleave(N // NKV, dim=1)
    vx = v.double().repeat_interleave(N // NKV, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.double(), kx) * scale
    pos_q = torch.arange(sq).reshape(sq, 1) + (skv - sq)
    pos_k = torch.arange(skv).reshape(1, skv)
    hidden = pos_k > pos_q
    if window:
        hidden |= pos_k <= pos_q - window
    logits = logits.masked_fill(hidden, float("-inf"))
    column = sinks.double().reshape(N, 1, 1).expand(N, sq, 1)
    with_sink = torch.cat([logits, column], dim=-1)
    weights = torch.softmax(with_sink, dim=-1)[..., :-1]
    out = torch.einsum("hqk,khd->qhd", weights, vx)
    return out, torch.logsumexp(with_sink, dim=-1).transpose(0, 1)


def _table(kv_lens: list[int], g: torch.Generator) -> torch.Tensor:
    """A block table: each sequence's blocks in a random order, two spare blocks."""
    per = max(-(-n // BS) for n in kv_lens)
    nb = len(kv_lens) * per + 2
    return torch.randperm(nb, generator=g)[: len(kv_lens) * per].reshape(len(kv_lens), per)


def _cache(xs: list[torch.Tensor], table: torch.Tensor) -> torch.Tensor:
    """A (blocknum, blocksize, KV_N*D) cache holding each sequence's rows."""
    cache = torch.zeros(table.numel() + 2, BS, NKV * D, dtype=xs[0].dtype)
    for b, x in enumerate(xs):
        for pos in range(x.shape[0]):
            cache[table[b, pos // BS], pos % BS] = x[pos].reshape(-1)
    return cache


class Batch:
    """Sequences with ``q_lens`` new tokens over ``kv_lens`` keys (bfloat16), as TND."""

    def __init__(self, q_lens: list[int], kv_lens: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.q_lens, self.kv_lens = q_lens, kv_lens
        self.qs = [torch.randn(n, N, D, generator=g).bfloat16() for n in q_lens]
        self.ks = [torch.randn(n, NKV, D, generator=g).bfloat16() for n in kv_lens]
        self.vs = [torch.randn(n, NKV, D, generator=g).bfloat16() for n in kv_lens]
        self.sinks = (torch.randn(N, generator=g) * 2).bfloat16()
        table = _table(kv_lens, g)
        self.kc, self.vc, self.table = _cache(self.ks, table), _cache(self.vs, table), table.int()

    def ends(self) -> list[int]:
        return [sum(self.q_lens[: i + 1]) for i in range(len(self.q_lens))]

    def want(self, scale: float, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [sink_attention(q, k, v, self.sinks, scale, window)
                 for q, k, v in zip(self.qs, self.ks, self.vs, strict=True)]  # fmt: skip
        return torch.cat([o for o, _ in pairs]), torch.cat([lse for _, lse in pairs])


def _kw(batch: Batch, scale: float, window: int = 0, **extra: Any) -> dict[str, Any]:
    return dict(
        atten_mask=MASK.npu(), block_table=batch.table.npu(), input_layout="TND",
        block_size=BS, actual_seq_qlen=batch.ends(), actual_seq_kvlen=batch.kv_lens,
        num_key_value_heads=NKV, num_query_heads=N, sparse_mode=4 if window else 3,
        pre_tokens=window - 1 if window else 2147483647, next_tokens=0,
        softmax_scale=scale, learnable_sink=batch.sinks.npu(), **extra,
    )  # fmt: skip


@pytest.mark.parametrize("window", [0, 5], ids=["causal", "sliding_window"])
def test_sinks_paged_tnd_eager_match_gpt_oss_reference(window: int) -> None:
    """Chunked prefill and decode rows in one TND batch; pre_tokens = window - 1 keeps
    the row's own key and the window - 1 before it."""
    batch = Batch([4, 1, 3], [9, 130, 3], seed=1)
    q = torch.cat(batch.qs).npu()
    out, lse = V2(q, batch.kc.npu(), batch.vc.npu(),
                  **_kw(batch, 0.2, window, return_softmax_lse=True))  # fmt: skip
    want, want_lse = batch.want(0.2, window)
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.cpu().double().reshape(-1, N), want_lse, atol=1e-3, rtol=1e-3)


def test_sinks_dense_tnd_prefill_without_mask() -> None:
    """sparse_mode 0 without a mask over cumulative key ends (every key, no causality):
    the sink still joins each row's softmax."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(5, N, D, generator=g).bfloat16()
    k = torch.randn(7, NKV, D, generator=g).bfloat16()
    v = torch.randn(7, NKV, D, generator=g).bfloat16()
    sinks = torch.tensor([-1.0, 0.0, 2.0, 8.0]).bfloat16()  # 8: a sink that takes most weight
    out, _ = V2(q.npu(), k.npu(), v.npu(), input_layout="TND", actual_seq_qlen=[2, 5],
                actual_seq_kvlen=[3, 7], num_query_heads=N, num_key_value_heads=NKV,
                softmax_scale=0.3, learnable_sink=sinks.npu())  # fmt: skip
    want = []
    for (q0, q1), (k0, k1) in (((0, 2), (0, 3)), ((2, 5), (3, 7))):
        kx = k[k0:k1].double().repeat_interleave(N // NKV, dim=1)
        vx = v[k0:k1].double().repeat_interleave(N // NKV, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), kx) * 0.3
        col = sinks.double().reshape(N, 1, 1).expand(N, q1 - q0, 1)
        w = torch.softmax(torch.cat([logits, col], dim=-1), dim=-1)[..., :-1]
        want.append(torch.einsum("hqk,khd->qhd", w, vx))
    torch.testing.assert_close(out.cpu().double(), torch.cat(want), atol=2e-2, rtol=2e-2)


def test_sinks_full_graph_update_per_step() -> None:
    """vllm-ascend's full graph with FIA v2: capture ``.out`` in a task group with the
    workspace ``_npu_fused_infer_attention_score_v2_get_max_workspace`` gives, then each
    step re-issues it on the update stream with the step's lengths (and the sinks) and
    replays."""
    batch = Batch([1, 1], [256, 256], seed=3)
    q = torch.cat(batch.qs).npu()
    kc, vc = batch.kc.npu(), batch.vc.npu()
    kw = _kw(batch, 0.25)
    workspace = torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace(q, kc, vc, **kw)
    out = torch.empty(2, N, D, dtype=torch.bfloat16, device="npu")
    lse = torch.empty(1, dtype=torch.float32, device="npu")
    event, update = torch.npu.ExternalEvent(), torch.npu.Stream()
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        s = torch.npu.current_stream()
        event.wait(s)
        event.reset(s)
        torch.npu.graph_task_group_begin(s)
        V2.out(q, kc, vc, **kw, workspace=workspace, out=[out, lse])
        handle = torch.npu.graph_task_group_end(s)
    for kv_lens in ([1, 256], [129, 17], [64, 200]):
        graph.replay()
        with torch.npu.stream(update):
            torch.npu.graph_task_update_begin(update, handle)
            step = dict(kw, actual_seq_kvlen=kv_lens)  # the captured tensors, new lengths
            V2.out(q, kc, vc, **step, workspace=workspace, out=[out, lse])
            torch.npu.graph_task_update_end(update)
            event.record(update)
        got = out.cpu().double()
        for b, n in enumerate(kv_lens):
            want, _ = sink_attention(batch.qs[b], batch.ks[b][:n], batch.vs[b][:n], batch.sinks,
                                     0.25)  # fmt: skip
            torch.testing.assert_close(got[b : b + 1], want, atol=2e-2, rtol=2e-2)


def _refused(match: str, **change: Any) -> None:
    batch = Batch([2], [5], seed=4)
    kw = _kw(batch, 0.25)
    kw.update(change)
    q = torch.cat(batch.qs)
    if kw["input_layout"] == "BSND":
        q = q.unsqueeze(0)
        kw.update(actual_seq_qlen=[2], atten_mask=MASK.npu())
    with pytest.raises(SimUsageError, match=match):
        V2(q.npu(), batch.kc.npu(), batch.vc.npu(), **kw)


def test_sink_dtype_shape_and_layout_are_refused_in_the_documents_words() -> None:
    _refused(r"learnable_sink is float16, which .* takes bfloat16",
             learnable_sink=torch.zeros(N, dtype=torch.float16).npu())  # fmt: skip
    _refused(r"learnable_sink: shape \(1, 4\) is not \(Q_N,\)",
             learnable_sink=torch.zeros(1, N, dtype=torch.bfloat16).npu())  # fmt: skip
    _refused(r"learnable_sink: is supported with the TND and NTD_TND layouts only, got BSND",
             input_layout="BSND")  # fmt: skip


def test_tnd_sliding_window_bounds_are_checked() -> None:
    _refused(r"pre_tokens: sparse_mode 4 with TND needs", sparse_mode=4, pre_tokens=-3,
             next_tokens=0)  # fmt: skip
