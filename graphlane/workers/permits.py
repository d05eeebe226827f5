"""The engine's in-flight bound: a counting semaphore of step permits."""

from __future__ import annotations

import threading


class Permits:
    """A counting semaphore for the in-flight bound, cheap when nobody waits (the
    issuer takes a permit per step; completions give it back from either thread)."""

    def __init__(self, n: int) -> None:
        self._free = n
        self._max = n
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._waiting = 0

    def acquire(self, blocking: bool = True) -> bool:
        with self._lock:
            while not self._free:
                if not blocking:
                    return False
                self._waiting += 1
                self._freed.wait()
                self._waiting -= 1
            self._free -= 1
            return True

    def alone(self) -> bool:
        """Whether the caller's permit is the only one taken. (Permits come back only
        after a step's dispatch on U is over, so then nothing else is on U.)"""
        return self._free == self._max - 1

    def release(self) -> None:
        with self._lock:
            if self._free >= self._max:
                raise ValueError("permit released more often than taken")
            self._free += 1
            if self._waiting:
                self._freed.notify()


__all__ = ["Permits"]
