"""The orderings used in the field, run on the sim: correct and hazard-free over 20
steps with changing lengths; and the field bugs, each reported instead of hung.

The reference attention is written here, independently of the sim's kernel.
"""

from __future__ import annotations

import math

import pytest
import torch
from npusim import DeadlockError, HazardError, torch_npu

B, N, NKV, D, MAXKV, LAYERS, STEPS = 3, 4, 2, 16, 32, 3, 20


def reference(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], lengths: list[int]):
    """Stacked decode attention, BNSD, GQA, per-batch kv lengths, float64, loops."""
    x = q.double()
    for k, v in zip(ks, vs, strict=True):
        out = torch.zeros_like(x)
        for b in range(B):
            n_kv = lengths[b]
            for h in range(N):
                kv_h = h // (N // NKV)
                if n_kv == 0:
                    continue
                kk = k[b, kv_h, :n_kv].double()
                vv = v[b, kv_h, :n_kv].double()
                scores = (x[b, h] @ kk.T) / math.sqrt(D)
                out[b, h] = torch.softmax(scores, dim=-1) @ vv
        x = out.to(q.dtype).double()  # each layer's output is stored in the query dtype
    return x.to(q.dtype)


class Stack:
    """A captured L-layer decode stack: per layer an ExternalEvent wait and a task group."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.q_cpu = torch.randn(B, N, 1, D, dtype=torch.float16, generator=g)
        self.k_cpu = [
            torch.randn(B, NKV, MAXKV, D, dtype=torch.float16, generator=g) for _ in range(LAYERS)
        ]
        self.v_cpu = [
            torch.randn(B, NKV, MAXKV, D, dtype=torch.float16, generator=g) for _ in range(LAYERS)
        ]
        self.q = self.q_cpu.npu()
        self.k = [t.npu() for t in self.k_cpu]
        self.v = [t.npu() for t in self.v_cpu]
        self.outs = [torch.empty_like(self.q) for _ in range(LAYERS)]
        self.lse = [torch.empty(1, dtype=torch.float32, device="npu") for _ in range(LAYERS)]
        self.events = [torch.npu.ExternalEvent() for _ in range(LAYERS)]
        self.capture = torch.npu.Stream()
        self.update = torch.npu.Stream()
        self.graph = torch.npu.NPUGraph()
        self.kw = dict(num_heads=N, num_key_value_heads=NKV, input_layout="BNSD",
                       scale=1 / math.sqrt(D), softmax_lse_flag=False)  # fmt: skip
        self.handles = []
        with torch.npu.graph(self.graph, stream=self.capture):
            for layer in range(LAYERS):
                self.events[layer].wait(self.capture)
                torch.npu.graph_task_group_begin(self.capture)
                self._op(layer, [MAXKV] * B)
                self.handles.append(torch.npu.graph_task_group_end(self.capture))

    def _op(self, layer: int, lengths: list[int]) -> None:
        x = self.q if layer == 0 else self.outs[layer - 1]
        torch_npu.npu_fused_infer_attention_score.out(
            x, self.k[layer], self.v[layer], actual_seq_lengths_kv=lengths,
            out=[self.outs[layer], self.lse[layer]], **self.kw,
        )  # fmt: skip

    def patch(self, layer: int, lengths: list[int]) -> None:
        """Patch one layer on the update stream and release its event."""
        with torch.npu.stream(self.update):
            torch.npu.graph_task_update_begin(self.update, self.handles[layer])
            self._op(layer, lengths)
            torch.npu.graph_task_update_end(self.update)
            self.events[layer].record(self.update)

    def replay(self) -> None:
        with torch.npu.stream(self.capture):
            self.graph.replay()

    def expected(self, lengths: list[int]) -> torch.Tensor:
        return reference(self.q_cpu, self.k_cpu, self.v_cpu, lengths)


def lengths_for(step: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, MAXKV + 1, (B,), generator=g).tolist()


def check(got: torch.Tensor, lengths: list[int], stack: Stack) -> None:
    torch.testing.assert_close(got.cpu(), stack.expected(lengths), atol=2e-3, rtol=2e-3)


# ============================================================ correct orderings
def test_update_then_replay_with_host_sync() -> None:
    stack = Stack()
    for step in range(STEPS):
        lengths = lengths_for(step)
        for layer in range(LAYERS):
            stack.patch(layer, lengths)
        stack.replay()
        torch.npu.synchronize()
        check(stack.outs[-1], lengths, stack)


def test_replay_then_per_layer_updates() -> None:
    """The graph waits at each layer's event: replay of layer k overlaps patch of k+1."""
    stack = Stack()
    for step in range(STEPS):
        lengths = lengths_for(step)
        stack.replay()
        for layer in range(LAYERS):
            stack.patch(layer, lengths)
        torch.npu.synchronize()
        check(stack.outs[-1], lengths, stack)


def test_device_ordered_pipeline_without_host_barrier() -> None:
    """The update stream waits an event recorded after the previous replay; the host
    never blocks between steps, so step N+1's patches are issued while N replays."""
    stack = Stack()
    done = torch.npu.Event()
    results = [torch.empty_like(stack.q) for _ in range(STEPS)]
    all_lengths = []
    for step in range(STEPS):
        lengths = lengths_for(step)
        all_lengths.append(lengths)
        stack.update.wait_event(done)  # previous replay is finished with the tasks
        stack.replay()
        with torch.npu.stream(stack.capture):
            results[step].copy_(stack.outs[-1])
        done.record(stack.capture)
        changed = step == 0 or lengths != all_lengths[-2]
        for layer in range(LAYERS):
            if changed:
                stack.patch(layer, lengths)
            else:  # unchanged layers are released without a patch
                stack.events[layer].record(stack.update)
    torch.npu.synchronize()
    for step in range(STEPS):
        check(results[step], all_lengths[step], stack)


def test_device_ordered_pipeline_with_unchanged_steps() -> None:
    stack = Stack()
    done = torch.npu.Event()
    lengths = lengths_for(0)
    for step in range(6):
        stack.update.wait_event(done)
        stack.replay()
        done.record(stack.capture)
        for layer in range(LAYERS):
            if step == 0:
                stack.patch(layer, lengths)
            else:
                stack.events[layer].record(stack.update)
    torch.npu.synchronize()
    check(stack.outs[-1], lengths, stack)


# ============================================================ field bugs, reported
def test_second_record_before_replay_consumed_first_is_a_lost_release(watchdog_off: None) -> None:
    """vllm-ascend #4233: async scheduling, no fence between steps. The record for
    step N+1 can run before replay N consumed step N's record; they merge and
    replay N+1 hangs. Reported on every run, whatever the timing did."""
    stack = Stack()
    lengths = lengths_for(0)
    for layer in range(LAYERS):
        stack.patch(layer, lengths)
    stack.replay()
    # Next step, nothing changed: release the layers again without waiting for the replay.
    for layer in range(LAYERS):
        stack.events[layer].record(stack.update)
    stack.replay()
    with pytest.raises(HazardError) as err:
        torch.npu.synchronize()
    assert err.value.kind == "lost-release"
    assert stack.events[0].name in str(err.value)


def test_patch_not_ordered_after_previous_replay_is_a_race(watchdog_off: None) -> None:
    stack = Stack()
    for layer in range(LAYERS):
        stack.patch(layer, lengths_for(0))
    stack.replay()
    stack.patch(0, lengths_for(1))  # no wait for the replay that reads layer 0
    with pytest.raises(HazardError) as err:
        torch.npu.synchronize()
    assert err.value.kind in ("race", "lost-release")
    assert stack.graph.name in str(err.value)


def test_update_stream_waiting_on_replay_after_launch_deadlocks_at_once(
    watchdog_off: None,
) -> None:
    """The update waits for an event recorded after the current replay, which waits
    for the update's own record: a cycle, reported at once, not after a watchdog."""
    stack = Stack()
    after_replay = torch.npu.Event()
    stack.replay()
    after_replay.record(stack.capture)
    stack.update.wait_event(after_replay)
    with pytest.raises(DeadlockError) as err:
        for layer in range(LAYERS):
            stack.patch(layer, lengths_for(0))
        torch.npu.synchronize()
    assert err.value.kind == "cycle"
