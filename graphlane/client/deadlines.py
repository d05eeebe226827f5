"""The deadlines of the calls on one client channel (:class:`~.transport.Channel`).

Every call has one: a call with no reply by then fails with TIMEOUT (the channel
then forgets its id, and a late reply is dropped). One loop timer per channel,
armed for the earliest deadline, serves all of them.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any

from graphlane.protocol.errors import Timeout


def _expire(fut: asyncio.Future[Any], what: str, timeout: float) -> None:
    if not fut.done():
        fut.set_exception(Timeout(f"{what} got no reply within {timeout:g} s"))


class Deadlines:
    """The deadlines of one channel's calls, with one loop timer, armed for the earliest.

    A loop timer per call costs a handle, a heap push and the pop of the cancelled
    handle, several microseconds a call. Calls with the same timeout expire in the
    order they were made, so a queue per timeout value stays sorted for the cost of
    an append. An entry whose call ended stays in its queue until the timer passes
    it or ended entries crowd the queue (then it is compacted: bounded memory). A
    call with an unusual timeout (more than ``_TIMEOUT_QUEUES`` distinct values in
    use) gets a loop timer of its own, as before.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        self._loop = loop
        self._name = name
        # timeout -> [queue of (deadline, future, op), length that triggers compaction]
        self._queues: dict[float, list[Any]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        # The loop's clock: asyncio's is time.monotonic, read here without its method.
        base = getattr(type(loop), "time", None) is asyncio.BaseEventLoop.time
        self._time = time.monotonic if base else loop.time

    def add(self, fut: asyncio.Future[Any], timeout: float, op: str) -> asyncio.TimerHandle | None:
        """Fail ``fut`` with TIMEOUT after ``timeout`` s unless it is done by then; a
        loop timer to cancel when the call ends, or None when nothing needs doing."""
        entry = self._queues.get(timeout)
        if entry is None:
            if len(self._queues) >= _TIMEOUT_QUEUES:
                what = f"{op} to {self._name}"
                return self._loop.call_later(timeout, _expire, fut, what, timeout)
            entry = self._queues[timeout] = [collections.deque(), _COMPACT_AT]
        when = self._time() + timeout
        queue: collections.deque[tuple[float, asyncio.Future[Any], str]] = entry[0]
        queue.append((when, fut, op))
        if len(queue) >= entry[1]:  # mostly ended calls: keep the live ones
            entry[0] = queue = collections.deque(e for e in queue if not e[1].done())
            entry[1] = max(_COMPACT_AT, 2 * len(queue))
        if when < self._timer_at:
            self._arm(when)
        return None

    def close(self) -> None:
        """Forget every deadline (the channel failed its calls already)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, float("inf")
        self._queues.clear()

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._expire)
        self._timer_at = when

    def _expire(self) -> None:
        """Fail the calls whose deadline passed; drop ended calls from the queues'
        fronts (so that the next wake-up is for a live call); re-arm."""
        self._timer, self._timer_at = None, float("inf")
        now = self._loop.time() + _CLOCK_RESOLUTION  # the loop runs a timer that early
        earliest = float("inf")
        for timeout, entry in list(self._queues.items()):
            queue = entry[0]
            while queue:
                when, fut, op = queue[0]
                if not fut.done():
                    if when > now:
                        earliest = min(earliest, when)
                        break
                    _expire(fut, f"{op} to {self._name}", timeout)
                queue.popleft()
            if not queue:
                del self._queues[timeout]
        if earliest < float("inf"):
            self._arm(earliest)


_TIMEOUT_QUEUES = 8  # distinct timeout values with a queue of their own, per channel
_COMPACT_AT = 1024  # the least queue length at which ended calls are dropped
_CLOCK_RESOLUTION = time.get_clock_info("monotonic").resolution
