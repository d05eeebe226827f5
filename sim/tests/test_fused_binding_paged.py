"""Patching through the fused binding ``torch_npu._C._npu_fused_infer_attention_score_out_graph``
(update stream, task-group handle, event, then the arguments of FIA ``.out``) with paged
KV and with the TND layout, checked after each replay against a reference written with
plain loops (tests/paged_reference.py), not the sim's kernel.

The binding is torch_npu's own (torch_npu/csrc/npu/Graph.cpp in Ascend/pytorch): it parses
FIA's schema, does ``graph_task_update_begin`` on the stream, the ``.out`` op,
``graph_task_update_end`` and records the event on the stream, and returns the ``out``
tensors. Both orders of the field are used: replay then patch (the graph waits at the
group's event) and patch then replay.
"""

from __future__ import annotations

import math

import torch
from npusim import torch_npu
from paged_reference import attend, gather_positions

FUSED = torch_npu._C._npu_fused_infer_attention_score_out_graph
STEPS = 8


def _rand(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g).half()


def test_paged_bsh_decode_replay_then_fused_patch() -> None:
    b, n, nkv, d, bs, nb, per_seq = 3, 4, 1, 16, 16, 12, 4
    scale = 1 / math.sqrt(d)
    g = torch.Generator().manual_seed(31)
    kc, vc = _rand(g, nb, bs, nkv, d), _rand(g, nb, bs, nkv, d)
    table = torch.randperm(nb, generator=g)[: b * per_seq].reshape(b, per_seq).int()
    q = _rand(g, b, 1, n * d)
    args = (q.npu(), kc.reshape(nb, bs, -1).npu(), vc.reshape(nb, bs, -1).npu())
    kw = dict(block_table=table.npu(), block_size=bs, num_heads=n, num_key_value_heads=nkv,
              scale=scale, input_layout="BSH", softmax_lse_flag=True)  # fmt: skip
    longest = [per_seq * bs] * b
    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
        *args, actual_seq_lengths_kv=longest, **kw
    )
    out = torch.empty(b, 1, n * d, dtype=torch.float16).npu()
    lse = torch.empty(b, n, 1, 1, dtype=torch.float32).npu()
    event, update = torch.npu.ExternalEvent(), torch.npu.Stream()
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        s = torch.npu.current_stream()
        event.wait(s)
        event.reset(s)
        torch.npu.graph_task_group_begin(s)
        torch_npu.npu_fused_infer_attention_score.out(
            *args, actual_seq_lengths_kv=longest, **kw, workspace=workspace, out=[out, lse]
        )
        handle = torch.npu.graph_task_group_end(s)

    g_len = torch.Generator().manual_seed(32)
    for step in range(STEPS):
        lens = torch.randint(1, per_seq * bs + 1, (b,), generator=g_len).tolist()
        if step == 0:
            lens = [1, bs + 1, per_seq * bs]  # one key, one past a block, all blocks full
        graph.replay()
        got = FUSED(update, handle, event, *args, actual_seq_lengths_kv=lens, **kw,
                    workspace=workspace, out=[out, lse])  # fmt: skip
        assert got[0] is out and got[1] is lse
        o, l_ = out.cpu().reshape(b, n, d), lse.cpu().reshape(b, n)
        for i in range(b):
            ks = gather_positions(kc, table, i, lens[i], bs)[:, 0]
            vs = gather_positions(vc, table, i, lens[i], bs)[:, 0]
            for h in range(n):
                want, want_lse = attend(q[i, 0, h * d : (h + 1) * d], ks, vs,
                                        [True] * lens[i], scale)  # fmt: skip
                torch.testing.assert_close(o[i, h].double(), want, atol=2e-3, rtol=2e-3)
                assert abs(float(l_[i, h]) - want_lse) < 2e-3, (step, i, h)


def test_tnd_paged_causal_fused_patch_then_replay() -> None:
    """Chunked prefill / speculative verify over paged KV: TND query with cumulative
    query ends, per-batch kv lengths, causal mask aligned bottom-right (sparse_mode 3);
    both length lists are patched through the binding, then the graph replays."""
    b, n, nkv, d, bs, nb, per_seq, t = 3, 4, 2, 16, 128, 8, 2, 8
    scale = 0.25
    g = torch.Generator().manual_seed(41)
    kc, vc = _rand(g, nb, bs, nkv, d), _rand(g, nb, bs, nkv, d)
    table = torch.randperm(nb, generator=g)[: b * per_seq].reshape(b, per_seq).int()
    q = _rand(g, t, n, d)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    args = (q.npu(), kc.reshape(nb, bs, -1).npu(), vc.reshape(nb, bs, -1).npu())
    kw = dict(atten_mask=mask.npu(), block_table=table.npu(), block_size=bs, num_heads=n,
              num_key_value_heads=nkv, scale=scale, input_layout="TND", sparse_mode=3)  # fmt: skip
    ends0, kv0 = [3, 6, t], [per_seq * bs] * b  # the capture's lengths: the longest
    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
        *args, actual_seq_lengths=ends0, actual_seq_lengths_kv=kv0, **kw
    )
    out = torch.empty(t, n, d, dtype=torch.float16).npu()
    lse = torch.empty(1, dtype=torch.float32).npu()
    event, update = torch.npu.ExternalEvent(), torch.npu.Stream()
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        s = torch.npu.current_stream()
        event.wait(s)
        event.reset(s)
        torch.npu.graph_task_group_begin(s)
        torch_npu.npu_fused_infer_attention_score.out(
            *args, actual_seq_lengths=ends0, actual_seq_lengths_kv=kv0, **kw,
            workspace=workspace, out=[out, lse],
        )  # fmt: skip
        handle = torch.npu.graph_task_group_end(s)

    g_len = torch.Generator().manual_seed(42)
    for step in range(STEPS):
        q_lens = torch.randint(1, 3, (b,), generator=g_len).tolist()  # 1..2 new tokens
        kv_lens = [int(torch.randint(ql, per_seq * bs + 1, (1,), generator=g_len))
                   for ql in q_lens]  # fmt: skip
        if step == 0:
            q_lens, kv_lens = [2, 1, 2], [bs + 1, 1, 2 * bs]  # across a block, one key, full
        ends = [sum(q_lens[: i + 1]) for i in range(b)]
        got = FUSED(update, handle, event, *args, actual_seq_lengths=ends,
                    actual_seq_lengths_kv=kv_lens, **kw, workspace=workspace,
                    out=[out, lse])  # fmt: skip
        assert got[0] is out
        graph.replay()
        o = out.cpu()
        start = 0
        for i, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
            ks = gather_positions(kc, table, i, kl, bs)
            vs = gather_positions(vc, table, i, kl, bs)
            for r in range(ql):
                allowed = [j <= r + kl - ql for j in range(kl)]
                for h in range(n):
                    want, _ = attend(q[start + r, h], ks[:, h // (n // nkv)],
                                     vs[:, h // (n // nkv)], allowed, scale)  # fmt: skip
                    got_row = o[start + r, h].double()
                    assert torch.allclose(got_row, want, atol=2e-3, rtol=2e-3), (step, i, r, h)
            start += ql
        assert torch.count_nonzero(o[ends[-1] :]) == 0, step  # rows past the last end
