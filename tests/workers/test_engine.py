"""The step engine on the sim: numerics of whole steps against the test's own
attention reference, for every bucket, padding, GQA, depth 1 and 2, serial and
pipelined, over the npu provider with and without the fused update binding.

The engine is driven as the worker drives it: the test's thread is the issuer
(``reserve`` then ``issue``), and ``on_done`` hands back each finished step.
Serving behaviour (sockets, queueing, deadlines) is tested through real workers
in tests/workers/test_worker_loop.py and tests/daemon."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from daemons import wait_for
from issuer import Issuer
from npusim import HazardError, torch_npu
from reference import decode_stack

from graphlane.protocol import ops
from graphlane.workers.backends import create_backend
from graphlane.workers.backends.faults import FaultyBackend, InjectedDeviceFault
from graphlane.workers.backends.npu import NpuBackend
from graphlane.workers.backends.null import NullBackend
from graphlane.workers.engine import EngineError
from graphlane.workers.job import Job, JobKind
from graphlane.workers.programs import AttentionConfig, AttentionProgram, GraphKey, StepError

CFG = AttentionConfig(
    layers=3, num_heads=4, num_kv_heads=2, head_dim=16, max_kv_len=24, buckets=(1, 2, 4)
)


def _issuer(depth: int = 1, pipeline: bool = True, fused: bool = True) -> Issuer:
    backend = NpuBackend(torch_npu, 0, use_fused_update=fused)
    # Serial mode runs with one permit, as the worker runs it.
    return Issuer(
        backend, [AttentionProgram(CFG)], depth=depth, pipeline=pipeline,
        max_inflight=8 if pipeline else 1,
    )  # fmt: skip


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


def _kv(batch: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (CFG.layers, batch, CFG.num_kv_heads, CFG.max_kv_len, CFG.head_dim)
    return (
        torch.randn(shape, dtype=torch.float16, generator=gen),
        torch.randn(shape, dtype=torch.float16, generator=gen),
    )


def _query(batch: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, CFG.num_heads, 1, CFG.head_dim, dtype=torch.float16, generator=gen)


def _lengths(batch: int, gen: torch.Generator) -> list[int]:
    return torch.randint(1, CFG.max_kv_len + 1, (batch,), generator=gen).tolist()


def _expected(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    return decode_stack(q, list(k), list(v), lengths)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_steps_match_reference(
    depth: int, pipeline: bool, fused: bool, gen: torch.Generator
) -> None:
    """Every batch size 1..4 (buckets 1, 2, 4: sizes 3 is padded), issued without
    waiting (as many as the engine's permits allow), so consecutive steps overlap;
    key/value written once per instance and kept by later steps that bring only a
    query."""
    kv_of: dict[GraphKey, tuple[torch.Tensor, torch.Tensor]] = {}
    with _issuer(depth, pipeline, fused) as it:
        # Round 1: write key/value into every instance.
        first = []
        for batch in (1, 2, 4):
            for _ in range(depth):
                k, v = _kv(batch, gen)
                q, n = _query(batch, gen), _lengths(batch, gen)
                step = it.step(batch, n, inputs={"query": q, "key": k, "value": v})
                first.append((step, q, k, v, n))
        it.wait([s for s, *_ in first])
        for r, q, k, v, n in first:
            assert r.graph is not None and r.results is not None
            kv_of[r.graph.key] = (k, v)
            torch.testing.assert_close(
                r.results["out"], _expected(q, k, v, n), atol=2e-3, rtol=2e-3
            )
        # Round 2: many steps, only queries and lengths, every batch size.
        steps = []
        for i in range(24):
            batch = 1 + i % 4
            q, n = _query(batch, gen), _lengths(batch, gen)
            steps.append((it.step(batch, n, inputs={"query": q}), q, n, batch))
        it.wait([s for s, *_ in steps])
        for r, q, n, batch in steps:
            assert r.graph is not None and r.results is not None
            assert r.graph.key.bucket == min(b for b in CFG.buckets if b >= batch)
            k, v = kv_of[r.graph.key]
            assert r.results["out"].shape == (batch, CFG.num_heads, 1, CFG.head_dim)
            kb, vb = k[:, :batch], v[:, :batch]
            torch.testing.assert_close(
                r.results["out"], _expected(q, kb, vb, n), atol=2e-3, rtol=2e-3
            )
        assert it.engine.failure is None


def test_depth_two_alternates_instances_and_skips_unchanged_groups() -> None:
    with _issuer(depth=2) as it:
        results = [it.run(2, [5, 6]) for _ in range(4)]
    assert [r.graph.key.instance for r in results if r.graph] == [0, 1, 0, 1]
    # The first step on each instance patches every layer; the same lengths again
    # on the same instance release the layers without a patch.
    assert [r.patched for r in results] == [CFG.layers, CFG.layers, 0, 0]


def test_an_update_stages_an_instance_that_the_next_replay_releases() -> None:
    """update patches the next instance and keeps it staged (no release, no replay);
    replay releases and replays that instance, as last patched."""
    with _issuer(depth=2) as it:
        body = ops.Update("attention", 0, {"actual_seq_lengths_kv": [4]}, batch=1)
        update = it.issue(Job(JobKind.UPDATE, it.engine.plan(body)))
        replay = it.issue(Job(JobKind.REPLAY, it.engine.plan_replay("attention", 1, ["out"]),
                               ("out",)))  # fmt: skip
        following = it.step(1, [4])
        it.wait([update, replay, following])
    assert update.patched == CFG.layers and update.results == {}
    assert replay.graph is update.graph and replay.patched == 0
    assert replay.results is not None and replay.results["out"].shape[0] == 1
    assert following.graph is not update.graph  # the ring moved on


@pytest.fixture
def issuer() -> Iterator[Issuer]:
    with _issuer() as it:
        yield it


@pytest.mark.parametrize(
    ("batch", "params", "inputs", "outputs", "field"),
    [
        (5, {"actual_seq_lengths_kv": [1] * 5}, {}, ("out",), "batch"),
        (2, {"actual_seq_lengths_kv": [1]}, {}, ("out",), "params.actual_seq_lengths_kv"),
        (2, {"actual_seq_lengths_kv": [1, 25]}, {}, ("out",), "params.actual_seq_lengths_kv[1]"),
        (2, {"actual_seq_lengths_kv": [0, 3]}, {}, ("out",), "params.actual_seq_lengths_kv[0]"),
        (1, {}, {}, ("out",), "params.actual_seq_lengths_kv"),
        (1, {"actual_seq_lengths_kv": [1], "x": 1}, {}, ("out",), "params.x"),
        (
            1,
            {"actual_seq_lengths_kv": [1]},
            {"query": torch.zeros(1, 4, 1, 8, dtype=torch.float16)},
            ("out",),
            "inputs.query",
        ),
        (
            1,
            {"actual_seq_lengths_kv": [1]},
            {"query": torch.zeros(1, 4, 1, 16)},
            ("out",),
            "inputs.query",
        ),
        (1, {"actual_seq_lengths_kv": [1]}, {"bias": torch.zeros(1)}, ("out",), "inputs.bias"),
        (1, {"actual_seq_lengths_kv": [1]}, {}, ("lse",), "outputs"),
    ],
)
def test_bad_steps_name_the_field(
    issuer: Issuer, batch: int, params: dict, inputs: dict, outputs: tuple[str, ...], field: str
) -> None:
    with pytest.raises(StepError) as err:
        issuer.plan(batch, [], inputs=inputs, outputs=outputs, params=params)
    assert err.value.field == field
    assert issuer.run(1, [3]).results is not None


def test_unknown_program(issuer: Issuer) -> None:
    with pytest.raises(StepError) as err:
        issuer.plan(1, [1], program="decoder")
    assert err.value.field == "program"


def test_a_hazard_fails_the_step_loudly_and_the_engine_refuses_more(issuer: Issuer) -> None:
    """Someone else releases a layer of a captured graph: the engine's own release
    for the next step then merges with it. The step fails with the HazardError."""
    key = GraphKey("attention", 1, 0)
    stray = torch.npu.Stream()
    issuer.run(1, [2])
    issuer.engine.graphs[key].events[1].record(stray)
    # The step can end before its own release of that layer runs (the stray one let the
    # replay through): the merge is reported when that release runs, at the latest by
    # the device's next synchronize; the engine fails on it and refuses further steps.
    with pytest.raises(HazardError):
        issuer.run(1, [3])
        issuer.engine.backend.synchronize()
    # A step's patches may be on the update thread when its issue returns (they go
    # first): its end, and the engine's failure, can come after; wait for it.
    first = issuer.step(1, [3])
    wait_for(lambda: issuer._all_done([first]), 30, "the step after the hazard")
    refused = first if isinstance(first.error, EngineError) else issuer.step(1, [3])
    wait_for(lambda: issuer._all_done([refused]), 30, "the step refused")
    assert isinstance(refused.error, EngineError)


def test_create_backend_names() -> None:
    assert create_backend("sim").name == "sim"
    with pytest.raises(ValueError):
        create_backend("tpu")


def test_null_backend_runs_the_engine_without_a_device() -> None:
    """The null provider (for measuring graphlane alone) drives the same engine path."""
    with Issuer(create_backend("null"), [AttentionProgram(CFG)], depth=2) as it:
        results = [it.run(3, [1, 2, 3]) for _ in range(4)]
    assert [r.graph.key.instance for r in results if r.graph] == [0, 1, 0, 1]
    assert all(
        r.results is not None and r.results["out"].shape == (3, CFG.num_heads, 1, CFG.head_dim)
        for r in results
    )


# ---------------------------------------------------------------- completion and permits
class _Gate:
    """A done event that completes when the test opens it."""

    def __init__(self, opened: threading.Event, queried: list[None]) -> None:
        self.opened = opened
        self.queried = queried

    def query(self) -> bool:
        self.queried.append(None)
        return self.opened.is_set()

    def synchronize(self) -> None:
        assert self.opened.wait(30)

    def record(self, stream: object = None) -> None:
        pass


class _GatedBackend(NullBackend):
    """No device; the done event of a step issued while ``hold`` is set completes when
    ``opened`` is set, the others at once."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = True
        self.opened = threading.Event()
        self.queried: list[None] = []  # one entry per query() of a gated event

    def new_event(self) -> Any:
        return _Gate(self.opened, self.queried) if self.hold else super().new_event()


def test_where_steps_are_answered_and_the_in_flight_bound() -> None:
    """A step's patches are dispatched by the update thread while the issuer launches the
    rest of it; the last of the two answers it if it is complete by then, else the
    completion thread does; and no more than max_inflight steps are ever on the device."""
    backend = _GatedBackend()
    issuer = threading.current_thread().name
    with Issuer(backend, [AttentionProgram(CFG)], max_inflight=2) as it:
        try:
            gated = [it.step(1, [2]), it.step(1, [3])]
            assert not it.engine.reserve(blocking=False)  # both permits are on the device
            # both dispatched, found unfinished and handed to the completion thread
            wait_for(lambda: len(backend.queried) == 2, 30, "both steps' dispatch")
            assert it.finished == []
            backend.opened.set()
            wait_for(lambda: len(it.finished) == 2, 30, "both steps to complete")
            assert [(s, name) for s, name in it.finished] == [
                (gated[0], "graphlane-completion"),
                (gated[1], "graphlane-completion"),
            ]
            assert [s.error for s in gated] == [None, None]
            assert it.engine.reserve(blocking=False)  # permits came back
            it.engine.issue(lone := it.plan(1, [2]))  # complete at once
            wait_for(lambda: len(it.finished) == 3, 30, "the lone step")
            assert it.finished[2][0] is lone
            assert it.finished[2][1] in (issuer, "graphlane-update")

            backend.opened.clear()
            first = it.step(1, [4])  # waits in the completion thread
            backend.hold = False
            behind = it.step(1, [5])  # complete at once, answered by one of its two issuers
            wait_for(lambda: len(it.finished) == 4, 30, "the step behind")
            assert it.finished[3][0] is behind
            assert it.finished[3][1] in (issuer, "graphlane-update")
            backend.opened.set()
            wait_for(lambda: len(it.finished) == 5, 30, "the first step")
            assert it.finished[4] == (first, "graphlane-completion")
            assert it.engine.jobs_done == 5
        finally:
            backend.opened.set()


class _ReplayAfterPatch(NullBackend):
    """No device; a patch costs ``patch_s`` of host time off the interpreter lock (as an
    NPU's tiling does); with ``gate``, a replay waits (at most 10 s) until a patch was
    dispatched since ``patched`` was cleared, and says whether one was. ``log``: each
    patch and replay, in order, with its thread."""

    def __init__(self, patch_s: float) -> None:
        super().__init__()
        self.patch_s = patch_s
        self.gate = False
        self.patched = threading.Event()
        self.log: list[tuple[str, str]] = []
        self.replays: list[bool] = []

    def patch(self, *args: Any, **kwargs: Any) -> Any:
        if self.patch_s:  # (a sleep of 0 still yields the core: long on a busy machine)
            time.sleep(self.patch_s)
        self.log.append(("patch", threading.current_thread().name))
        self.patched.set()
        return super().patch(*args, **kwargs)

    def replay(self, *args: Any, **kwargs: Any) -> Any:
        if self.gate:
            self.replays.append(self.patched.wait(10))
        self.log.append(("replay", threading.current_thread().name))
        return super().replay(*args, **kwargs)


def _lone_steps(backend: _ReplayAfterPatch, steps: int) -> list[list[tuple[str, str]]]:
    """Eight steps to learn what patches cost (the engine takes the least of the last
    eight), then ``steps`` lone steps: each step's log."""
    logs = []
    with Issuer(backend, [AttentionProgram(CFG)], max_inflight=2) as it:
        for i in range(8):
            it.step(1, [2 + i % 2])
            wait_for(lambda n=i + 1: len(it.finished) == n, 30, "a first step")
        for i in range(steps):  # each step alone: the one before it is over
            backend.log.clear()
            backend.patched.clear()
            job = it.step(1, [2 + i % 2])  # a length other than the step before's
            wait_for(lambda n=i + 9: len(it.finished) == n, 30, "the step")
            assert job.error is None
            logs.append(list(backend.log))
    return logs


def test_a_lone_steps_costly_patches_are_dispatched_while_its_issuer_launches_the_rest() -> None:
    """A step's patches go to the update thread before its issuer copies its inputs and
    launches its replay (they need none of that), so a lone step's patches, the
    host-bound part of it, overlap its launch instead of following it on one thread.
    The backend's replay blocks until a patch was dispatched: issued one after the other
    by the issuer, each step would wait 10 s and find none."""
    backend = _ReplayAfterPatch(patch_s=0.005)
    backend.gate = True
    backend.patched.set()  # the first step, which learns the cost, is not gated
    for log in _lone_steps(backend, 3):
        assert {t for kind, t in log if kind == "patch"} == {"graphlane-update"}
    assert backend.replays == [True] * 11


def test_a_lone_steps_cheap_patches_are_dispatched_by_its_issuer() -> None:
    """Patches that cost less than a hand-off (a `null` device's) are dispatched by a lone
    step's issuer after its launch, with no thread hop."""
    backend = _ReplayAfterPatch(patch_s=0.0)
    me = threading.current_thread().name
    for log in _lone_steps(backend, 3):
        assert log[0] == ("replay", me)
        assert {t for kind, t in log if kind == "patch"} == {me}


def test_a_failed_issue_is_reported_to_its_issuer_and_returns_the_permit() -> None:
    backend = FaultyBackend(create_backend("null"), device_fault_after=0)
    with Issuer(backend, [AttentionProgram(CFG)], max_inflight=1) as it:
        failed = it.step(1, [2])
        assert isinstance(failed.error, InjectedDeviceFault)
        assert it.engine.failure is failed.error
        refused = it.step(1, [2])  # the permit came back; a failed engine refuses, in order
        assert isinstance(refused.error, EngineError)
        assert it.engine.reserve(blocking=False)


def test_null_backend_captures_and_steps_the_model_program() -> None:
    """``backend = "null"`` serves every program (it measures graphlane's own CPU, as
    ``graphlane bench --field`` does with the model): the model's fused ops give zeros
    of their meta kernels' shapes, so its graph is built as on a device. (The null
    provider returned None for every op, and the model program, built from fused ops
    that return tensors, failed to start there.)"""
    from graphlane.workers.programs.model import ModelConfig, ModelProgram

    arch = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}  # fmt: skip
    config = ModelConfig(random=arch, seed=5, init_std=0.3, block_size=128, num_blocks=6,
                         max_blocks_per_seq=1, buckets=(2,))  # fmt: skip
    program = ModelProgram(config)
    with Issuer(create_backend("null"), [program], depth=2) as it:
        inputs = {"tokens": torch.tensor([3, 4]),
                  "block_table": torch.tensor([[0], [1]], dtype=torch.int32)}  # fmt: skip
        done = it.wait([it.issue(it.plan(2, [1, 1], inputs=inputs, outputs=("tokens",),
                                         program="model",
                                         params={"actual_seq_lengths_kv": [1, 1]}))])  # fmt: skip
    assert done[0].results is not None and done[0].results["tokens"].shape == (2,)


class _FailingAfterHandOff(_ReplayAfterPatch):
    """Costly patches (so a step's patches go to the update thread first); ``fail``
    names what raises next: "replay" (the issuer's side) or "patch" (the update
    thread's)."""

    def __init__(self) -> None:
        super().__init__(patch_s=0.005)
        self.fail = ""

    def patch(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail == "patch":
            raise InjectedDeviceFault("the patch failed")
        return super().patch(*args, **kwargs)

    def replay(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail == "replay":
            raise InjectedDeviceFault("the replay failed")
        return super().replay(*args, **kwargs)


@pytest.mark.parametrize("side", ["replay", "patch"])
@pytest.mark.parametrize("alone", [True, False])
def test_a_fault_on_either_side_of_a_handed_over_step_ends_it_once(side: str, alone: bool) -> None:
    """A step whose patches went to the update thread while its issuer launched the rest:
    a fault on either side ends it once, with that fault (the other side, done or not,
    does not answer it again), every permit comes back, and the failed engine refuses
    what follows in order."""
    backend = _FailingAfterHandOff()
    with Issuer(backend, [AttentionProgram(CFG)], max_inflight=3) as it:
        it.step(1, [2])  # learns that patches are costly
        wait_for(lambda: len(it.finished) == 1, 30, "the first step")
        before = [] if alone else [it.step(1, [3])]
        backend.fail = side
        failed = it.step(1, [4])
        wait_for(lambda: failed in [s for s, _ in it.finished], 30, "the failed step")
        backend.fail = ""
        refused = it.step(1, [5])
        wait_for(lambda: len(it.finished) == 3 + len(before), 30, "every step's end")
    # the engine closed: its threads are joined, so a second answer would be in by now
    ends = [s for s, _ in it.finished]
    assert ends.count(failed) == 1
    # its own fault, or (not alone) the step before it met the fault first, on the
    # update thread, and this one was refused for the failed engine
    assert isinstance(failed.error, InjectedDeviceFault) or (
        not alone and isinstance(failed.error, EngineError) and side in str(failed.error)
    ), failed.error
    assert it.engine.failure is not None
    assert isinstance(refused.error, EngineError)
    assert len(ends) == len(set(ends)) == 3 + len(before)
    for _ in range(3):  # every permit came back
        assert it.engine.reserve(blocking=False)
