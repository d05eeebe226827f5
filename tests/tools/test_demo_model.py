"""The demo's model part (graphlane/tools/demo_model.py) against a real daemon serving
the demo's tiny Llama: its decoding-ahead generation loop gives transformers' tokens, and
a wrong token is counted (the demo then exits 1): here the reference is another seed's
model, so every checked sequence differs."""

from __future__ import annotations

import asyncio
import tomllib
from typing import Any

from graphlane.demo_model import PROGRAM_TOML, SEED, run_model

PROGRAMS = tomllib.loads(PROGRAM_TOML)["programs"]


def test_the_demo_generation_loop_gives_transformers_tokens(start_daemon: Any) -> None:
    d = start_daemon(devices=1, programs=PROGRAMS)
    right = asyncio.run(run_model(d.endpoint, 1, verify=1.0, per_device=4))
    assert right["tokens"] > 0 and right["tokens_per_s"] > 0
    assert (right["checked"], right["wrong"], right["sequences"]) == (4, 0, 4)
    wrong = asyncio.run(run_model(d.endpoint, 1, verify=1.0, per_device=4, seed=SEED + 1))
    assert wrong["checked"] == 4 and wrong["wrong"] > 0
