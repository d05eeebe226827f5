"""Sim extensions: named, off by default, scoped, and passed to child processes."""

from __future__ import annotations

import os
import subprocess
import sys

import npusim
import pytest
from npusim import extensions


def test_off_by_default_and_scoped() -> None:
    assert extensions.active() == frozenset()
    with extensions.enabled("float32_attention"):
        assert extensions.is_enabled("float32_attention")
        with extensions.enabled("float32_attention"):
            pass
        assert extensions.is_enabled("float32_attention")  # the inner block did not own it
    assert not extensions.is_enabled("float32_attention")
    extensions.enable("float32_attention")
    try:
        assert extensions.active() == {"float32_attention"}
    finally:
        extensions.disable("float32_attention")
    assert extensions.active() == frozenset()


def test_unknown_name_is_refused() -> None:
    with pytest.raises(npusim.SimUsageError, match=r"extension 'float64'.*float32_attention"):
        extensions.enable("float64")
    with pytest.raises(npusim.SimUsageError, match="unknown npusim extension"):
        extensions.parse("float32_attention, nope")


def test_environment_names_them_for_a_child() -> None:
    env = dict(os.environ, NPUSIM_EXTENSIONS="float32_attention")
    out = subprocess.run(
        [sys.executable, "-c", "import npusim; print(sorted(npusim.extensions.active()))"],
        env=env, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    assert out.stdout.strip() == "['float32_attention']"
