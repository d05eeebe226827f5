"""Drives a step engine as the worker does, from the calling thread: ``reserve`` then
``issue``; ``on_done`` hands back each finished step (for engine and program tests;
serving is tested through real workers)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from daemons import wait_for

from graphlane.protocol import ops
from graphlane.workers.backends.base import DeviceBackend
from graphlane.workers.engine import StepEngine
from graphlane.workers.job import Job, JobKind
from graphlane.workers.programs import GraphProgram


class Issuer:
    """Issues steps from the calling thread, as the worker's socket thread does; keeps
    what ``on_done`` hands back (from this thread or the completion thread)."""

    def __init__(
        self, backend: DeviceBackend, programs: Sequence[GraphProgram], **options: Any
    ) -> None:
        self.finished: list[tuple[Job, str]] = []  # (step, the thread that answered it)
        self.backend = backend
        self.engine = StepEngine(backend, programs, on_done=self._on_done, **options)

    def _on_done(self, step: Job) -> None:
        self.finished.append((step, threading.current_thread().name))

    def __enter__(self) -> Issuer:
        self.engine.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.engine.close()
        # What a finished step's hook queued behind its done event (a decode's scatter of
        # its tokens into the persistent batch) may still run: the program's memory is
        # freed when this test lets it go, and a next engine in this process may take it
        # (a worker process exits instead). Not after a failure (a faulted engine's device
        # raises its fault again).
        if exc == (None, None, None) and self.engine.failure is None:
            self.backend.synchronize()

    def plan(
        self,
        batch: int,
        lengths: list[int],
        inputs: dict[str, torch.Tensor] | None = None,
        outputs: Sequence[str] = ("out",),
        program: str = "attention",
        params: dict[str, Any] | None = None,
    ) -> Job:
        """A step of ``program`` (its params default to the attention program's)."""
        body = ops.Step(
            program,
            0,
            {"actual_seq_lengths_kv": lengths} if params is None else params,
            inputs or {},
            list(outputs),
            batch,
        )
        return Job(JobKind.STEP, self.engine.plan(body, tuple(outputs)), tuple(outputs))

    def state(self, program: str, op: str, fields: dict[str, Any]) -> Job:
        """Issue an operation on ``program``'s device state (``kv_write``, ``kv_read``)."""
        return self.issue(Job(JobKind.STATE, self.engine.plan_state(program, op, fields)))

    def issue(self, step: Job, blocking: bool = True) -> Job:
        assert self.engine.reserve(blocking)
        self.engine.issue(step)
        return step

    def step(self, batch: int, lengths: list[int], **kw: Any) -> Job:
        return self.issue(self.plan(batch, lengths, **kw))

    def wait(self, steps: Sequence[Job], timeout: float = 30) -> list[Job]:
        """The steps once finished; the first one's error raised if any failed."""
        wait_for(lambda: self._all_done(steps), timeout, f"{len(steps)} steps to finish")
        for s in steps:
            if s.error is not None:
                raise s.error
        return list(steps)

    def _all_done(self, steps: Sequence[Job]) -> bool:
        done = {id(s) for s, _ in self.finished}
        return all(id(s) in done for s in steps)

    def run(self, batch: int, lengths: list[int], **kw: Any) -> Job:
        return self.wait([self.step(batch, lengths, **kw)])[0]
