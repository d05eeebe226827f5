"""How the load test treats a server that is not there (docs/loadtest.md): backoff per
device after an error (:class:`DeviceBackoff`); what makes it unavailable
(:data:`UNAVAILABLE`, judged per window by :meth:`.record.Recorder.unavailable_s`)."""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable

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
        self, rng: random.Random, first_s: float = BACKOFF_FIRST_S, cap_s: float = BACKOFF_CAP_S
    ) -> None:
        self.rng, self.first_s, self.cap_s = rng, first_s, cap_s
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
        b = self.backoffs.setdefault(device, Backoff(self.rng))
        self.until[device] = max(self.until.get(device, 0.0), now + b.next_delay())

    async def hold(self, device: int, pause: Callable[[float], Awaitable[None]]) -> None:
        """A failure on ``device``: ``pause`` until it is released."""
        now = time.monotonic()
        self.failure(device, now)
        await pause(self.until[device] - now)

    def held(self, device: int, now: float) -> bool:
        return self.until.get(device, 0.0) > now

    def all_held(self, devices: tuple[int, ...], now: float) -> float | None:
        """The first release when every device in ``devices`` is held, else None."""
        if len(self.until) < len(devices):
            return None
        untils = [self.until.get(d, 0.0) for d in devices]
        first = min(untils)
        return first if first > now else None
