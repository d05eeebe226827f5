"""The program registry: built-ins, config errors, and a program added through the
``graphlane.programs`` entry point group (a real distribution on sys.path)."""

from __future__ import annotations

import importlib
import math
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from issuer import Issuer

from graphlane.workers.backends import create_backend
from graphlane.workers.programs import (
    AttentionProgram,
    ProgramConfigError,
    StepError,
    available_programs,
    load_program,
)


@pytest.fixture
def installed_prefill(tmp_path: Path) -> Iterator[None]:
    """Install a distribution whose entry points register the docs' example program
    and a plugin whose module fails to import."""
    dist = tmp_path / "graphlane_prefill_example-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: graphlane-prefill-example\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        "[graphlane.programs]\nprefill = prefill_program:PrefillProgram.from_config\n"
        "broken = graphlane_broken_plugin:Program.from_config\n"
    )
    (tmp_path / "graphlane_broken_plugin.py").write_text("raise ImportError('no such kernel')\n")
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    try:
        yield
    finally:
        sys.path.remove(str(tmp_path))
        importlib.invalidate_caches()


def test_builtin_attention_is_available() -> None:
    assert "attention" in available_programs()
    program = load_program("attention", {"name": "attention", "layers": 2, "buckets": [4, 1]})
    assert isinstance(program, AttentionProgram)
    assert program.buckets == (1, 4)


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"layers": 0}, "programs.attention.layers"),
        ({"num_heads": 6, "num_kv_heads": 4}, "programs.attention.num_kv_heads"),
        ({"buckets": []}, "programs.attention.buckets"),
        ({"buckets": [2, 2]}, "programs.attention.buckets"),
        ({"dtype": "int8"}, "programs.attention.dtype"),
        ({"heads": 8}, "programs.attention.heads"),
    ],
)
def test_bad_attention_config_names_the_key(config: dict, key: str) -> None:
    with pytest.raises(ProgramConfigError) as err:
        load_program("attention", config)
    assert err.value.key == key


def test_unknown_program_kind() -> None:
    with pytest.raises(ProgramConfigError):
        load_program("no-such-program", {})


def test_a_plugin_that_fails_to_import_fails_alone(installed_prefill: None) -> None:
    assert {"attention", "broken", "prefill"} <= set(available_programs())
    with pytest.raises(ProgramConfigError, match=r"'broken'.*no such kernel") as err:
        load_program("broken", {})
    assert err.value.key == "programs.broken.name"  # the key written: name = "broken"
    assert isinstance(load_program("attention", {"layers": 1}), AttentionProgram)


def test_program_from_an_entry_point_runs_steps(installed_prefill: None) -> None:
    assert "prefill" in available_programs()
    program = load_program("prefill", {"name": "prefill", "heads": 2, "seq": 4, "kv": 8, "dim": 8})
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 4, 8, dtype=torch.float16, generator=g)
    k = torch.randn(2, 2, 8, 8, dtype=torch.float16, generator=g)
    v = torch.randn(2, 2, 8, 8, dtype=torch.float16, generator=g)
    with Issuer(create_backend("sim"), [program]) as it:
        params = {"q_len": [4, 2], "kv_len": [8, 3]}
        step = it.run(2, [], params=params, program="prefill",
                      inputs={"query": q, "key": k, "value": v})  # fmt: skip
        assert step.results is not None
        out = step.results["out"]
    # Reference: batch 1 has 2 valid query rows over 3 keys; rows beyond are zero.
    for b, (nq, nk) in enumerate([(4, 8), (2, 3)]):
        for h in range(2):
            s = (q[b, h, :nq].double() @ k[b, h, :nk].double().T) / math.sqrt(8)
            expect = torch.softmax(s, -1) @ v[b, h, :nk].double()
            torch.testing.assert_close(out[b, h, :nq].double(), expect, atol=3e-3, rtol=3e-3)
            assert torch.count_nonzero(out[b, h, nq:]) == 0


@pytest.mark.parametrize("batch", [0, -1, True, 2.0, 3])
def test_every_program_refuses_a_batch_no_bucket_holds(installed_prefill: None, batch) -> None:
    """The batch check is the base class's (bucket_for): a plugin gets it too."""
    config = {"name": "prefill", "heads": 2, "seq": 4, "kv": 8, "dim": 8}  # buckets 1, 2
    program = load_program("prefill", config)
    with pytest.raises(StepError) as err:
        program.plan(batch, {"q_len": [1] * 3, "kv_len": [1] * 3}, {})
    assert err.value.field == "batch"


def test_a_missing_batch_comes_from_the_programs_own_batch_parameter() -> None:
    program = load_program("attention", {"name": "attention", "layers": 1, "buckets": [1, 4]})
    assert program.batch_param == "actual_seq_lengths_kv"
    assert program.infer_batch({"actual_seq_lengths_kv": [3, 1, 2]}) == 3
    for params in ({}, {"actual_seq_lengths_kv": []}, {"actual_seq_lengths_kv": 3}):
        with pytest.raises(StepError) as err:
            program.infer_batch(params)
        assert err.value.field == "batch"


def _docs_paged_program() -> type:
    """The paged decode program of docs/programs.md ("A program on another op")."""
    page = (Path(__file__).parents[2] / "docs" / "programs.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", page, flags=re.S | re.M)
    source = next(b for b in blocks if "class PagedDecode" in b)
    namespace: dict[str, Any] = {}
    exec(compile(source, "docs/programs.md:PagedDecode", "exec"), namespace)
    return namespace["PagedDecode"]  # type: ignore[no-any-return]


def _paged_reference(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lens: list[int], blocks_per_seq: int
) -> torch.Tensor:
    """Row b's keys are the first lens[b] tokens of its blocks; GQA by head groups."""
    batch, heads, dim = q.shape
    kv_heads = kc.shape[2]
    out = torch.zeros(batch, heads, dim, dtype=torch.float64)
    for b, n in enumerate(lens):
        rows = slice(b * blocks_per_seq, (b + 1) * blocks_per_seq)
        keys = kc[rows].reshape(-1, kv_heads, dim)[:n].double()
        values = vc[rows].reshape(-1, kv_heads, dim)[:n].double()
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            s = keys[:, kvh] @ q[b, h].double() / math.sqrt(dim)
            out[b, h] = torch.softmax(s, 0) @ values[:, kvh]
    return out


@pytest.mark.parametrize("backend", ["sim", "null"])
def test_the_docs_program_on_another_op_patches_its_context_lens(backend: str) -> None:
    """A program on torch_npu._npu_paged_attention needs no engine or backend change:
    steps with new context_lens patch the group and match the reference (on null they
    run the same engine path with no device)."""
    program = _docs_paged_program()()
    g = torch.Generator().manual_seed(5)
    cache = (3 * 4, 16, 2, 16)  # batch 3 (bucket 4) * 4 blocks per sequence
    kc = torch.randn(cache, dtype=torch.float16, generator=g)
    vc = torch.randn(cache, dtype=torch.float16, generator=g)
    with Issuer(create_backend(backend), [program], depth=2) as it:
        steps = []
        for i, lens in enumerate(([5, 64, 17], [1, 33, 48], [5, 64, 17], [60, 2, 9])):
            q = torch.randn(3, 4, 16, dtype=torch.float16, generator=g)
            inputs = {"query": q, **({"key_cache": kc, "value_cache": vc} if i < 2 else {})}
            step = it.step(3, [], params={"context_lens": lens}, program="paged", inputs=inputs)
            steps.append((step, q, lens))
        it.wait([s for s, _, _ in steps])
    assert [s.patched for s, _, _ in steps] == [1, 1, 0, 1]  # step 3: instance 0 holds them
    if backend == "null":
        return
    for step, q, lens in steps:
        assert step.results is not None
        want = _paged_reference(q, kc, vc, lens, 4)
        torch.testing.assert_close(step.results["out"].double(), want, atol=3e-3, rtol=3e-3)
