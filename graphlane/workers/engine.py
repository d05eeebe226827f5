"""The step engine: slot ring, update/replay fencing, completion.

One engine owns one device: a capture stream S (replays), an update stream U
(patches and input copies), the captured graph instances, an *issue thread*
that is the only thread issuing device work after capture, and a *completion
thread* that waits for finished steps and resolves their futures.

A pipelined step on graph instance g (``depth`` instances per bucket, used in
turn) is issued as:

    U: wait done[g]                  the previous replay of g is finished with it
    S: replay g                      layer l waits ev[l] before its task group
    S: copy the outputs to the host, record done[g]
    U: for each group l: copy l's inputs, patch l if its parameters changed,
       record ev[l]                  exactly one record per captured wait

The replay is launched first, so the replay of layer k overlaps the host's
dispatch of the patch of layer k+1, and the next step's dispatch overlaps this
step's replay. U never waits on S for a replay issued after its own records
(that would deadlock); inputs of step N+1 are copied on U after done[g] of
step N, so they never overwrite buffers that replay N still reads.

``pipeline=False`` keeps a serial mode for comparison: patches, then replay,
then the host waits for the result before it issues the next step.

Schedulers that drive the two halves themselves use ``submit_update`` (patch an
instance of the bucket and keep it *staged*, no release) and ``submit_replay``
(release every group of the staged instance, or of the next one in the ring,
and replay it). A step on a bucket with a staged instance uses that instance.

Two ways to drive it. ``submit*`` (futures, thread-safe) queue requests for the
engine's own issue thread. A server that already has a thread of its own (the
worker's socket thread) calls :meth:`StepEngine.issue` from that thread
instead (``start(issue_thread=False)``): no hand-off between receiving a
request and issuing it, and a step whose done event is already complete when
its issue returns is completed on the spot, without waking the completion
thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from graphlane.workers.backends.base import DeviceBackend
from graphlane.workers.input_check import check_inputs
from graphlane.workers.programs.base import (
    CapturedGraph,
    GraphKey,
    GraphProgram,
    StepError,
    StepPlan,
)

log = logging.getLogger("graphlane.pipeline")


class EngineError(RuntimeError):
    """The engine cannot serve (closed, or failed after a device fault)."""


class EngineBusy(RuntimeError):
    """The engine's queue is full; the request may be retried."""


@dataclass(frozen=True)
class StepRequest:
    program: str
    batch: int
    params: Mapping[str, Any]
    inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)
    outputs: tuple[str, ...] = ("out",)


class StepFields(Protocol):
    """What :meth:`StepEngine.plan` reads: a :class:`StepRequest`'s fields (and its
    ``outputs``, if it has them and none are given)."""

    @property
    def program(self) -> str: ...
    @property
    def batch(self) -> int | None: ...
    @property
    def params(self) -> Mapping[str, Any]: ...
    @property
    def inputs(self) -> Mapping[str, torch.Tensor]: ...


@dataclass(slots=True)
class StepResult:
    outputs: dict[str, torch.Tensor]
    key: GraphKey
    patched_groups: int
    issued_at: float  # when it was submitted
    done_at: float = 0.0  # when the device finished it
    dispatch_s: float = 0.0  # host time spent copying inputs and dispatching patches
    replay_at: float = 0.0  # when its replay was issued (0: no replay)


OnDone = Callable[[StepResult | None, BaseException | None], None]
"""Called once per issued request: (result, None) or (None, error)."""


@dataclass(eq=False)
class _Pending:
    kind: str  # "step" | "update" | "replay"
    plan: StepPlan
    outputs: tuple[str, ...]
    future: Future[StepResult]
    submitted: float


@dataclass(eq=False, slots=True)
class _InFlight:
    done: Any
    on_done: OnDone
    result: StepResult


def _resolver(fut: Future[StepResult]) -> OnDone:
    def on_done(result: StepResult | None, exc: BaseException | None) -> None:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    return on_done


_STOP = object()


class _Slots:
    """A counting semaphore for the in-flight bound, cheap when nobody waits (the
    issuer takes a slot per step; completions give it back from either thread)."""

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

    def release(self) -> None:
        with self._lock:
            if self._free >= self._max:
                raise ValueError("slot released more often than taken")
            self._free += 1
            if self._waiting:
                self._freed.notify()


class StepEngine:
    """Runs steps of graph programs on one device. Thread-safe ``submit``."""

    def __init__(
        self,
        backend: DeviceBackend,
        programs: Sequence[GraphProgram],
        *,
        depth: int = 1,
        pipeline: bool = True,
        max_queued: int = 256,
        max_inflight: int = 8,
    ) -> None:
        if depth < 1:
            raise ValueError("depth must be >= 1")
        if max_queued < 1:
            raise ValueError("max_queued must be >= 1")
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        names = [p.name for p in programs]
        if len(set(names)) != len(names):
            raise ValueError(f"program names must be distinct: {names}")
        self.backend = backend
        self.programs = {p.name: p for p in programs}
        self.depth = depth
        self.pipeline = pipeline
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queued)
        self._completions: queue.Queue[Any] = queue.Queue()
        # Steps issued to the device and not yet complete: the issuer may run ahead
        # of the device by this much, no more (bounded memory, bounded latency).
        self._slots = _Slots(max_inflight)
        self._ring: dict[tuple[str, int], int] = {}  # (program, bucket) -> next slot
        self._rings: dict[tuple[str, int], list[CapturedGraph]] = {}  # instances by slot
        self._staged: dict[tuple[str, int], CapturedGraph] = {}
        self._failure: BaseException | None = None
        self._closed = False
        self._started = False
        self._threads: list[threading.Thread] = []
        self.steps_done = 0
        self._count_lock = threading.Lock()
        # Fault injection for tests: after this many releases, stop releasing the
        # graph's events, so replays wait on the device forever (a hung device).
        self.fault_hang_after: int | None = None
        self.fault_device_after: int | None = None  # then a device fault fails the next step
        self._releases = 0
        self._issued = 0

    # ------------------------------------------------------------ lifecycle
    def start(self, issue_thread: bool = True) -> None:
        """Capture every program (largest bucket first), then start the threads.

        ``issue_thread=False``: no issue thread; the caller's thread issues with
        :meth:`reserve` and :meth:`issue` (``submit*`` are then unavailable)."""
        if self._started:
            return
        b = self.backend
        self.capture_stream = b.new_stream()
        self.update_stream = b.new_stream()
        for program in self.programs.values():
            for bucket in sorted(program.buckets, reverse=True):
                for slot in range(self.depth):
                    self._capture(program, bucket, slot)
        b.synchronize()
        self._started = True
        self._own_issuer = issue_thread
        self._threads = [
            threading.Thread(target=self._completion_loop, name="graphlane-completion", daemon=True)
        ]
        if issue_thread:
            self._threads.append(
                threading.Thread(target=self._issue_loop, name="graphlane-issue", daemon=True)
            )
        for t in self._threads:
            t.start()

    def _capture(self, program: GraphProgram, bucket: int, slot: int) -> None:
        b = self.backend
        key = GraphKey(program.name, bucket, slot)
        buffers = program.allocate(b, bucket)
        events = [b.new_external_event() for _ in range(program.num_groups)]
        for i, ev in enumerate(events):
            if hasattr(ev, "label"):
                ev.label = f"group {i} of {program.name} bucket {bucket} slot {slot}"
        graph = b.new_graph()
        b.synchronize()  # buffers are initialised before capture starts
        with b.capture(graph, self.capture_stream):
            handles, signatures = program.capture(b, self.capture_stream, bucket, buffers, events)
        captured = CapturedGraph(key, graph, handles, events, buffers, list(signatures))
        self._rings.setdefault((program.name, bucket), []).append(captured)  # slot order
        log.debug("captured %s", key)

    def close(self) -> None:
        """Finish queued steps, stop the threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._started:
            (self._queue if self._own_issuer else self._completions).put(_STOP)
            for t in self._threads:
                t.join()

    def __enter__(self) -> StepEngine:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def graphs(self) -> dict[GraphKey, CapturedGraph]:
        """Every captured instance by its key."""
        return {g.key: g for ring in self._rings.values() for g in ring}

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    # ------------------------------------------------------------ submit
    def _program(self, name: str) -> GraphProgram:
        program = self.programs.get(name)
        if program is None:
            raise StepError(
                "program", f"unknown program {name!r} (serving {sorted(self.programs)})"
            )
        return program

    @staticmethod
    def _check_outputs(program: GraphProgram, names: Sequence[str]) -> None:
        if len(set(names)) != len(names):
            raise StepError("outputs", f"names must be unique, got {list(names)}")
        for name in names:
            if name not in program.outputs:
                raise StepError(
                    "outputs", f"unknown output {name!r} (known: {list(program.outputs)})"
                )

    def plan(self, request: StepFields, outputs: Sequence[str] | None = None) -> StepPlan:
        """Validate a step or update (a StepRequest or a wire message with its fields;
        ``outputs``: these instead of the request's)."""
        program = self._program(request.program)
        batch = request.batch if request.batch is not None else program.infer_batch(request.params)
        plan = program.plan(batch, request.params, request.inputs)
        if plan.inputs and not program.checks_inputs:
            ring = self._rings.get((program.name, plan.bucket))
            if ring is None:
                raise StepError("batch", f"bucket {plan.bucket} was not captured")
            check_inputs(program, ring[0].buffers, plan)
        if outputs is None:
            outputs = getattr(request, "outputs", ())
        self._check_outputs(program, outputs)
        return plan

    def plan_replay(self, program: str, batch: int, outputs: Sequence[str] = ()) -> StepPlan:
        """Validate a replay of the bucket that serves ``batch``."""
        prog = self._program(program)
        bucket = prog.bucket_for(batch)
        self._check_outputs(prog, outputs)
        return StepPlan(program, batch, bucket)

    def plan_state(self, program: str, op: str, fields: Mapping[str, Any]) -> StepPlan:
        """Validate an operation on a program's device state (``kv_write``, ``kv_read``)."""
        prog = self._program(program)
        if op not in prog.state_ops:
            raise StepError("op", f"program {program!r} has no operation {op!r}")
        return prog.plan_state(op, fields)

    def submit_state(self, program: str, op: str, fields: Mapping[str, Any]) -> Future[StepResult]:
        """Queue an operation on a program's device state (see :meth:`plan_state`)."""
        return self._enqueue("state", self.plan_state(program, op, fields), ())

    def submit(self, request: StepRequest) -> Future[StepResult]:
        """Validate and queue a step. Raises StepError, EngineBusy or EngineError at once."""
        return self._enqueue("step", self.plan(request), tuple(request.outputs))

    def submit_update(self, request: StepRequest) -> Future[StepResult]:
        """Patch the bucket's staged (or next) instance for the next replay; no release."""
        return self._enqueue("update", self.plan(request, ()), ())

    def submit_replay(
        self, program: str, batch: int, outputs: tuple[str, ...]
    ) -> Future[StepResult]:
        """Release and replay the bucket's staged instance (or the next one in the ring)."""
        return self._enqueue("replay", self.plan_replay(program, batch, outputs), tuple(outputs))

    def _enqueue(self, kind: str, plan: StepPlan, outputs: tuple[str, ...]) -> Future[StepResult]:
        if self._failure is not None:
            raise EngineError(f"engine failed: {self._failure}") from self._failure
        if self._closed or not self._started or not self._own_issuer:
            raise EngineError("engine is not running (or has no issue thread)")
        fut: Future[StepResult] = Future()
        try:
            self._queue.put_nowait(_Pending(kind, plan, outputs, fut, time.perf_counter()))
        except queue.Full:
            raise EngineBusy(f"{self._queue.maxsize} requests are queued already") from None
        return fut

    def run(self, request: StepRequest, timeout: float | None = None) -> StepResult:
        return self.submit(request).result(timeout)

    # ------------------------------------------------------------ issue thread
    def _next_graph(self, plan: StepPlan) -> CapturedGraph:
        ring_key = (plan.program, plan.bucket)
        slot = self._ring.get(ring_key, 0)
        self._ring[ring_key] = (slot + 1) % self.depth
        return self._rings[ring_key][slot]

    def _issue_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._completions.put(_STOP)
                return
            pending: _Pending = item
            # Checked before taking a slot too: slots held by a hung device never return.
            if self._failure is not None:
                pending.future.set_exception(EngineError(f"engine failed: {self._failure}"))
                continue
            if not pending.future.set_running_or_notify_cancel():
                continue
            self._slots.acquire()
            # Serial mode waits for each step here, before taking the next.
            self.issue(
                pending.kind,
                pending.plan,
                pending.outputs,
                _resolver(pending.future),
                pending.submitted,
                wait=not self.pipeline,
            )

    # ------------------------------------------------------------ issuing
    def reserve(self, blocking: bool = True) -> bool:
        """Take one in-flight slot (``max_inflight`` in all); the step's completion
        gives it back. Without a slot, :meth:`issue` must not be called."""
        return self._slots.acquire(blocking)

    def issue(
        self,
        kind: str,
        plan: StepPlan,
        outputs: tuple[str, ...],
        on_done: OnDone,
        submitted: float = 0.0,
        *,
        wait: bool = False,
    ) -> None:
        """Issue one request's device work ("step", "update" or "replay") on a slot the
        caller holds. Only one thread issues. ``on_done`` runs once: here if the work
        failed to issue, is already complete, or ``wait``; else in the completion
        thread."""
        if self._failure is not None:
            self._slots.release()
            on_done(None, EngineError(f"engine failed: {self._failure}"))
            return
        try:
            inflight = self._issue(kind, plan, outputs, on_done, submitted or time.perf_counter())
        except BaseException as exc:  # a device fault or a misuse: fail loudly
            self._slots.release()
            self._fail(exc)
            on_done(None, exc)
            return
        if wait:
            self._complete(inflight)
            return
        try:
            finished = inflight.done.query()
        except BaseException:  # a fault: synchronize() in _complete reports it
            finished = True
        if finished:
            self._complete(inflight)
        else:
            self._completions.put(inflight)

    def _issue(
        self, kind: str, plan: StepPlan, outputs: tuple[str, ...], on_done: OnDone, submitted: float
    ) -> _InFlight:
        self._issued += 1
        if self.fault_device_after is not None and self._issued > self.fault_device_after:
            from graphlane.sim import DeviceFaultError

            raise DeviceFaultError("fault injection: the device failed (device_fault_after)")
        b = self.backend
        program = self.programs[plan.program]
        if kind == "state":
            return self._issue_state(program, plan, on_done, submitted)
        ring_key = (plan.program, plan.bucket)
        if kind == "update":
            g = self._staged.get(ring_key) or self._next_graph(plan)
            self._staged[ring_key] = g
            if g.last_done is not None:
                b.wait(self.update_stream, g.last_done)
            t0 = time.perf_counter()
            patched = self._patch_groups(program, g, plan)
            result = StepResult({}, g.key, patched, submitted)
            result.dispatch_s = time.perf_counter() - t0
            done = b.new_event()
            b.record(done, self.update_stream)
            return _InFlight(done, on_done, result)
        staged = self._staged.pop(ring_key, None) if self._staged else None
        g = staged if staged is not None else self._next_graph(plan)
        patched = 0
        dispatch = 0.0
        if kind == "replay":
            if g.last_done is not None:
                b.wait(self.update_stream, g.last_done)
            replay_at = time.perf_counter()
            b.replay(g.graph, self.capture_stream)
            with b.use_stream(self.update_stream):
                for event in g.events:
                    b.record(event, self.update_stream)
        elif not self.pipeline:
            t0 = time.perf_counter()
            patched = self._release_groups(program, g, plan)
            replay_at = time.perf_counter()
            dispatch = replay_at - t0
            b.replay(g.graph, self.capture_stream)
        else:
            if g.last_done is not None:
                b.wait(self.update_stream, g.last_done)  # previous replay of g is done with it
            replay_at = time.perf_counter()
            b.replay(g.graph, self.capture_stream)
            # The patches go first: the replay waits for layer 0's release. The
            # output copy is queued behind the replay on S, so issuing it after
            # the patches costs the device nothing.
            t0 = time.perf_counter()
            patched = self._release_groups(program, g, plan)
            dispatch = time.perf_counter() - t0
        outs, done = self._collect(program, g, plan, outputs)
        result = StepResult(outs, g.key, patched, submitted, 0.0, dispatch, replay_at)
        return _InFlight(done, on_done, result)

    def _issue_state(
        self, program: GraphProgram, plan: StepPlan, on_done: OnDone, submitted: float
    ) -> _InFlight:
        """A device-state operation, on the capture stream S: every replay reads and
        writes the state on S, so stream order fences it against replays issued before
        and after it (no graph instance or update-stream fence is involved)."""
        b = self.backend
        with b.use_stream(self.capture_stream):
            views = program.run_state(b, plan)
            outs = {n: v if v.is_cpu else v.to("cpu", non_blocking=True) for n, v in views.items()}
        done = b.new_event()
        b.record(done, self.capture_stream)
        result = StepResult(outs, GraphKey(plan.program, 0, 0), 0, submitted)
        return _InFlight(done, on_done, result)

    def _collect(
        self, program: GraphProgram, g: CapturedGraph, plan: StepPlan, names: tuple[str, ...]
    ) -> tuple[dict[str, torch.Tensor], Any]:
        """Queue the outputs' copy to the host behind the replay, and the step's done event."""
        b = self.backend
        S = self.capture_stream
        with b.use_stream(S):
            views = program.output_views(g.buffers, plan, list(names))
            # A view on the host already (the null device) is its own copy, as .to() says.
            outs = {n: v if v.is_cpu else v.to("cpu", non_blocking=True) for n, v in views.items()}
        done = b.new_event()
        b.record(done, S)
        g.last_done = done
        return outs, done

    def _release_groups(self, program: GraphProgram, g: CapturedGraph, plan: StepPlan) -> int:
        """Copy inputs, patch changed groups and record every group's event once, on U."""
        self._releases += 1
        if self.fault_hang_after is not None and self._releases > self.fault_hang_after:
            log.error("fault injection: not releasing %s (the device will hang)", g.key)
            return 0
        return self._patch_groups(program, g, plan, release=True)

    def _patch_groups(
        self, program: GraphProgram, g: CapturedGraph, plan: StepPlan, release: bool = False
    ) -> int:
        b = self.backend
        U = self.update_stream
        patched = 0
        with b.use_stream(U):
            for group in range(program.num_groups):
                for dst, src in program.input_writes(g.buffers, plan, group):
                    b.copy_in(dst, src)
                sig = program.group_signature(plan, group)
                changed = sig != g.signatures[group]
                if changed:
                    args = program.group_arguments(g.buffers, plan, group)
                    if release:
                        b.update_attention(U, g.handles[group], g.events[group], args)
                    else:
                        b.patch_attention(U, g.handles[group], args)
                    g.signatures[group] = sig
                    patched += 1
                if release and not changed:
                    b.record(g.events[group], U)
        return patched

    # ------------------------------------------------------------ completion
    def _completion_loop(self) -> None:
        while True:
            item = self._completions.get()
            if item is _STOP:
                return
            self._complete(item)

    def _complete(self, inflight: _InFlight) -> None:
        try:
            inflight.done.synchronize()
        except BaseException as exc:
            self._fail(exc)
            self._slots.release()
            inflight.on_done(None, exc)
            return
        self._slots.release()
        inflight.result.done_at = time.perf_counter()
        with self._count_lock:  # completions run in the issuer and the completion thread
            self.steps_done += 1
        inflight.on_done(inflight.result, None)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
            log.error("step engine failed: %s", exc)
