"""The program registry: built-ins, config errors, and a program added through the
``graphlane.programs`` entry point group (a real distribution on sys.path)."""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Iterator
from pathlib import Path

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
    assert err.value.key == "programs.kind"
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
