"""Errors of the simulated NPU.

``SimError`` is the root. Misuse of the graph API (a rule broken at the call)
raises ``SimUsageError`` at once. What real hardware would silently get wrong
is found by happens-before tracking and reported as ``HazardError`` (a race on
a task group, a lost ExternalEvent release) or ``DeadlockError`` (a wait that
nothing will satisfy). Those two are asynchronous, like a device fault: they
make the device faulted, and every later synchronize, query or launch on it
raises the same error until :func:`graphlane.workers.sim.reset_device`.
"""

from __future__ import annotations


class SimError(RuntimeError):
    """Any error reported by the simulated NPU."""


class SimUsageError(SimError):
    """An API call that breaks a documented rule; raised at the call."""


class HazardError(SimError):
    """Operations that real hardware would run in an unsafe order."""


class DeadlockError(SimError):
    """A device wait that nothing will ever satisfy."""


class DeviceFaultError(SimError):
    """A device operation failed while a stream executed it."""
