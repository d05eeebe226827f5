"""The command line a new user meets (issue 16, item 8): version, no abbreviated
flags, readable help, ``config check``, and a config module that documents every key."""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any

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


# ------------------------------------------------------------------ ordinary mistakes (issue 27)
def test_serve_refuses_an_endpoint_the_client_refuses(tmp_path: Path, capsys) -> None:
    """One check for every endpoint: a port over 65535 is refused by serve (naming the
    setting) as by the client, before anything starts; port 0 is a bind's any port."""
    from graphlane.protocol.endpoints import InvalidEndpoint, check_endpoint

    for listen in ("tcp://127.0.0.1:99999", "tcp://127.0.0.1:-1", "tcp://127.0.0.1:x"):
        with pytest.raises(InvalidEndpoint):
            check_endpoint(listen)
        with pytest.raises(cfg.ConfigError) as err:
            cfg.load(None, {"listen": listen})
        assert err.value.key == "listen"
        bad = tmp_path / "bad.toml"
        bad.write_text(f'listen = "{listen}"\n')
        assert main(["config", "check", str(bad)]) == 2
        line = capsys.readouterr().err
        assert line.count("\n") == 1 and "listen" in line and "Traceback" not in line
    # Any free port, for tests: the daemon and each worker bind one (status shows which).
    for listen in ("tcp://127.0.0.1:0", "tcp://127.0.0.1:*"):
        assert cfg.load(None, {"listen": listen}).worker_endpoint(1) == "tcp://127.0.0.1:0"
    with pytest.raises(InvalidEndpoint):
        check_endpoint("tcp://127.0.0.1:0")  # a client connects to a port
    # Device 1's worker would need port 65536.
    with pytest.raises(cfg.ConfigError) as err:
        cfg.load(None, {"listen": "tcp://127.0.0.1:65534", "devices": 2})
    assert err.value.key == "listen"
    with pytest.raises(cfg.ConfigError) as err:
        cfg.load(None, {"listen": "tcp://127.0.0.1:7450", "metrics_port": 7451})
    assert err.value.key == "metrics_port"


def test_a_metrics_port_in_use_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "graphlane", "serve", "--devices", "1", "--listen",
             f"ipc://{tmp_path}/d.sock", "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert run.returncode == 1, run.stderr  # as a daemon's own port in use
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    assert f"port {port}" in run.stderr and "--metrics-port" in run.stderr


def test_bench_exits_non_zero_when_a_goal_fails(capsys) -> None:
    from graphlane.bench.goals import EXIT_FAILED, EXIT_MET, EXIT_NOISY, exit_status, goals

    def report(rtt: float, windowed: float, spread: float) -> dict[str, Any]:
        null = {"step_rtt_vs_raw": rtt, "windowed_vs_raw": windowed, "windowed_spread": spread}
        return {"control_plane": {"null": null}}

    assert exit_status(goals(report(1.0, 1.0, 0.0))) == EXIT_MET == 0
    assert exit_status(goals(report(2.0, 1.0, 0.0))) == EXIT_FAILED == 1
    assert exit_status(goals(report(2.0, 0.5, 0.9))) == EXIT_FAILED  # one clean failure
    assert exit_status(goals(report(1.0, 0.5, 0.9))) == EXIT_NOISY == 3  # noise only
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 when every goal is met; 1 when a goal failed; 3" in text


def _closed_stdout_run(*args: str) -> subprocess.CompletedProcess[str]:
    """``graphlane ARGS`` with a stdout whose reader is gone before anything is written
    (``graphlane ... | head -0``): every write to it fails."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(
            [sys.executable, "-m", "graphlane", *args],
            stdout=w, stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    finally:
        os.close(w)


def test_a_closed_stdout_ends_a_command_quietly_with_141() -> None:
    run = _closed_stdout_run("config", "check", str(ROOT / "deploy" / "graphlane.toml"))
    assert (run.returncode, run.stderr) == (141, ""), run.stderr


def test_loadtest_with_nothing_at_the_endpoint_exits_3_naming_the_wait(
    tmp_path: Path, capsys
) -> None:
    nobody = f"ipc://{tmp_path}/nobody.sock"
    code = main(["loadtest", "--connect", nobody, "--concurrency", "1", "--duration", "1",
                 "--report", str(tmp_path / "r"), "--connect-timeout", "0.3"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1, err
    assert nobody in err and "0.3 s" in err and "--connect-timeout" in err
    with pytest.raises(SystemExit):
        main(["loadtest", "--help"])
    assert "3  nothing answered at --connect within --connect-timeout" in capsys.readouterr().out


def test_loadtest_says_which_programs_it_can_drive(capsys, monkeypatch) -> None:
    """A custom program is refused naming what loadtest drives and what the program
    is, not with a --shape hint that cannot apply."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "workers"))
    from prefill_program import PrefillProgram  # docs/programs.md's worked example

    from graphlane.loadtest import LoadConfig, LoadTestError
    from graphlane.loadtest.driver import Plan

    hello = {"workers": [{"device": 0, "programs": {"prefill": PrefillProgram().describe()}}]}
    config = LoadConfig("ipc:///nowhere", 1.0, concurrency=1, program="prefill")
    with pytest.raises(LoadTestError) as err:
        Plan(config, hello)
    text = str(err.value)
    assert "--program" in text and "'attention'" not in text and "--shape" not in text
    assert "attention" in text and "paged_attention" in text
    assert "'prefill' has parameters: none" in text  # what its hello entry describes
    with pytest.raises(SystemExit):
        main(["loadtest", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Programs it can drive (--program): attention-shaped ones" in help_text
