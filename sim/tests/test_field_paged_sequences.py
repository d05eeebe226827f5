"""Call sequences of serving stacks over paged KV, written here from how their public
sources order the calls (streams, events, update placement); the only line that differs
from NPU code is the ``torch_npu`` import. Each runs 20 steps with changing lengths and
checks the output against eager calls; each has a mutation that drops a fence, which the
sim must report. (test_field_orderings.py covers the dense BNSD orderings.)
"""

from __future__ import annotations

import threading

import pytest
import torch
from npusim import HazardError, torch_npu

B, N, D, BS, NB, LAYERS, STEPS = 3, 4, 16, 16, 16, 2, 20


def lengths(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(1, 4 * BS + 1, (B,), generator=g).to(torch.int32)


class PagedDecode:
    """LAYERS paged-attention decode layers over one KV cache each, vllm-ascend style:
    each layer's op captured in a task group behind an ExternalEvent."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.q = torch.randn(B, N, D, generator=g).half().npu()
        self.kc = [torch.randn(NB, BS, N, D, generator=g).half().npu() for _ in range(LAYERS)]
        self.vc = [torch.randn(NB, BS, N, D, generator=g).half().npu() for _ in range(LAYERS)]
        self.table = torch.randperm(NB, generator=g)[: B * 4].reshape(B, 4).int().npu()
        self.outs = [torch.empty(B, N, D, dtype=torch.float16).npu() for _ in range(LAYERS)]
        self.events = [torch.npu.ExternalEvent() for _ in range(LAYERS)]
        self.handles: list[object] = []
        full = torch.full((B,), 4 * BS, dtype=torch.int32)
        self.workspace = torch_npu._npu_paged_attention_get_workspace(
            **self._args(0, full), out=self.outs[0]
        )
        self.graph = torch.npu.NPUGraph()
        with torch.npu.graph(self.graph):
            stream = torch_npu.npu.current_stream()
            for layer in range(LAYERS):
                self.events[layer].wait(stream)
                self.events[layer].reset(stream)
                torch.npu.graph_task_group_begin(stream)
                self._op(layer, full)
                self.handles.append(torch.npu.graph_task_group_end(stream))

    def _args(self, layer: int, lens: torch.Tensor) -> dict[str, object]:
        x = self.q if layer == 0 else self.outs[layer - 1]
        return dict(query=x, key_cache=self.kc[layer], value_cache=self.vc[layer],
                    num_kv_heads=N, num_heads=N, scale_value=0.25, block_table=self.table,
                    context_lens=lens)  # fmt: skip

    def _op(self, layer: int, lens: torch.Tensor, out: torch.Tensor | None = None) -> None:
        target = self.outs[layer] if out is None else out
        torch_npu._npu_paged_attention(**self._args(layer, lens), out=target,
                                       workspace=self.workspace)  # fmt: skip

    def update_attn_params(self, update_stream: torch.npu.Stream, lens: torch.Tensor) -> None:
        """Per layer: update_begin, the op with new context_lens, update_end, record."""
        with torch.npu.stream(update_stream):
            for layer in range(LAYERS):
                torch.npu.graph_task_update_begin(update_stream, self.handles[layer])
                self._op(layer, lens)
                torch.npu.graph_task_update_end(update_stream)
                self.events[layer].record(update_stream)

    def eager(self, lens: torch.Tensor) -> torch.Tensor:
        x = self.q
        for layer in range(LAYERS):
            out = torch.empty_like(self.outs[layer])
            torch_npu._npu_paged_attention(**{**self._args(layer, lens), "query": x}, out=out)
            x = out
        return x.cpu()


def test_vllm_ascend_full_decode_replay_then_update_attn_params() -> None:
    """ACLGraphWrapper: synchronize the current stream, replay; then the model runner
    patches every layer on its update stream (the graph waits at each layer's event)."""
    model, update_stream = PagedDecode(), torch.npu.Stream()
    for step in range(STEPS):
        lens = lengths(step)
        torch.npu.current_stream().synchronize()
        model.graph.replay()
        model.update_attn_params(update_stream, lens)
        got = model.outs[-1].cpu()  # sampling reads the result
        assert torch.equal(got, model.eager(lens)), step


def test_vllm_ascend_without_the_pre_replay_barrier_is_reported(watchdog_off: None) -> None:
    """Drop the barrier the wrapper takes before replay (async scheduling, vllm-ascend
    #4233): the next step's patches are no longer ordered after the previous replay."""
    model, update_stream = PagedDecode(), torch.npu.Stream()
    with pytest.raises(HazardError):
        for step in range(3):
            model.graph.replay()
            model.update_attn_params(update_stream, lengths(step))
        torch.npu.synchronize()


class AutoDispatchDecode:
    """sglang's NPU graph runner: capture with auto_dispatch_capture; each step
    NPUGraph.update runs in a thread started before replay, then both are joined."""

    def __init__(self) -> None:
        self.model = PagedDecode.__new__(PagedDecode)
        g = torch.Generator().manual_seed(4)
        m = self.model
        m.q = torch.randn(B, N, D, generator=g).half().npu()
        m.kc = [torch.randn(NB, BS, N, D, generator=g).half().npu() for _ in range(LAYERS)]
        m.vc = [torch.randn(NB, BS, N, D, generator=g).half().npu() for _ in range(LAYERS)]
        m.table = torch.randperm(NB, generator=g)[: B * 4].reshape(B, 4).int().npu()
        m.outs = [torch.empty(B, N, D, dtype=torch.float16).npu() for _ in range(LAYERS)]
        self.graph = torch.npu.NPUGraph()
        full = torch.full((B,), 4 * BS, dtype=torch.int32)
        with torch.npu.graph(self.graph, stream=torch.npu.Stream(), auto_dispatch_capture=True):
            for layer in range(LAYERS):
                torch_npu._npu_paged_attention(**m._args(layer, full), out=m.outs[layer])

    def step(self, lens: torch.Tensor) -> torch.Tensor:
        errors: list[BaseException] = []

        def update() -> None:
            try:
                self.graph.update(cpu_update_input=[{"context_lens": lens}])
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=update)
        thread.start()
        self.graph.replay()
        thread.join()
        if errors:
            raise errors[0]
        return self.model.outs[-1].cpu()


def test_sglang_update_in_a_thread_then_replay() -> None:
    runner = AutoDispatchDecode()
    for step in range(STEPS):
        lens = lengths(step)
        assert torch.equal(runner.step(lens), runner.model.eager(lens)), step


def test_sglang_without_reading_the_result_between_steps_is_reported(watchdog_off: None) -> None:
    """Mutation: the step's result is not awaited before the next update thread patches."""
    runner = AutoDispatchDecode()
    with pytest.raises(HazardError):
        for step in range(3):
            update = [{"context_lens": lengths(step)}]
            t = threading.Thread(target=runner.graph.update, args=(update,))
            t.start()
            runner.graph.replay()
            t.join()
        torch.npu.synchronize()
