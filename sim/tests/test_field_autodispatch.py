"""Auto-dispatch captures as the field writes them, on the sim: torch_npu 2.14's handler
registry (``torch_npu/npu/_npugraph_handlers``), its weak-reference records
(``torch_npu._C._weak_ref_tensor``), the one update stream of the process
(``NPUGraph().graph_dispatch_mode.update_stream``), and an error inside a capture's task
group, which must surface as the cause of the failed capture.

Call shapes from sglang's NPU graph runner (``with torch.npu.graph(g, pool=..., stream=...,
auto_dispatch_capture=True)`` per batch size, ``g.update(cpu_update_input=[{...}])`` before
each replay) and Ascend/pytorch ``test/npu/test_npugraph_handler.py``.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import pytest
import torch
from npusim import HazardError, SimUsageError, reset_device, torch_npu

G = torch.Generator().manual_seed(11)
N, D, S = 4, 16, 64
KW = dict(num_heads=N, input_layout="BNSD", scale=0.25)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G).to(torch.float16)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Plain torch: one query token per head over the first kv_len keys."""
    s = (q.float() @ k[:, :, :kv_len].float().transpose(-1, -2)) * 0.25
    return (torch.softmax(s, dim=-1) @ v[:, :, :kv_len].float()).to(q.dtype)


@pytest.fixture
def registry() -> Iterator[dict[str, type]]:
    handlers = torch_npu.npu._npugraph_handlers.npugraph_handler._NPU_GRAPH_OP_HANDLERS
    saved = dict(handlers)
    yield handlers
    handlers.clear()
    handlers.update(saved)


def test_builtin_handlers_are_registered_by_name_with_torch_npus_update_specs(
    registry: dict[str, type],
) -> None:
    for name in ("npu_fused_infer_attention_score.default", "npu_fused_infer_attention_score.out"):
        assert ("arg", 6, "actual_seq_lengths_kv") in registry[name].get_update_specs(name)
    v2 = "npu_fused_infer_attention_score_v2.default"
    assert ("arg", 8, "actual_seq_kvlen") in registry[v2].get_update_specs(v2)
    pa = "_npu_paged_attention.default"
    assert registry[pa].get_update_specs(pa) == [("arg", 7, "context_lens")]
    assert issubclass(registry[pa], torch.npu.NpuGraphOpHandler)


def test_a_registered_handler_decides_what_an_update_patches(registry: dict[str, type]) -> None:
    name = "npu_fused_infer_attention_score.out"

    names = [name, "npu_fused_infer_attention_score.default"]

    @torch.npu.register_npu_graph_handler(names)
    class KvLens(registry[name]):  # type: ignore[misc,valid-type]
        UPDATE_SPECS = {n: [("kwarg", "actual_seq_lengths_kv", "kv_lens")] for n in names}

    assert registry[name] is KvLens
    q, k, v = rand(1, N, 1, D), rand(1, N, S, D), rand(1, N, S, D)
    qn, kn, vn = q.npu(), k.npu(), v.npu()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        out, _ = torch_npu.npu_fused_infer_attention_score(
            qn, kn, vn, actual_seq_lengths_kv=[S], **KW
        )
    for kv_len in (5, 40):
        g.update(cpu_update_input=[{"kv_lens": [kv_len]}])
        g.replay()
        torch.testing.assert_close(out.cpu(), reference(q, k, v, kv_len), atol=2e-3, rtol=2e-3)


def _capture_batches(sizes: tuple[int, ...]) -> dict[int, tuple[torch.npu.NPUGraph, torch.Tensor]]:
    """sglang's NPU graph runner: one graph per batch size, largest first, one pool, one
    capture stream, FIA with the kv lengths as the patched parameter."""
    pool, stream = torch.npu.graph_pool_handle(), torch.npu.Stream()
    graphs = {}
    for bs in sorted(sizes, reverse=True):
        q, k, v = QKV[0][:bs], QKV[1][:bs], QKV[2][:bs]
        g = torch.npu.NPUGraph()
        with torch.npu.graph(g, pool=pool, stream=stream, auto_dispatch_capture=True):
            out, _ = torch_npu.npu_fused_infer_attention_score(
                q, k, v, actual_seq_lengths_kv=[S] * bs, **KW
            )
        graphs[bs] = (g, out)
    return graphs


QKV = (rand(4, N, 1, D).npu(), rand(4, N, S, D).npu(), rand(4, N, S, D).npu())


def test_graphs_of_several_batch_sizes_updated_on_the_process_update_stream() -> None:
    graphs = _capture_batches((1, 2, 4))
    update_streams = {g.graph_dispatch_mode.update_stream for g, _ in graphs.values()}
    assert len(update_streams) == 1  # one per process, made with the first graph
    assert torch.npu.NPUGraph().graph_dispatch_mode.update_stream in update_streams
    q, k, v = (t.cpu() for t in QKV)
    for bs, lens in ((2, [7, 33]), (4, [1, 64, 20, 9]), (1, [50])):
        g, out = graphs[bs]
        g.update(cpu_update_input=[{"actual_seq_lengths_kv": lens}])
        g.replay()
        got = out.cpu()  # observes the replay: the next update is ordered after it
        for i, n in enumerate(lens):
            want = reference(q[i : i + 1], k[i : i + 1], v[i : i + 1], n)
            torch.testing.assert_close(got[i : i + 1], want, atol=2e-3, rtol=2e-3)


def test_an_update_not_ordered_after_the_previous_replay_is_reported() -> None:
    g, _ = _capture_batches((2,))[2]
    g.update(cpu_update_input=[{"actual_seq_lengths_kv": [3, 4]}])
    g.replay()
    # The mutation: no observation of the replay (out.cpu(), an event) before the update.
    g.update(cpu_update_input=[{"actual_seq_lengths_kv": [5, 6]}])
    g.replay()
    with pytest.raises(HazardError) as err:
        torch.npu.synchronize()
    # Both are that missing fence: the patch races the first replay, and its release can
    # merge with the first update's if that replay has not consumed it yet.
    assert err.value.kind in ("race", "lost-release")
    reset_device()


def test_records_hold_device_tensors_weakly() -> None:
    q, k, v = rand(1, N, 1, D).npu(), rand(1, N, S, D).npu(), rand(1, N, S, D).npu()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, auto_dispatch_capture=True):
        out, _ = torch_npu.npu_fused_infer_attention_score(q, k, v, **KW)
    (record,) = g.graph_dispatch_mode.graph_dispatch_records
    assert record.args[0].data_ptr() == q.data_ptr()
    weak = torch_npu._C._weak_ref_tensor(q)
    assert weak.data_ptr() == q.data_ptr() and weak.shape == q.shape
    before = torch.npu.memory_allocated()
    nbytes = q.numel() * q.element_size()
    del q
    gc.collect()
    assert torch.npu.memory_allocated() <= before - nbytes  # nothing else held it
    assert weak.data_ptr() == record.args[0].data_ptr()
    del out


def test_an_error_inside_an_auto_dispatch_task_group_is_the_cause_of_the_failed_capture() -> None:
    q, kv = rand(1, N, 1, D).npu(), rand(1, N, S, D).npu()
    ws = torch.empty(1, dtype=torch.uint8).npu()
    o, lse = torch.empty_like(q), torch.empty(1, dtype=torch.float32).npu()
    g = torch.npu.NPUGraph()
    # A fallback that swallows the op's error (dlinfer tries kernels in turn).
    with (
        pytest.raises(SimUsageError, match="task group 0") as err,
        torch.npu.graph(g, auto_dispatch_capture=True),
        contextlib.suppress(SimUsageError),
    ):
        torch_npu.npu_fused_infer_attention_score.out(q, kv, kv, workspace=ws, out=[o, lse], **KW)
    cause = err.value.__cause__
    assert isinstance(cause, SimUsageError) and "workspace" in str(cause)
    assert "workspace" in str(err.value)  # the message names the cause too
