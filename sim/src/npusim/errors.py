"""Errors of the simulated NPU.

``SimError`` is the root. Misuse of the graph API (a rule broken at the call)
raises ``SimUsageError`` at once. What real hardware would silently get wrong
is found by happens-before tracking and reported as ``HazardError`` (a race on
a task group, a lost ExternalEvent release) or ``DeadlockError`` (a wait that
nothing will satisfy). Those two are asynchronous, like a device fault: they
make the device faulted: work issued after that is dropped, and every later
synchronize or query (stream, event or device; host reads synchronize) raises
the same error until :func:`npusim.reset_device`.
"""

from __future__ import annotations

from typing import Any, ClassVar


class SimError(RuntimeError):
    """Any error reported by the simulated NPU."""


class SimUsageError(SimError):
    """An API call that breaks a documented rule; raised at the call."""


class _KindedError(SimError):
    """A SimError with a ``kind`` (``default_kind`` when not given) that copies and
    pickles keep: a fault is raised again as a copy."""

    default_kind: ClassVar[str]

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = self.default_kind if kind is None else kind

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.kind))


class HazardError(_KindedError):
    """Operations that real hardware would run in an unsafe order.

    ``kind`` is "race" (the default: a task-group patch not ordered with a
    replay that reads the group), "lost-release" (an ExternalEvent record
    that can merge with an unconsumed one) or "use-after-free" (memory freed
    while work of another stream used it, reused unordered with that work; a
    replay using a freed tensor whose memory another tensor holds).
    """

    default_kind = "race"


class DeadlockError(_KindedError):
    """A device wait that nothing will ever satisfy.

    ``kind`` is "cycle" (the default: streams wait on each other; reported at
    once) or "watchdog" (nothing queued can release the wait; reported after
    NPUSIM_WATCHDOG_S).
    """

    default_kind = "cycle"


class DeviceFaultError(SimError):
    """A device operation failed while a stream executed it."""


class UpdateKeyIgnoredWarning(UserWarning):
    """A sim-only diagnostic: an ``NPUGraph.update`` key that patches nothing.

    torch_npu drops such a key silently (the captured call did not pass it), so the
    replay keeps the captured value; the sim applies the same rule and warns.
    """
