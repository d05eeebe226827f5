"""Attention workspaces as torch_npu 2.14 and the field size them, on the sim.

torch_npu's auto-dispatch capture gets the FIA workspace once, from
``_npu_fused_infer_attention_score_get_max_workspace`` on the captured arguments
(``_npugraph_handlers/ifa_handler.py``), and every later update reuses it; lmdeploy/dlinfer
capture with a kv length of 1 and update to the real lengths. vllm-ascend's full-graph
``_npu_paged_attention`` update passes the workspace it holds at update time
(``attention_v1.py`` ``update_attn_params``), which may be another tensor than the captured
one. Numbers are checked against plain torch; the mutations drop the fence between a
replay and the next update.
"""

from __future__ import annotations

import pytest
import torch
from npusim import HazardError, reset_device, torch_npu

G = torch.Generator().manual_seed(5)
N, D = 4, 16


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G).to(torch.float16)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain torch: q [N, D] over k, v [S, N, D] -> [N, D]."""
    s = torch.einsum("nd,snd->ns", q.float(), k.float()) * scale
    return torch.einsum("ns,snd->nd", torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def test_fia_captured_with_kv_length_1_is_updated_to_the_full_cache() -> None:
    s = 256
    q, k, v = rand(2, N, 1, D), rand(2, N, s, D), rand(2, N, s, D)
    qn, kn, vn = q.npu(), k.npu(), v.npu()
    kw = dict(num_heads=N, input_layout="BNSD", scale=0.25)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        out, _ = torch_npu.npu_fused_infer_attention_score(
            qn, kn, vn, actual_seq_lengths_kv=[1, 1], **kw
        )
    for lens in ([256, 3], [77, 200]):
        g.update(cpu_update_input=[{"actual_seq_lengths_kv": lens}])
        g.replay()
        got = out.cpu()
        for i, n in enumerate(lens):
            want = attend(q[i, :, 0], k[i, :, :n].transpose(0, 1), v[i, :, :n].transpose(0, 1),
                          0.25)  # fmt: skip
            torch.testing.assert_close(got[i, :, 0], want, atol=2e-3, rtol=2e-3)


def _paged_setup() -> dict[str, torch.Tensor]:
    bs, nb, b = 16, 8, 2
    kc, vc = rand(nb, bs, N, D), rand(nb, bs, N, D)
    table = torch.tensor([[3, 0, 5], [1, 7, 2]], dtype=torch.int32)
    return dict(q=rand(b, N, D), kc=kc, vc=vc, table=table)


def _paged_ref(t: dict[str, torch.Tensor], lens: list[int]) -> torch.Tensor:
    rows = []
    for i, n in enumerate(lens):
        blocks = t["table"][i].tolist()
        k = torch.cat([t["kc"][blk] for blk in blocks])[:n]
        v = torch.cat([t["vc"][blk] for blk in blocks])[:n]
        rows.append(attend(t["q"][i], k, v, 0.25))
    return torch.stack(rows)


def _paged_capture(t: dict[str, torch.Tensor], s: torch.npu.Stream) -> tuple:
    q, kc, vc, table = t["q"].npu(), t["kc"].npu(), t["vc"].npu(), t["table"].npu()
    out = torch.empty(2, N, D, dtype=torch.float16).npu()
    args = (q, kc, vc, N, N, 0.25, table)
    cap = torch.tensor([48, 48], dtype=torch.int32)
    ws = torch_npu._npu_paged_attention_get_workspace(*args, cap, out)
    g, ev = torch.npu.NPUGraph(), torch.npu.ExternalEvent()
    with torch.npu.graph(g, stream=s):
        ev.wait(s)
        ev.reset(s)
        torch.npu.graph_task_group_begin(s)
        torch_npu._npu_paged_attention(*args, cap, out, workspace=ws)
        handle = torch.npu.graph_task_group_end(s)
    return g, ev, handle, args, out, ws


def _paged_update(u, handle, ev, args, out, lens) -> None:  # type: ignore[no-untyped-def]
    ws = torch_npu._npu_paged_attention_get_workspace(
        *args, torch.tensor(lens, dtype=torch.int32), out
    )  # a workspace got now, not the captured one
    with torch.npu.stream(u):
        torch.npu.graph_task_update_begin(u, handle)
        torch_npu._npu_paged_attention(*args, torch.tensor(lens, dtype=torch.int32), out,
                                       workspace=ws)  # fmt: skip
        torch.npu.graph_task_update_end(u)
        ev.record(u)


def test_paged_attention_update_with_a_new_workspace() -> None:
    t = _paged_setup()
    s, u = torch.npu.Stream(), torch.npu.Stream()
    g, ev, handle, args, out, _ = _paged_capture(t, s)
    for lens in ([5, 48], [33, 17]):
        _paged_update(u, handle, ev, args, out, lens)
        with torch.npu.stream(s):
            g.replay()
        torch.npu.current_stream().wait_stream(s)
        got = out.cpu()  # observed: the next update is ordered after this replay
        torch.testing.assert_close(got, _paged_ref(t, lens), atol=2e-3, rtol=2e-3)


def test_paged_attention_update_not_fenced_after_the_replay_is_reported() -> None:
    t = _paged_setup()
    s, u = torch.npu.Stream(), torch.npu.Stream()
    g, ev, handle, args, out, _ = _paged_capture(t, s)
    _paged_update(u, handle, ev, args, out, [5, 48])
    with torch.npu.stream(s):
        g.replay()
    # The mutation: the second update neither observes the replay nor waits for it on u.
    _paged_update(u, handle, ev, args, out, [33, 17])
    with torch.npu.stream(s):
        g.replay()
    with pytest.raises(HazardError) as err:
        torch.npu.synchronize()
    assert err.value.kind in ("race", "lost-release")
    reset_device()
