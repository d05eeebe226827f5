"""The CPU cores a worker process runs on (``cpu_affinity`` in the daemon's config).

A worker on the ``sim`` or ``null`` backend is Python threads that take turns
on one interpreter lock: the socket thread, the engine's update and completion
threads and, on the sim, one thread per simulated stream. Left to the kernel on
a 2-core machine, those threads run on both cores and the lock passes between
cores on most hand-offs, each a cross-core wake-up: a 4-layer step at zero
modelled cost took 1,100-1,300 us of the worker's CPU through a daemon, and
520-630 us with the worker on one core (about 800 against 1,500-1,800 steps/s;
``benchmarks/pipeline.py`` has the figures with costs). So ``"auto"`` pins each
sim or null worker to one core, a different one per device (the daemon's pid
picks the first, so that daemons started side by side spread), and leaves
ZeroMQ's I/O threads, which run without the lock, on every core.

A pinned worker's threads also run under ``SCHED_BATCH`` (any user may choose
it): a thread woken on the same core then waits for the waker to block instead
of preempting it, which on one core would only switch to a thread that needs
the lock the waker holds, and back. In 5 alternating daemon runs of the step
above it gave 1,880-2,260 steps/s against 1,160-1,710 without (one run of the
five went the other way: the machine's own speed varies by a third from run to
run).

A ``sim`` worker in npusim's perf mode is not pinned by ``"auto"`` either: most of its
update and replay time is modelled as sleeps off the lock, and a sleeping
``SCHED_BATCH`` thread on a shared core wakes behind whatever runs there (a lone step
of the 20-layer field profile through a daemon, load average 3: 12.5 ms pinned against
7.5 ms not, in-process 6.0; docs/performance.md).

An ``npu`` worker is not pinned by ``"auto"``: there the patches' host work (the
tiling) runs in torch_npu's C++ with the lock released and wants cores of its
own; pin it with an explicit list (a list of cores per device, as torch_npu's
``CPU_AFFINITY_CONF`` binds the cores near each NPU).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

import zmq

#: Backends whose worker is Python under one lock: "auto" pins them.
PINNED_BY_AUTO = frozenset({"sim", "null"})


def available() -> tuple[int, ...]:
    """The cores this process may run on (empty where the OS cannot say)."""
    if not hasattr(os, "sched_getaffinity"):
        return ()
    return tuple(sorted(os.sched_getaffinity(0)))


def core_sets(
    setting: str | Sequence[Sequence[int]],
    backend: str,
    count: int,
    offset: int,
    sim_mode: str = "compute",
) -> list[tuple[int, ...] | None]:
    """The cores of each of ``count`` workers (None: not pinned). ``setting`` is
    ``"auto"``, ``"off"`` or one list of cores per worker; ``sim_mode`` the sim's mode
    (``[sim] mode``)."""
    if setting == "off":
        return [None] * count
    if setting == "auto":
        cores = available()
        # npusim's perf mode models the field's host work as an npu worker's: sleeps
        # off the lock, not Python (see the module doc).
        perf = backend == "sim" and sim_mode == "perf"
        if backend not in PINNED_BY_AUTO or perf or len(cores) < 2:
            return [None] * count
        return [(cores[(offset + i) % len(cores)],) for i in range(count)]
    if isinstance(setting, str) or len(setting) != count:
        raise ValueError(f"cpu_affinity: expected 'auto', 'off' or {count} lists of cores")
    return [tuple(c) for c in setting]


#: ``idle_spin_us = "auto"``'s poll, where the host has a core to spare for it: longer
#: than a client's turn-around between two steps (the reply in, the next request out:
#: 60-150 us on this project's machines), short against a scheduler's own work per step.
AUTO_IDLE_SPIN_US = 250.0


def idle_spin_us(setting: str | float, workers: int) -> float:
    """The microseconds an idle worker polls for its next request (``idle_spin_us``):
    ``"auto"`` is :data:`AUTO_IDLE_SPIN_US` when this host has more cores than the
    daemon's ``workers`` (each may then keep one busy while the clients run on the
    others), else 0: where workers share cores, a polling worker takes the core another
    worker or a client needs."""
    if setting != "auto":
        return float(setting)
    return AUTO_IDLE_SPIN_US if len(available()) > workers else 0.0


_unpinned: tuple[int, ...] = ()  # the cores this process had before pin()


def pin(cores: tuple[int, ...] | None) -> None:
    """Run the calling thread, and every thread it starts from now on, on ``cores``
    under ``SCHED_BATCH`` (where the OS has it)."""
    global _unpinned
    if cores and hasattr(os, "sched_setaffinity"):
        _unpinned = available()
        os.sched_setaffinity(0, cores)
        _policy(0, getattr(os, "SCHED_BATCH", None))


def free_io_threads(ctx: zmq.Context[Any]) -> None:
    """Have the I/O threads of ZeroMQ context ``ctx`` (they start with its first socket)
    run on the cores this process had before :func:`pin`, woken at once (SCHED_OTHER):
    they do the sockets' I/O without the interpreter lock."""
    if not _unpinned:
        return
    for core in _unpinned:
        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, core)
    if hasattr(os, "SCHED_OTHER"):
        ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_OTHER)


def place_as(pid: int, other: int) -> None:
    """Run process ``pid``'s main thread on the cores of process ``other``'s, under its
    scheduling policy (where the OS lets this process say so)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    with contextlib.suppress(OSError):
        os.sched_setaffinity(pid, os.sched_getaffinity(other))
    with contextlib.suppress(OSError):
        _policy(pid, os.sched_getscheduler(other))


def _policy(tid: int, policy: int | None) -> None:
    if policy is None or not hasattr(os, "sched_setscheduler"):
        return
    # A container that forbids it: the pinning alone still helps.
    with contextlib.suppress(OSError):
        os.sched_setscheduler(tid, policy, os.sched_param(0))


__all__ = ["PINNED_BY_AUTO", "available", "core_sets", "free_io_threads", "pin", "place_as"]
