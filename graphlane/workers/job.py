"""A job: one accepted device request (step, update, replay, kv op), from its decode to its reply.

The worker makes a :class:`Job` when it accepts a request (routing, request id,
deadline, the program's validated :class:`~graphlane.workers.programs.StepPlan`),
the engine fills in what the device did (graph instance, done event, outputs,
patched groups, times, or the error), and the worker answers from it. Nothing
else describes a step on its way through a worker.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from graphlane.workers.programs.base import CapturedGraph, StepPlan


class JobKind(enum.Enum):
    """What a device request does (its wire op of the same name)."""

    STEP = "step"  # patch, copy inputs, release, replay, answer outputs
    UPDATE = "update"  # patch the next replay of the bucket only (no release, no replay)
    REPLAY = "replay"  # release and replay as last patched
    STATE = "state"  # an operation on a program's device state (kv_write, kv_read)


@dataclass(eq=False, slots=True)
class Job:
    """An accepted device request and, once done, its result."""

    kind: JobKind
    plan: StepPlan
    outputs: tuple[str, ...] = ()  # names of the outputs asked for
    # routing (the worker's): who asked, and how to answer
    ident: Any = None  # the sender's routing id
    source: Any = None  # that routing id's Frame, when the worker watches connections
    # whose sequences it names: the sender's CURVE key, else its routing id (a program's
    # per-client state, see GraphProgram.feeds)
    owner: Any = None
    request_id: int = 0
    bundled: bool = False  # came in a bundle: its sender takes bundled replies
    received: float = 0.0  # perf_counter time the worker decoded it
    deadline: float | None = None  # perf_counter time after which it is not issued
    changes_state: bool = False  # a kv_write or step of a program with device state
    feeds: list[Any] | None = None  # its DeviceFeeds, resolved at issue (GraphProgram.feeds)
    inputs_on_u: bool = False  # its inputs go on U, behind an update's (a staged instance)
    parties: int = 0  # threads still issuing it, when its patches went first (engine._arrive)
    previous: Any = None  # then: the done event of its instance's previous replay
    # filled by the engine
    graph: CapturedGraph | None = None  # the graph instance it ran on
    done: Any = None  # the device event that ends its work
    results: dict[str, torch.Tensor] | None = None  # host copies of the outputs
    patched: int = 0  # task groups patched
    dispatch_s: float = 0.0  # host time copying inputs and dispatching patches
    replay_at: float = 0.0  # when its replay was issued (0: no replay)
    done_at: float = 0.0  # when the host saw the device finish it
    error: BaseException | None = None  # why it failed (then no results)


__all__ = ["Job", "JobKind"]
