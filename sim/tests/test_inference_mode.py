"""Device work issued under ``torch.inference_mode()``, as vLLM issues it.

vLLM's GPU/NPU model runners execute the model, and capture its graphs, inside
``torch.inference_mode()`` (``@torch.inference_mode()`` on ``execute_model`` and
``capture_model``); vllm-ascend's model runner inherits that. The mode is per host
thread: the NPU writes device memory whatever the mode of the thread that issued the
work. On the sim the work runs on stream threads, which once ran outside the mode and
faulted on the first write into memory allocated inside it ("Inplace update to
inference tensor outside InferenceMode"). Every path is driven here: eager ops,
in-place ops, factories, copies both ways, host reads, the allocator, capture, replay
in and out of the mode and from another thread, task-group updates and the fused
update binding, and ``no_grad`` mixtures.
"""

from __future__ import annotations

import math
import threading

import torch
from npusim import torch_npu

FUSED = torch_npu._C._npu_fused_infer_attention_score_out_graph


def test_eager_ops_factories_and_inplace_under_inference_mode() -> None:
    with torch.inference_mode():
        x = torch.arange(6, dtype=torch.float32, device="npu").reshape(2, 3)
        y = torch.ones(2, 3, device="npu") * 2 + x
        y.add_(1)
        y[0].mul_(10)  # an in-place op on a view
        z = torch.full((2, 3), 3.0, device="npu").clone()
        z.copy_(y)
        assert z.is_inference()
        assert torch.equal(z.cpu(), torch.tensor([[30.0, 40.0, 50.0], [6.0, 7.0, 8.0]]))
        assert z.sum().item() == 141.0
        assert z[1].tolist() == [6.0, 7.0, 8.0]


def test_copies_both_ways_and_host_reads() -> None:
    with torch.inference_mode():
        host = torch.arange(8, dtype=torch.float16)  # an inference tensor of the host
        dev = torch.empty(8, dtype=torch.float16, device="npu")
        dev.copy_(host, non_blocking=True)
        dev2 = host.npu()
        back = torch.empty(8, dtype=torch.float16)  # written by the device: a D2H copy
        back.copy_(dev + dev2)
        assert torch.equal(back, host * 2)
        assert torch.equal((dev > 3).nonzero().cpu().flatten(), torch.arange(4, 8))
        pinned = dev.to("cpu", non_blocking=True)
        torch.npu.synchronize()
        assert torch.equal(pinned, host)


def test_tensors_made_in_the_mode_are_used_outside_it_and_under_no_grad() -> None:
    with torch.inference_mode():
        made_inside = torch.ones(4, device="npu")
    outside = made_inside * 3  # reading an inference tensor outside the mode is allowed
    assert outside.cpu().tolist() == [3.0] * 4
    with torch.no_grad():
        a = torch.zeros(4, device="npu")
        a.add_(made_inside)
        with torch.inference_mode():
            a.mul_(5)  # a normal tensor updated inside the mode
            b = a + 1
        a.sub_(1)
    assert a.cpu().tolist() == [4.0] * 4 and b.cpu().tolist() == [6.0] * 4


def test_allocator_reuses_memory_allocated_in_and_out_of_the_mode() -> None:
    side = torch.npu.Stream()
    for _ in range(3):
        with torch.inference_mode():
            x = torch.randn(256, device="npu")
            x.record_stream(side)
            side.wait_stream(torch.npu.current_stream())
            with torch.npu.stream(side):
                x.mul_(2)
        del x
        y = torch.zeros(256, device="npu")  # may take the block x had
        y.add_(1)
        assert y.cpu().sum().item() == 256.0
        del y
    torch.npu.synchronize()
    torch.npu.empty_cache()
    assert torch.npu.memory_allocated() >= 0


def _graph_in_mode() -> tuple[torch.npu.NPUGraph, torch.Tensor, torch.Tensor]:
    # The model and the persistent input buffer are made before the mode (vLLM's
    # __init__): a tensor made inside it could not be written outside it, on the NPU too.
    weight = torch.randn(8, 8).npu()
    static_in = torch.zeros(2, 8, device="npu")
    with torch.inference_mode():
        graph = torch.npu.NPUGraph()
        with torch.npu.graph(graph):
            hidden = static_in @ weight
            static_out = torch.relu(hidden) + 1  # memory of the graph's pool
    return graph, static_in, static_out, weight  # type: ignore[return-value]


def test_graph_captured_in_the_mode_replays_in_and_out_of_it_and_from_a_thread() -> None:
    graph, static_in, static_out, weight = _graph_in_mode()  # type: ignore[misc]
    results: list[torch.Tensor] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        static_in.copy_(x.npu())
        graph.replay()
        return static_out.cpu()

    def want(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ weight.cpu()) + 1

    x = torch.randn(2, 8)
    with torch.inference_mode():
        torch.testing.assert_close(step(x), want(x))
    torch.testing.assert_close(step(2 * x), want(2 * x))  # replay outside the mode

    def thread() -> None:  # a thread of its own: not in the mode unless it enters it
        results.append(step(3 * x))
        with torch.inference_mode():
            results.append(step(4 * x))

    t = threading.Thread(target=thread)
    t.start()
    t.join()
    torch.testing.assert_close(results[0], want(3 * x))
    torch.testing.assert_close(results[1], want(4 * x))


def _reference(q, k, v, lens, scale):  # [B, S=1, N, D] fp16, per-batch kv lengths
    b, _, n, d = q.shape
    out = torch.empty(b, 1, n, d)
    for i in range(b):
        s = torch.einsum("nd,lnd->nl", q[i, 0].float(), k[i, : lens[i]].float()) * scale
        p = torch.softmax(s, dim=-1)
        out[i, 0] = torch.einsum("nl,lnd->nd", p, v[i, : lens[i]].float())
    return out


def test_vllm_like_capture_in_the_mode_then_update_and_replay_from_a_thread() -> None:
    """vLLM: the model is built, then ``capture_model`` runs under inference_mode and
    captures a decode graph whose attention is a task group; each step (here on a
    worker thread, outside the mode, then inside it) patches the group's lengths on an
    update stream (by re-issuing the op, then through the fused binding) and replays."""
    b, s, n, d = 2, 32, 4, 16
    scale = 1 / math.sqrt(d)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(b, n_s, n, d, generator=g).half() for n_s in (1, s, s))
    q_d, k_d, v_d = q.npu(), k.npu(), v.npu()
    kw = dict(num_heads=n, input_layout="BSND", scale=scale)
    with torch.inference_mode():
        workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
            q_d, k_d, v_d, actual_seq_lengths_kv=[s] * b, **kw
        )
        out = torch.empty(b, 1, n, d, dtype=torch.float16, device="npu")
        lse = torch.empty(1, dtype=torch.float32, device="npu")
        event, update = torch.npu.ExternalEvent(), torch.npu.Stream()
        graph = torch.npu.NPUGraph()
        with torch.npu.graph(graph):
            cs = torch.npu.current_stream()
            event.wait(cs)
            event.reset(cs)
            torch.npu.graph_task_group_begin(cs)
            torch_npu.npu_fused_infer_attention_score.out(
                q_d, k_d, v_d, actual_seq_lengths_kv=[s] * b, workspace=workspace,
                out=[out, lse], **kw,
            )  # fmt: skip
            handle = torch.npu.graph_task_group_end(cs)
            doubled = out * 2  # a task after the group, into the graph's pool

    def patch(lens: list[int], fused: bool) -> None:
        if fused:
            FUSED(update, handle, event, q_d, k_d, v_d, actual_seq_lengths_kv=lens,
                  workspace=workspace, out=[out, lse], **kw)  # fmt: skip
            return
        with torch.npu.stream(update):
            torch.npu.graph_task_update_begin(update, handle)
            torch_npu.npu_fused_infer_attention_score.out(
                q_d, k_d, v_d, actual_seq_lengths_kv=lens, workspace=workspace,
                out=[out, lse], **kw,
            )  # fmt: skip
            torch.npu.graph_task_update_end(update)
            event.record(update)

    got: list[tuple[list[int], torch.Tensor]] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for i, lens in enumerate(([3, 32], [17, 1], [32, 9], [5, 5])):
                with torch.inference_mode(i >= 2):
                    graph.replay()  # waits at the event until the patch is recorded
                    patch(lens, fused=i % 2 == 1)
                    got.append((lens, doubled.cpu()))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert not errors, errors
    for lens, o in got:
        torch.testing.assert_close(o.float(), 2 * _reference(q, k, v, lens, scale),
                                   atol=4e-3, rtol=4e-3)  # fmt: skip


VIEWS = {
    "slice": lambda t: t[:2],
    "view": lambda t: t.view(24),
    "reshape": lambda t: t.reshape(6, 4),
    "transpose": lambda t: t.t(),
    "select": lambda t: t[1],
    "split": lambda t: t.split(2)[1],
    "unbind": lambda t: t.unbind(0)[2],
    "detach": lambda t: t.detach(),
    "as_strided": lambda t: t.as_strided((2, 2), (6, 1)),
    "view_dtype": lambda t: t.view(torch.int32),
}


def _view_rules(device: str) -> dict[str, tuple[bool, bool, bool]]:
    """For each view: (inference?, in-place allowed outside the mode) of a view of a
    normal tensor made inside the mode, and (inference?) of a view of an inference
    tensor made outside it."""
    rules = {}
    for name, view in VIEWS.items():
        normal = torch.zeros(4, 6, device=device)
        with torch.inference_mode():
            inside = view(normal)
            inf = torch.zeros(4, 6, device=device)
        try:
            inside.add_(1)
            allowed = True
        except RuntimeError:
            allowed = False
        rules[name] = (inside.is_inference(), allowed, view(inf).is_inference())
    torch.npu.synchronize()
    return rules


def test_views_follow_torchs_inference_rules() -> None:
    """A view of a normal tensor made inside the mode is a normal tensor (vLLM slices
    its persistent buffers inside it: ``input_ids[:n]``), a view of an inference tensor
    is an inference tensor, as on the CPU (and the NPU); the sim once failed the first
    ("Cannot set version_counter for inference tensor")."""
    assert _view_rules("npu") == _view_rules("cpu")
