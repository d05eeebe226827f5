"""Sequences of a program with a paged KV cache on the device (hello's ``state.kind ==
"paged_kv"``, e.g. ``paged_attention``), driven as a scheduler's decode loop: one
:class:`PagedLoop` per device, in the shape of the reference scheduler
(:mod:`graphlane.client.scheduler`) on this program's own operations (``kv_write`` and
steps). What it does: docs/loadtest.md."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import statistics
import time
from collections import Counter, deque
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from graphlane.protocol import ops
from graphlane.protocol.errors import GraphlaneError
from graphlane.protocol.wire import encode_request

from .attention import reference
from .availability import DeviceBackoff
from .run import Call, Run, arrive, batch_figures, close_to, finish, send

#: What the load test fills of a paged program's step (and its kv_write).
PAGED_INPUTS = ("query", "key", "value", "slot_mapping", "block_table")
_INTS = ("layers", "num_heads", "num_kv_heads", "head_dim", "block_size", "num_blocks",
         "max_blocks_per_seq")  # fmt: skip


@dataclass(frozen=True)
class PagedShape:
    """The program's shapes, as the daemon's ``hello`` describes them (``config``)."""

    layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    max_blocks_per_seq: int
    buckets: tuple[int, ...]
    dtype: str

    @classmethod
    def from_description(cls, described: Mapping[str, Any]) -> PagedShape:
        """From a program's ``hello`` entry; ValueError when it is not a paged program."""
        state, cfg = described.get("state") or {}, described.get("config") or {}
        if state.get("kind") != "paged_kv":
            raise ValueError("the program keeps no paged KV cache (its hello has no state)")
        lacks = [n for n in PAGED_INPUTS if n not in (described.get("inputs") or {})]
        lacks += [] if "kv_write" in (state.get("ops") or {}) else ["kv_write"]
        if lacks:
            raise ValueError(f"a paged KV program's steps take inputs {', '.join(PAGED_INPUTS)}"
                             f" and its state op kv_write; this one lacks {', '.join(lacks)}")
        if "out" not in described.get("outputs", ()):
            raise ValueError("a paged KV program's steps give output out; this one does not")
        missing = [k for k in (*_INTS, "dtype") if k not in cfg]
        if missing:
            raise ValueError(f"the program's hello config lacks {', '.join(missing)}")
        buckets = tuple(int(b) for b in described.get("buckets", cfg.get("buckets", ())))
        return cls(**{k: int(cfg[k]) for k in _INTS}, buckets=buckets, dtype=str(cfg["dtype"]))

    @property
    def max_len(self) -> int:
        return self.block_size * self.max_blocks_per_seq

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    def describe(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in (*_INTS, "dtype")}, "buckets": list(self.buckets)}


@dataclass
class Sequence:
    """A live sequence: its blocks (for its whole life), the host copy of its KV, how
    much of it the device's cache holds (``length``) and in which worker generation."""

    sid: int
    blocks: list[int]
    keys: torch.Tensor  # [layers, capacity, num_kv_heads, head_dim]
    values: torch.Tensor
    length: int  # tokens in the cache (prompt + decoded)
    remaining: int  # tokens still to decode
    ended: asyncio.Future[None]
    generation: int | None = None

    def slots(self, block_size: int, start: int, stop: int) -> torch.Tensor:
        pos = torch.arange(start, stop)
        return torch.tensor(self.blocks)[pos // block_size] * block_size + pos % block_size


class PagedLoop:
    """One device's scheduler (see the module docstring)."""

    def __init__(self, run: Run, device: int, shape: PagedShape, backoff: DeviceBackoff) -> None:
        self.run, self.device, self.shape, self.backoff = run, device, shape, backoff
        self.counts: Counter[str] = Counter()  # figures of its own (blocks reused, bytes)
        self.request_bytes: list[int] = []
        # as the reference scheduler's loop counts (run.batch_figures)
        self.admitted: list[int] = []
        self.steps = self.batch_sum = self.bucket_sum = self.reprefilled = self.state_losses = 0
        seed = run.config.seed * 1000 + device
        self.rng, self.gen = random.Random(seed), torch.Generator().manual_seed(seed)
        self.queue: deque[tuple[int, int, int, asyncio.Future[None]]] = deque()
        self.live: dict[int, Sequence] = {}
        self.free = list(range(shape.num_blocks))[::-1]
        self.used: set[int] = set()
        self.wake = asyncio.Event()
        self.lost = False

    def arrive(self, sid: int, prompt: int, decode: int) -> asyncio.Future[None]:
        """Queue a sequence; the future is done when it ended (finished or cut)."""
        ended = asyncio.get_running_loop().create_future()
        self.queue.append((sid, prompt, decode, ended))
        self.wake.set()
        return ended

    def _random(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen).to(self.shape.torch_dtype)

    async def _admit(self) -> None:
        s = self.shape
        while self.queue and len(self.live) < max(s.buckets):
            sid, prompt, decode, ended = self.queue[0]
            need = -(-(prompt + decode) // s.block_size)
            if need > len(self.free):
                return  # wait for blocks
            self.queue.popleft()
            blocks = [self.free.pop() for _ in range(need)]
            self.counts["blocks_reused"] += sum(b in self.used for b in blocks)
            self.used.update(blocks)
            kv = (s.layers, prompt + decode, s.num_kv_heads, s.head_dim)
            seq = Sequence(sid, blocks, self._random(*kv), self._random(*kv), prompt, decode,
                           ended)  # fmt: skip
            self.live[sid] = seq
            self.admitted.append(sid)
            await self._write(seq)

    async def _recorded(self, call: Awaitable[Any]) -> Any:
        """Await a call; its error (but STATE_LOST, which is recovered from) is recorded."""
        try:
            return await call
        except GraphlaneError as exc:
            if exc.code != "STATE_LOST":
                self.run.rec.failed(exc, self.device)
            raise

    async def _write(self, seq: Sequence) -> None:
        """``kv_write`` what the cache should hold of ``seq``."""
        n = seq.length
        slots = seq.slots(self.shape.block_size, 0, n)
        key, value = seq.keys[:, :n].contiguous(), seq.values[:, :n].contiguous()
        reply = await self._recorded(
            self.run.client.kv_write(self.run.config.program, self.device, slots, key, value))
        seq.generation = reply.generation
        self.counts["prefill_bytes"] += key.nbytes + value.nbytes + slots.nbytes

    async def _recover(self) -> None:
        """STATE_LOST: adopt the new generation, write every live sequence again."""
        self.state_losses += 1
        while self.run.sending():
            try:
                await self._recorded(self.run.client.reset_state(self.device))
                for seq in self.live.values():
                    seq.generation = None
                for seq in list(self.live.values()):
                    await self._write(seq)
                    self.reprefilled += 1
                self.lost = False
                return
            except GraphlaneError as exc:
                if exc.code == "STATE_LOST":  # restarted again meanwhile
                    self.state_losses += 1
                elif not exc.retryable:
                    raise
                else:
                    await self._hold()

    async def _hold(self) -> None:
        await self.backoff.hold(self.device, self.run.pause)

    async def loop(self) -> None:
        with contextlib.suppress(GraphlaneError):  # a non-retryable error: already counted
            while self.run.sending():
                try:
                    if self.lost:
                        await self._recover()
                        continue
                    await self._admit()
                    if self.live:
                        await self._step()
                        continue
                    self.wake.clear()
                    await self.run.until(self.wake.wait(), 0.1)
                except GraphlaneError as exc:  # recorded where it happened
                    if exc.code == "STATE_LOST":
                        self.lost = True
                    elif not exc.retryable:
                        raise
                    else:
                        await self._hold()  # the step is rebuilt after the pause
        self.counts["cut"] += len(self.live)  # still decoding at the end
        for seq in list(self.live.values()):
            self._end(seq)

    def _end(self, seq: Sequence) -> None:
        del self.live[seq.sid]
        self.free.extend(seq.blocks)
        if not seq.ended.done():
            seq.ended.set_result(None)

    async def _step(self) -> None:
        run, s = self.run, self.shape
        seqs = [self.live[sid] for sid in sorted(self.live)]
        call = self._call(seqs, self.rng.random() < run.verify)
        body = ops.Step(run.config.program, self.device, call.params, call.inputs, ["out"],
                        call.batch, int(run.config.timeout_s * 1000),
                        run.client.generation(self.device))  # fmt: skip
        self.request_bytes.append(
            sum(len(memoryview(f)) for f in encode_request(1, "step", body)))
        reply = await send(run, call, "out", time.monotonic(), reraise=True)
        assert reply is not None
        self.backoff.success(self.device)
        self.steps += 1
        self.batch_sum += call.batch
        self.bucket_sum += min(b for b in s.buckets if b >= call.batch)
        # Only numbers computed on state written in the answering generation count.
        if call.expected is not None and all(q.generation == reply.generation for q in seqs):
            error = close_to(reply.outputs["out"], call.expected, s.torch_dtype)
            run.rec.verification(call, error, reply.generation)
        for seq in seqs:
            seq.length += 1
            seq.remaining -= 1
            if seq.remaining <= 0:
                self._end(seq)
                self.counts["finished"] += 1

    def _call(self, seqs: list[Sequence], check: bool) -> Call:
        """The next token of every sequence in ``seqs`` (its K/V is in the host copy
        already; committed once the step succeeded)."""
        s = self.shape
        table = torch.zeros(len(seqs), s.max_blocks_per_seq, dtype=torch.int32)
        for i, seq in enumerate(seqs):
            table[i, : len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        lengths = [seq.length + 1 for seq in seqs]
        inputs = {
            "query": self._random(len(seqs), s.num_heads, s.head_dim),
            "key": torch.stack([seq.keys[:, seq.length] for seq in seqs], dim=1),
            "value": torch.stack([seq.values[:, seq.length] for seq in seqs], dim=1),
            "slot_mapping": torch.cat([q.slots(s.block_size, q.length, q.length + 1)
                                       for q in seqs]),
            "block_table": table,
        }
        expected = self.expected(seqs, inputs["query"], lengths) if check else None
        rows = tuple(seq.sid for seq in seqs)
        return Call(self.device, len(seqs), {"actual_seq_lengths_kv": lengths}, inputs,
                    expected, rows)  # fmt: skip

    def expected(self, seqs: list[Sequence], query: torch.Tensor, lengths: list[int]) -> Any:
        """The step's output from the host copy: the eager attention of independent calls
        (:func:`.attention.reference`) over each row's KV, padded to the longest row."""
        s = self.shape
        kv = torch.zeros(2, s.layers, len(seqs), s.num_kv_heads, max(lengths), s.head_dim,
                         dtype=s.torch_dtype)  # fmt: skip
        for i, (seq, n) in enumerate(zip(seqs, lengths, strict=True)):
            kv[0, :, i, :, :n] = seq.keys[:, :n].transpose(1, 2)
            kv[1, :, i, :, :n] = seq.values[:, :n].transpose(1, 2)
        return reference(s, query[:, :, None], kv[0], kv[1], lengths)[:, :, 0]


async def drive_sequences(run: Run, shape: PagedShape, devices: tuple[int, ...]) -> None:
    """Sequences arrive (:func:`.run.arrive`) in turn on the devices' loops until the
    run's end; fills ``run.extra`` (see docs/loadtest.md)."""
    backoff = DeviceBackoff(random.Random(run.config.seed ^ 0xB0FF))
    loops = run.loops = [PagedLoop(run, d, shape, backoff) for d in sorted(devices)]
    sids = itertools.count()

    def one(_: float) -> asyncio.Future[None]:
        sid = next(sids)
        lp = loops[sid % len(loops)]
        return lp.arrive(sid, *run.config.draw_lengths(lp.rng, shape.max_len))

    tasks = {run.spawn(lp.loop()) for lp in loops}
    await arrive(run, one)
    run.end_sending()
    for lp in loops:
        lp.wake.set()
    await finish(run, tasks)
    c = sum((lp.counts for lp in loops), Counter[str]())
    rb = [n for lp in loops for n in lp.request_bytes]
    run.extra.update(batch_figures(loops, sum(lp.batch_sum for lp in loops), next(sids),
                                   c["finished"], c["cut"]))  # fmt: skip
    run.extra.update(blocks_reused=c["blocks_reused"], prefill_bytes=c["prefill_bytes"],
                     request_bytes={"mean": round(statistics.fmean(rb), 1) if rb else None,
                                    "min": min(rb, default=None), "max": max(rb, default=None)})
