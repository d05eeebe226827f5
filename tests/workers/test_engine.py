"""The step engine on the sim: numerics of whole steps against the test's own
attention reference, for every bucket, padding, GQA, depth 1 and 2, serial and
pipelined, over the npu provider with and without the fused update binding."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from daemons import wait_for
from reference import decode_stack

from graphlane.sim import DeviceFaultError, HazardError, torch_npu
from graphlane.workers.backends import create_backend
from graphlane.workers.backends.npu import NpuBackend
from graphlane.workers.backends.null import NullBackend
from graphlane.workers.engine import EngineError, StepEngine, StepRequest, StepResult
from graphlane.workers.programs import AttentionConfig, AttentionProgram, GraphKey, StepError

CFG = AttentionConfig(
    layers=3, num_heads=4, num_kv_heads=2, head_dim=16, max_kv_len=24, buckets=(1, 2, 4)
)


def _engine(depth: int = 1, pipeline: bool = True, fused: bool = True) -> StepEngine:
    backend = NpuBackend(torch_npu, 0, use_fused_update=fused)
    return StepEngine(backend, [AttentionProgram(CFG)], depth=depth, pipeline=pipeline)


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
    """Every batch size 1..4 (buckets 1, 2, 4: sizes 3 is padded), submitted without
    waiting, so consecutive steps overlap; key/value written once per instance and
    kept by later steps that bring only a query."""
    kv_of: dict[GraphKey, tuple[torch.Tensor, torch.Tensor]] = {}
    with _engine(depth, pipeline, fused) as eng:
        # Round 1: write key/value into every instance.
        first = []
        for batch in (1, 2, 4):
            for _ in range(depth):
                k, v = _kv(batch, gen)
                q, n = _query(batch, gen), _lengths(batch, gen)
                req = StepRequest(
                    "attention",
                    batch,
                    {"actual_seq_lengths_kv": n},
                    {"query": q, "key": k, "value": v},
                )
                first.append((eng.submit(req), q, k, v, n))
        for fut, q, k, v, n in first:
            r = fut.result(30)
            kv_of[r.key] = (k, v)
            torch.testing.assert_close(
                r.outputs["out"], _expected(q, k, v, n), atol=2e-3, rtol=2e-3
            )
        # Round 2: many steps, only queries and lengths, every batch size.
        steps = []
        for i in range(24):
            batch = 1 + i % 4
            q, n = _query(batch, gen), _lengths(batch, gen)
            req = StepRequest("attention", batch, {"actual_seq_lengths_kv": n}, {"query": q})
            steps.append((eng.submit(req), q, n, batch))
        for fut, q, n, batch in steps:
            r = fut.result(30)
            assert r.key.bucket == min(b for b in CFG.buckets if b >= batch)
            k, v = kv_of[r.key]
            assert r.outputs["out"].shape == (batch, CFG.num_heads, 1, CFG.head_dim)
            kb, vb = k[:, :batch], v[:, :batch]
            torch.testing.assert_close(
                r.outputs["out"], _expected(q, kb, vb, n), atol=2e-3, rtol=2e-3
            )
        assert eng.failure is None


def test_depth_two_alternates_instances_and_skips_unchanged_groups() -> None:
    with _engine(depth=2) as eng:
        n = {"actual_seq_lengths_kv": [5, 6]}
        results = [eng.run(StepRequest("attention", 2, n), timeout=30) for _ in range(4)]
    assert [r.key.slot for r in results] == [0, 1, 0, 1]
    # The first step on each instance patches every layer; the same lengths again
    # on the same instance release the layers without a patch.
    assert [r.patched_groups for r in results] == [CFG.layers, CFG.layers, 0, 0]


def test_steps_are_asyncio_friendly() -> None:
    async def main(eng: StepEngine) -> list[int]:
        futs = [
            asyncio.wrap_future(
                eng.submit(StepRequest("attention", 1, {"actual_seq_lengths_kv": [i + 1]}))
            )
            for i in range(8)
        ]
        return [r.outputs["out"].shape[0] for r in await asyncio.gather(*futs)]

    with _engine() as eng:
        assert asyncio.run(main(eng)) == [1] * 8


@pytest.fixture
def engine() -> Iterator[StepEngine]:
    with _engine() as eng:
        yield eng


@pytest.mark.parametrize(
    ("batch", "params", "inputs", "outputs", "field"),
    [
        (5, {"actual_seq_lengths_kv": [1] * 5}, {}, ("out",), "batch"),
        (0, {"actual_seq_lengths_kv": []}, {}, ("out",), "batch"),
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
    engine: StepEngine, batch: int, params: dict, inputs: dict, outputs: tuple[str, ...], field: str
) -> None:
    with pytest.raises(StepError) as err:
        engine.submit(StepRequest("attention", batch, params, inputs, outputs))
    assert err.value.field == field
    assert engine.run(StepRequest("attention", 1, {"actual_seq_lengths_kv": [3]}), 30)


def test_unknown_program(engine: StepEngine) -> None:
    with pytest.raises(StepError) as err:
        engine.submit(StepRequest("decoder", 1, {}))
    assert err.value.field == "program"


def test_a_hazard_fails_the_step_loudly_and_the_engine_refuses_more(engine: StepEngine) -> None:
    """Someone else releases a layer of a captured graph: the engine's own release
    for the next step then merges with it. The step fails with the HazardError."""
    key = GraphKey("attention", 1, 0)
    stray = torch.npu.Stream()
    engine.run(StepRequest("attention", 1, {"actual_seq_lengths_kv": [2]}), 30)
    engine.graphs[key].events[1].record(stray)
    fut = engine.submit(StepRequest("attention", 1, {"actual_seq_lengths_kv": [3]}))
    with pytest.raises(HazardError):
        fut.result(30)
    with pytest.raises(EngineError):
        engine.submit(StepRequest("attention", 1, {"actual_seq_lengths_kv": [3]}))


def test_create_backend_names() -> None:
    assert create_backend("sim").name == "sim"
    with pytest.raises(ValueError):
        create_backend("tpu")


def test_null_backend_runs_the_engine_without_a_device() -> None:
    """The null provider (for measuring graphlane alone) drives the same engine path."""
    with StepEngine(create_backend("null"), [AttentionProgram(CFG)], depth=2) as eng:
        results = [
            eng.run(StepRequest("attention", 3, {"actual_seq_lengths_kv": [1, 2, 3]}), 30)
            for _ in range(4)
        ]
    assert [r.key.slot for r in results] == [0, 1, 0, 1]
    assert all(r.outputs["out"].shape == (3, CFG.num_heads, 1, CFG.head_dim) for r in results)


# ---------------------------------------------------------------- driven by its owner's thread
class _Gate:
    """A done event that completes when the test opens it."""

    def __init__(self, opened: threading.Event) -> None:
        self.opened = opened

    def query(self) -> bool:
        return self.opened.is_set()

    def synchronize(self) -> None:
        assert self.opened.wait(30)

    def record(self, stream: object = None) -> None:
        pass


class _GatedBackend(NullBackend):
    """No device; a step's done event completes when ``opened`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.opened = threading.Event()

    def new_event(self) -> _Gate:
        return _Gate(self.opened)


def _collector() -> tuple[list[tuple[object, object, int]], Callable[..., None]]:
    done: list[tuple[object, object, int]] = []

    def on_done(result: object, exc: object) -> None:
        done.append((result, exc, threading.get_ident()))

    return done, on_done


def test_a_driven_engine_answers_complete_steps_on_the_spot_and_others_from_its_thread() -> None:
    """Without an issue thread the caller issues; a step already complete when its issue
    returns is answered in the caller's thread, the others in the completion thread,
    and no more than max_inflight steps are ever on the device."""
    backend = _GatedBackend()
    eng = StepEngine(backend, [AttentionProgram(CFG)], max_inflight=2)
    eng.start(issue_thread=False)
    try:
        plan = eng.plan(StepRequest("attention", 1, {"actual_seq_lengths_kv": [2]}))
        done, on_done = _collector()
        for _ in range(2):
            assert eng.reserve(blocking=False)
            eng.issue("step", plan, ("out",), on_done)
        assert not eng.reserve(blocking=False)  # both slots are on the device
        assert done == []
        with pytest.raises(EngineError):  # no issue thread: submit is not the way in
            eng.submit(StepRequest("attention", 1, {"actual_seq_lengths_kv": [2]}))
        backend.opened.set()
        wait_for(lambda: len(done) == 2, 30, "both steps to complete")
        assert [exc for _, exc, _ in done] == [None, None]
        assert all(thread != threading.get_ident() for _, _, thread in done)
        assert eng.reserve(blocking=False)  # slots came back
        eng.issue("step", plan, ("out",), on_done)  # complete at once: answered right here
        assert len(done) == 3 and done[2][2] == threading.get_ident()
        assert eng.steps_done == 3
    finally:
        backend.opened.set()
        eng.close()


def test_a_driven_engine_reports_a_failed_issue_to_its_caller_and_returns_the_slot() -> None:
    eng = StepEngine(create_backend("null"), [AttentionProgram(CFG)], max_inflight=1)
    eng.fault_device_after = 0
    eng.start(issue_thread=False)
    try:
        plan = eng.plan(StepRequest("attention", 1, {"actual_seq_lengths_kv": [2]}))
        done, on_done = _collector()
        assert eng.reserve(blocking=False)
        eng.issue("step", plan, ("out",), on_done)
        assert isinstance(done[0][1], DeviceFaultError) and eng.failure is done[0][1]
        assert eng.reserve(blocking=False)  # the failed step gave its slot back
        eng.issue("step", plan, ("out",), on_done)  # a failed engine refuses, in order
        assert isinstance(done[1][1], EngineError)
        assert eng.reserve(blocking=False)
    finally:
        eng.close()


def test_a_driven_engine_on_the_sim_matches_the_reference(gen: torch.Generator) -> None:
    eng = _engine()
    eng.start(issue_thread=False)
    try:
        k, v = _kv(2, gen)
        done, on_done = _collector()
        cases = []
        for i in range(6):
            q, n = _query(2, gen), _lengths(2, gen)
            inputs = {"query": q, **({"key": k, "value": v} if i == 0 else {})}
            plan = eng.plan(StepRequest("attention", 2, {"actual_seq_lengths_kv": n}, inputs))
            eng.reserve()
            eng.issue("step", plan, ("out",), on_done)
            cases.append((q, n))
        wait_for(lambda: len(done) == len(cases), 30, "every step to complete")
        assert all(exc is None for _, exc, _ in done)
        # Answers may come from either thread; match them to their steps by issue time.
        results: list[StepResult] = sorted(
            (r for r, _, _ in done if isinstance(r, StepResult)), key=lambda r: r.issued_at
        )
        for r, (q, n) in zip(results, cases, strict=True):
            expected = _expected(q, k, v, n)
            torch.testing.assert_close(r.outputs["out"], expected, atol=2e-3, rtol=2e-3)
    finally:
        eng.close()
