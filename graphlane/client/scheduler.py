"""The reference scheduler of a ``model`` program: continuous batching, decoding ahead,
on the typed sequence operations (docs/models.md, "Sequences"). ``graphlane loadtest``
(:mod:`graphlane.loadtest.serving`) and the demo run it.

Per device, one :class:`GenerationLoop`: requests arrive (:meth:`~GenerationLoop.arrive`)
with a prompt and a number of tokens to generate; each gets the cache blocks it needs
for its whole life and joins the batch with an ``add`` (its prompt, its blocks; its
first token); every ``decode`` names the live requests' sequences, and the worker feeds
each the token it sampled last, on the device, so decode N+1 goes out before decode N's
reply is back, ``window`` requests in flight; a request that has asked for all its
tokens leaves (a ``free``) and its blocks go to the next (its last decode runs before a
later add writes them: the worker keeps the order). Each reply's tokens land in their
request, with the time they came back.

A failed add or decode fails the requests of its rows (their later decodes are refused
by the worker too: never fed a stale token), except when the worker was lost: after
STATE_LOST or WORKER_LOST (a worker restart forgets every sequence) the loop lets what
is in flight end, adopts the worker's new generation and prefills each live request
again, its prompt followed by the tokens it got so far, into the blocks it holds; it
then goes on decoding (``reprefilled`` counts them), and no request fails for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from graphlane.protocol.errors import GraphlaneError

from .client import Client, StepReply

#: What a step of a model program takes and gives (its hello entry says so).
MODEL_INPUTS = ("tokens", "block_table")
#: Errors that mean the worker's sequences are gone (a restarted worker, or the
#: connection to it): the loop prefills its requests again instead of failing them.
LOST = frozenset({"STATE_LOST", "WORKER_LOST"})


@dataclass(frozen=True)
class ModelShape:
    """What the scheduler needs of a model program, from its ``hello`` entry."""

    block_size: int
    num_blocks: int
    max_blocks_per_seq: int
    buckets: tuple[int, ...]
    vocab_size: int
    dtype: str

    @classmethod
    def from_description(cls, described: Mapping[str, Any]) -> ModelShape:
        """ValueError when the entry is not a model program's (prefill, tokens)."""
        cfg = described.get("config") or {}
        ops = (described.get("state") or {}).get("ops") or {}
        missing = [n for n in MODEL_INPUTS if n not in (described.get("inputs") or {})]
        if "prefill" not in ops or missing or "tokens" not in described.get("outputs", ()):
            raise ValueError("not a model program (state op prefill, input and output tokens)")
        if "decode" not in (described.get("sequence_ops") or ()):
            raise ValueError("the worker's model program has no sequence operations (add, "
                             "decode): upgrade the daemon")  # fmt: skip
        arch = cfg.get("architecture") or {}
        try:
            return cls(
                int(cfg["block_size"]), int(cfg["num_blocks"]), int(cfg["max_blocks_per_seq"]),
                tuple(int(b) for b in described.get("buckets", cfg.get("buckets", ()))),
                int(arch["vocab_size"]), str(cfg["dtype"]),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"the model program's hello config lacks {exc}") from None

    @property
    def max_len(self) -> int:
        return self.block_size * self.max_blocks_per_seq

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def bucket_for(self, batch: int) -> int:
        return min(b for b in self.buckets if b >= batch)


@dataclass
class Request:
    """One generation request: ``prompt`` token ids, ``new`` tokens to generate (the
    prefill's first one included), and what came back."""

    rid: int
    prompt: list[int]
    new: int
    arrived: float = 0.0  # time.monotonic() of its arrival
    blocks: list[int] = field(default_factory=list)
    asked: int = 0  # tokens asked for so far (the prefill's, then one per step)
    tokens: list[int | None] = field(default_factory=list)  # by position
    times: list[float | None] = field(default_factory=list)  # when each came back
    received: int = 0
    failed: str | None = None  # the error code that ended it
    cut: bool = False  # unanswered when the run ended

    @property
    def done(self) -> bool:
        return self.failed is None and self.received == self.new

    @property
    def out(self) -> list[int]:
        return [t for t in self.tokens if t is not None]


class Observer(Protocol):
    """What a loop reports (the load test records it; the demo needs none)."""

    def sent(self, kind: str, rows: list[Request]) -> None: ...

    def answered(self, kind: str, rows: list[Request], sent: float, done: float) -> None: ...

    def failed(self, kind: str, rows: list[Request], exc: GraphlaneError) -> None: ...

    def cancelled(self, kind: str, rows: list[Request]) -> None: ...

    def ended(self, request: Request) -> None:
        """``request`` got its last token, or failed."""
        ...


class GenerationLoop:
    """One device's scheduler of a model program (see the module docstring)."""

    def __init__(
        self,
        client: Client,
        program: str,
        device: int,
        shape: ModelShape,
        *,
        window: int = 3,
        observer: Observer | None = None,
        hold: Callable[[], Any] | None = None,
    ) -> None:
        self.client, self.program, self.device, self.shape = client, program, device, shape
        self.window = window
        self.observer = observer
        self.hold = hold  # awaited after a failure before sending again (a backoff)
        self.queue: deque[Request] = deque()
        self.live: list[Request] = []
        self.admitted: list[Request] = []
        self._admitted_ids: set[int] = set()
        self.free = list(range(shape.num_blocks))
        self.inflight: list[asyncio.Task[None]] = []
        self._frees: list[asyncio.Future[None]] = []  # free calls, ended by run()
        self.closed = False  # no more arrivals: run() ends when all is answered
        self.stopped = False  # send nothing more: run() ends when the calls in flight are
        self.state_lost = False
        self.state_losses = 0  # recoveries from a lost worker
        self.reprefilled = 0  # requests prefilled again after one
        self.steps = 0
        self.batch_sum = 0
        self.bucket_sum = 0
        self._failures = 0
        self._wake = asyncio.Event()

    def arrive(self, request: Request) -> None:
        need = self.shape.blocks_for(len(request.prompt) + request.new)
        if need > min(self.shape.num_blocks, self.shape.max_blocks_per_seq):
            raise ValueError(f"request {request.rid} needs {need} blocks: more than fit")
        request.tokens = [None] * request.new
        request.times = [None] * request.new
        self.queue.append(request)
        self._wake.set()

    def close(self) -> None:
        """No more arrivals: run() ends once every request is answered."""
        self.closed = True
        self._wake.set()

    def stop(self) -> None:
        """Send nothing more: the live requests are cut, the queued ones never start."""
        self.stopped = True
        self._wake.set()

    async def run(self) -> None:
        try:
            while not self.stopped:
                if self.state_lost:
                    await self._recover()
                    continue
                failures = self._failures
                self._admit_all()
                rows = [r for r in self.live if r.asked < r.new]
                if rows:
                    await self._send_step(rows)
                for r in [r for r in self.live if r.asked >= r.new or r.failed]:
                    self._leave(r)
                if self._failures != failures and self.hold is not None:
                    await self.hold()
                if not rows and not self.queue:
                    if self.closed:
                        await self._drain()  # a lost worker's reply may yet come back
                        if self.state_lost or self.queue:
                            continue
                        break
                    self._wake.clear()
                    waits = [*self.inflight, asyncio.ensure_future(self._wake.wait())]
                    try:
                        await asyncio.wait(waits, timeout=0.1, return_when="FIRST_COMPLETED")
                    finally:
                        waits[-1].cancel()
            await self._drain()
        finally:
            # Stopped (or cancelled): frees in flight are abandoned too, not waited for
            # (a stalled worker would hold them until their deadline).
            for t in [*self.inflight, *(self._frees if self.stopped else ())]:
                t.cancel()
            await asyncio.gather(*self.inflight, *self._frees, return_exceptions=True)
            for r in self.admitted:
                r.cut = r.failed is None and not r.done

    async def _drain(self) -> None:
        while self.inflight:
            await asyncio.wait(self.inflight, return_when="FIRST_COMPLETED")
            self.inflight[:] = [t for t in self.inflight if not t.done()]

    def _admit_all(self) -> None:
        while self.queue and len(self.live) < max(self.shape.buckets):
            r = self.queue[0]
            need = self.shape.blocks_for(len(r.prompt) + r.new)
            if need > len(self.free):
                return
            self.queue.popleft()
            r.blocks = [self.free.pop() for _ in range(need)]
            self.live.append(r)
            if id(r) not in self._admitted_ids:  # not one resumed after a lost worker
                self._admitted_ids.add(id(r))
                self.admitted.append(r)
            self._prefill(r, r.received)

    def _prefill(self, r: Request, got: int) -> None:
        """Add ``r``'s sequence: its prompt and the ``got`` tokens it has so far (none
        on its first admission; after a lost worker, those that came back)."""
        r.asked = got + 1
        context = [*r.prompt, *(int(t) for t in r.tokens[:got] if t is not None)]
        call = self.client.add_sequence(self.program, self.device, r.rid, context, r.blocks)
        self._start("prefill", call, [r])

    async def _send_step(self, rows: list[Request]) -> None:
        while len(self.inflight) >= self.window:
            await asyncio.wait(self.inflight, return_when="FIRST_COMPLETED")
            self.inflight[:] = [t for t in self.inflight if not t.done()]
        rows = [r for r in rows if r.failed is None]  # a failure meanwhile
        if not rows or self.stopped or self.state_lost:
            return
        for r in rows:
            r.asked += 1
        call = self.client.decode(self.program, self.device, [r.rid for r in rows], as_lists=True)
        self._start("step", call, rows)
        self.steps += 1
        self.batch_sum += len(rows)
        self.bucket_sum += self.shape.bucket_for(len(rows))

    def _start(self, kind: str, call: Any, rows: list[Request]) -> None:
        """Send ``call`` now: its task runs to its send before anything else is made
        (the client keeps the order of calls made one after another)."""
        if self.observer is not None:
            self.observer.sent(kind, rows)
        at = [r.asked for r in rows]  # each row's token is its sequence's asked-th
        task = asyncio.ensure_future(self._answer(kind, call, rows, at, time.monotonic()))
        self.inflight.append(task)

    async def _answer(
        self, kind: str, call: Any, rows: list[Request], at: list[int], sent: float
    ) -> None:
        try:
            reply: StepReply = await call
        except asyncio.CancelledError:
            if self.observer is not None:
                self.observer.cancelled(kind, rows)
            raise
        except GraphlaneError as exc:
            self._failures += 1
            if self.observer is not None:
                self.observer.failed(kind, rows, exc)
            if exc.code in LOST:  # the rows are prefilled again by _recover
                self.state_lost = True
            else:
                for r in rows:
                    self._fail(r, str(exc.code))
            self._wake.set()
            return
        done = time.monotonic()
        tokens = reply.outputs["tokens"]  # a decode's as a list, an add's a tensor
        for r, i, token in zip(rows, at, _as_list(tokens), strict=True):
            r.tokens[i - 1] = int(token)
            r.times[i - 1] = done
            r.received += 1
        if self.observer is not None:
            self.observer.answered(kind, rows, sent, done)
            for r in rows:
                if r.done:
                    self.observer.ended(r)

    def _fail(self, r: Request, code: str) -> None:
        if r.failed is None:
            r.failed = code
            if self.observer is not None:
                self.observer.ended(r)

    def _leave(self, r: Request) -> None:
        self.live.remove(r)
        if not self.state_lost:  # the worker forgets it (in order: after its last decode)
            self._frees = [f for f in self._frees if not f.done()]
            self._frees.append(asyncio.ensure_future(self._free(r.rid)))
        self.free += r.blocks  # its last decode runs before a later add writes them

    async def _free(self, rid: int) -> None:
        with contextlib.suppress(GraphlaneError):  # a restarted worker forgot it anyway
            await self.client.free_sequences(self.program, self.device, [rid])

    async def _recover(self) -> None:
        """The worker was lost: its sequences are gone with the cache. Once what is in
        flight ended, adopt the new generation (retryable errors meanwhile: held back,
        then tried again) and prefill every live request again from its prompt and the
        tokens it got (those after a token that never came back are asked again)."""
        await self._drain()
        self.state_losses += 1
        while not self.stopped:
            try:
                await self.client.reset_state(self.device)
                break
            except GraphlaneError as exc:
                if not exc.retryable:
                    raise
                if self.observer is not None:
                    self.observer.failed("reset_state", [], exc)
                if self.hold is not None:
                    await self.hold()
                else:
                    await asyncio.sleep(0.1)
        if self.stopped:
            return
        self.state_lost = False
        # Requests that left with their last decode in flight (asked every token, one
        # never came back) go back to the front of the queue: their blocks went to
        # others, so they are admitted again as room allows.
        live = set(map(id, self.live))
        orphans = [r for r in self.admitted
                   if id(r) not in live and r.failed is None and not r.done]  # fmt: skip
        for r in [*self.live, *orphans]:
            if r.failed is not None:
                continue
            got = next((i for i, t in enumerate(r.tokens) if t is None), r.new)
            r.tokens[got:] = [None] * (r.new - got)
            r.times[got:] = [None] * (r.new - got)
            r.received = r.asked = got
            if got == r.new:
                continue  # every token came back: it leaves
            # Forget it first where the worker still has it (only the connection was
            # lost): an id is added once. The free goes out before the add.
            self._frees.append(asyncio.ensure_future(self._free(r.rid)))
            self.reprefilled += 1
            if id(r) in live:
                self._prefill(r, got)
        self.queue.extendleft(reversed([r for r in orphans if not r.done]))


def _as_list(tokens: Any) -> list[Any]:
    """A reply's tokens as a list: as they are (a decode's, ``as_lists``) or a tensor's."""
    return tokens if type(tokens) is list else tokens.tolist()


__all__ = ["GenerationLoop", "ModelShape", "Observer", "Request"]
