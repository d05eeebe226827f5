"""The reference scheduler (graphlane/client/scheduler.py) after a lost worker, against a
fake worker whose next token is a function of the sequence's context: every request
ends with its own tokens, whichever of its calls the loss hit. The races a real daemon
shows once in a while (a request's last decode in flight when the worker dies, after the
request left the batch; the loss arriving while the loop drains at the end) are made
here on purpose."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from graphlane.client.scheduler import GenerationLoop, ModelShape, Request
from graphlane.protocol.errors import WorkerLost

VOCAB = 97
SHAPE = ModelShape(block_size=4, num_blocks=16, max_blocks_per_seq=4, buckets=(1, 2, 4),
                   vocab_size=VOCAB, dtype="float32")  # fmt: skip


def next_token(context: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(context)) * 31 + len(context)) % VOCAB


def expected(prompt: list[int], new: int) -> list[int]:
    context, out = list(prompt), []
    for _ in range(new):
        out.append(next_token(context))
        context.append(out[-1])
    return out


@dataclass
class Reply:
    outputs: dict[str, torch.Tensor]
    generation: int = 0


class FakeWorker:
    """Sequences by id, calls run in the order they were made (as a worker keeps a
    connection's order); the first call for which ``lose_when(worker, kind, rids)`` says
    so finds the worker dead: every sequence is forgotten and that call and every call
    after it fail with WORKER_LOST until the client adopts the new generation."""

    def __init__(self, lose_when: Any) -> None:
        self.seqs: dict[int, list[int]] = {}
        self.lose_when = lose_when
        self.losses = 0
        self.generation = 0
        self.lost_pending = False
        self.made = 0  # calls made
        self.ran = 0  # calls run
        self.turn = asyncio.Condition()

    def _call(self, kind: str, rids: list[int], make: Any, lists: bool = False) -> Any:
        async def answer() -> Reply | None:
            ticket = self.made  # sent when first run, as the client's calls are
            self.made += 1
            await asyncio.sleep(0.001)  # replies come back after the loop moved on
            async with self.turn:
                await self.turn.wait_for(lambda: self.ran == ticket)
                self.ran += 1
                self.turn.notify_all()
                if kind in ("add", "decode") and (
                    self.lost_pending or (self.losses == 0 and self.lose_when(self, kind, rids))
                ):
                    if not self.lost_pending:
                        self.losses += 1
                        self.generation += 1
                        self.seqs.clear()
                        self.lost_pending = True
                    raise WorkerLost("the worker died")
                out = make()
                if out is None:
                    return None
                tokens = out if lists else torch.tensor(out, dtype=torch.int64)
                return Reply({"tokens": tokens}, self.generation)

        return answer()

    def add_sequence(self, program: str, device: int, rid: int, prompt: list[int],
                     blocks: list[int]) -> Any:  # fmt: skip
        def make() -> list[int]:
            assert rid not in self.seqs, f"sequence {rid} added twice"
            self.seqs[rid] = list(prompt)
            token = next_token(self.seqs[rid])
            self.seqs[rid].append(token)
            return [token]

        return self._call("add", [rid], make)

    def decode(self, program: str, device: int, rids: list[int], as_lists: bool = False) -> Any:
        def make() -> list[int]:
            out = []
            for rid in rids:
                token = next_token(self.seqs[rid])
                self.seqs[rid].append(token)
                out.append(token)
            return out

        return self._call("decode", list(rids), make, as_lists)

    def free_sequences(self, program: str, device: int, rids: list[int]) -> Any:
        def make() -> None:
            for rid in rids:
                self.seqs.pop(rid, None)

        return self._call("free", list(rids), make)

    async def reset_state(self, device: int) -> None:
        self.lost_pending = False


def run_loop(worker: FakeWorker, requests: list[Request]) -> GenerationLoop:
    loop = GenerationLoop(worker, "model", 0, SHAPE, window=3)  # type: ignore[arg-type]

    async def main() -> None:
        task = asyncio.ensure_future(loop.run())
        for r in requests:
            loop.arrive(r)
        loop.close()
        await asyncio.wait_for(task, 10)

    asyncio.run(main())
    return loop


def requests(n: int, new: int) -> list[Request]:
    return [Request(i, [1 + i, 2 + i, 3], new) for i in range(n)]


def test_a_loss_on_a_requests_last_decode_after_it_left_the_batch_resumes_it() -> None:
    """Request 0 asked its last token (it left the batch, its blocks went to others) and
    the worker died under that decode: it is prefilled again, not cut."""
    reqs = requests(6, 5)
    last: dict[int, int] = {}

    def when(w: FakeWorker, kind: str, rids: list[int]) -> bool:
        if kind == "decode" and 0 in rids:
            last[0] = last.get(0, 0) + 1
            return last[0] == 4  # the 4th decode of request 0 asks its 5th token
        return False

    worker = FakeWorker(when)
    loop = run_loop(worker, reqs)
    assert worker.losses == 1
    assert [(r.done, r.cut, r.failed) for r in reqs] == [(True, False, None)] * 6
    for r in reqs:
        assert r.out == expected(r.prompt, r.new), r.rid
    assert loop.reprefilled >= 1 and loop.state_losses == 1


def test_a_loss_while_the_loop_drains_at_the_end_resumes_the_requests() -> None:
    """No more arrivals and every token asked: the loop drains, and the worker dies
    under the last decode; the requests are prefilled again and end with every token."""
    reqs = requests(2, 4)

    def when(w: FakeWorker, kind: str, rids: list[int]) -> bool:
        return kind == "decode" and all(len(w.seqs[r]) == 3 + 3 for r in rids)

    worker = FakeWorker(when)
    loop = run_loop(worker, reqs)
    assert worker.losses == 1
    assert [(r.done, r.cut, r.failed) for r in reqs] == [(True, False, None)] * 2
    for r in reqs:
        assert r.out == expected(r.prompt, r.new)
    assert loop.state_losses == 1


def test_a_loss_at_any_call_leaves_every_request_right() -> None:
    """The loss on each call of a run in turn: every request ends with its own tokens."""
    calls = 0
    for k in range(1, 40):
        seen = [0]

        def when(
            w: FakeWorker, kind: str, rids: list[int], k: int = k, seen: list[int] = seen
        ) -> bool:
            seen[0] += 1
            return seen[0] == k

        reqs = requests(5, 6)
        worker = FakeWorker(when)
        run_loop(worker, reqs)
        calls = max(calls, seen[0])
        assert [(r.done, r.cut, r.failed) for r in reqs] == [(True, False, None)] * 5, k
        for r in reqs:
            assert r.out == expected(r.prompt, r.new), (k, r.rid)
    assert calls >= 10  # the loss landed on every call of a run, prefills and decodes
