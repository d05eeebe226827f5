"""Happens-before over every device memory access (issue 18, item 1).

Reads and writes are tracked per storage byte range on every stream, by replays (a
replay's tasks read and write their captured tensors), by host copies and host reads.
Each correct program below runs clean; its fence-less mutation is reported as a
HazardError naming both accesses and the fence, on every run, whatever the timing.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch
from npusim import HazardError, configure, fault, reset_device, torch_npu  # noqa: F401
from test_host_ordering import Stack, lengths_for

npu = torch.npu
STEPS = 6


@pytest.fixture(params=["compute", "timed"])
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Tracking is the same whether replayed tasks compute or only cost time."""
    old = configure()
    configure(mode=request.param, task_us=0.0, patch_us=0.0)
    yield request.param
    configure(mode=old.mode, task_us=old.task_us, patch_us=old.patch_us)


def doubling_graph(S: torch.npu.Stream, n: int = 8) -> tuple[torch.npu.NPUGraph, torch.Tensor,
                                                                torch.Tensor]:  # fmt: skip
    """A graph that reads the static input x and writes the static output y = 2x."""
    x = torch.zeros(n, device="npu")
    y = torch.zeros(n, device="npu")
    npu.synchronize()
    g = npu.NPUGraph()
    with npu.graph(g, stream=S):
        torch.mul(x, 2, out=y)
    return g, x, y


def raised(fn) -> HazardError:  # type: ignore[no-untyped-def]
    with pytest.raises(HazardError) as err:
        fn()
        npu.synchronize()
    assert err.value.kind == "race"
    assert "race on npu memory" in str(err.value)
    return err.value


# ================================================================ static input refill
def refill_and_replay(fenced: bool, mode: str) -> list[torch.Tensor]:
    S, U = npu.Stream(), npu.Stream()
    g, x, y = doubling_graph(S)
    inputs = [torch.full((8,), float(i)) for i in range(STEPS)]
    outs = []
    for step in range(STEPS):
        with npu.stream(U):
            x.copy_(inputs[step], non_blocking=True)  # refill the static input on U
        S.wait_stream(U)
        with npu.stream(S):
            g.replay()
            outs.append(y.to("cpu", non_blocking=True))
        if fenced:
            U.wait_stream(S)  # the next refill waits until this replay read x
    npu.synchronize()
    return outs


def test_static_input_refilled_after_the_replay_runs_clean(mode: str) -> None:
    outs = refill_and_replay(fenced=True, mode=mode)
    if mode == "compute":
        assert [o[0].item() for o in outs] == [2.0 * i for i in range(STEPS)]


def test_static_input_refilled_on_another_stream_during_a_replay_is_reported(mode: str) -> None:
    for _ in range(3):  # on every run, not when the timing happened to be bad
        err = raised(lambda: refill_and_replay(fenced=False, mode=mode))
        text = str(err)
        # Both accesses, in issue order: the replay's read of x, then the next refill.
        assert "the read of `self` by mul.out in replay #" in text
        assert "the write of `self` by copy host->npu on stream" in text
        assert text.index("by mul.out in replay") < text.index("by copy host->npu")
        assert "wait_stream" in text and "Event" in text
        reset_device()


# ================================================================ KV write on a side stream
def kv_steps(fenced: bool) -> torch.Tensor:
    """A side stream writes one new KV row per step (index_copy_ into the cache) that
    the decode graph on S reads."""
    S, side = npu.Stream(), npu.Stream()
    cache = torch.zeros(STEPS, 4, device="npu")
    total = torch.zeros(4, device="npu")
    new_row = torch.zeros(1, 4, device="npu")
    slot = torch.zeros(1, dtype=torch.int64, device="npu")
    npu.synchronize()
    g = npu.NPUGraph()
    with npu.graph(g, stream=S):
        torch.sum(cache, 0, out=total)
    for step in range(STEPS):
        with npu.stream(side):
            new_row.copy_(torch.full((1, 4), 1.0), non_blocking=True)
            slot.copy_(torch.tensor([step]), non_blocking=True)
            cache.index_copy_(0, slot, new_row)
        if fenced:
            S.wait_stream(side)  # the replay reads the row written on the side stream
        with npu.stream(S):
            g.replay()
        side.wait_stream(S)  # the next write waits for this replay
    npu.synchronize()
    return total.cpu()


def test_kv_write_on_a_side_stream_fenced_before_the_replay_runs_clean() -> None:
    assert kv_steps(fenced=True).tolist() == [float(STEPS)] * 4


def test_kv_write_on_a_side_stream_without_a_fence_is_reported() -> None:
    text = str(raised(lambda: kv_steps(fenced=False)))
    assert "the write of `self` by index_copy_.default on stream" in text
    # Which replay's read meets the unordered write first depends on the threads' timing.
    assert re.search(r"the read of `self` by sum\.IntList_out in replay #\d+", text), text


# ================================================================ output read on another stream
def read_output(fenced: bool) -> list[float]:
    S, B = npu.Stream(), npu.Stream()
    g, x, y = doubling_graph(S)
    x.copy_(torch.full((8,), 3.0))
    got = []
    for _ in range(2):
        with npu.stream(S):
            g.replay()
        if fenced:
            B.wait_stream(S)
        with npu.stream(B):
            got.append(y.cpu()[0].item())  # a blocking host read on B
    return got


def test_output_read_on_another_stream_after_a_wait_runs_clean() -> None:
    assert read_output(fenced=True) == [6.0, 6.0]


def test_output_read_on_another_stream_without_a_wait_is_reported() -> None:
    text = str(raised(lambda: read_output(fenced=False)))
    assert "the write of `out` by mul.out in replay #1" in text
    assert "the read of `src` by copy npu->host on stream" in text


# ================================================================ host write, queued reader
def host_write_behind_a_reader(fenced: bool) -> torch.Tensor:
    S = npu.Stream()
    x = torch.ones(8).npu()
    with npu.stream(S):
        y = x * 2  # queued on S: reads x
    if fenced:
        npu.current_stream().wait_stream(S)
    x.copy_(torch.full((8,), 5.0), non_blocking=True)  # H2D on the current stream
    npu.synchronize()
    return y.cpu()


def test_host_write_after_the_reader_is_fenced_runs_clean() -> None:
    assert host_write_behind_a_reader(fenced=True).tolist() == [2.0] * 8


def test_host_write_into_a_buffer_a_queued_op_reads_is_reported() -> None:
    text = str(raised(lambda: host_write_behind_a_reader(fenced=False)))
    assert "the read of `self` by mul.Tensor on stream" in text
    assert "the write of `self` by copy host->npu on default stream of npu:0" in text
    assert "make default stream of npu:0 wait for stream" in text


# ================================================================ what is a conflict
def test_reads_by_many_streams_are_not_a_race() -> None:
    x = torch.ones(64).npu()
    streams = [npu.Stream() for _ in range(4)]
    outs = []
    for _ in range(3):
        for s in streams:
            with npu.stream(s):
                outs.append(x.sum())
    npu.synchronize()
    assert fault() is None
    assert all(o.item() == 64.0 for o in outs)


def test_unordered_writes_on_two_streams_are_reported() -> None:
    x = torch.zeros(8).npu()
    A, B = npu.Stream(), npu.Stream()

    def writes() -> None:
        with npu.stream(A):
            x.fill_(1.0)
        with npu.stream(B):
            x.fill_(2.0)

    text = str(raised(writes))
    assert text.count("the write of `self` by fill_.Scalar") == 2


def test_disjoint_slices_of_one_buffer_are_separate_and_overlapping_views_are_not() -> None:
    """Storage byte ranges: two streams writing disjoint halves of one buffer are fine;
    a view and the buffer it views share memory."""
    x = torch.zeros(2, 8).npu()
    A, B = npu.Stream(), npu.Stream()
    for _ in range(3):
        with npu.stream(A):
            x[0].add_(1)
        with npu.stream(B):
            x[1].add_(2)
    npu.synchronize()
    assert fault() is None
    assert x.cpu().tolist() == [[3.0] * 8, [6.0] * 8]

    def overlapping() -> None:
        with npu.stream(A):
            x[:, 4:].add_(1)  # a strided view: bytes 16..64 of the buffer
        with npu.stream(B):
            x.view(-1)[10:12].add_(1)  # another view of the same storage, inside that span

    raised(overlapping)


def test_a_device_reset_forgets_what_was_recorded() -> None:
    x = torch.zeros(8).npu()
    A, B = npu.Stream(), npu.Stream()
    with npu.stream(A):
        x.add_(1)
    with npu.stream(B):
        x.add_(1)
    with pytest.raises(HazardError):
        npu.synchronize()
    reset_device()  # drops all pending work; what ran before is over
    with npu.stream(A):
        x.add_(1)
    npu.synchronize()
    assert fault() is None


# ================================================================ the engine's per-layer refill
def layered(fenced: bool) -> torch.Tensor:
    """The engine's pattern: U refills each layer's slice of one per-layer buffer, then
    releases that layer's ExternalEvent; the replay on S reads layer l after waiting its
    event, so U refills layer l+1 while the replay reads layer l. The mutation refills
    a layer after releasing it."""
    layers = 3
    S, U = npu.Stream(), npu.Stream()
    kv = torch.zeros(layers, 4, device="npu")  # one storage, a slice per layer
    outs = [torch.zeros(4, device="npu") for _ in range(layers)]
    events = [npu.ExternalEvent() for _ in range(layers)]
    npu.synchronize()
    g = npu.NPUGraph()
    with npu.graph(g, stream=S):
        for layer in range(layers):
            events[layer].wait(S)
            torch.mul(kv[layer], 2, out=outs[layer])
    done = None
    for step in range(STEPS):
        if done is not None:
            U.wait_event(done)  # the previous replay is over
        with npu.stream(S):
            g.replay()
        with npu.stream(U):
            for layer in range(layers):
                if not fenced:
                    events[layer].record(U)
                kv[layer].copy_(torch.full((4,), float(step + layer)), non_blocking=True)
                if fenced:
                    events[layer].record(U)
        done = npu.Event()
        done.record(S)
    npu.synchronize()
    return torch.stack([o.cpu() for o in outs])


def test_per_layer_refill_while_the_replay_reads_earlier_layers_runs_clean() -> None:
    got = layered(fenced=True)
    assert got[:, 0].tolist() == [2.0 * (STEPS - 1 + layer) for layer in range(3)]


def test_refilling_a_layer_after_releasing_it_is_reported() -> None:
    text = str(raised(lambda: layered(fenced=False)))
    assert "mul.out in replay #" in text and "copy host->npu" in text


def test_a_timed_patch_is_a_patch_not_an_eager_op() -> None:
    """In timed mode a patch is charged host time and then issued: it must still patch
    the task, not run the op on the update stream (which reads and writes the graph's
    buffers there, unordered with the replay: a race)."""
    old = configure()
    configure(mode="timed", task_us=0.0, patch_us=20.0)
    try:
        stack = Stack(11)
        done = None
        for step in range(4):  # replay then update, as the daemon's pipeline
            if done is not None:
                stack.update.wait_event(done)
            stack.replay()
            stack.patch_all(lengths_for(step))
            done = npu.Event()
            done.record(stack.capture)
        npu.synchronize()
    finally:
        configure(mode=old.mode, task_us=old.task_us, patch_us=old.patch_us)
    assert fault() is None


# ================================================================ task-group reads
def release_then_patch(stack: Stack, release_first: bool) -> None:
    """Each layer's patch on the update stream and its event's record: after the patch
    (the replay's wait orders the patch before the group's read), or before it."""
    u = stack.update
    with torch.npu.stream(u):
        for layer in range(len(stack.handles)):
            if release_first:
                stack.events[layer].record(u)
            torch.npu.graph_task_update_begin(u, stack.handles[layer])
            stack.op(layer, lengths_for(0))
            torch.npu.graph_task_update_end(u)
            if not release_first:
                stack.events[layer].record(u)


@pytest.mark.parametrize("release_first", [False, True])
def test_a_replay_reading_a_task_group_its_patch_is_not_ordered_before(
    mode: str, release_first: bool
) -> None:
    """A replay's read of a task group is checked against the group's patches in timed mode
    as in compute mode (timed mode checks a row of tasks in one go)."""
    stack = Stack()
    npu.synchronize()
    release_then_patch(stack, release_first)
    if not release_first:
        stack.replay()
        npu.synchronize()
        return
    with pytest.raises(HazardError) as err:
        stack.replay()
        npu.synchronize()
    # Whichever the streams reach first: the replay's read finds the patch unordered
    # before it, or the patch finds the replay's read unordered before it.
    assert err.value.kind == "race"
    assert re.search(r"race on task group \d+ \(.*\) of " + stack.graph.name + ":", str(err.value))
