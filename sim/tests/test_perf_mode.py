"""Performance mode: device work is modelled time that costs the host nothing.

No wall-clock bound is asserted: the sim's CPU per replay is compared between two graphs
in the same run, and a patch's CPU against its modelled cost.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

import pytest
import torch
from npusim import SimConfig, configure, torch_npu


@pytest.fixture
def restore_config() -> Iterator[None]:
    old = configure()
    yield
    configure(mode=old.mode, task_us=old.task_us, patch_us=old.patch_us,
              patch_gil_us=old.patch_gil_us)  # fmt: skip


def _graph(tasks: int) -> tuple[torch.npu.NPUGraph, torch.Tensor]:  # type: ignore[name-defined]
    x = torch.zeros(4).npu()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        for _ in range(tasks):
            x.add_(1)
    torch.npu.synchronize()
    return g, x


def _cpu_per_replay(g: torch.npu.NPUGraph) -> float:  # type: ignore[name-defined]
    t0 = time.process_time()
    g.replay()
    torch.npu.synchronize()
    return time.process_time() - t0


def test_cpu_per_replay_does_not_grow_with_the_graphs_task_count(restore_config: None) -> None:
    """A 200-task graph's replay costs the process about as much CPU as a 10-task one's
    (timed mode checks and steps every task: about 2 us of Python each)."""
    small, _ = _graph(10)
    large, x = _graph(200)
    configure(mode="perf", task_us=1.0)
    for g in (small, large):  # warm up (the replay plan is made once per capture)
        _cpu_per_replay(g)
    cpu: dict[int, list[float]] = {10: [], 200: []}
    for _ in range(40):  # interleaved: a busy spell of the machine falls on both
        cpu[10].append(_cpu_per_replay(small))
        cpu[200].append(_cpu_per_replay(large))
    ratio = statistics.median(cpu[200]) / statistics.median(cpu[10])
    assert ratio < 1.5, f"CPU per replay: 200 tasks {ratio:.2f}x 10 tasks"
    assert torch.count_nonzero(x.cpu()) == 0  # nothing computed


def test_a_replay_is_its_tasks_modelled_time(restore_config: None) -> None:
    g, x = _graph(3)
    start, end = (torch.npu.Event(enable_timing=True) for _ in range(2))  # type: ignore[attr-defined]
    configure(mode="perf", task_us=20_000)
    torch.npu.synchronize()
    t0 = time.perf_counter()
    start.record()
    g.replay()
    end.record()
    issued_ms = (time.perf_counter() - t0) * 1e3
    end.synchronize()
    assert time.perf_counter() - t0 >= 3 * 0.020  # never earlier than modelled
    # modelled: the three tasks, after the host's Python between the two issues (as long
    # as this run's host took to issue them: on a busy machine, more than a quiet one's)
    assert 60.0 <= start.elapsed_time(end) <= 60.0 + issued_ms + 1.0
    assert torch.count_nonzero(x.cpu()) == 0


def _fused_patch_setup() -> tuple[object, ...]:
    q = torch.randn(2, 4, 1, 8, dtype=torch.float16).npu()
    kv = torch.randn(2, 4, 16, 8, dtype=torch.float16).npu()
    out = torch.zeros_like(q)
    lse = torch.zeros(1, device="npu")
    s = torch.npu.Stream()
    u = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        torch.npu.graph_task_group_begin(s)
        torch_npu.npu_fused_infer_attention_score.out(
            q, kv, kv, num_heads=4, input_layout="BNSD", actual_seq_lengths_kv=[16, 16],
            out=[out, lse],
        )
        handle = torch.npu.graph_task_group_end(s)
    torch.npu.synchronize()
    return q, kv, out, lse, u, handle


def test_a_patch_holds_the_interpreter_lock_only_for_its_python_share(
    restore_config: None,
) -> None:
    """A 30 ms patch whose share under the lock is 2 ms spends well under 30 ms of its
    thread's CPU: the rest is a sleep off the lock (the op's C++ dispatch)."""
    q, kv, out, lse, u, handle = _fused_patch_setup()
    configure(mode="perf", patch_us=30_000, patch_gil_us=2_000)
    t0, c0 = time.perf_counter(), time.thread_time()
    with torch.npu.stream(u):  # type: ignore[attr-defined]
        torch.npu.graph_task_update_begin(u, handle)
        torch_npu.npu_fused_infer_attention_score.out(
            q, kv, kv, num_heads=4, input_layout="BNSD", actual_seq_lengths_kv=[8, 8],
            out=[out, lse],
        )
        torch.npu.graph_task_update_end(u)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    torch.npu.synchronize()
    assert wall >= 0.030  # the whole modelled cost, in wall time
    assert cpu < 0.020, f"the patching thread used {cpu * 1e3:.1f} ms of CPU"


@pytest.mark.parametrize("kwargs", [{"mode": "fast"}, {"patch_gil_us": -1.0}])
def test_invalid_perf_config_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SimConfig(**kwargs)  # type: ignore[arg-type]


def test_perf_mode_is_timed() -> None:
    c = SimConfig(mode="perf")
    assert c.timed and c.perf
    assert SimConfig(mode="timed").timed and not SimConfig(mode="timed").perf
    assert not SimConfig().timed


def test_a_layer_by_layer_replay_waits_for_each_release_in_modelled_time(
    restore_config: None,
) -> None:
    """Replay, then update each layer releasing its wait (vllm-ascend's order): the
    replay blocks once for the whole stretch of waits, but each layer's tasks still start
    at its own release in the model, so the step is never shorter than its floor:
    releases at 2, 4, 6 ms (2 ms patches), each layer's two 1 ms tasks after its release:
    done at 8 ms after the replay's issue."""
    layers = 3
    q = torch.randn(2, 4, 1, 8, dtype=torch.float16).npu()
    kv = torch.randn(2, 4, 16, 8, dtype=torch.float16).npu()
    outs = [(torch.zeros_like(q), torch.zeros(1, device="npu")) for _ in range(layers)]
    x = torch.zeros(4).npu()
    events = [torch.npu.ExternalEvent() for _ in range(layers)]
    s, u = torch.npu.Stream(), torch.npu.Stream()
    g = torch.npu.NPUGraph()
    handles = []
    fia = dict(num_heads=4, input_layout="BNSD")
    with torch.npu.graph(g, stream=s):
        for layer in range(layers):
            events[layer].wait(s)
            events[layer].reset(s)
            torch.npu.graph_task_group_begin(s)
            torch_npu.npu_fused_infer_attention_score.out(
                q, kv, kv, actual_seq_lengths_kv=[16, 16], out=list(outs[layer]), **fia
            )
            handles.append(torch.npu.graph_task_group_end(s))
            x.add_(1)
    torch.npu.synchronize()
    configure(mode="perf", patch_us=2_000, patch_gil_us=100, task_us=1_000)
    start, done = (torch.npu.Event(enable_timing=True) for _ in range(2))  # type: ignore[attr-defined]
    with torch.npu.stream(s):  # type: ignore[attr-defined]
        start.record()
        g.replay()
        done.record()
    for layer in range(layers):
        with torch.npu.stream(u):  # type: ignore[attr-defined]
            torch.npu.graph_task_update_begin(u, handles[layer])
            torch_npu.npu_fused_infer_attention_score.out(
                q, kv, kv, actual_seq_lengths_kv=[8, 8], out=list(outs[layer]), **fia
            )
            torch.npu.graph_task_update_end(u)
            events[layer].record(u)
    done.synchronize()
    assert start.elapsed_time(done) >= 8.0
    assert torch.count_nonzero(x.cpu()) == 0
