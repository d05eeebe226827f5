"""Streams, events and ordinary torch ops on the simulated NPU.

No test sleeps: progress is observed with synchronize/query only. A stream is held back
deterministically by an ExternalEvent wait (a "gate") that only the host releases.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from npusim import (
    DeadlockError,
    DeviceFaultError,
    HazardError,
    SimUsageError,
)
from npusim.streams import Stream


def read_on(stream: Stream, t: torch.Tensor) -> torch.Tensor:
    """Host read of ``t`` queued on ``stream`` (waits for that stream only)."""
    with torch.npu.stream(stream):
        return t.cpu()


# ------------------------------------------------------------------ streams
def test_stream_blocked_at_external_event_does_not_block_host_or_other_streams() -> None:
    a, b = torch.npu.Stream(), torch.npu.Stream()
    gate = torch.npu.ExternalEvent()
    x = torch.zeros(4, device="npu")
    y = torch.zeros(4, device="npu")
    torch.npu.synchronize()  # the zero fills ran on the default stream

    gate.wait(a)  # returns at once although A cannot proceed
    with torch.npu.stream(a):
        x.fill_(7)
    with torch.npu.stream(b):
        y.fill_(3)
        y.mul_(2)
    b.synchronize()  # B runs while A is blocked
    assert b.query()
    assert torch.equal(read_on(b, y), torch.full((4,), 6.0))
    assert not a.query()  # A is still held at the gate
    assert torch.equal(read_on(b, x), torch.zeros(4))  # so its fill has not run

    gate.record(b)
    a.synchronize()
    assert a.query()
    assert torch.equal(read_on(a, x), torch.full((4,), 7.0))


def test_stream_runs_work_in_issue_order() -> None:
    s = torch.npu.Stream()
    x = torch.ones(1, dtype=torch.int64, device="npu")
    torch.npu.synchronize()
    expected = 1
    with torch.npu.stream(s):
        for i in range(40):
            x.mul_(3)
            x.sub_(i)
            expected = expected * 3 - i
            x.remainder_(1_000_003)
            expected %= 1_000_003
    s.synchronize()
    assert read_on(s, x).item() == expected


# ------------------------------------------------------------------ Event
def test_event_wait_on_never_recorded_event_does_not_block(
    watchdog: Callable[[float], None],
) -> None:
    watchdog(600)  # a blocked wait would hang the test, not turn into a DeadlockError
    s = torch.npu.Stream()
    ev = torch.npu.Event()
    x = torch.zeros(2, device="npu")
    torch.npu.synchronize()
    ev.wait(s)
    with torch.npu.stream(s):
        x.fill_(1)
    s.synchronize()
    assert torch.equal(read_on(s, x), torch.ones(2))
    assert ev.query()


def test_event_record_query_synchronize() -> None:
    s = torch.npu.Stream()
    gate = torch.npu.ExternalEvent()
    ev = torch.npu.Event()
    assert ev.query()  # never recorded: complete
    ev.synchronize()

    gate.wait(s)
    ev.record(s)
    assert not ev.query()  # the record is queued behind the gate
    gate.record()
    ev.synchronize()
    assert ev.query()


def test_event_wait_binds_to_record_issued_before_the_wait() -> None:
    """The waiter is released by record #1, although record #2 (issued after the wait) can
    only run when the host opens a second gate, which it does after the waiter finished."""
    a, b = torch.npu.Stream(), torch.npu.Stream()
    gate1, gate2 = torch.npu.ExternalEvent(), torch.npu.ExternalEvent()
    ev = torch.npu.Event()
    x = torch.zeros(4, device="npu")
    y = torch.zeros(4, device="npu")
    torch.npu.synchronize()

    gate1.wait(a)
    with torch.npu.stream(a):
        x.fill_(5)
    ev.record(a)  # record #1, held behind gate1
    ev.wait(b)  # binds to record #1
    with torch.npu.stream(b):
        y.copy_(x)  # must see x == 5: ordered after record #1
    gate2.wait(a)
    with torch.npu.stream(a):
        x.fill_(9)
    ev.record(a)  # record #2, issued after the wait, held behind gate2

    assert not b.query()  # B waits for record #1, which cannot have run yet
    gate1.record()
    b.synchronize()  # returns while record #2 is still held: the wait bound to #1
    assert not ev.query()  # the event's latest record (#2) has not run
    assert torch.equal(read_on(b, y), torch.full((4,), 5.0))

    gate2.record()
    ev.synchronize()
    assert ev.query()
    assert torch.equal(read_on(a, x), torch.full((4,), 9.0))


def test_event_elapsed_time() -> None:
    s = torch.npu.Stream()
    start = torch.npu.Event(enable_timing=True)
    end = torch.npu.Event(enable_timing=True)
    x = torch.ones(64, 64, device="npu")
    torch.npu.synchronize()
    start.record(s)
    with torch.npu.stream(s):
        for _ in range(5):
            x = x @ x / 64
    end.record(s)
    end.synchronize()
    assert start.elapsed_time(end) >= 0


def test_event_elapsed_time_without_timing() -> None:
    s = torch.npu.Stream()
    start, end = torch.npu.Event(), torch.npu.Event()
    start.record(s)
    end.record(s)
    end.synchronize()
    with pytest.raises(SimUsageError):
        start.elapsed_time(end)


# ------------------------------------------------------------------ ExternalEvent
def test_external_event_wait_before_record_is_released_by_later_record() -> None:
    a, b = torch.npu.Stream(), torch.npu.Stream()
    ev = torch.npu.ExternalEvent()
    x = torch.zeros(2, device="npu")
    torch.npu.synchronize()
    ev.wait(a)
    with torch.npu.stream(a):
        x.fill_(4)
    assert not a.query()
    ev.record(b)
    a.synchronize()
    assert torch.equal(read_on(a, x), torch.full((2,), 4.0))


def test_external_event_second_record_before_consuming_wait_is_lost_release(
    watchdog: Callable[[float], None],
) -> None:
    watchdog(600)
    a, b = torch.npu.Stream(), torch.npu.Stream()
    ev = torch.npu.ExternalEvent()
    ev.record(b)
    ev.record(b)  # the first record is still unconsumed: the two merge
    ev.wait(a)
    with pytest.raises(HazardError) as info:
        torch.npu.synchronize()
    assert info.value.kind == "lost-release"
    assert ev.name in str(info.value)


def test_external_event_record_not_ordered_after_consuming_wait_is_lost_release(
    watchdog: Callable[[float], None],
) -> None:
    """Whichever way the timing falls, the second record is not ordered after the wait."""
    watchdog(600)
    a, b = torch.npu.Stream(), torch.npu.Stream()
    ev = torch.npu.ExternalEvent()
    ev.record(b)
    ev.wait(a)
    ev.record(b)
    with pytest.raises(HazardError) as info:
        torch.npu.synchronize()
    assert info.value.kind == "lost-release"


def test_external_event_record_ordered_after_consuming_wait_is_fine(
    watchdog: Callable[[float], None],
) -> None:
    watchdog(600)
    a, b = torch.npu.Stream(), torch.npu.Stream()
    ev = torch.npu.ExternalEvent()
    consumed = torch.npu.Event()
    for _ in range(3):
        ev.record(b)
        ev.wait(a)
        consumed.record(a)
        consumed.wait(b)  # the next record on B follows the wait that consumed this one
    ev.record(b)
    ev.wait(a)
    torch.npu.synchronize()


def test_external_event_reset_between_is_harmless(watchdog: Callable[[float], None]) -> None:
    watchdog(600)
    a, b = torch.npu.Stream(), torch.npu.Stream()
    ev = torch.npu.ExternalEvent()
    x = torch.zeros(1, device="npu")
    torch.npu.synchronize()
    # wait, reset, record
    ev.wait(a)
    ev.reset(a)
    ev.record(b)
    a.synchronize()
    # record, reset, wait: reset does not clear the pending release
    b.wait_stream(a)
    ev.record(b)
    b.synchronize()
    ev.reset(a)
    ev.wait(a)
    with torch.npu.stream(a):
        x.fill_(1)
    torch.npu.synchronize()
    assert torch.equal(read_on(a, x), torch.ones(1))


# ------------------------------------------------------------------ deadlocks
def test_replay_waiting_on_never_recorded_external_event_is_watchdog_deadlock(
    watchdog: Callable[[float], None],
) -> None:
    watchdog(0.5)
    ev = torch.npu.ExternalEvent()
    x = torch.zeros(2, device="npu")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        ev.wait(torch.npu.current_stream())
        x.add_(1)
    g.replay()
    with pytest.raises(DeadlockError) as info:
        torch.npu.synchronize()
    assert info.value.kind == "watchdog"
    assert ev.name in str(info.value)


def test_streams_waiting_on_each_other_is_cycle_deadlock(
    watchdog: Callable[[float], None],
) -> None:
    watchdog(600)  # reported at once, not by the watchdog
    a, b = torch.npu.Stream(), torch.npu.Stream()
    e1 = torch.npu.ExternalEvent()
    ev = torch.npu.Event()
    e1.wait(a)  # A waits for e1 ...
    ev.record(a)  # ... before it records ev
    ev.wait(b)  # B waits for ev ...
    e1.record(b)  # ... before it records e1
    with pytest.raises(DeadlockError) as info:
        torch.npu.synchronize()
    assert info.value.kind == "cycle"


# ------------------------------------------------------------------ host threads
def test_current_stream_is_per_host_thread() -> None:
    main_stream, worker_stream = torch.npu.Stream(), torch.npu.Stream()
    default = torch.npu.default_stream()
    entered, checked = threading.Event(), threading.Event()
    seen: dict[str, Stream] = {}
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            seen["before"] = torch.npu.current_stream()
            with torch.npu.stream(worker_stream):
                seen["inside"] = torch.npu.current_stream()
                entered.set()
                assert checked.wait(timeout=30)
            seen["after"] = torch.npu.current_stream()
        except BaseException as exc:
            errors.append(exc)
            entered.set()

    with torch.npu.stream(main_stream):
        t = threading.Thread(target=worker)
        t.start()
        assert entered.wait(timeout=30)
        assert torch.npu.current_stream() is main_stream
        checked.set()
        t.join(timeout=30)
        assert torch.npu.current_stream() is main_stream
    assert not t.is_alive()
    assert not errors, errors
    assert seen["before"] is default
    assert seen["inside"] is worker_stream
    assert seen["after"] is default
    assert torch.npu.current_stream() is default


# ------------------------------------------------------------------ torch ops on the device
def test_graph_of_ordinary_torch_ops_replays_with_new_inputs() -> None:
    x = torch.zeros(3, 5, device="npu")
    y = torch.empty(3, 5, device="npu")
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        y.copy_(x * 2 + 1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        new = torch.randn(3, 5, generator=gen)
        x.copy_(new)
        g.replay()
        assert torch.equal(y.cpu(), new * 2 + 1)


def test_factories_and_transfers() -> None:
    e = torch.empty(2, 3, device="npu")
    assert e.device == torch.device("npu", 0)
    assert e.shape == (2, 3)
    z = torch.zeros(2, 3, device="npu")
    assert z.device.type == "npu"
    assert torch.equal(z.cpu(), torch.zeros(2, 3))

    host = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    a = host.npu()
    b = host.to("npu")
    assert a.device.type == "npu" and b.device.type == "npu"
    assert torch.equal(a.cpu(), host)
    assert torch.equal(a, b)
    assert not torch.equal(a, z)
    assert a.sum().item() == 15.0
    assert (a[1, 2] * 2).item() == 10.0


def test_repr_and_print_name_the_device(capsys: pytest.CaptureFixture[str]) -> None:
    t = torch.tensor([1.5, 2.5]).npu()
    assert "device='npu:0'" in repr(t)
    print(t)
    out = capsys.readouterr().out
    assert "device='npu:0'" in out
    assert "1.5000" in out


def test_views_share_storage_with_base() -> None:
    base = torch.zeros(4, 4, device="npu")
    mirror = torch.zeros(4, 4)

    base[1].fill_(1)
    mirror[1].fill_(1)
    base[:, 3].fill_(2)
    mirror[:, 3].fill_(2)
    base.view(2, 8)[1, :3].fill_(3)
    mirror.view(2, 8)[1, :3].fill_(3)
    base.transpose(0, 1)[0].fill_(4)  # column 0 of base
    mirror.transpose(0, 1)[0].fill_(4)
    v = base.view(16)
    assert v.data_ptr() == base.data_ptr()
    v[15:].fill_(5)
    mirror.view(16)[15:].fill_(5)

    assert torch.equal(base.cpu(), mirror)
    assert torch.equal(base.transpose(0, 1).cpu(), mirror.t())


def test_dtype_conversion_half() -> None:
    x = torch.tensor([0.1, 1.25, -3.5]).npu()
    h = x.half()
    assert h.dtype == torch.float16
    assert h.device.type == "npu"
    assert torch.equal(h.cpu(), torch.tensor([0.1, 1.25, -3.5]).half())


def test_host_read_under_side_stream_sees_final_value_of_long_chain() -> None:
    side = torch.npu.Stream()
    x = torch.zeros(8, dtype=torch.int64, device="npu")
    side.wait_stream(torch.npu.current_stream())  # the zero fill ran first
    with torch.npu.stream(side):
        for _ in range(300):
            x.add_(1)
        got = x.cpu()
    assert torch.equal(got, torch.full((8,), 300, dtype=torch.int64))


def test_device_op_failing_on_stream_is_device_fault() -> None:
    """index_select's meta kernel cannot see index values; the CPU kernel rejects them."""
    s = torch.npu.Stream()
    x = torch.arange(4, dtype=torch.float32).npu()
    idx = torch.tensor([0, 100]).npu()
    with torch.npu.stream(s):
        torch.index_select(x, 0, idx)  # issued fine: shapes are valid
    with pytest.raises(DeviceFaultError):
        torch.npu.synchronize()
