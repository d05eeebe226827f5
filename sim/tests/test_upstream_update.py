"""The scenarios of Ascend/pytorch ``test/npu/test_aclgraph_update.py``, on the sim.

Each captures the fused infer attention op with actual_seq_lengths [29],
updates it to [100] and expects the eager result for [100]. The query has
sequence length 1, so the op takes the incremental branch where query lengths
do not matter; what the tests prove is that capture, update and replay run
in the right order and the replay produces the eager result.
"""

from __future__ import annotations

import torch
from npusim import torch_npu

LENGTH = [29]
LENGTH_NEW = [100]
SCALE = 1 / 0.0078125
FIA_KW = dict(num_heads=32, input_layout="BNSD", scale=SCALE, pre_tokens=65535, next_tokens=65535)


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(  # type: ignore[return-value]
        torch.randn(1, 32, 1, 128, dtype=torch.float16, generator=g).npu() for _ in range(3)
    )


def _eager(q, k, v):
    return torch_npu.npu_fused_infer_attention_score(
        q, k, v, softmax_lse_flag=False, actual_seq_lengths=LENGTH_NEW, **FIA_KW
    )


def _manual_update(reset_event: bool) -> None:
    torch.npu.set_device(0)
    query, key, value = _qkv()
    res_src = _eager(query, key, value)

    g = torch.npu.NPUGraph()
    event = torch.npu.ExternalEvent()
    update_stream = torch.npu.Stream()
    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
        query, key, value, softmax_lse_flag=False, actual_seq_lengths=LENGTH, **FIA_KW
    )
    with torch.npu.graph(g):
        stream = torch.npu.current_stream()
        output = torch.empty(1, 32, 1, 128, dtype=torch.float16, device="npu")
        softmax_lse = torch.empty(1, dtype=torch.float16, device="npu")
        event.wait(stream)
        if reset_event:
            event.reset(stream)
        torch.npu.graph_task_group_begin(stream)
        torch_npu.npu_fused_infer_attention_score.out(
            query, key, value, workspace=workspace, softmax_lse_flag=False,
            actual_seq_lengths=LENGTH, out=[output, softmax_lse], **FIA_KW,
        )  # fmt: skip
        handle = torch.npu.graph_task_group_end(stream)

    with torch.npu.stream(update_stream):
        torch.npu.graph_task_update_begin(update_stream, handle)
        torch_npu.npu_fused_infer_attention_score.out(
            query, key, value, workspace=workspace, softmax_lse_flag=False,
            actual_seq_lengths=LENGTH_NEW, out=[output, softmax_lse], **FIA_KW,
        )  # fmt: skip
        torch.npu.graph_task_update_end(update_stream)
        event.record(update_stream)

    g.replay()
    assert torch.equal(output.cpu(), res_src[0].cpu())
    assert torch.equal(softmax_lse.cpu(), res_src[1].cpu().to(torch.float16))


def test_ifa_update() -> None:
    _manual_update(reset_event=True)


def test_ifa_update_without_reset() -> None:
    _manual_update(reset_event=False)


def test_ifa_update_with_auto_dispatch_capture() -> None:
    query, key, value = _qkv()
    res_src = _eager(query, key, value)
    g = torch.npu.NPUGraph()
    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
        query, key, value, softmax_lse_flag=False, actual_seq_lengths=LENGTH, **FIA_KW
    )
    with torch.npu.graph(g, auto_dispatch_capture=True):
        output = torch.empty(1, 32, 1, 128, dtype=torch.float16, device="npu")
        softmax_lse = torch.empty(1, dtype=torch.float16, device="npu")
        torch_npu.npu_fused_infer_attention_score.out(
            query, key, value, workspace=workspace, softmax_lse_flag=False,
            actual_seq_lengths=LENGTH, out=[output, softmax_lse], **FIA_KW,
        )  # fmt: skip
    g.update(cpu_update_input=[{"actual_seq_lengths": LENGTH_NEW}])
    g.replay()
    assert torch.equal(output.cpu(), res_src[0].cpu())
    assert torch.equal(softmax_lse.cpu(), res_src[1].cpu().to(torch.float16))


def test_ifa_update_with_non_out_and_auto_dispatch_capture() -> None:
    query, key, value = _qkv()
    res_src = _eager(query, key, value)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        output, softmax_lse = torch_npu.npu_fused_infer_attention_score(
            query, key, value, softmax_lse_flag=False, actual_seq_lengths=LENGTH, **FIA_KW
        )
    g.update(cpu_update_input=[{"actual_seq_lengths": LENGTH_NEW}])
    g.replay()
    assert torch.equal(output.cpu(), res_src[0].cpu())
    assert torch.equal(softmax_lse.cpu(), res_src[1].cpu())


def test_shared_update_stream_serves_two_graphs_over_many_steps() -> None:
    """auto_dispatch graphs share one process-wide update stream (torch_npu 2.14)."""
    query = _qkv()[0]
    kv = torch.randn(1, 32, 64, 128, dtype=torch.float16).npu()
    graphs, outs = [], []
    for _ in range(2):
        g = torch.npu.NPUGraph()
        with torch.npu.graph(g, auto_dispatch_capture=True):
            out, _ = torch_npu.npu_fused_infer_attention_score(
                query, kv, kv, softmax_lse_flag=False, actual_seq_lengths_kv=[64], **FIA_KW
            )
        graphs.append(g)
        outs.append(out)
    for step in range(4):
        for i, g in enumerate(graphs):
            n = 8 + 8 * step + i
            g.update(cpu_update_input=[{"actual_seq_lengths_kv": [n]}])
            g.replay()
            torch.npu.synchronize()  # the next update must follow this replay's wait
            expected, _ = torch_npu.npu_fused_infer_attention_score(
                query, kv, kv, softmax_lse_flag=False, actual_seq_lengths_kv=[n], **FIA_KW
            )
            assert torch.equal(outs[i].cpu(), expected.cpu())
