"""Attention layouts and shapes the op documents and the field uses, run as the field runs
them: captured in a task group behind an ExternalEvent, lengths updated on an update
stream, replayed (vllm-ascend's full-graph decode, ``attention_v1.py``/``mla_v1.py``).

* ``_npu_paged_attention`` with a value head size other than key's (torch_npu's
  ``test_paged_attention_aclgraph_update``: key D 288, value D 96);
* FIA v2 MLA decode, ``BNSD_NBSD`` with a one-token query and 16 or 128 query heads
  (vllm-ascend ``mla_v1.py``; op-plugin's MLA section: query N 1/2/4/8/16/32/64/128);
* a dense TND prefill passing ``block_size`` without ``block_table`` (ignored).

Numbers are checked against plain torch; each mutation drops the fence between a replay
and the next update, and the sim reports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from npusim import HazardError, reset_device, torch_npu

G = torch.Generator().manual_seed(33)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G).to(torch.float16)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           causal: bool = False) -> torch.Tensor:  # fmt: skip
    """Plain torch: q [S, N, D] over k [S_kv, N, D], v [S_kv, N, Dv] -> [S, N, Dv]."""
    s = torch.einsum("qnd,knd->nqk", q.float(), k.float()) * scale
    if causal:  # aligned bottom-right
        sq, skv = q.shape[0], k.shape[0]
        allowed = torch.arange(skv)[None, :] <= torch.arange(sq)[:, None] + skv - sq
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("nqk,knd->qnd", torch.softmax(s, dim=-1), v.float())


class Case:
    """One field call shape: ``issue(lens)`` issues the op on the current stream with
    the given lengths (eager, captured or as an update); ``want(lens)`` is plain torch."""

    issue: Callable[[list[int]], None]
    want: Callable[[list[int]], torch.Tensor]
    got: Callable[[], torch.Tensor]
    capture_lens: list[int]
    update_lens: tuple[list[int], ...]


def paged_value_dim_differs() -> Case:
    """ATB paged attention, key D 48 and value D 16 (torch_npu's update test runs 288/96)."""
    b, n, nkv, dk, dv, bs, nb = 2, 4, 2, 48, 16, 16, 8
    q, kc, vc = rand(b, n, dk), rand(nb, bs, nkv, dk), rand(nb, bs, nkv, dv)
    table = torch.tensor([[3, 0, 5], [1, 7, 2]], dtype=torch.int32)
    qn, kn, vn, tn = q.npu(), kc.npu(), vc.npu(), table.npu()
    out = torch.zeros(b, n, dv, dtype=torch.float16).npu()
    c = Case()

    def issue(lens: list[int]) -> None:
        torch_npu._npu_paged_attention(
            query=qn, key_cache=kn, value_cache=vn, num_kv_heads=nkv, num_heads=n,
            scale_value=0.2, block_table=tn, context_lens=torch.tensor(lens, dtype=torch.int32),
            out=out,
        )  # fmt: skip

    def want(lens: list[int]) -> torch.Tensor:
        rows = []
        for i, ln in enumerate(lens):
            k = torch.cat([kc[blk] for blk in table[i].tolist()])[:ln]
            v = torch.cat([vc[blk] for blk in table[i].tolist()])[:ln]
            rows.append(attend(q[i : i + 1], k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                               0.2)[0])  # fmt: skip
        return torch.stack(rows)

    c.issue, c.want, c.got = issue, want, lambda: out.cpu().float()
    c.capture_lens, c.update_lens = [48, 48], ([5, 48], [33, 17])
    return c


def mla_decode_bnsd_nbsd(heads: int) -> Case:
    """vllm-ascend MLA decode: FIA v2 ``.out``, ``BNSD_NBSD``, query S 1, latent KV cache
    (blocknum, 1, blocksize, 512) passed as key and value, rope 64."""
    b, d, rd, bs, nb = 2, 512, 64, 128, 4
    q, qr = rand(b, heads, 1, d), rand(b, heads, 1, rd)
    latent, rope = rand(nb, 1, bs, d), rand(nb, 1, bs, rd)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    qn, qrn, ln, rn, tn = q.npu(), qr.npu(), latent.npu(), rope.npu(), table.npu()
    out = torch.zeros(heads, b, 1, d, dtype=torch.float16).npu()
    lse = torch.zeros(1, dtype=torch.float32).npu()
    scale = (d + rd) ** -0.5
    kw: dict[str, Any] = dict(
        query_rope=qrn, key_rope=rn, num_query_heads=heads, num_key_value_heads=1,
        input_layout="BNSD_NBSD", atten_mask=None, sparse_mode=0, softmax_scale=scale,
        block_table=tn, block_size=bs, actual_seq_qlen=None,
    )  # fmt: skip
    ws = torch_npu._npu_fused_infer_attention_score_v2_get_max_workspace(
        qn, ln, ln, actual_seq_kvlen=[bs * 2] * b, **kw
    )
    c = Case()

    def issue(lens: list[int]) -> None:
        torch_npu.npu_fused_infer_attention_score_v2.out(
            qn, ln, ln, actual_seq_kvlen=lens, workspace=ws, out=[out, lse], **kw
        )

    def want(lens: list[int]) -> torch.Tensor:
        rows = []
        for i, n in enumerate(lens):
            blocks = table[i].tolist()
            kl = torch.cat([latent[blk, 0] for blk in blocks])[:n]
            kr = torch.cat([rope[blk, 0] for blk in blocks])[:n]
            keys = torch.cat([kl, kr], dim=-1)[:, None].expand(n, heads, d + rd)
            qq = torch.cat([q[i], qr[i]], dim=-1).transpose(0, 1)  # [1, N, D+R]
            rows.append(attend(qq, keys, kl[:, None].expand(n, heads, d), scale)[0])
        return torch.stack(rows, dim=1)[:, :, None]  # [N, B, 1, D]

    c.issue, c.want, c.got = issue, want, lambda: out.cpu().float()
    c.capture_lens, c.update_lens = [1, 1], ([200, 7], [64, 129])
    return c


def tnd_prefill_block_size_without_table() -> Case:
    """A dense TND prefill that passes the cache's block size and no block table."""
    n, d, t = 4, 16, 12
    q, k, v = rand(t, n, d), rand(t, n, d), rand(t, n, d)
    qn, kn, vn = q.npu(), k.npu(), v.npu()
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1).npu()
    out = torch.zeros(t, n, d, dtype=torch.float16).npu()
    lse = torch.zeros(1, dtype=torch.float32).npu()
    c = Case()

    def issue(ends: list[int]) -> None:
        torch_npu.npu_fused_infer_attention_score.out(
            qn, kn, vn, atten_mask=mask, actual_seq_lengths=ends, actual_seq_lengths_kv=ends,
            num_heads=n, scale=0.25, input_layout="TND", sparse_mode=3, block_size=128,
            out=[out, lse],
        )  # fmt: skip

    def want(ends: list[int]) -> torch.Tensor:
        got = torch.zeros(t, n, d)
        start = 0
        for end in ends:
            sl = slice(start, end)
            got[sl] = attend(q[sl], k[sl], v[sl], 0.25, causal=True)
            start = end
        return got[: ends[-1]]

    c.issue, c.want = issue, want
    c.got = lambda: out.cpu().float()[: c.update_lens[0][-1]]
    c.capture_lens, c.update_lens = [6, 12], ([5, 12], [9, 12])
    return c


CASES: dict[str, Callable[[], Case]] = {
    "paged_value_dim_differs": paged_value_dim_differs,
    "mla_bnsd_nbsd_16_heads": lambda: mla_decode_bnsd_nbsd(16),
    "mla_bnsd_nbsd_32_heads": lambda: mla_decode_bnsd_nbsd(32),
    "mla_bnsd_nbsd_128_heads": lambda: mla_decode_bnsd_nbsd(128),
    "tnd_block_size_without_table": tnd_prefill_block_size_without_table,
}


def _capture(c: Case, s: torch.npu.Stream) -> tuple[Any, Any, Any]:
    g, ev = torch.npu.NPUGraph(), torch.npu.ExternalEvent()
    with torch.npu.graph(g, stream=s):
        ev.wait(s)
        ev.reset(s)
        torch.npu.graph_task_group_begin(s)
        c.issue(c.capture_lens)
        handle = torch.npu.graph_task_group_end(s)
    return g, ev, handle


def _update(c: Case, u: torch.npu.Stream, handle: Any, ev: Any, lens: list[int]) -> None:
    with torch.npu.stream(u):
        torch.npu.graph_task_update_begin(u, handle)
        c.issue(lens)
        torch.npu.graph_task_update_end(u)
        ev.record(u)


@pytest.mark.parametrize("name", list(CASES))
def test_field_shape_runs_clean_with_the_reference_numbers(name: str) -> None:
    c = CASES[name]()
    c.issue(c.update_lens[0])  # eager
    torch.testing.assert_close(c.got(), c.want(c.update_lens[0]), atol=3e-3, rtol=3e-3)
    s, u = torch.npu.Stream(), torch.npu.Stream()
    g, ev, handle = _capture(c, s)
    for lens in c.update_lens:
        _update(c, u, handle, ev, lens)
        with torch.npu.stream(s):
            g.replay()
        torch.npu.current_stream().wait_stream(s)
        got = c.got()  # observed: the next update is ordered after this replay
        torch.testing.assert_close(got, c.want(lens), atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("name", list(CASES))
def test_field_shape_update_not_fenced_after_the_replay_is_reported(name: str) -> None:
    c = CASES[name]()
    s, u = torch.npu.Stream(), torch.npu.Stream()
    g, ev, handle = _capture(c, s)
    _update(c, u, handle, ev, c.update_lens[0])
    with torch.npu.stream(s):
        g.replay()
    # The mutation: the second update neither observes the replay nor waits for it on u.
    _update(c, u, handle, ev, c.update_lens[1])
    with torch.npu.stream(s):
        g.replay()
    with pytest.raises(HazardError) as err:
        torch.npu.synchronize()
    assert err.value.kind in ("race", "lost-release")
    reset_device()
