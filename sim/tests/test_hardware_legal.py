"""What the NPU allows and the sim used to refuse or get wrong (issue 18, item 6):
allocations are never graph tasks, an update may use the graph's idle capture
stream, an eager op may write a captured graph's buffers, and seeding works
through torch.manual_seed, torch.npu.manual_seed(_all) and the RNG state API.
Each correct use runs clean; its fence-less mutation is still reported."""

from __future__ import annotations

import pytest
import torch
from npusim import HazardError, SimUsageError
from test_host_ordering import LAYERS, STEPS, Stack, lengths_for


# ================================================================ update on the idle capture stream
def test_update_on_the_idle_capture_stream_runs_clean() -> None:
    """CANN requires only that the update stream is not capturing: the capture stream
    orders patch and replay by itself."""
    stack = Stack(8)
    for step in range(STEPS):
        lengths = lengths_for(step)
        stack.patch_all(lengths, stream=stack.capture)
        stack.replay()
        if step % 3 == 2:
            stack.check(lengths)
    stack.check(lengths_for(STEPS - 1))


def test_update_on_the_capture_stream_racing_a_replay_on_another_stream_is_reported(
    watchdog_off: None,
) -> None:
    stack = Stack(9)
    side = torch.npu.Stream()
    stack.patch_all(lengths_for(0), stream=stack.capture)
    stack.replay(side)
    with pytest.raises(HazardError) as err:
        stack.patch_all(lengths_for(1), stream=stack.capture)  # not after the side replay
        stack.replay(side)
        torch.npu.synchronize()
    assert err.value.kind in ("race", "lost-release")


def test_update_on_a_capture_stream_while_it_captures_is_still_refused() -> None:
    stack = Stack(10)
    with torch.npu.graph(torch.npu.NPUGraph(), stream=stack.capture):
        with pytest.raises(SimUsageError):
            torch.npu.graph_task_update_begin(stack.capture, stack.handles[0])
        torch.ones(1, device="npu").add_(1)


# ================================================================ eager op into captured buffers
def test_eager_fused_op_into_captured_buffers_runs_as_on_hardware() -> None:
    """Legal on the NPU: the op runs eagerly into the graph's buffers and the graph keeps
    its own (captured or patched) parameters."""
    stack = Stack(11)
    captured = lengths_for(0)
    stack.patch_all(captured)
    stack.replay()
    stack.check(captured)
    eager = lengths_for(1)
    with torch.npu.stream(stack.capture):  # eager, after the replay, into its buffers
        for layer in range(LAYERS):
            stack.op(layer, eager)
    stack.check(eager)
    for layer in range(LAYERS):  # release the graph without a patch
        stack.events[layer].record(stack.update)
    stack.replay()
    stack.check(captured)  # the eager call did not patch the graph


# ================================================================ allocations are not tasks
def node_labels(g: torch.npu.NPUGraph) -> list[str]:
    return [n.label for n in g.nodes]


@pytest.mark.parametrize(
    "alloc",
    [
        lambda x: torch.empty_like(x),
        lambda x: x.new_empty(x.shape),
        lambda x: x.new_empty_strided(tuple(x.shape), x.stride()),
        lambda x: torch.empty_strided(tuple(x.shape), x.stride(), device="npu"),
        lambda x: torch.empty(tuple(x.shape), device="npu"),
    ],
    ids=["empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty"],
)
def test_an_allocation_inside_a_capture_is_not_a_task(alloc) -> None:
    """torchair's clone_input path: allocate inside the capture, copy the input in
    before every replay; a replay must not overwrite it with fresh memory."""
    x = torch.zeros(4).npu()
    g, s = torch.npu.NPUGraph(), torch.npu.Stream()
    with torch.npu.graph(g, stream=s):
        buf = alloc(x)
        out = buf * 2
    assert node_labels(g) == [node_labels(g)[0]] and "mul" in node_labels(g)[0], node_labels(g)
    assert buf.device.type == "npu" and buf.shape == x.shape
    for value in (1.0, 5.0):
        buf.copy_(torch.full((4,), value))
        with torch.npu.stream(s):
            g.replay()
            got = out.cpu()
        assert got.tolist() == [2 * value] * 4


def test_a_fill_inside_a_capture_is_still_a_task() -> None:
    """The mutation: zeros_like is an allocation and a fill kernel, and a replay
    refills, as on the NPU."""
    x = torch.ones(4).npu()
    g, s = torch.npu.NPUGraph(), torch.npu.Stream()
    with torch.npu.graph(g, stream=s):
        buf = torch.zeros_like(x)
        out = buf + 1
    assert len(g.nodes) == 2
    buf.copy_(torch.full((4,), 7.0))
    with torch.npu.stream(s):
        g.replay()
        assert out.cpu().tolist() == [1.0] * 4


def test_an_allocation_inside_a_task_group_and_its_update_is_no_task_of_it() -> None:
    """xLLM allocates the op's output between group begin and the op; the update
    re-issues the same sequence, allocation included."""
    q = torch.randn(1, 2, 1, 8, dtype=torch.float16).npu()
    kv = torch.randn(1, 2, 16, 8, dtype=torch.float16).npu()
    lse = torch.empty(1, device="npu")
    kw = dict(num_heads=2, input_layout="BNSD", scale=0.25, softmax_lse_flag=False)
    g, s, u = torch.npu.NPUGraph(), torch.npu.Stream(), torch.npu.Stream()
    with torch.npu.graph(g, stream=s):
        torch.npu.graph_task_group_begin(s)
        out = torch.empty_like(q)
        torch.ops.npu.npu_fused_infer_attention_score.out(
            q, kv, kv, actual_seq_lengths_kv=[16], out=[out, lse], **kw)  # fmt: skip
        handle = torch.npu.graph_task_group_end(s)
    assert len(handle.group.tasks) == 1
    with torch.npu.stream(u):
        torch.npu.graph_task_update_begin(u, handle)
        scratch = torch.empty_like(q)  # allocated again, as the re-run code does
        assert scratch.data_ptr() != out.data_ptr()
        torch.ops.npu.npu_fused_infer_attention_score.out(
            q, kv, kv, actual_seq_lengths_kv=[3], out=[out, lse], **kw)  # fmt: skip
        torch.npu.graph_task_update_end(u)
        done = torch.npu.Event()
        done.record(u)
    done.wait(s)
    with torch.npu.stream(s):
        g.replay()
        got = out.cpu()
    want = torch.ops.npu.npu_fused_infer_attention_score(
        q, kv, kv, actual_seq_lengths_kv=[3], **kw)[0].cpu()  # fmt: skip
    torch.testing.assert_close(got, want)


def test_untyped_storage_data_ptr_of_a_device_tensor() -> None:
    """torchair's get_tensor_metadata reads x.untyped_storage().data_ptr()."""
    x = torch.arange(12, dtype=torch.float32).npu()
    view = x[3:]
    storage = view.untyped_storage()
    assert storage.data_ptr() == x.data_ptr() == x.untyped_storage().data_ptr()
    assert view.data_ptr() == storage.data_ptr() + 3 * x.element_size()
    assert storage.nbytes() == 12 * x.element_size()
    assert torch.empty(3, device="npu").untyped_storage().data_ptr() != storage.data_ptr()


# ================================================================ seeding
def _draw() -> list[float]:
    return torch.randn(4, device="npu").cpu().tolist()


def test_torch_manual_seed_seeds_the_device() -> None:
    torch.manual_seed(0)  # calls torch.npu.manual_seed_all itself
    a = _draw()
    torch.npu.manual_seed(0)
    b = _draw()
    torch.npu.manual_seed_all(0)
    c = _draw()
    assert a == b == c
    torch.manual_seed(1)
    assert _draw() != a
    assert torch.npu.initial_seed() == 1


def test_device_rng_state_and_fork_rng() -> None:
    torch.manual_seed(3)
    state = torch.npu.get_rng_state()
    a = _draw()
    torch.npu.set_rng_state(state)
    assert _draw() == a
    torch.npu.set_rng_state_all(torch.npu.get_rng_state_all())
    with torch.random.fork_rng(devices=[0], device_type="npu"):
        torch.npu.manual_seed(99)
        _draw()
    b = _draw()
    torch.npu.set_rng_state(state)
    _draw()
    assert _draw() == b
    torch.npu.default_generators[0].manual_seed(5)
    c = _draw()
    torch.manual_seed(5)
    assert _draw() == c
