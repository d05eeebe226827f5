"""Continuous batching: how the load test drives a program with device state, as a
scheduler's decode loop does. Per device, one :class:`DeviceLoop` over that device's
:class:`.workload.SequenceWorkload`:

* **sequences arrive**: closed loop (``concurrency`` C): C sequences live across the
  devices, a new one arriving as soon as one ends; open loop (``rate`` R): Poisson
  arrivals at R sequences/s. Arrivals go to the devices in turn and wait in the
  device's queue until it has room;
* a sequence is **admitted** when the batch has room (the largest bucket) and the
  workload has room for its state for its whole life (a random prompt length in
  ``prompt_lens`` plus a random number of tokens to decode in ``decode_tokens``);
  its state is then written (for a paged KV cache: its prompt's KV, ``kv_write``);
* **continuously batched steps**: each step carries one new token of every live
  sequence; arrivals join the next step, finished sequences leave it and their
  share of the state goes back to be reused. One step per device is in flight, as in
  a decode loop whose next token depends on the last one. When the duration is over,
  the step in flight is answered and the sequences still decoding are cut;
* a ``verify`` share of the steps is checked against the workload's reference.

A worker restart: a step or write answered STATE_LOST means the device's state is gone.
The loop adopts the new generation (``Client.reset_state``) and writes the state of
every live sequence again (``reprefilled``); a reply is only checked when every
sequence in it was written in the generation that answered, so no number computed on
emptied state is ever counted as verified. Other retryable errors (WORKER_LOST, BUSY,
TIMEOUT ...) hold the device back as in the closed loop of calls
(:mod:`.availability`), and the step is rebuilt: a token is committed to the host copy
only when its step succeeded. A non-retryable error ends that device's loop.

The report gets, besides what every run records, ``tokens`` and ``tokens_per_s``,
``mean_batch`` and ``occupancy`` (mean batch / bucket), ``request_bytes`` per step
(the encoded request, measured: mean, min, max), ``sequences`` (arrived, admitted,
finished, cut, never_admitted: still queued at the end, reprefilled), ``state_lost``
and the workload's own figures (e.g. ``blocks_reused``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from graphlane.protocol import ops
from graphlane.protocol.errors import GraphlaneError
from graphlane.protocol.wire import encode_request

from .availability import DeviceBackoff
from .config import DECODE_TOKENS
from .run import Run, finish, send
from .workload import Call, SequenceWorkload


@dataclass
class SequenceCounts:
    steps: int = 0
    tokens: int = 0
    batch_sum: int = 0
    bucket_sum: int = 0
    arrived: int = 0
    admitted: int = 0
    finished: int = 0
    reprefilled: int = 0
    cut: int = 0
    state_lost: int = 0
    request_bytes: list[int] = field(default_factory=list)


class DeviceLoop:
    """The scheduler of one device: its queue of arrivals, its live batch, its steps."""

    def __init__(
        self,
        run: Run,
        device: int,
        workload: SequenceWorkload,
        counts: SequenceCounts,
        backoff: DeviceBackoff,
        seed: int,
        ended: Callable[[], None],
    ) -> None:
        self.run, self.device, self.workload = run, device, workload
        self.counts, self.backoff = counts, backoff
        self.ended = ended  # a sequence finished (the closed loop lets a new one arrive)
        self.rng = random.Random(seed)
        self.waiting: list[tuple[int, int, int]] = []  # (sid, prompt, decode)
        self.wake = asyncio.Event()

    def arrive(self, sid: int, prompt: int, decode: int) -> None:
        self.waiting.append((sid, prompt, decode))
        self.counts.arrived += 1
        self.wake.set()

    async def _admit(self) -> None:
        room = self.workload.max_batch - len(self.workload.seqs)
        while self.waiting and room > 0:
            sid, prompt, decode = self.waiting[0]
            if self.workload.admit(sid, prompt, decode) is None:  # wait for room
                return
            self.waiting.pop(0)
            room -= 1
            self.counts.admitted += 1
            await self._write(sid)

    async def _write(self, sid: int) -> None:
        """Write a sequence's state; an error is recorded (but STATE_LOST) and raised."""
        try:
            await self.workload.write(self.run.client, self.run.config.program, self.device, sid)
        except GraphlaneError as exc:
            if exc.code != "STATE_LOST":
                self._error(exc)
            raise

    async def _recover(self) -> None:
        """STATE_LOST: adopt the new generation, write every live sequence again."""
        self.counts.state_lost += 1
        while self.run.sending():
            try:
                try:
                    await self.run.client.reset_state(self.device)
                except GraphlaneError as exc:
                    self._error(exc)
                    raise
                self.workload.forget_state()
                for sid in list(self.workload.seqs):
                    await self._write(sid)
                    self.counts.reprefilled += 1
                return
            except GraphlaneError as exc:
                if exc.code == "STATE_LOST":  # restarted again meanwhile
                    self.counts.state_lost += 1
                    continue
                if not exc.retryable:
                    raise
                await self._hold()

    def _error(self, exc: GraphlaneError) -> None:
        self.run.rec.error(str(exc.code), time.monotonic(), device=self.device,
                           retryable=exc.retryable, message=exc.message)  # fmt: skip

    async def _hold(self) -> None:
        now = time.monotonic()
        self.backoff.failure(self.device, now)
        await self.run.pause(self.backoff.until[self.device] - now)

    async def loop(self) -> None:
        run = self.run
        with contextlib.suppress(GraphlaneError):  # a non-retryable error: already counted
            while run.sending():
                try:
                    await self._admit()
                    if not self.workload.seqs:
                        self.wake.clear()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self.wake.wait(), 0.1)
                        continue
                    await self._step()
                except GraphlaneError as exc:  # recorded where it happened
                    if exc.code == "STATE_LOST":
                        await self._recover()
                        continue
                    if not exc.retryable:
                        raise
                    await self._hold()  # the step is rebuilt after the pause
        self.counts.cut += len(self.workload.seqs)  # still decoding at the end
        for sid in list(self.workload.seqs):
            self.workload.end(sid)

    async def _step(self) -> None:
        run, w, c = self.run, self.workload, self.counts
        check = self.rng.random() < run.verify
        call = w.step(sorted(w.seqs), self.device, check)
        c.request_bytes.append(self._request_bytes(call, w.output))
        reply = await send(run, call, w.output, time.monotonic(), reraise=True)
        assert reply is not None
        self.backoff.success(self.device)
        c.steps += 1
        c.tokens += call.batch
        c.batch_sum += call.batch
        c.bucket_sum += w.bucket_for(call.batch)
        # Only numbers computed on state written in the answering generation count.
        if call.expected is not None and all(
            w.generation_of(sid) == reply.generation for sid in call.rows
        ):
            run.rec.verification(call, w.check(call, reply), reply.generation)
        for sid in w.advance(call):
            w.end(sid)
            c.finished += 1
            self.ended()

    def _request_bytes(self, call: Call, output: str) -> int:
        """The size of the step's request as the client encodes it (every frame)."""
        body = ops.Step(
            self.run.config.program, call.device, call.params, call.inputs, [output],
            call.batch, int(self.run.config.timeout_s * 1000),
            self.run.client.generation(call.device),
        )  # fmt: skip
        return sum(len(memoryview(f)) for f in encode_request(1, "step", body))


class Sequences:
    """The arrivals of a run's sequences, spread over the devices' loops in turn."""

    def __init__(self, run: Run, workloads: dict[int, SequenceWorkload]) -> None:
        self.run = run
        self.counts = SequenceCounts()
        self.rng = random.Random(run.config.seed)
        backoff = DeviceBackoff(random.Random(run.config.seed ^ 0xB0FF))
        ended = self.arrive if run.config.mode == "closed" else _nothing
        self.loops = {
            d: DeviceLoop(run, d, w, self.counts, backoff, run.config.seed * 1000 + d, ended)
            for d, w in sorted(workloads.items())
        }
        self._next_sid = 0
        self._turn = 0

    def arrive(self) -> None:
        if not self.run.sending():
            return
        cfg = self.run.config
        loop = list(self.loops.values())[self._turn % len(self.loops)]
        self._turn += 1
        max_len = loop.workload.max_len
        lo, hi = cfg.prompt_lens or (1, max(1, max_len // 2))
        decode = loop.rng.randint(*(cfg.decode_tokens or DECODE_TOKENS))
        prompt = max(1, min(loop.rng.randint(lo, hi), max_len - decode))
        loop.arrive(self._next_sid, prompt, min(decode, max_len - prompt))
        self._next_sid += 1
        self.run.rec.arrivals += 1

    async def _open_loop(self) -> None:
        assert self.run.config.rate is not None
        t = time.monotonic()
        while self.run.sending():
            t += self.rng.expovariate(self.run.config.rate)
            await self.run.pause(min(t, self.run.stop_at) - time.monotonic())
            if self.run.sending() and time.monotonic() < self.run.stop_at:
                self.arrive()

    async def drive(self) -> None:
        """Run the loops until the run's end; then fill ``run.extra``."""
        run = self.run
        if run.config.mode == "closed":
            for _ in range(run.config.concurrency or 0):
                self.arrive()
        tasks = {asyncio.create_task(lp.loop()) for lp in self.loops.values()}
        if run.config.mode == "open":
            tasks.add(asyncio.create_task(self._open_loop()))
        run.tasks.update(tasks)
        await run.pause(run.stop_at - time.monotonic())
        run.end_sending()
        for lp in self.loops.values():
            lp.wake.set()
        await finish(run, tasks)
        run.extra.update(self.figures())

    def figures(self) -> dict[str, Any]:
        c = self.counts
        rb = c.request_bytes
        own: Counter[str] = Counter()
        for lp in self.loops.values():
            own.update(lp.workload.stats())
        return {
            "tokens": c.tokens,
            "mean_batch": round(c.batch_sum / c.steps, 3) if c.steps else 0.0,
            "occupancy": round(c.batch_sum / c.bucket_sum, 3) if c.bucket_sum else 0.0,
            "request_bytes": {
                "mean": round(statistics.fmean(rb), 1) if rb else None,
                "min": min(rb, default=None),
                "max": max(rb, default=None),
            },
            "sequences": {
                "arrived": c.arrived,
                "admitted": c.admitted,
                "finished": c.finished,
                "reprefilled": c.reprefilled,
                "cut": c.cut,
                "never_admitted": sum(len(lp.waiting) for lp in self.loops.values()),
            },
            "state_lost": c.state_lost,
            **dict(own),
        }


def _nothing() -> None:
    pass
