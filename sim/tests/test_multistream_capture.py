"""Fork/join capture over several streams (issue 18, item 4).

Modelled on Ascend/pytorch ``test/npu/test_aclgraph_multi_stream.py``: a side stream
that waits on the capture stream joins the capture; its work is recorded into the same
graph and must be joined back before the capture ends (CANN's cross-stream capture,
ACL_ERROR_RT_STREAM_UNJOINED otherwise). Replay runs the side branch on a stream of its
own, ordered by the captured edges only.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from npusim import HazardError, SimUsageError, fault


def _npu_stream_switch(target: Any, enabled: bool = True) -> Any:
    return torch.npu.stream(target) if enabled else nullcontext()


# ------------------------------------------------------------------ the upstream patterns
def test_shared_expert_stream_capture_replay() -> None:
    shared_stream = torch.npu.Stream()
    positions = torch.ones(4, 4).npu()

    def eager(x: torch.Tensor, side: Any) -> tuple[torch.Tensor, torch.Tensor]:
        default = torch.npu.current_stream()
        a = x + x
        side.wait_stream(default)
        with torch.npu.stream(side):
            b = x / x
            b = b + x
        default.wait_stream(side)
        return a, b

    ref_a, ref_b = eager(positions, torch.npu.Stream())
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        stream_default = torch.npu.current_stream()
        out_a = positions + positions
        shared_stream.wait_stream(stream_default)
        with _npu_stream_switch(shared_stream):
            out_b = positions / positions
            out_b = out_b + positions
        stream_default.wait_stream(shared_stream)
    torch.npu.synchronize()
    assert not shared_stream.is_capturing()

    g.replay()
    torch.npu.synchronize()
    assert torch.equal(out_a.cpu(), ref_a.cpu()) and torch.equal(out_b.cpu(), ref_b.cpu())

    positions.fill_(2.0)
    ref_a2, ref_b2 = eager(positions, torch.npu.Stream())
    g.replay()
    torch.npu.synchronize()
    assert torch.equal(out_a.cpu(), ref_a2.cpu()) and torch.equal(out_b.cpu(), ref_b2.cpu())
    assert out_b.cpu()[0, 0].item() == 3.0


def test_parallel_branch_capture_replay() -> None:
    m = 16
    s_inp, wa, wb = (torch.randn(m, m).npu() for _ in range(3))
    capture_stream, side_stream = torch.npu.Stream(), torch.npu.Stream()
    g = torch.npu.NPUGraph()

    capture_stream.wait_stream(torch.npu.current_stream())
    with torch.npu.stream(capture_stream):  # warm-up, eager
        for _ in range(3):
            side_stream.wait_stream(capture_stream)
            with torch.npu.stream(side_stream):
                _b = torch.matmul(s_inp, wb)
            _a = torch.matmul(s_inp, wa)
            capture_stream.wait_stream(side_stream)
            _ = _a + _b
    torch.npu.current_stream().wait_stream(capture_stream)
    torch.npu.synchronize()

    with torch.npu.stream(capture_stream), torch.npu.graph(g, stream=capture_stream):
        side_stream.wait_stream(capture_stream)
        with torch.npu.stream(side_stream):
            branch_b = torch.matmul(s_inp, wb)
        branch_a = torch.matmul(s_inp, wa)
        capture_stream.wait_stream(side_stream)
        output = branch_a + branch_b
    torch.npu.synchronize()

    for _ in range(2):
        inp = torch.randn(m, m)
        s_inp.copy_(inp.npu())
        g.replay()
        torch.npu.synchronize()
        ref = inp @ wa.cpu() + inp @ wb.cpu()
        assert torch.allclose(output.cpu(), ref, atol=1e-5)


def test_fork_and_join_through_events_and_an_indirect_branch() -> None:
    """Stream 3 forks from stream 2, which forked from the capture stream; 3 joins back
    to 2 and 2 to the capture stream (CANN's indirect join)."""
    s, s2, s3 = torch.npu.Stream(), torch.npu.Stream(), torch.npu.Stream()
    x = torch.full((4,), 3.0).npu()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        fork = torch.npu.Event()
        fork.record(s)
        fork.wait(s2)
        with torch.npu.stream(s2):
            y = x * 2
            s3.wait_stream(s2)
            with torch.npu.stream(s3):
                z = y + 1
                assert torch.npu.is_current_stream_capturing()
            s2.wait_stream(s3)
            w = z * 10
            back = torch.npu.Event()
            back.record(s2)
        back.wait(s)
        out = w + x
    assert [b.source for b in g.branches] == [s2.name, s3.name]
    x.copy_(torch.ones(4).npu())
    g.replay()
    torch.npu.synchronize()
    assert out.cpu().tolist() == [31.0] * 4


def test_side_branch_replays_concurrently_with_the_main_branch(
    watchdog: Callable[[float], None],
) -> None:
    """The main branch is held at an ExternalEvent gate after the fork; the side branch
    still runs and releases a stream that waits for it. Serialised behind the gate it
    would never run (the watchdog would report a deadlock)."""
    watchdog(5.0)
    s, side, observer = torch.npu.Stream(), torch.npu.Stream(), torch.npu.Stream()
    gate, ready = torch.npu.ExternalEvent(), torch.npu.ExternalEvent()
    x = torch.full((3,), 2.0).npu()
    seen = torch.zeros(3).npu()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        side.wait_stream(s)
        gate.wait(s)
        with torch.npu.stream(side):
            b = x * 5
            ready.record(side)
        s.wait_stream(side)
        out = b + 1
    g.replay()
    ready.wait(observer)
    with torch.npu.stream(observer):
        seen.copy_(b)
    observer.synchronize()  # returns although the main branch still waits at the gate
    assert not torch.npu.current_stream().query()  # the replay waits at the gate
    gate.record(torch.npu.Stream())
    torch.npu.synchronize()
    assert seen.cpu().tolist() == [10.0] * 3 and out.cpu().tolist() == [11.0] * 3
    assert fault() is None


def test_hazard_checker_sees_the_captured_edges() -> None:
    """A task group captured on the side branch: an update fenced after the replay by an
    event on the replaying stream is ordered through the join edge (clean); an update
    without that fence races with the side branch's read of the group."""
    s, side, u = torch.npu.Stream(), torch.npu.Stream(), torch.npu.Stream()
    x, y = torch.ones(4).npu(), torch.zeros(4).npu()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        side.wait_stream(s)
        with torch.npu.stream(side):
            torch.npu.graph_task_group_begin(side)
            torch.mul(x, 2, out=y)
            handle = torch.npu.graph_task_group_end(side)
        s.wait_stream(side)
    assert [t.label for t in handle.group.tasks] == ["mul.out"]

    def patch() -> None:
        with torch.npu.stream(u):
            torch.npu.graph_task_update_begin(u, handle)
            torch.mul(x, 3, out=y)
            torch.npu.graph_task_update_end(u)

    g.replay()
    done = torch.npu.Event()
    done.record(torch.npu.current_stream())
    u.wait_event(done)
    patch()
    torch.npu.current_stream().wait_stream(u)
    g.replay()  # ordered after the patch
    torch.npu.synchronize()
    assert fault() is None and y.cpu().tolist() == [3.0] * 4
    g.replay()
    patch()  # no fence: the patch may land while the side branch reads the group
    with pytest.raises(HazardError, match="branch 1"):
        torch.npu.synchronize()


# ------------------------------------------------------------------ misuse
def test_fork_without_join_fails_at_capture_end_and_runs_nothing() -> None:
    s, side = torch.npu.Stream(), torch.npu.Stream()
    x = torch.zeros(3).npu()
    g = torch.npu.NPUGraph()
    with pytest.raises(SimUsageError, match=r"not joined.*107025"), torch.npu.graph(g, stream=s):
        side.wait_stream(s)
        with torch.npu.stream(side):
            x.add_(1)  # recorded into the capture, never run eagerly
    assert not side.is_capturing() and not s.is_capturing()
    torch.npu.synchronize()
    assert x.cpu().tolist() == [0.0] * 3
    with pytest.raises(SimUsageError):
        g.replay()  # the failed capture holds nothing
    with torch.npu.stream(side):
        x.add_(1)  # the side stream is an ordinary stream again
    torch.npu.synchronize()
    assert x.cpu().tolist() == [1.0] * 3


def test_work_on_a_branch_after_its_join_is_unjoined() -> None:
    s, side = torch.npu.Stream(), torch.npu.Stream()
    x = torch.zeros(3).npu()
    g = torch.npu.NPUGraph()
    with pytest.raises(SimUsageError, match=r"not joined.*add_"), torch.npu.graph(g, stream=s):
        side.wait_stream(s)
        with torch.npu.stream(side):
            x.mul_(2)
        s.wait_stream(side)
        with torch.npu.stream(side):
            x.add_(1)  # after the join: CANN finds an unjoined task


def test_a_fork_that_captures_nothing_must_still_be_joined() -> None:
    s, side = torch.npu.Stream(), torch.npu.Stream()
    with pytest.raises(SimUsageError, match="not joined"), torch.npu.graph(
        torch.npu.NPUGraph(), stream=s
    ):
        side.wait_stream(s)


def test_the_default_stream_cannot_join_a_capture() -> None:
    s = torch.npu.Stream()
    with pytest.raises(SimUsageError, match="IMPLICIT"), torch.npu.graph(
        torch.npu.NPUGraph(), stream=s
    ):
        torch.npu.default_stream().wait_stream(s)


def test_waiting_on_a_record_made_outside_the_capture_is_refused() -> None:
    s, other = torch.npu.Stream(), torch.npu.Stream()
    outside = torch.npu.Event()
    outside.record(other)
    with pytest.raises(SimUsageError, match="isolation"), torch.npu.graph(
        torch.npu.NPUGraph(), stream=s
    ):
        outside.wait(s)


def test_an_event_of_an_ended_capture_is_an_ordinary_wait() -> None:
    s, side = torch.npu.Stream(), torch.npu.Stream()
    x = torch.zeros(2).npu()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        ev = torch.npu.Event()
        x.add_(1)
        ev.record(s)
    ev.wait(side)  # not a fork: the capture has ended
    assert not side.is_capturing()
    with torch.npu.stream(s):  # the replay writes x on s: side reads it after ev
        g.replay()
    ev.record(s)
    ev.wait(side)
    with torch.npu.stream(side):
        y = x * 3
    torch.npu.synchronize()
    assert y.cpu().tolist() == [3.0, 3.0]


def test_a_record_of_an_earlier_capture_does_not_fork_into_a_new_one() -> None:
    s, side = torch.npu.Stream(), torch.npu.Stream()
    x = torch.zeros(2).npu()
    g = torch.npu.NPUGraph()
    ev = torch.npu.Event()
    with torch.npu.graph(g, stream=s):
        ev.record(s)
        x.add_(1)
    g.reset()
    with torch.npu.graph(g, stream=s):
        x.add_(2)
        ev.wait(side)  # the record belongs to the reset capture: an eager wait
        assert not side.is_capturing()
    g.replay()
    torch.npu.synchronize()
    assert x.cpu().tolist() == [2.0, 2.0]
