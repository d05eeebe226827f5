"""The client's call deadlines: one loop timer per channel, queues per timeout value."""

from __future__ import annotations

import asyncio

import pytest

from graphlane.client import deadlines as deadlines_mod
from graphlane.client.deadlines import Deadlines
from graphlane.protocol.errors import Timeout


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 30))  # a hang fails the test, not the suite


def test_a_call_fails_with_timeout_at_its_deadline_and_an_ended_one_does_not() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        d = Deadlines(loop, "worker 0")
        slow, answered = loop.create_future(), loop.create_future()
        assert d.add(slow, 0.05, "step") is None  # no loop timer of its own
        d.add(answered, 0.05, "step")
        answered.set_result("reply")
        with pytest.raises(Timeout, match=r"step to worker 0 got no reply within 0.05 s"):
            await slow
        assert answered.result() == "reply"
        assert not d._queues and d._timer is None  # nothing left, nothing armed

    _run(main())


def test_a_shorter_timeout_made_later_expires_first() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        d = Deadlines(loop, "w")
        long, short = loop.create_future(), loop.create_future()
        d.add(long, 60.0, "step")
        d.add(short, 0.02, "status")
        with pytest.raises(Timeout, match="status"):
            await short
        assert not long.done()
        assert d._timer_at == pytest.approx(loop.time() + 60.0, abs=1.0)  # re-armed for it
        d.close()
        assert d._timer is None and not d._queues

    _run(main())


def test_ended_calls_at_the_front_do_not_keep_the_timer_busy() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        d = Deadlines(loop, "w")
        done = [loop.create_future() for _ in range(100)]
        for fut in done:
            d.add(fut, 0.01, "step")
            fut.set_result(None)
        live = loop.create_future()
        d.add(live, 30.0, "step")
        marker = loop.create_future()  # expires last in the 0.01 s queue
        d.add(marker, 0.01, "step")
        with pytest.raises(Timeout):
            await marker  # the timer fired: it dropped the ended calls before the marker
        assert list(d._queues) == [30.0]
        assert d._timer_at > loop.time() + 20  # next wake-up: the live call's deadline
        assert not live.done()
        d.close()

    _run(main())


def test_queues_of_ended_calls_are_compacted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deadlines_mod, "_COMPACT_AT", 16)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        d = Deadlines(loop, "w")
        live = []
        for i in range(1000):
            fut = loop.create_future()
            d.add(fut, 60.0, "step")
            if i % 10:
                fut.set_result(None)
            else:
                live.append(fut)
        queue, limit = d._queues[60.0]
        assert len(queue) < 2 * len(live) + 16  # not every call made, only about the live
        assert all(not e[1].done() for e in list(queue)[: len(queue) // 2])
        assert limit >= 16
        d.close()

    _run(main())


def test_more_distinct_timeouts_than_queues_still_expire() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        d = Deadlines(loop, "w")
        futs = [loop.create_future() for _ in range(deadlines_mod._TIMEOUT_QUEUES + 4)]
        timers = [d.add(fut, 0.01 + i * 0.001, "step") for i, fut in enumerate(futs)]
        assert timers[0] is None and timers[-1] is not None  # the overflow: own loop timers
        for fut in futs:
            with pytest.raises(Timeout):
                await fut

    _run(main())
