"""The step engine: the instance ring, update/replay fencing, completion.

One engine owns one device: a capture stream S (replays), an update stream U
(patches), a copy stream C (a pipelined step's inputs), the captured graph
instances, an *update thread*
and a *completion thread*. The worker's socket thread is its only issuer: it
takes an in-flight permit (:meth:`StepEngine.reserve`, ``max_inflight`` in all)
and issues a :class:`~graphlane.workers.job.Job` (:meth:`StepEngine.issue`).
A step's work on U (its patches) needs nothing of its work on S (the inputs'
copies, the replay, the program's hook), so the issuer hands it to the update
thread first and launches the rest meanwhile: the patches, the host-bound part
of a step, start a launch earlier, and a lone step's launch overlaps them instead
of going before them on one thread (a 20-layer decode on npusim's perf mode at
the field's costs: 6.1 ms through a daemon with the issuer patching it alone,
5.5 ms so, 4.4 ms in one process). A lone step whose patches have been cheaper
than a hand-off (the ``null`` device's) is patched by its issuer after its launch
instead (:meth:`StepEngine._patches_first`). An update or a replay (``update``/``replay``
requests) alone in the engine is dispatched by the issuer itself (the update
thread is idle then), else handed over after its work on S. When the
step's device work is over, the engine calls ``on_done(step)``: in the last of
the threads that issued it if the work was complete by then (no further
hand-off), else in the completion thread, which waits for it.

A pipelined step on graph instance g (``depth`` instances per bucket, used in
turn) is issued as:

    issuer, on C:  wait done[g]      (only if the step has inputs) the previous
                   copy the inputs   replay of g is finished with its buffers
                   record copied
            on S:  wait copied, replay g    layer l waits ev[l] before its task group
                   copy the outputs to the host, record done[g]
    update thread, on U (handed over before the issuer's work above):
                   wait done[g]      of the previous replay of g: it is finished with g
                   for each group l: patch l if its parameters changed,
                   record ev[l]      exactly one record per captured wait
                                     (ev[l] is a flag the replay's wait consumes and
                                     its captured reset clears: torch_npu's
                                     ExternalEvent, npu/streams.py; a record that comes
                                     before the replay's wait is not lost)

A step alone in the engine, or one with device feeds (decoding ahead: its token
rows are copied from an earlier step's output, so the copies must follow that
step's replay, on S, anyway), copies its inputs and feeds on S itself, before
its replay: stream order fences them, and C could overlap nothing.

The update thread dispatches the patches (the host-bound part: on an NPU, the
tiling of every patched op) while the socket thread decodes, launches and
answers other steps, as sglang dispatches ``NPUGraph.update`` from a thread of
its own: the replay of layer k overlaps the dispatch of the patch of layer k+1,
and the next step's dispatch overlaps this step's replay. One thread issues on
U and one on S, so each stream's order is the order of issue. U never waits on
S for a replay issued after its own records (that would deadlock). Inputs of
step N+1 are copied on C after done[g] of the step before it on g, so they never
overwrite buffers that replay still reads; the issuer copies them, so the update
thread's time per step is its patches alone (and with ``depth`` >= 2 the copies
are done on the device long before S reaches the replay that waits for them).

``pipeline=False`` keeps a serial mode for comparison: patches, then the replay,
then the issuer waits for the step's end before it returns (a host barrier:
the next step is issued after the host saw this one finish). It issues U's work
itself; no update thread runs.

Schedulers that drive the two halves themselves send ``update`` (patch an
instance of the bucket and keep it *staged*, no release) and ``replay``
(release every group of the staged instance, or of the next one in the ring,
and replay it). A step on a bucket with a staged instance uses that instance.

The engine knows no op: each group is patched by re-issuing the op its program
names for it (:meth:`GraphProgram.group_call`) through :meth:`DeviceBackend.patch`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from graphlane.workers.backends.base import DeviceBackend
from graphlane.workers.input_check import check_inputs
from graphlane.workers.job import Job, JobKind
from graphlane.workers.permits import Permits
from graphlane.workers.programs.base import (
    CapturedGraph,
    Feed,
    GraphKey,
    GraphProgram,
    OpCall,
    StepError,
    StepPlan,
)

log = logging.getLogger("graphlane.pipeline")


@contextlib.contextmanager
def _capturing(b: DeviceBackend, graph: Any, stream: Any, key: GraphKey) -> Iterator[None]:
    """``b.capture(graph, stream)``, except that an error raised inside the capture (a
    program's: an op it names wrongly, a task group it leaves open) propagates as
    itself. The capture is ended (abandoned) all the same; what ending it complains
    of (a task group left open by the error, say) becomes a note on that error, never
    its replacement (a capture context's own exit would replace it)."""
    capture = b.capture(graph, stream)
    capture.__enter__()
    try:
        yield
    except BaseException as exc:
        try:
            capture.__exit__(type(exc), exc, exc.__traceback__)
        except BaseException as end:
            exc.add_note(f"ending the abandoned capture also failed: {type(end).__name__}: {end}")
        exc.add_note(
            f"raised while program {key.program!r} captured bucket {key.bucket} "
            f"(instance {key.instance})"
        )
        raise
    capture.__exit__(None, None, None)


class EngineError(RuntimeError):
    """The engine cannot serve (closed, or failed after a device fault)."""


class StepFields(Protocol):
    """What :meth:`StepEngine.plan` reads: a step or update body's fields."""

    @property
    def program(self) -> str: ...
    @property
    def batch(self) -> int | None: ...
    @property
    def params(self) -> Mapping[str, Any]: ...
    @property
    def inputs(self) -> Mapping[str, torch.Tensor]: ...


OnDone = Callable[[Job], None]
"""Called once per issued step, with its results or its ``error`` filled in."""

_STOP = object()
_S_ONLY = object()  # what _issue returns for a step with no work on U
_EARLY = object()  # what _issue returns for a step whose work on U went first (see issue)
#: Patches that take less host time than this are not worth a hand-off to the update
#: thread for a lone step: the overlap they could give is less than what the hand-off
#: costs (a thread's wake-up and the interpreter lock passed between two: 50-100 us
#: on this project's machines).
_HAND_OVER_S = 200e-6


class StepEngine:
    """Runs steps of graph programs on one device, issued from one thread."""

    def __init__(
        self,
        backend: DeviceBackend,
        programs: Sequence[GraphProgram],
        *,
        on_done: OnDone,
        depth: int = 1,
        pipeline: bool = True,
        max_inflight: int = 8,
        records_first: bool = False,  # ENPU: U's work before the replay, no update thread
    ) -> None:
        if depth < 1:
            raise ValueError("depth must be >= 1")
        if max_inflight < 1:
            raise ValueError("max_inflight must be >= 1")
        names = [p.name for p in programs]
        if len(set(names)) != len(names):
            raise ValueError(f"program names must be distinct: {names}")
        self.backend = backend
        self.programs = {p.name: p for p in programs}
        self.depth = depth
        self.pipeline = pipeline
        self.records_first = records_first
        self._u_inline = not pipeline or records_first  # U's work always issued by the issuer
        self.on_done = on_done
        self._completions: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Steps issued to the device and not yet complete: the issuer may run ahead
        # of the device by this much, no more (bounded memory, bounded latency).
        self._permits = Permits(max_inflight)
        self._next: dict[tuple[str, int], int] = {}  # (program, bucket) -> next instance
        self._rings: dict[tuple[str, int], list[CapturedGraph]] = {}  # instances in order
        self._staged: dict[tuple[str, int], CapturedGraph] = {}
        # Work on U, in issue order: (step, the event U waits for first, or None).
        self._updates: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._closed = False
        self._started = False
        self._thread: threading.Thread | None = None
        self._updater: threading.Thread | None = None
        self.jobs_done = 0
        self._count_lock = threading.Lock()
        # The host time of the last steps' patches (see _patches_first).
        self._u_costs: collections.deque[float] = collections.deque(maxlen=8)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Capture every program (largest bucket first), then start the completion thread
        (and, pipelined, the update thread)."""
        if self._started:
            return
        b = self.backend
        self.capture_stream = b.new_stream()
        self.update_stream = b.new_stream(priority=-1)  # as npugraph_ex's (torch_npu 2.14)
        self.copy_stream = b.new_stream()
        for program in self.programs.values():
            for bucket in sorted(program.buckets, reverse=True):
                for instance in range(self.depth):
                    self._capture(program, bucket, instance)
        b.synchronize()
        self._started = True
        self._thread = threading.Thread(
            target=self._completion_loop, name="graphlane-completion", daemon=True
        )
        self._thread.start()
        if self.pipeline and not self.records_first:
            self._updater = threading.Thread(
                target=self._update_loop, name="graphlane-update", daemon=True
            )
            self._updater.start()

    def _capture(self, program: GraphProgram, bucket: int, instance: int) -> None:
        b = self.backend
        key = GraphKey(program.name, bucket, instance)
        buffers = program.allocate(b, bucket)
        events = [b.new_external_event() for _ in range(program.num_groups)]
        for i, ev in enumerate(events):
            if hasattr(ev, "label"):
                ev.label = f"group {i} of {program.name} bucket {bucket} instance {instance}"
        graph = b.new_graph()
        b.synchronize()  # buffers are initialised before capture starts
        with _capturing(b, graph, self.capture_stream, key):
            handles, signatures = program.capture(b, self.capture_stream, bucket, buffers, events)
        captured = CapturedGraph(key, graph, handles, events, buffers, list(signatures))
        for name in program.tails:  # each its own graph, over the instance's buffers
            tail = b.new_graph()
            with _capturing(b, tail, self.capture_stream, key):
                program.capture_tail(b, self.capture_stream, bucket, buffers, name)
            captured.tails[name] = tail
        profile = getattr(b, "graph_profile", None)
        if profile is not None:
            captured.profile = {
                "graph": profile(graph),
                **({"tails": {n: profile(t) for n, t in captured.tails.items()}}
                   if captured.tails else {}),
            }  # fmt: skip
        self._rings.setdefault((program.name, bucket), []).append(captured)  # ring order
        log.debug("captured %s", key)

    def close(self) -> None:
        """Complete the steps on the device, stop the engine's threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._updater is not None:  # it feeds the completion thread: stop it first
            self._updates.put(_STOP)
            self._updater.join()
        if self._thread is not None:
            self._completions.put(_STOP)
            self._thread.join()

    def __enter__(self) -> StepEngine:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def graphs(self) -> dict[GraphKey, CapturedGraph]:
        """Every captured instance by its key."""
        return {g.key: g for ring in self._rings.values() for g in ring}

    def graph_profiles(self, program: str) -> dict[str, Any]:
        """Each bucket's graph profile of ``program`` (its first instance: every instance
        of a bucket is the same capture), by bucket; empty when the backend cannot tell."""
        return {
            str(bucket): ring[0].profile
            for (name, bucket), ring in sorted(self._rings.items())
            if name == program and ring[0].profile is not None
        }

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    # ------------------------------------------------------------ validation
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

    def plan(self, request: StepFields, outputs: Sequence[str] = ()) -> StepPlan:
        """Validate a step or update (a wire body with its fields) asking for ``outputs``."""
        program = self._program(request.program)
        batch = request.batch if request.batch is not None else program.infer_batch(request.params)
        plan = program.plan(batch, request.params, request.inputs)
        if plan.inputs and not program.checks_inputs:
            ring = self._rings.get((program.name, plan.bucket))
            if ring is None:
                raise StepError("batch", f"bucket {plan.bucket} was not captured")
            check_inputs(program, ring[0].buffers, plan)
        self._check_outputs(program, outputs)
        return plan

    def plan_update(self, request: StepFields) -> StepPlan:
        """Validate an update: a step's patches, staged for a later step or replay."""
        prog = self._program(request.program)
        if not prog.replayable:  # see GraphProgram.replayable
            why = "its staged patches would be replayed over device state, or overwritten"
            raise StepError(
                "op", f"update is refused for {request.program!r}: {why}; send steps"
            )
        return self.plan(request)

    def plan_replay(self, program: str, batch: int, outputs: Sequence[str] = ()) -> StepPlan:
        """Validate a replay of the bucket that serves ``batch``."""
        prog = self._program(program)
        if not prog.replayable:  # see GraphProgram.replayable
            why = "a replay would write its device state from what the instance last held"
            raise StepError("op", f"replay is refused for {program!r}: {why}; send steps")
        bucket = prog.bucket_for(batch)
        self._check_outputs(prog, outputs)
        return StepPlan(program, batch, bucket)

    def plan_sequences(
        self, program: str, op: str, fields: Mapping[str, Any], owner: Any,
        outputs: Sequence[str] = (),
    ) -> StepPlan:  # fmt: skip
        """Validate a sequence operation (``add``, ``decode``) of ``owner``'s sequences."""
        prog = self._program(program)
        if not prog.sequence_ops:
            raise StepError("op", f"program {program!r} keeps no sequences (a model does)")
        self._check_outputs(prog, outputs)
        return prog.plan_sequences(op, fields, owner)

    def plan_state(self, program: str, op: str, fields: Mapping[str, Any]) -> StepPlan:
        """Validate an operation on a program's device state (``kv_write``, ``kv_read``)."""
        prog = self._program(program)
        if op not in prog.state_ops:
            raise StepError("op", f"program {program!r} has no operation {op!r}")
        return prog.plan_state(op, fields)

    # ------------------------------------------------------------ issuing
    def reserve(self, blocking: bool = True) -> bool:
        """Take one in-flight permit (``max_inflight`` in all); the step's completion
        gives it back. Without a permit, :meth:`issue` must not be called."""
        return self._permits.acquire(blocking)

    def issue(self, job: Job) -> None:
        """Issue one step's device work on a permit the caller holds. Only one thread
        issues. ``on_done(step)`` runs once: here if the work failed to issue, or the
        engine is serial (it waits here for the step); else in the update thread or
        the completion thread (see the module doc)."""
        if self._failure is not None:
            self._abandon(job, EngineError(f"engine failed: {self._failure}"))
            return
        program = self.programs[job.plan.program]
        if job.kind is JobKind.STEP:
            try:
                checked = program.checks_feeds_first and self._patches_first(job)
                if checked:
                    # its refusal, if any, before its patches go (host state only)
                    program.check_feeds(job.plan, job.owner)
                    self._hand_patches(job, self._pick(job))
                # copies from earlier steps' outputs (decoding ahead), if it has any;
                # device work the program issues for them goes on S, before the step's
                with self.backend.use_stream(self.capture_stream):
                    job.feeds = program.feeds(job.plan, job.owner, checked)
            except Exception as exc:
                if job.parties:  # its patches went: a fault past the check, not a refusal
                    self._fail(exc)
                    job.error = exc
                    self._arrive(job)
                else:  # nothing of it was issued: its refusal alone
                    self._abandon(job, exc)
                return
        wait_event: Any = None
        try:
            wait_event = self._issue(job)
            if job.kind is JobKind.STEP or job.kind is JobKind.STATE:
                # on S, behind the step's replay: what the hook issues reads its outputs
                with self.backend.use_stream(self.capture_stream):
                    program.issued(job.plan, job.graph, job.done, job.owner)
            if wait_event is _EARLY:  # its patches are on their way on the update thread
                self._arrive(job)
                return
            # Alone in the engine (the update thread is idle): U's work is issued here.
            inline = wait_event is not _S_ONLY and (self._u_inline or self._permits.alone())
            if inline:
                self._on_update_stream(job, wait_event)
        except BaseException as exc:  # a device fault or a misuse: fail loudly
            self._fail(exc)
            if job.parties:  # the update thread has it too: the last of the two ends it
                job.error = exc
                self._arrive(job)
            else:
                self._abandon(job, exc)
            return
        if not self.pipeline:  # serial: the issuer waits for the step (a host barrier)
            self._complete(job)
        elif inline or wait_event is _S_ONLY:
            self._hand_over(job)
        else:
            self._updates.put((job, wait_event))

    def _abandon(self, job: Job, error: BaseException) -> None:
        self._permits.release()
        job.error = error
        job.results = None
        self.on_done(job)

    def _next_graph(self, ring_key: tuple[str, int]) -> CapturedGraph:
        i = self._next.get(ring_key, 0)
        self._next[ring_key] = (i + 1) % self.depth
        return self._rings[ring_key][i]

    def _issue(self, job: Job) -> Any:
        """Issue ``job``'s work on S; return the event its work on U waits for first
        (None: nothing to wait for), or ``_S_ONLY`` if it has no work on U."""
        plan = job.plan
        program = self.programs[plan.program]
        if job.kind is JobKind.STATE:
            self._issue_state(program, job)
            return _S_ONLY
        if job.kind is JobKind.UPDATE:  # its work is all on U
            ring_key = (plan.program, plan.bucket)
            staged = self._staged.get(ring_key) or self._next_graph(ring_key)
            self._staged[ring_key] = job.graph = staged
            return staged.last_done
        early = bool(job.parties)  # its patches went before its feeds (issue)
        previous = job.previous if early else self._pick(job)
        g = job.graph
        assert g is not None
        if not early:
            early = self._patches_first(job)
            if early:
                # The patches need nothing the issuer does next (the inputs' copies, the
                # replay, the program's hook): the update thread starts on them now,
                # while this thread issues the rest, and the last of the two hands the
                # step over (_arrive). A lone step's patches thus overlap its launch; the
                # replay waits for each group's record, which may come before it runs.
                self._hand_patches(job, previous)
        if job.kind is JobKind.STEP and not self.pipeline:  # patches, then the replay
            t0 = time.perf_counter()
            if job.feeds:  # the inputs and the feeds on S, before the replay
                self._copy_inputs(program, g, plan, previous, job.feeds)
            copy = not job.feeds
            job.patched = self._patch_groups(program, g, plan, release=True, copy=copy)
            job.replay_at = time.perf_counter()
            job.dispatch_s = job.replay_at - t0
            self._replay(program, g, job)
            self._collect(program, g, job)
            return _S_ONLY
        if (plan.inputs and not job.inputs_on_u) or job.feeds:
            self._copy_inputs(program, g, plan, previous, job.feeds, inputs=not job.inputs_on_u)
        if self.records_first:  # ENPU: every record before the replay that waits on it
            self._on_update_stream(job, previous)
        # Pipelined, the replay goes first: it waits for layer 0's release. The output
        # copy is queued behind the replay on S, so queueing it before the patches
        # costs the device nothing.
        job.replay_at = time.perf_counter()
        self._replay(program, g, job)
        self._collect(program, g, job)
        if early:
            return _EARLY
        return _S_ONLY if self.records_first else previous

    def _pick(self, job: Job) -> Any:
        """The graph instance a step or a replay runs on (``job.graph``): the staged one
        of its bucket, else the next of the ring; returns the previous replay's done event
        of that instance (U waits for it)."""
        plan = job.plan
        ring_key = (plan.program, plan.bucket)
        staged = self._staged.pop(ring_key, None) if self._staged else None
        g = staged if staged is not None else self._next_graph(ring_key)
        job.graph = g
        if staged is not None and plan.inputs and self.pipeline:
            # An update wrote g's inputs on U, and its work may still be queued there:
            # this step's inputs go on U too, behind it (C would race it). (Serial, the
            # host saw the update finish.)
            job.inputs_on_u = True
        return g.last_done

    def _patches_first(self, job: Job) -> bool:
        """Whether ``job``'s patches go to the update thread before the issuer's work on S:
        a pipelined step (not ENPU's order), whose inputs do not follow a staged update's
        on U, unless it is alone in the engine and patches have been cheap (the least
        host time of the last 8 steps' patches under _HAND_OVER_S; then the
        issuer patches it after its launch, as it does a lone update or replay: a hand-off
        to a thread, and the interpreter lock passed between two, cost more than such
        patches could overlap; a `null` device's step round trip took 1.7-1.8x a raw
        pyzmq one with every lone step handed over, 1.3-1.4x without)."""
        if job.kind is not JobKind.STEP or not self.pipeline or self.records_first:
            return False
        # The least of the last 8: a thread preempted while it patched (a busy machine)
        # takes longer, never shorter, so one slow dispatch does not change the path.
        costs = self._u_costs
        if (not costs or min(costs) < _HAND_OVER_S) and self._permits.alone():
            return False
        if job.graph is None:  # not picked yet: would it take a staged instance?
            plan = job.plan
            return not (self._staged and (plan.program, plan.bucket) in self._staged)
        return not job.inputs_on_u

    def _hand_patches(self, job: Job, previous: Any) -> None:
        job.previous = previous
        job.parties = 2  # the issuer and the update thread (_arrive)
        self._updates.put((job, previous))

    def _replay(self, program: GraphProgram, g: CapturedGraph, job: Job) -> None:
        """Replay g on S, then the tails this step needs (stream order fences them)."""
        b = self.backend
        b.replay(g.graph, self.capture_stream)
        if g.tails:
            for name in program.tails_for(job.plan, job.outputs):
                b.replay(g.tails[name], self.capture_stream)

    def _copy_inputs(
        self,
        program: GraphProgram,
        g: CapturedGraph,
        plan: StepPlan,
        previous: Any,
        feeds: Sequence[Feed] | None = None,
        inputs: bool = True,
    ) -> None:
        """Copy a step's inputs into g's buffers before this replay, then its ``feeds``.

        On C, after ``previous`` (the previous replay of g), S waiting for the copies:
        so they can land while another step's replay runs. Where nothing could overlap
        them they go on S, whose order alone puts them after every replay issued before
        and before this one, without the three fences: a step with feeds (each reads an
        earlier step's output, so it must wait for that step's replay, which ran on S),
        and a step alone in the engine (no replay runs)."""
        b = self.backend
        on_s = bool(feeds) or self._permits.alone()
        stream = self.capture_stream if on_s else self.copy_stream
        if not on_s and previous is not None:
            b.wait(stream, previous)
        buffers = g.buffers
        with b.use_stream(stream):
            if inputs:
                writes, copy_in = program.input_writes, b.copy_in
                for group in _input_groups(program):
                    for dst, src in writes(buffers, plan, group):
                        copy_in(dst, src)
            for feed in feeds or ():
                feed.write(buffers)
        if on_s:
            return
        copied = b.new_event()
        b.record(copied, stream)
        b.wait(self.capture_stream, copied)

    def _on_update_stream(self, job: Job, previous: Any) -> None:
        """``job``'s work on U: wait for ``previous`` (the previous replay of its graph
        instance), then patch (a step or an update) or release (a replay)."""
        b = self.backend
        U = self.update_stream
        g = job.graph
        assert g is not None
        if previous is not None:
            b.wait(U, previous)
        if job.kind is JobKind.REPLAY:
            with b.use_stream(U):
                for event in g.events:
                    b.record(event, U)
            return
        release = job.kind is JobKind.STEP  # a step's inputs are on C already, unless
        copy = not release or job.inputs_on_u  # they follow an update's, on U
        t0 = time.perf_counter()
        program = self.programs[job.plan.program]
        job.patched = self._patch_groups(program, g, job.plan, release, copy=copy)
        job.dispatch_s = took = time.perf_counter() - t0
        self._u_costs.append(took)  # (one thread issues on U at a time)
        if not release:  # an update: staged, done when its patches are
            job.results = {}
            job.done = b.new_event()
            b.record(job.done, U)

    def _issue_state(self, program: GraphProgram, job: Job) -> None:
        """A device-state operation, on the capture stream S: every replay reads and
        writes the state on S, so stream order fences it against replays issued before
        and after it (no graph instance or update-stream fence is involved)."""
        b = self.backend
        S = self.capture_stream
        with b.use_stream(S):
            views = program.run_state(b, job.plan)
            job.results = {
                n: v if v.is_cpu else v.to("cpu", non_blocking=True) for n, v in views.items()
            }
        job.done = b.new_event()
        b.record(job.done, S)

    def _collect(self, program: GraphProgram, g: CapturedGraph, job: Job) -> None:
        """Queue the outputs' copy to the host behind the replay, and the step's done event."""
        b = self.backend
        S = self.capture_stream
        with b.use_stream(S):
            views = program.output_views(g.buffers, job.plan, list(job.outputs))
            # A view on the host already (the null device) is its own copy, as .to() says.
            job.results = {
                n: v if v.is_cpu else v.to("cpu", non_blocking=True) for n, v in views.items()
            }
        job.done = g.last_done = b.new_event()
        b.record(job.done, S)

    def _patch_groups(
        self, program: GraphProgram, g: CapturedGraph, plan: StepPlan, release: bool, copy: bool
    ) -> int:
        """Patch changed groups on U, with ``copy`` copying each group's inputs before
        its patch; with ``release``, record every group's event once (after its patch,
        if any)."""
        b = self.backend
        U = self.update_stream
        patched = 0
        # Run once per group of every step: what the loop reads is looked up once.
        buffers, signatures, handles, events = g.buffers, g.signatures, g.handles, g.events
        signature, call, patch = program.group_signature, program.group_call, b.patch
        writes = program.input_writes if copy and plan.inputs else None
        first_only = program.inputs_before_first_group
        # One signature for every group (the step's): asked once, not per group.
        step_sig = signature(plan, 0) if program.step_wide_signature else _PER_GROUP
        calls: list[OpCall] | None = None
        with b.use_stream(U):
            for group in range(program.num_groups):
                if writes is not None and (group == 0 or not first_only):
                    for dst, src in writes(buffers, plan, group):
                        b.copy_in(dst, src)
                sig = signature(plan, group) if step_sig is _PER_GROUP else step_sig
                if sig != signatures[group]:
                    if step_sig is _PER_GROUP:
                        op, args, kwargs = call(buffers, plan, group)
                    else:  # every group's call of the step, made in one pass
                        if calls is None:
                            calls = program.group_calls(buffers, plan)
                        op, args, kwargs = calls[group]
                    patch(U, handles[group], op, args, kwargs, events[group] if release else None)
                    signatures[group] = sig
                    patched += 1
                elif release:
                    b.record(events[group], U)
        return patched

    # ------------------------------------------------------------ the engine's threads
    def _update_loop(self) -> None:
        self.backend.enter_thread()
        while True:
            item = self._updates.get()
            if item is _STOP:
                return
            job, previous = item
            if self._failure is not None:  # its replay waits for releases that never come
                error = EngineError(f"engine failed: {self._failure}")
                if job.parties:
                    job.error = job.error or error
                    self._arrive(job)
                else:
                    self._abandon(job, error)
                continue
            try:
                self._on_update_stream(job, previous)
            except BaseException as exc:  # a device fault or a misuse: fail loudly
                self._fail(exc)
                if job.parties:
                    job.error = job.error or exc
                    self._arrive(job)
                else:
                    self._abandon(job, exc)
                continue
            if job.parties:
                self._arrive(job)
            else:
                self._hand_over(job)

    def _arrive(self, job: Job) -> None:
        """One of the two threads that issue a step whose patches went first (the issuer,
        the update thread) is done with it; the second hands it over, or ends it when
        either failed."""
        with self._count_lock:
            job.parties -= 1
            last = job.parties == 0
        if not last:
            return
        if job.error is not None:
            self._abandon(job, job.error)
        else:
            self._hand_over(job)

    def _hand_over(self, job: Job) -> None:
        """Complete ``job`` here if its device work is over, else in the completion thread."""
        try:
            finished = job.done.query()
        except BaseException:  # a fault: synchronize() in _complete reports it
            finished = True
        if finished:
            self._complete(job)
        else:
            self._completions.put(job)

    def _completion_loop(self) -> None:
        self.backend.enter_thread()  # it synchronizes the device's events
        while True:
            item = self._completions.get()
            if item is _STOP:
                return
            self._complete(item)

    def _complete(self, job: Job) -> None:
        try:
            job.done.synchronize()
        except BaseException as exc:
            self._fail(exc)
            self._permits.release()
            job.error = exc
            job.results = None
            self.on_done(job)
            return
        self._permits.release()
        job.done_at = time.perf_counter()
        with self._count_lock:  # completions run in any of the engine's threads
            self.jobs_done += 1
        self.on_done(job)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
            log.error("step engine failed: %s", exc)


_PER_GROUP: Any = object()  # _patch_groups: a program whose signature is each group's


def _input_groups(program: GraphProgram) -> range:
    """The groups whose input_writes may copy anything (GraphProgram.inputs_before_first_group)."""
    return range(1 if program.inputs_before_first_group else program.num_groups)


__all__ = ["EngineError", "OnDone", "StepEngine", "StepFields"]
