"""xLLM's ACL graph executor with task updates, over a paged KV cache, on the sim.

Reproduced from how xLLM orders its calls (jd-opensource/xllm,
xllm/core/runtime/acl_graph_executor_impl.cpp: ``AclGraph::initialize_capture_stream``,
``capture``, ``replay``, ``update_graph_tasks``, ``make_current_stream_wait_for_graph``;
xllm/core/layers/npu_torch/qwen3_gated_delta_net_base.cpp: ``run_causal_conv1d_graph_update``
for how a patchable task is captured). Written here in Python, not copied; the only line
that differs from NPU code is the ``torch_npu`` import.

xLLM patches ``causal_conv1d`` tasks this way (its attention reads lengths from device
buffers instead); the sim has no causal_conv1d kernel, so the patched task here is fused
infer attention (BSND decode) over the paged cache, with its kv lengths patched each
step. Everything around it is xLLM's sequence:

* two high-priority pool streams, one to capture on and one to update on, and a plain
  completion event;
* capture: synchronize, copy the step's inputs into persistent buffers (block table
  included), make the capture stream current (the current one is the default stream),
  ``capture_begin(capture_error_mode="thread_local")``, the forward, where each patchable
  op is ``ExternalEvent.wait`` + ``reset`` on the current stream, ``graph_task_group_begin``,
  the output allocated, the ``.out`` op, ``graph_task_group_end``; ``capture_end``,
  restore the default stream, synchronize both, then replay once and update;
* replay: refresh the persistent buffers on the current stream, ``replay()``, then on
  the update stream per task ``graph_task_update_begin``, the op with the new host
  lengths, ``graph_task_update_end``, the task's event recorded on the update stream;
  then the completion event is recorded on the graph stream and the current stream
  waits on it. The scheduler reads each step's result before the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from npusim import HazardError, torch_npu
from paged_reference import (
    BS,
    HKV,
    LAYERS,
    MAXB,
    NKV,
    SCALE,
    B,
    H,
    N,
    RefDecoder,
    StepInput,
    Weights,
    assert_close,
    make_weights,
)

STEPS = 20


@dataclass
class GraphTask:
    output: torch.Tensor
    lse: torch.Tensor
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    workspace: torch.Tensor
    handle: Any
    event: Any


class XllmDecode:
    def __init__(self, w: Weights, alloc_in_group: bool = False, wait_first: bool = True):
        self.wq, self.wk, self.wv, self.wo = (
            [t.npu() for t in ts] for ts in (w.wq, w.wk, w.wv, w.wo)
        )
        self.kc = [c.npu() for c in w.kc]
        self.vc = [c.npu() for c in w.vc]
        self.alloc_in_group, self.wait_first = alloc_in_group, wait_first
        # persistent parameters: fixed addresses the graph reads, refreshed before replay
        self.p_x = torch.zeros(B, H, dtype=torch.float16).npu()
        self.p_slots = torch.zeros(B, dtype=torch.int64).npu()
        self.p_table = torch.zeros(B, MAXB, dtype=torch.int32).npu()
        self.tasks: list[GraphTask] = []
        self.capturing = False
        self.hidden: torch.Tensor | None = None
        self.graph = torch_npu.npu.NPUGraph()
        # initialize_capture_stream
        self.capture_stream = torch.npu.Stream(priority=-1)
        self.update_stream = torch.npu.Stream(priority=-1)
        self.replay_done = torch.npu.Event()
        self.graph_stream: Any = None

    # ------------------------------------------------------------ the model's forward
    def attention(self, layer: int, q: torch.Tensor, lens: list[int]) -> torch.Tensor:
        kw: dict[str, Any] = dict(
            block_table=self.p_table, actual_seq_lengths_kv=lens, num_heads=N,
            num_key_value_heads=NKV, scale=SCALE, input_layout="BSND", block_size=BS,
        )  # fmt: skip
        cache = (self.kc[layer], self.vc[layer])
        workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(q, *cache, **kw)
        if not self.capturing:
            out, _ = torch_npu.npu_fused_infer_attention_score(q, *cache, **kw)
            return out
        stream = torch.npu.current_stream()
        event = torch.npu.ExternalEvent()
        if layer > 0 or self.wait_first:
            event.wait(stream)
            event.reset(stream)
        if not self.alloc_in_group:
            output, lse = torch.empty_like(q), torch.empty(1, dtype=torch.float32, device="npu")
        torch.npu.graph_task_group_begin(stream)
        if self.alloc_in_group:  # xLLM allocates the output inside the group
            output, lse = torch.empty_like(q), torch.empty(1, dtype=torch.float32, device="npu")
        torch_npu.npu_fused_infer_attention_score.out(
            q, *cache, **kw, workspace=workspace, out=[output, lse]
        )
        handle = torch.npu.graph_task_group_end(stream)
        self.tasks.append(GraphTask(output, lse, q, *cache, workspace, handle, event))
        return output

    def forward(self, lens: list[int]) -> torch.Tensor:
        x = self.p_x
        for layer in range(LAYERS):
            q = (x @ self.wq[layer]).view(B, 1, N, -1)
            self.kc[layer].view(-1, HKV).index_copy_(0, self.p_slots, x @ self.wk[layer])
            self.vc[layer].view(-1, HKV).index_copy_(0, self.p_slots, x @ self.wv[layer])
            x = self.attention(layer, q, lens).view(B, H) @ self.wo[layer]
        return x

    # ------------------------------------------------------------ the graph executor
    def update_persistent(self, inp: StepInput) -> None:
        self.p_x.copy_(inp.x, non_blocking=True)
        self.p_slots.copy_(inp.slots, non_blocking=True)
        self.p_table.copy_(inp.table, non_blocking=True)

    def update_graph_tasks(self, lens: list[int]) -> None:
        u = self.update_stream
        with torch.npu.stream(u):
            for t in self.tasks:
                torch.npu.graph_task_update_begin(u, t.handle)
                torch_npu.npu_fused_infer_attention_score.out(
                    t.query, t.key_cache, t.value_cache, block_table=self.p_table,
                    actual_seq_lengths_kv=lens, num_heads=N, num_key_value_heads=NKV,
                    scale=SCALE, input_layout="BSND", block_size=BS,
                    workspace=t.workspace, out=[t.output, t.lse],
                )  # fmt: skip
                torch.npu.graph_task_update_end(u)
                t.event.record(u)

    def make_current_stream_wait_for_graph(self, current: Any) -> None:
        self.replay_done.record(self.graph_stream)
        if current != self.graph_stream:
            current.wait_event(self.replay_done)

    def capture(self, inp: StepInput) -> torch.Tensor:
        torch.npu.synchronize()
        stream = torch.npu.current_stream()
        self.update_persistent(inp)
        stream.synchronize()
        self.graph_stream = stream
        restore = False
        if torch.npu.current_stream() == torch.npu.default_stream():
            torch.npu.set_stream(self.capture_stream)
            self.capture_stream.synchronize()
            self.graph_stream = self.capture_stream
            restore = True
        self.capturing = True
        self.graph.capture_begin(capture_error_mode="thread_local")
        self.hidden = self.forward(inp.lens)
        self.graph.capture_end()
        self.capturing = False
        if restore:
            torch.npu.set_stream(torch.npu.default_stream())
        self.graph_stream.synchronize()
        stream.synchronize()
        self.graph.replay()
        self.update_graph_tasks(inp.lens)
        self.make_current_stream_wait_for_graph(stream)
        return self.hidden

    def replay(self, inp: StepInput) -> torch.Tensor:
        self.update_persistent(inp)
        stream = torch.npu.current_stream()
        self.graph.replay()
        self.update_graph_tasks(inp.lens)
        self.make_current_stream_wait_for_graph(stream)
        assert self.hidden is not None
        return self.hidden


def run_steps(model: XllmDecode, ref: RefDecoder, steps: int = STEPS) -> None:
    for step in range(steps):
        inp = StepInput.make(3000 + step)
        got = model.capture(inp) if step == 0 else model.replay(inp)
        assert_close(got.cpu(), ref.forward(inp), step)  # the scheduler samples from it


def test_xllm_capture_replay_update_per_step() -> None:
    w = make_weights(21)
    run_steps(XllmDecode(w), RefDecoder(w))


def test_xllm_eager_forward_matches_the_reference() -> None:
    """The same forward run eagerly (xLLM's non-graph path) agrees with the reference,
    so the graph test above checks the graph sequence, not the model."""
    w = make_weights(22)
    model, ref = XllmDecode(w), RefDecoder(w)
    for step in range(3):
        inp = StepInput.make(3100 + step)
        model.update_persistent(inp)
        assert_close(model.forward(inp.lens).cpu(), ref.forward(inp), step)


def test_xllm_output_allocated_inside_the_task_group() -> None:
    w = make_weights(23)
    run_steps(XllmDecode(w, alloc_in_group=True), RefDecoder(w), steps=3)


def test_xllm_without_the_captured_event_wait_is_reported(watchdog_off: None) -> None:
    """Mutation: the first layer's ExternalEvent wait (and reset) is left out of the
    capture, so its replayed attention no longer waits for the update stream's patch."""
    model = XllmDecode(make_weights(24), wait_first=False)
    with pytest.raises(HazardError) as caught:
        run_steps(model, RefDecoder(make_weights(24)), steps=3)
        torch.npu.synchronize()
    assert caught.value.kind in ("race", "lost-release"), caught.value


def test_xllm_output_allocated_inside_the_task_group_without_the_event_wait_is_reported(
    watchdog_off: None,
) -> None:
    """The allocation-in-group path's mutation: still reported."""
    model = XllmDecode(make_weights(25), alloc_in_group=True, wait_first=False)
    with pytest.raises(HazardError) as caught:
        run_steps(model, RefDecoder(make_weights(25)), steps=3)
        torch.npu.synchronize()
    assert caught.value.kind in ("race", "lost-release"), caught.value
