"""Host ordering as the hardware gives it (issue 18, item 2).

Host threads are ordered by ``Thread.start`` and ``Thread.join``, and a host's
observation of a device completion (an Event or stream synchronize, a query that
returned True, a device synchronize, a blocking host read) precedes every later host
action on any thread. Each correct ordering runs clean over many steps; each has a
fence-less mutation that is still reported, on every run.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable

import pytest
import torch
from npusim import HazardError, torch_npu
from npusim.runtime import RUNTIME

B, N, NKV, D, MAXKV, LAYERS, STEPS = 2, 4, 2, 16, 32, 2, 8


def reference(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], lengths: list[int]):
    x = q.double()
    for k, v in zip(ks, vs, strict=True):
        out = torch.zeros_like(x)
        for b in range(B):
            n = lengths[b]
            if n == 0:
                continue
            for h in range(N):
                kk, vv = k[b, h // (N // NKV), :n].double(), v[b, h // (N // NKV), :n].double()
                out[b, h] = torch.softmax((x[b, h] @ kk.T) / math.sqrt(D), dim=-1) @ vv
        x = out.to(q.dtype).double()
    return x.to(q.dtype)


class Stack:
    """Per layer an ExternalEvent wait and a task group of one fused attention op."""

    def __init__(
        self, seed: int = 0, capture: torch.npu.Stream | None = None, reset: bool = False
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.q_cpu = torch.randn(B, N, 1, D, dtype=torch.float16, generator=g)
        self.k_cpu = [torch.randn(B, NKV, MAXKV, D, dtype=torch.float16, generator=g)
                      for _ in range(LAYERS)]  # fmt: skip
        self.v_cpu = [torch.randn(B, NKV, MAXKV, D, dtype=torch.float16, generator=g)
                      for _ in range(LAYERS)]  # fmt: skip
        self.q = self.q_cpu.npu()
        self.k = [t.npu() for t in self.k_cpu]
        self.v = [t.npu() for t in self.v_cpu]
        self.outs = [torch.empty_like(self.q) for _ in range(LAYERS)]
        self.lse = [torch.empty(1, dtype=torch.float32, device="npu") for _ in range(LAYERS)]
        self.events = [torch.npu.ExternalEvent() for _ in range(LAYERS)]
        self.capture = capture if capture is not None else torch.npu.Stream()
        self.update = torch.npu.Stream()
        self.graph = torch.npu.NPUGraph()
        self.handles = []
        with torch.npu.graph(self.graph, stream=self.capture):
            for layer in range(LAYERS):
                self.events[layer].wait(self.capture)
                if reset:  # as torch_npu's own capture paths do
                    self.events[layer].reset(self.capture)
                torch.npu.graph_task_group_begin(self.capture)
                self.op(layer, [MAXKV] * B)
                self.handles.append(torch.npu.graph_task_group_end(self.capture))

    def op(self, layer: int, lengths: list[int]) -> None:
        x = self.q if layer == 0 else self.outs[layer - 1]
        torch_npu.npu_fused_infer_attention_score.out(
            x, self.k[layer], self.v[layer], actual_seq_lengths_kv=lengths,
            out=[self.outs[layer], self.lse[layer]], num_heads=N, num_key_value_heads=NKV,
            input_layout="BNSD", scale=1 / math.sqrt(D), softmax_lse_flag=False,
        )  # fmt: skip

    def patch_all(self, lengths: list[int], stream: torch.npu.Stream | None = None) -> None:
        u = self.update if stream is None else stream
        with torch.npu.stream(u):
            for layer in range(LAYERS):
                torch.npu.graph_task_update_begin(u, self.handles[layer])
                self.op(layer, lengths)
                torch.npu.graph_task_update_end(u)
                self.events[layer].record(u)

    def replay(self, stream: torch.npu.Stream | None = None) -> None:
        with torch.npu.stream(self.capture if stream is None else stream):
            self.graph.replay()

    def check(self, lengths: list[int]) -> None:
        """A blocking host read on the capture stream (after its replays): an observation."""
        want = reference(self.q_cpu, self.k_cpu, self.v_cpu, lengths)
        with torch.npu.stream(self.capture):
            got = self.outs[-1].cpu()
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def lengths_for(step: int) -> list[int]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randint(1, MAXKV + 1, (B,), generator=g).tolist()


def run_in_thread(fn: Callable[[], None]) -> None:
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if errors:
        raise errors[0]


# ================================================================ start and join
def test_a_thread_starts_with_its_starters_history_and_join_takes_its_history_back() -> None:
    actor, clock = RUNTIME.host_actor()
    before = dict(clock)
    seen: dict[str, dict[int, int]] = {}

    def child() -> None:
        child_actor, child_clock = RUNTIME.host_actor()
        seen["start"] = dict(child_clock)
        with RUNTIME.cond:
            RUNTIME.host_issue_clock()  # the child acts
        seen["end"] = dict(child_clock)
        seen["actor"] = {child_actor: child_clock[child_actor]}

    t = threading.Thread(target=child)
    t.start()
    t.join()
    assert all(seen["start"].get(k, 0) >= v for k, v in before.items())  # start edge
    assert seen["start"][actor] <= clock[actor]
    child_actor, n = next(iter(seen["actor"].items()))
    assert clock.get(child_actor, 0) >= n  # join edge


def test_a_thread_started_by_a_thread_that_never_used_the_device_still_inherits() -> None:
    before = dict(RUNTIME.host_actor()[1])
    got: dict[int, int] = {}

    def grandchild() -> None:
        got.update(RUNTIME.host_actor()[1])

    def child() -> None:  # never touches the device itself
        t = threading.Thread(target=grandchild)
        t.start()
        t.join()

    run_in_thread(child)
    assert all(got.get(k, 0) >= v for k, v in before.items())


# ================================================================ observation -> later host actions
def test_sync_then_patch_from_a_new_thread_runs_clean() -> None:
    """sglang's shape: the main thread reads the step's result, then a thread patches."""
    stack = Stack(1)
    for step in range(STEPS):
        lengths = lengths_for(step)
        run_in_thread(lambda lengths=lengths: stack.patch_all(lengths))
        stack.replay()
        stack.check(lengths)  # a blocking host read: observes the replay's end


def test_new_thread_patch_without_observing_the_replay_is_reported(watchdog_off: None) -> None:
    stack = Stack(2)
    with pytest.raises(HazardError) as err:
        for step in range(3):
            run_in_thread(lambda step=step: stack.patch_all(lengths_for(step)))
            stack.replay()  # nobody waits for it before the next patch
        torch.npu.synchronize()
    assert err.value.kind in ("race", "lost-release")


def completion_pipeline(stack: Stack, observe: bool, steps: int) -> None:
    """graphlane's serial mode: a completion thread waits for each replay's done event
    and hands the step back through a queue; the issuing thread patches the next step
    only after it got the previous one back."""
    handed: queue.Queue[int] = queue.Queue()
    done_events: queue.Queue[torch.npu.Event | None] = queue.Queue()

    def completion() -> None:
        while (ev := done_events.get()) is not None:
            if observe:
                ev.synchronize()
            handed.put(1)

    t = threading.Thread(target=completion, daemon=True)
    t.start()
    try:
        for step in range(steps):
            stack.patch_all(lengths_for(step))
            stack.replay()
            ev = torch.npu.Event()
            ev.record(stack.capture)
            done_events.put(ev)
            handed.get(timeout=30)
    finally:
        done_events.put(None)
        t.join()


def test_completion_thread_observes_then_issuing_thread_patches_runs_clean() -> None:
    stack = Stack(3)
    completion_pipeline(stack, observe=True, steps=STEPS)
    stack.check(lengths_for(STEPS - 1))


def test_completion_thread_that_does_not_wait_for_the_replay_is_reported(
    watchdog_off: None,
) -> None:
    stack = Stack(4)
    with pytest.raises(HazardError) as err:
        completion_pipeline(stack, observe=False, steps=4)
        torch.npu.synchronize()
    assert err.value.kind in ("race", "lost-release")


def test_query_true_in_one_thread_orders_a_patch_in_another() -> None:
    stack = Stack(5)
    for step in range(STEPS):
        lengths = lengths_for(step)
        if step:
            done = torch.npu.Event()
            done.record(stack.capture)
            seen = threading.Event()

            def poll(done: torch.npu.Event = done, seen: threading.Event = seen) -> None:
                deadline = time.monotonic() + 30
                while not done.query():  # the pattern under test: a thread polls query()
                    if time.monotonic() > deadline:
                        return  # never seen: the main thread's assert reports it
                    time.sleep(0.0005)
                seen.set()

            t = threading.Thread(target=poll)
            t.start()
            # the program's own order: the poller saw it, then we patch
            assert seen.wait(30), "the replay's end was never observed"
            t.join(30)
        stack.patch_all(lengths)
        stack.replay()
    stack.check(lengths_for(STEPS - 1))


def test_a_finished_but_unobserved_replay_is_still_unordered(watchdog_off: None) -> None:
    """What an observation publishes is what was observed, never what happens to be done
    by then: the replay has finished (the test peeks at the sim's state, which observes
    nothing) and another stream was synchronized, yet the patch is reported."""
    stack = Stack(6)
    stack.patch_all(lengths_for(0))
    stack.replay()
    other = torch.npu.Stream()
    with torch.npu.stream(other):
        torch.ones(2, device="npu").add_(1)
    deadline = time.monotonic() + 30
    while not (stack.capture._last is not None and stack.capture._last.done):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    other.synchronize()  # an unrelated observation
    with pytest.raises(HazardError) as err:
        stack.patch_all(lengths_for(1))
        stack.replay()
        torch.npu.synchronize()
    assert err.value.kind in ("race", "lost-release")


def test_an_observation_in_a_thread_after_the_patch_was_issued_does_not_order_it(
    watchdog_off: None,
) -> None:
    """The patch is issued while the replay is held back at its first wait; another
    thread then observes the replay's end. The patch was issued first: reported."""
    stack = Stack(7)
    stack.patch_all(lengths_for(0))
    stack.replay()  # consumes the step's records, runs
    stack.replay()  # held at layer 0's wait until a record comes
    with torch.npu.stream(stack.update):  # next step, no wait for either replay
        torch.npu.graph_task_update_begin(stack.update, stack.handles[0])
        stack.op(0, lengths_for(1))
        torch.npu.graph_task_update_end(stack.update)
    with pytest.raises(HazardError):
        for layer in range(LAYERS):
            stack.events[layer].record(stack.update)
        run_in_thread(torch.npu.synchronize)
        torch.npu.synchronize()
