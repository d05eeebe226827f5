"""The command line a new user meets (issue 16, item 8): version, no abbreviated
flags, readable help, ``config check``, and a config module that documents every key."""

from __future__ import annotations

import argparse
import re
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest

from graphlane import __version__
from graphlane.cli import _parser, main
from graphlane.orchestrator import config as cfg
from graphlane.workers.programs.attention import AttentionConfig

ROOT = Path(__file__).resolve().parents[1]


def _all_parsers(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = [p]
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _all_parsers(sub)
    return out


def test_version_and_no_abbreviations(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"graphlane {__version__}"
    parsers = _all_parsers(_parser())
    assert len(parsers) >= 10 and all(not p.allow_abbrev for p in parsers)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--device", "2"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --device 2" in capsys.readouterr().err


def test_every_flag_and_positional_has_help_and_help_lines_are_short(capsys) -> None:
    for p in _all_parsers(_parser()):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help, f"{p.prog}: {action.option_strings or action.dest} has no help"
    for command in (["loadtest"], ["keys", "generate"], ["serve"], ["config", "check"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        text = capsys.readouterr().out
        assert max(map(len, text.splitlines())) <= 100, text


def test_config_check(tmp_path: Path, capsys) -> None:
    assert main(["config", "check", str(ROOT / "deploy" / "graphlane.toml")]) == 0
    assert "ok" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text("devices = 2\n[[programs]]\nname = 'attention'\nnum_head = 4\n")
    assert main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_head: unknown key" in err


def test_the_config_module_documents_every_key() -> None:
    doc = cfg.__doc__ or ""
    (block,) = re.findall(r"```toml\n(.*?)```", doc, flags=re.S)
    raw = tomllib.loads(block)
    # program_clients: the [[programs]] tables' clients, the daemon's key in them.
    assert set(raw) == {f.name for f in fields(cfg.ServeConfig)} - {"program_clients"}
    assert set(raw["sim"]) == {f.name for f in fields(cfg.SimSettings)}
    (program,) = raw["programs"]
    assert set(program) == {"name", "clients", *AttentionConfig.__dataclass_fields__}
    readme = (ROOT / "README.md").read_text()
    for text in ("graphlane example", "graphlane --version", ".venv/bin/graphlane",
                 "source .venv/bin/activate", "graphlane config check"):  # fmt: skip
        assert text in readme, text


def test_bench_help_says_where_keys_go(capsys) -> None:
    """bench runs its own unauthenticated daemons: its help sends a user with keys to
    loadtest, which takes them."""
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "takes no keys" in text and "loadtest --connect EP --server-key" in text
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--client-key", "x"])
    assert exit_.value.code == 2
