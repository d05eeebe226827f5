"""The paged_attention program on the step engine (sim): a scheduler's decode run over the
device-resident KV cache, checked against the scheduler's own copy of the KV with
torch SDPA (tests/paged_kv.py), with prefills through kv_write, reads through kv_read,
blocks freed and reused, depth 1 and 2, pipelined and serial. Every step and KV
operation is issued without waiting for the previous ones: the sim reports any
unordered access to the cache as a HazardError, which fails the run."""

from __future__ import annotations

import pytest
import torch
from issuer import Issuer
from npusim import torch_npu
from paged_kv import Scheduler

from graphlane.protocol import ops
from graphlane.workers.backends.npu import NpuBackend
from graphlane.workers.job import Job
from graphlane.workers.programs import (
    PagedAttentionConfig,
    PagedAttentionProgram,
    ProgramConfigError,
    StepError,
    load_program,
)

CFG = PagedAttentionConfig(
    layers=2, num_heads=4, num_kv_heads=2, head_dim=16, block_size=128, num_blocks=10,
    max_blocks_per_seq=3, buckets=(1, 2, 4),
)  # fmt: skip
TOL = dict(atol=3e-3, rtol=3e-3)


def _engine(depth: int = 1, pipeline: bool = True) -> Issuer:
    program = PagedAttentionProgram(CFG)
    # Serial mode runs with one permit, as the worker runs it.
    return Issuer(
        NpuBackend(torch_npu, 0), [program], depth=depth, pipeline=pipeline,
        max_inflight=8 if pipeline else 1,
    )  # fmt: skip


def _step(eng: Issuer, inputs: dict[str, torch.Tensor], lengths: list[int]) -> Job:
    return eng.issue(
        eng.plan(len(lengths), lengths, inputs, ("out", "lse"), program="paged_attention")
    )


def _done(eng: Issuer, step: Job) -> dict[str, torch.Tensor]:
    (done,) = eng.wait([step], 60)
    assert done.results is not None
    return done.results


@pytest.mark.parametrize(("depth", "pipeline"), [(1, True), (2, True), (2, False)])
def test_decode_run_matches_sdpa_over_the_schedulers_copy(depth: int, pipeline: bool) -> None:
    sched = Scheduler(CFG, torch.Generator().manual_seed(11))
    with _engine(depth, pipeline) as eng:
        program = eng.engine.programs["paged_attention"]
        assert isinstance(program, PagedAttentionProgram)
        caches = {id(g.buffers["key_cache_0"]) for g in eng.engine.graphs.values()}
        assert len(caches) == 1  # one cache, shared by every bucket and instance
        writes = []
        for sid, n in enumerate([130, 5, 255, 60]):  # crossing block boundaries
            slots, k, v = sched.prefill(sid, n)
            writes.append(eng.state("paged_attention", "kv_write",
                                           {"slots": slots, "key": k, "value": v}))  # fmt: skip
        # Steps follow the writes at once: the cache's stream order is what fences them.
        live, pending = [0, 1, 2, 3], []
        for i in range(14):
            sids = live[: 1 + (i % len(live))]  # batch 1..4: buckets 1, 2, 4 (3 padded)
            inputs, lengths = sched.decode(sids)
            pending.append((_step(eng, inputs, lengths), sids, inputs["query"]))
            expected = sched.expected(sids, inputs["query"])
            pending[-1] = (*pending[-1], expected)
            if i == 6:  # sequence 1 ends; its blocks go to a new sequence 4
                sched.end(1)
                live.remove(1)
                slots, k, v = sched.prefill(4, 200)
                writes.append(eng.state("paged_attention", "kv_write",
                                               {"slots": slots, "key": k, "value": v}))  # fmt: skip
                live.append(4)
        for step, sids, _q, expected in pending:
            r = _done(eng, step)
            assert r["out"].shape == (len(sids), CFG.num_heads, CFG.head_dim)
            assert r["lse"].shape == (len(sids), CFG.num_heads, 1)
            torch.testing.assert_close(r["out"], expected, **TOL)
        eng.wait(writes, 60)
        # kv_read returns what prefill wrote and what the decode steps wrote in-graph.
        seq = sched.seqs[2]
        slots = sched.slots(seq, 0, seq.length)
        read = _done(eng, eng.state("paged_attention", "kv_read", {"slots": slots}))
        assert torch.equal(read["key"], seq.keys)
        assert torch.equal(read["value"], seq.values)
        assert eng.engine.failure is None


def test_a_smaller_batch_on_a_bucket_does_not_write_the_earlier_rows_again() -> None:
    """Batch 4 then batch 3 on bucket 4: row 3's slot belongs to a sequence that ended
    and whose block was reused; the padding row must not write there."""
    sched = Scheduler(CFG, torch.Generator().manual_seed(5))
    with _engine() as eng:
        for sid in range(4):
            slots, k, v = sched.prefill(sid, 10)
            eng.state("paged_attention", "kv_write",
                             {"slots": slots, "key": k, "value": v})  # fmt: skip
        inputs, lengths = sched.decode([0, 1, 2, 3])
        _done(eng, _step(eng, inputs, lengths))
        sched.end(3)
        slots, k, v = sched.prefill(5, 20)  # takes sequence 3's block
        eng.state("paged_attention", "kv_write", {"slots": slots, "key": k, "value": v})
        inputs, lengths = sched.decode([0, 1, 2])
        _done(eng, _step(eng, inputs, lengths))
        seq = sched.seqs[5]
        slots = sched.slots(seq, 0, seq.length)
        read = _done(eng, eng.state("paged_attention", "kv_read", {"slots": slots}))
        assert torch.equal(read["key"], seq.keys)


def test_steps_and_kv_ops_are_validated_with_the_field_named() -> None:
    sched = Scheduler(CFG, torch.Generator().manual_seed(3))
    with _engine() as eng:
        sched.prefill(0, 3)
        inputs, lengths = sched.decode([0])

        def refused(**changes: object) -> str:
            ins = {**inputs, **{k: v for k, v in changes.items() if k != "lengths"}}
            ins = {k: v for k, v in ins.items() if v is not None}
            n = changes.get("lengths", lengths)
            with pytest.raises(StepError) as info:
                body = ops.Step("paged_attention", 0, {"actual_seq_lengths_kv": n}, ins, [], 1)
                eng.engine.plan(body)
            return info.value.field

        assert refused(lengths=[CFG.max_kv_len + 1]) == "params.actual_seq_lengths_kv[0]"
        assert refused(slot_mapping=None) == "inputs.slot_mapping"
        assert refused(slot_mapping=torch.tensor([CFG.num_blocks * 128])) == "inputs.slot_mapping"
        bad_table = inputs["block_table"].clone()
        bad_table[0, 0] = CFG.num_blocks  # the scratch block is not the scheduler's
        assert refused(block_table=bad_table) == "inputs.block_table[0]"
        assert refused(query=inputs["query"].float()) == "inputs.query"
        with pytest.raises(StepError) as info:
            eng.engine.plan_state("paged_attention", "kv_write", {"slots": torch.tensor([1, 1]),
                           "key": torch.zeros(2, 2, 2, 16, dtype=torch.float16),
                           "value": torch.zeros(2, 2, 2, 16, dtype=torch.float16)})  # fmt: skip
        assert info.value.field == "slots"
        with pytest.raises(StepError) as info:
            eng.engine.plan_state("paged_attention", "kv_read", {"slots": torch.tensor([-1])})
        assert info.value.field == "slots"


def test_a_steps_slot_mapping_must_be_each_rows_own_new_token_slot() -> None:
    """A row's new token goes to position length - 1 of its own blocks: a slot_mapping
    into another sequence's blocks, or two rows writing one slot, is refused naming the
    row, and the cache keeps what was written."""
    sched = Scheduler(CFG, torch.Generator().manual_seed(8))
    with _engine() as eng:
        for sid, n in ((0, 20), (1, 130)):
            slots, k, v = sched.prefill(sid, n)
            eng.state("paged_attention", "kv_write", {"slots": slots, "key": k, "value": v})
        inputs, lengths = sched.decode([0, 1])

        def refused(ins: dict[str, torch.Tensor], n: list[int]) -> str:
            body = ops.Step("paged_attention", 0, {"actual_seq_lengths_kv": n}, ins, [], 2)
            with pytest.raises(StepError) as info:
                eng.engine.plan(body)
            return info.value.field

        victim = sched.slots(sched.seqs[0], 3, 4)  # a token sequence 0 holds
        into_other = inputs["slot_mapping"].clone()
        into_other[1] = victim[0]
        assert refused({**inputs, "slot_mapping": into_other}, lengths) == "inputs.slot_mapping[1]"
        # Two rows over one block table, one length: both would write one slot.
        table = inputs["block_table"].clone()
        table[1] = table[0]
        same = inputs["slot_mapping"].clone()
        same[1] = same[0]
        twice = {**inputs, "block_table": table, "slot_mapping": same}
        assert refused(twice, [lengths[0], lengths[0]]) == "inputs.slot_mapping[1]"
        seq = sched.seqs[0]
        read = _done(eng, eng.state("paged_attention", "kv_read",
                                    {"slots": sched.slots(seq, 0, 20)}))  # fmt: skip
        assert torch.equal(read["key"], seq.keys[:, :20])


def test_replay_is_refused_for_a_program_with_device_state() -> None:
    """A replay would re-run the cache writes from whatever the instance last held (a
    finished step's slots, maybe reassigned since): refused, for any program with
    state_ops, and hello says so; a stateless program still replays."""
    from graphlane.workers.programs import load_program as load

    sched = Scheduler(CFG, torch.Generator().manual_seed(9))
    attention = load("attention", {"name": "attention", "layers": 1, "num_heads": 4,
                                   "num_kv_heads": 2, "head_dim": 16, "max_kv_len": 32,
                                   "buckets": [1]})  # fmt: skip
    with Issuer(NpuBackend(torch_npu, 0), [PagedAttentionProgram(CFG), attention]) as eng:
        slots, k, v = sched.prefill(0, 3)
        eng.state("paged_attention", "kv_write", {"slots": slots, "key": k, "value": v})
        inputs, lengths = sched.decode([0])
        _done(eng, _step(eng, inputs, lengths))
        with pytest.raises(StepError) as info:
            eng.engine.plan_replay("paged_attention", 1, ["out"])
        assert info.value.field == "op"
        assert "device state" in str(info.value)  # it says why
        eng.engine.plan_replay("attention", 1, ["out"])  # no device state: offered
    assert PagedAttentionProgram(CFG).describe()["replay"] is False
    assert attention.describe()["replay"] is True


def test_config_is_checked_and_described() -> None:
    with pytest.raises(ProgramConfigError) as info:
        load_program("paged_attention", {"name": "paged_attention", "block_size": 16})
    assert info.value.key == "programs.paged_attention.block_size"
    with pytest.raises(ProgramConfigError) as info:
        load_program("paged_attention", {"name": "paged_attention", "kv_heads": 2})
    assert info.value.key == "programs.paged_attention.kv_heads"
    d = PagedAttentionProgram(CFG).describe()
    assert d["config"]["num_blocks"] == CFG.num_blocks
    assert d["inputs"]["block_table"] == {"shape": ["batch", 3], "dtype": "int32"}
    assert set(d["state_ops"]) == {"kv_write", "kv_read"}


def test_status_shows_the_description_readably() -> None:
    from graphlane.cli import describe_program

    lines = describe_program("paged_attention", PagedAttentionProgram(CFG).describe())
    assert lines[0].startswith("program paged_attention: buckets [1, 2, 4] layers=2")
    assert "  input  block_table [batch, 3] int32" in lines
    assert "  output lse [batch, 4, 1] float32" in lines
    assert any(line.startswith("  kv op  kv_write:") for line in lines)
