"""The stateful-program walk-through of docs/programs.md runs as written: its config
table serves, and its scheduler script, against that daemon, prints True (its last
decode step matches SDPA over the script's own copy of the KV)."""

from __future__ import annotations

import contextlib
import io
import re
import tomllib
from pathlib import Path
from typing import Any

from daemons import RunningDaemon

PAGE = Path(__file__).parents[2] / "docs" / "programs.md"


def _section() -> str:
    text = PAGE.read_text()
    start = text.index("## A stateful program: `paged_attention`")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def test_the_paged_walk_through_runs_as_written(start_daemon: Any) -> None:
    section = _section()
    (table,) = tomllib.loads(_blocks(section, "toml")[0])["programs"]
    assert table["buckets"] == [1, 2, 4, 8]
    # The script's steps are of batch 2: capturing the other buckets would only cost time.
    d: RunningDaemon = start_daemon(devices=1, programs=[{**table, "buckets": [2]}])
    (script,) = _blocks(section, "python")
    assert "tcp://127.0.0.1:7450" in script
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(script.replace("tcp://127.0.0.1:7450", d.endpoint), "docs", "exec"), {})
    assert out.getvalue().strip() == "True"
