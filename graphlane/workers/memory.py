"""How a worker process asks glibc's malloc to keep large freed buffers, and to give back
what a peer made it hold.

A worker receives each large input as zmq frames that zmq's I/O thread
allocates and the worker frees once the step is answered. With glibc's default,
dynamic thresholds, a buffer of a few MiB freed at the top of a heap is given
back to the kernel, and the next request's buffer is mapped afresh: page faults
over its whole size (about 4 000 for two 8 MiB frames, several milliseconds) on
every other step, measured. Fixing the thresholds keeps buffers up to
``MMAP_THRESHOLD`` inside the heaps and up to ``TRIM_THRESHOLD`` of freed memory
at a heap's top, so the next request reuses pages already mapped.

Only the worker, graphlane's own process, is tuned (the client library runs
inside its user's process and leaves malloc alone). Users who set glibc's own
``MALLOC_*_`` variables or malloc tunables keep their settings.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time

log = logging.getLogger("graphlane.worker")

MMAP_THRESHOLD = 32 * 2**20  # the largest value glibc accepts on 64-bit
TRIM_THRESHOLD = 64 * 2**20
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters
_M_MMAP_THRESHOLD = -3
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_buffers() -> bool:
    """Set the thresholds above in this process; False (and nothing changed) when
    malloc is not glibc's or the user configured it."""
    if any(name in os.environ for name in _USER_SETTINGS):
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without it)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # The mmap threshold first: setting either turns glibc's dynamic adjustment off.
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not ok:
        log.debug("mallopt refused the thresholds; malloc keeps its defaults")
    return ok


class FreedMemory:
    """Gives freed memory back to the kernel after a peer's large buffers went (a
    refused message, the replies of a connection that closed): the thresholds above,
    or glibc's dynamic ones, keep such buffers inside the heaps, where they would count
    against the process for as long as it lives. ``malloc_trim(0)`` releases every
    free page of every heap; it costs time in proportion to the heaps, so it runs at
    most once per ``interval_s``: a request between two runs is kept, and done by the
    next :meth:`poll` once the interval has passed."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self.interval_s = interval_s
        self.pending = False
        self.trims = 0  # how many times memory was given back (tests read it)
        self._last = -interval_s
        try:
            trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):  # not glibc: its malloc returns memory itself
            self._trim = None
        else:
            trim.argtypes = [ctypes.c_size_t]
            trim.restype = ctypes.c_int
            self._trim = trim

    def release(self) -> None:
        """Give freed memory back now, or as soon as the interval allows."""
        self.pending = True
        self.poll()

    def poll(self) -> None:
        """Run a pending release if the interval has passed (call it now and then)."""
        if not self.pending:
            return
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self.pending = False
        self._last = now
        if self._trim is not None:
            self._trim(0)
            self.trims += 1
