"""How ``graphlane loadtest`` treats a server that is not there: backoff after
retryable errors, and the share of the run during which the server was unavailable.

Backoff (closed loop), per device and shared by the callers: after an error on a
device, the device is held for a random time in [d/2, d], where d doubles with
each consecutive error on it, from :data:`BACKOFF_FIRST_S` up to
:data:`BACKOFF_CAP_S`; a success resets it. A caller whose draw falls on a held
device draws again (as a scheduler routes around a device that is down), and
waits for the first release only when every device is held. So a dead server
costs at most about ``concurrency / (BACKOFF_CAP_S / 2)`` calls per second once
backed off, instead of a busy loop, while devices that serve stay loaded. The
open loop does not back off: its arrivals are the offered load, and its error
rate is bounded by ``--rate`` already.

Unavailability is judged per window of the report's time series (about 1/120 of
the duration, at least 0.25 s): a window is *unavailable* when calls ended in it
and none succeeded while at least one got an :data:`UNAVAILABLE` code, or when no
call ended in it and the window before was unavailable (callers backing off
through an outage). A run in which the server was unavailable for more than
``--max-unavailable`` of the sending time (default :data:`MAX_UNAVAILABLE`)
fails, with a verdict that says how long. One device lost among several that
serve is not an unavailable server: the others' successes keep its windows
available.
"""

from __future__ import annotations

import random

#: First backoff after a retryable error, seconds.
BACKOFF_FIRST_S = 0.01
#: Longest backoff, seconds.
BACKOFF_CAP_S = 1.0
#: Default largest share of the sending time the server may be unavailable.
MAX_UNAVAILABLE = 0.1
#: Codes that say the server (or the worker of a device) did not serve at all.
#: BUSY is not one of them: a busy server is there, and tells the client to slow down.
UNAVAILABLE = frozenset({"WORKER_LOST", "SHUTTING_DOWN", "TIMEOUT", "CLIENT_DEADLINE"})


class Backoff:
    """Exponential backoff with jitter for one caller."""

    def __init__(
        self,
        rng: random.Random,
        first_s: float = BACKOFF_FIRST_S,
        cap_s: float = BACKOFF_CAP_S,
    ) -> None:
        self.rng = rng
        self.first_s = first_s
        self.cap_s = cap_s
        self.failures = 0

    def success(self) -> None:
        self.failures = 0

    def next_delay(self) -> float:
        """The pause after one more consecutive failure."""
        d = min(self.cap_s, self.first_s * 2.0 ** min(self.failures, 32))
        self.failures += 1
        return self.rng.uniform(d / 2, d)


class DeviceBackoff:
    """:class:`Backoff` per device, with the time until which each device is held."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.backoffs: dict[int, Backoff] = {}
        self.until: dict[int, float] = {}

    def success(self, device: int) -> None:
        b = self.backoffs.get(device)
        if b is not None:
            b.success()
            self.until.pop(device, None)

    def failure(self, device: int, now: float) -> None:
        b = self.backoffs.get(device)
        if b is None:
            b = self.backoffs[device] = Backoff(self.rng)
        self.until[device] = max(self.until.get(device, 0.0), now + b.next_delay())

    def held(self, device: int, now: float) -> bool:
        return self.until.get(device, 0.0) > now

    def all_held(self, devices: tuple[int, ...], now: float) -> float | None:
        """The first release when every device in ``devices`` is held, else None."""
        if len(self.until) < len(devices):
            return None
        untils = [self.until.get(d, 0.0) for d in devices]
        first = min(untils)
        return first if first > now else None


class Availability:
    """Successes and unavailability errors per window, from ``start`` (monotonic s)."""

    def __init__(self, start: float, window_s: float) -> None:
        self.start = start
        self.window_s = window_s
        self.ok_in: dict[int, int] = {}
        self.down_in: dict[int, int] = {}

    def _index(self, t: float) -> int:
        return max(0, int((t - self.start) / self.window_s))

    def ok(self, t: float) -> None:
        i = self._index(t)
        self.ok_in[i] = self.ok_in.get(i, 0) + 1

    def error(self, code: str, t: float) -> None:
        if code in UNAVAILABLE:
            i = self._index(t)
            self.down_in[i] = self.down_in.get(i, 0) + 1

    def total(self, until: float) -> float:
        """Unavailable seconds from the start up to ``until`` (the end of sending)."""
        span = max(0.0, until - self.start)
        down = False
        seconds = 0.0
        for i in range(int(span / self.window_s) + 1):
            if self.ok_in.get(i):
                down = False
            elif self.down_in.get(i):
                down = True
            if down:
                seconds += max(0.0, min(self.window_s, span - i * self.window_s))
        return seconds
