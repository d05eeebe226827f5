"""The model program's persistent batch (graphlane/workers/programs/batch.py) on the step
engine (sim, in this process): each sequence's block-table row and last token stay on
the device while others join, leave and take the rows they left; a decode copies what
changed alone; two clients' same sequence ids are two sequences; a token its sequence
never sampled on this worker is refused, never fed. Through a daemon: tests/daemon/
test_model_serving.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from daemons import wait_for
from issuer import Issuer
from model_ref import reference, save, tiny_model
from npusim import torch_npu

from graphlane.protocol.errors import NoPreviousToken
from graphlane.workers.backends.npu import NpuBackend
from graphlane.workers.job import Job, JobKind
from graphlane.workers.programs import ModelConfig, ModelProgram
from graphlane.workers.programs.batch import PersistentBatch

pytestmark = pytest.mark.usefixtures("float32_attention")

BLOCK = 128


class CountingBackend(NpuBackend):
    """The npu provider over the sim, counting its host-to-device copies (bytes each)."""

    def __init__(self) -> None:
        super().__init__(torch_npu, 0)
        self.copies: list[int] = []

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.copies.append(src.numel() * src.element_size())
        super().copy_in(dst, src)


class Client:
    """One client's sequence operations, issued in order as the worker issues them."""

    def __init__(self, eng: Issuer, owner: str) -> None:
        self.eng, self.owner = eng, owner
        self.jobs: list[tuple[Job, list[int]]] = []  # each add's and decode's, its rows

    def plan(self, op: str, fields: dict[str, Any]) -> Job:
        plan = self.eng.engine.plan_sequences("model", op, fields, self.owner, ("tokens",))
        kind = JobKind.STATE if op == "add" else JobKind.STEP
        return Job(kind, plan, ("tokens",), owner=self.owner)

    def add(self, sid: int, prompt: list[int], blocks: list[int]) -> Job:
        fields = {"sequence": sid, "tokens": torch.tensor(prompt), "blocks": blocks}
        job = self.eng.issue(self.plan("add", fields))
        self.jobs.append((job, [sid]))
        return job

    def decode(self, sids: list[int], new_blocks: dict[int, list[int]] | None = None) -> Job:
        job = self.eng.issue(self.plan("decode", {"sequences": sids,
                                                  "new_blocks": new_blocks or {}}))  # fmt: skip
        self.jobs.append((job, sids))
        return job

    def free(self, sids: list[int]) -> None:
        self.eng.engine.programs["model"].sequence_change("free", {"sequences": sids}, self.owner)

    def tokens(self) -> dict[int, list[int]]:
        """Each sequence's tokens, in the order its adds and decodes were issued."""
        self.eng.wait([j for j, _ in self.jobs], 120)
        out: dict[int, list[int]] = {}
        for job, sids in self.jobs:
            assert job.results is not None
            for sid, tok in zip(sids, job.results["tokens"].tolist(), strict=True):
                out.setdefault(sid, []).append(tok)
        return out


def test_rows_survive_others_joining_and_leaving_and_clients_ids_are_their_own(
    tmp_path: Path,
) -> None:
    """Two clients decode ahead (nothing waited for until the end) over the same
    sequence ids: sequences join, sit steps out, change row order, cross into a new
    block, leave, and a newcomer takes a freed row and block; every sequence's tokens
    are transformers' greedy tokens for its own prompt."""
    model = tiny_model("llama", seed=3)
    config = ModelConfig(model=save(model, tmp_path / "m"), dtype="float32", block_size=BLOCK,
                         num_blocks=12, max_blocks_per_seq=3, buckets=(1, 2, 4))  # fmt: skip
    g = torch.Generator().manual_seed(9)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, 256, (n,), generator=g).tolist()

    pa = {0: prompt(125), 1: prompt(7), 2: prompt(40), 3: prompt(3)}
    pb = {0: prompt(20), 1: prompt(126)}
    with Issuer(NpuBackend(torch_npu, 0), [ModelProgram(config)], max_inflight=4) as eng:
        a, b = Client(eng, "a"), Client(eng, "b")
        a.add(0, pa[0], [0])
        b.add(0, pb[0], [4])
        a.decode([0])
        a.add(1, pa[1], [1])
        b.decode([0])
        a.decode([1, 0])
        b.add(1, pb[1], [5])
        a.add(2, pa[2], [2])
        b.decode([1, 0])
        a.decode([2, 0, 1])  # a's 0 is 128 tokens long now
        a.free([1])  # its row and block go to the newcomer, after its last decode
        a.add(3, pa[3], [1])
        b.decode([0, 1], {1: [6]})  # b's 1 crosses into its second block
        a.decode([0, 3, 2], {0: [3]})  # a's 0 crosses into its second block
        a.decode([3])  # 0 and 2 sit out
        b.decode([1])
        a.decode([2, 3, 0])
        a.decode([0])
        got_a, got_b = a.tokens(), b.tokens()
    for sid, p in pa.items():
        assert got_a[sid] == reference(model, p, len(got_a[sid])), f"a's sequence {sid}"
    for sid, p in pb.items():
        assert got_b[sid] == reference(model, p, len(got_b[sid])), f"b's sequence {sid}"


def _random_program(width: int) -> ModelProgram:
    arch = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}  # fmt: skip
    return ModelProgram(ModelConfig(random=arch, seed=5, init_std=0.3, block_size=BLOCK,
                                    num_blocks=4 * width, max_blocks_per_seq=width,
                                    buckets=(4,)))  # fmt: skip


def _decode_copies(width: int, context: int, new_block: bool) -> list[int]:
    """The host-to-device copies (bytes each) of one greedy decode of 3 sequences of
    ``context`` tokens at ``width`` blocks per sequence, the first given a new block."""
    backend = CountingBackend()
    with Issuer(backend, [_random_program(width)]) as eng:
        c = Client(eng, "a")
        need = (context + 1) // BLOCK + 1  # the blocks both decodes' tokens need
        for sid in range(3):
            c.add(sid, [sid + 1] * context, list(range(sid * width, sid * width + need)))
        c.decode([2, 0, 1])  # the first decode: rows written as they joined
        c.tokens()
        before = len(backend.copies)
        more = {0: [width - 1]} if new_block else None  # sequence 0's last block
        c.decode([1, 0, 2], more)
        c.tokens()
        return backend.copies[before:]


def test_a_decode_copies_what_changed_alone() -> None:
    """Per decode, the host copies one small tensor: its per-row values and the rows'
    index, in one copy (each copy costs the host a pinning and a launch): the same at 1
    or 8 blocks per sequence and 10 or 800 tokens of context; a new block adds one copy
    of its id, not the table."""
    plain = _decode_copies(1, 10, False)
    assert plain == _decode_copies(8, 10, False) == _decode_copies(8, 800, False)
    assert plain == [4 * (3 + 1) * 8]  # ints (token, position, slot) and rows, 4 rows
    assert _decode_copies(8, 800, True) == [4, *plain]  # the block's id, then as before


@pytest.mark.parametrize("patches_first", [False, True])
def test_a_token_its_sequence_never_sampled_here_is_refused(
    patches_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode whose sequence's add was planned but never issued, or whose previous
    decode was planned but never issued, is refused (NO_PREVIOUS_TOKEN): never fed the
    row's stale token (its previous holder's, or its own older one). Refused before its
    patches go when they go first (patches that cost more than a hand-off: the program's
    check_feeds), so the refusal is the step's alone, and the next decode is served.
    Each decode's rows are checked once, whichever way it goes."""
    checks: list[int] = []
    check = PersistentBatch.check

    def counted(seqs: Any, lengths: Any) -> None:
        checks.append(len(seqs))
        check(seqs, lengths)

    monkeypatch.setattr(PersistentBatch, "check", staticmethod(counted))
    with Issuer(NpuBackend(torch_npu, 0), [_random_program(2)]) as eng:
        if patches_first:
            eng.engine._u_costs.extend([1.0] * 8)  # as if each step's patches took a second
        c = Client(eng, "a")
        c.add(0, [1, 2, 3], [0])
        c.plan("add", {"sequence": 1, "tokens": torch.tensor([4, 5]), "blocks": [1]})  # lost
        refused = c.decode([0, 1])
        c.plan("decode", {"sequences": [0]})  # planned, lost
        behind = c.decode([0])
        wait_for(lambda: eng._all_done([refused, behind]), 60, "both decodes answered")
        for job in (refused, behind):
            assert isinstance(job.error, NoPreviousToken), job.error
        assert eng.engine.failure is None
        c.add(2, [6, 7], [2])  # (sequence 0 stays refused until freed and added again)
        served = c.decode([2])
        wait_for(lambda: eng._all_done([served]), 60, "the next decode")
        assert served.error is None
    assert checks == [2, 1, 1]  # the three decodes' rows, once each


def test_a_sampling_sequence_draws_the_same_tokens_in_any_row_beside_any_others() -> None:
    """A sequence's sampling settings are kept with it (its add's params): decoded alone,
    or in another row beside greedy sequences that join and leave (steps with no draw
    between its steps), it draws the same seeded tokens."""
    hot = {"temperature": 0.9, "top_k": 8, "seed": 4}

    def run(others: bool) -> list[int]:
        with Issuer(NpuBackend(torch_npu, 0), [_random_program(2)], max_inflight=3) as eng:
            c = Client(eng, "a")
            fields = {"sequence": 7, "tokens": torch.tensor([3, 1, 4]), "blocks": [0],
                      "params": hot}  # fmt: skip
            job = eng.issue(c.plan("add", fields))
            c.jobs.append((job, [7]))
            if others:
                c.add(1, [5, 9], [1])
                c.decode([1])  # greedy alone: its step copies no sampling settings
                c.decode([1, 7])
                c.add(2, [2, 6, 5], [2])
                c.free([1])
                c.decode([2, 7])
                c.decode([2])
                c.decode([7, 2])
            else:
                for _ in range(3):
                    c.decode([7])
            return c.tokens()[7]

    alone = run(False)
    assert run(True) == alone and len(set(alone)) > 1, alone
