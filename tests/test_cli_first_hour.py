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
from graphlane.workers import affinity
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
    # The idle poll as this host resolves it: one device on a host of several cores
    # polls, a poll of 0 is off whatever the host.
    one = tmp_path / "one.toml"
    one.write_text("backend = 'null'\ndevices = 1\n")
    assert main(["config", "check", str(one)]) == 0
    spin = affinity.idle_spin_us("auto", 1)
    assert f"idle_spin_us auto ({spin:g} us on this host)" in capsys.readouterr().out
    one.write_text("backend = 'null'\ndevices = 1\nidle_spin_us = 0\n")
    assert main(["config", "check", str(one)]) == 0
    assert "idle_spin_us 0.0 (0 us on this host)" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text("devices = 2\n[[programs]]\nname = 'attention'\nnum_head = 4\n")
    assert main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_head: unknown key" in err


def test_the_config_module_documents_every_key() -> None:
    doc = cfg.__doc__ or ""
    (block,) = re.findall(r"```toml\n(.*?)```", doc, flags=re.S)
    raw = tomllib.loads(block)
    # program_clients, tensor_parallel: the daemon's keys in the [[programs]] tables.
    assert set(raw) == {f.name for f in fields(cfg.ServeConfig)} - {
        "program_clients", "tensor_parallel"
    }  # fmt: skip
    assert set(raw["sim"]) == {f.name for f in fields(cfg.SimSettings)}
    (program,) = raw["programs"]
    assert set(program) == {
        "name", "clients", "tensor_parallel", *AttentionConfig.__dataclass_fields__
    }  # fmt: skip
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
        assert err.value.key == "--listen"
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
    assert err.value.key == "--listen"
    with pytest.raises(cfg.ConfigError) as err:
        cfg.load(None, {"listen": "tcp://127.0.0.1:7450", "metrics_port": 7451})
    assert err.value.key == "--metrics-port"


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


def _commands(
    p: argparse.ArgumentParser, words: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command line's words that end in a parser without subcommands, with it."""
    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(words, p)]
    return [c for a in subs for n, s in a.choices.items() for c in _commands(s, (*words, n))]


def test_a_mistyped_flag_shows_its_own_command_s_usage(capsys) -> None:
    """``graphlane serve --devises 2`` is serve's mistake: its usage and a near miss,
    not the top-level usage; so for every command."""
    commands = _commands(_parser())
    assert len(commands) >= 8
    for words, p in commands:
        required: list[str] = []
        chosen = [g._group_actions[0] for g in p._mutually_exclusive_groups if g.required]
        for a in p._actions:
            if (a.required or a in chosen) and not isinstance(a, argparse._SubParsersAction):
                required += [a.option_strings[0], "1"] if a.option_strings else ["1"]
        with pytest.raises(SystemExit) as exit_:
            main([*words, *required, "--devises", "2"])
        err = capsys.readouterr().err
        prog = " ".join(("graphlane", *words))
        assert exit_.value.code == 2 and err.startswith(f"usage: {prog} "), err
        assert f"{prog}: error: unrecognized arguments: --devises" in err, err
    with pytest.raises(SystemExit):
        main(["serve", "--devises", "2"])
    assert "(did you mean --devices?)" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--timeout", "--wait"])
def test_status_with_no_daemon_asks_whether_one_runs_there(
    tmp_path: Path, capsys, flag: str
) -> None:
    nobody = f"ipc://{tmp_path}/nobody.sock"
    assert main(["status", "--connect", nobody, flag, "0.3"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and nobody in err, err
    assert f"0.3 s ({flag})" in err and "is the daemon running there?" in err, err


def test_status_shows_only_the_settings_that_apply() -> None:
    """A checkpoint's model has no random architecture, so no seed or init_std either;
    seeded weights show theirs; an unset option is not shown as None."""
    from graphlane.cli import describe_program

    common = {"buckets": [4], "dtype": "float32", "block_size": 16}
    checkpoint = {"model": "/models/llama", "random": None, "seed": 0, "init_std": 0.02}
    (line, *_) = describe_program("model", {"buckets": [4], "config": {**checkpoint, **common}})
    assert "model=/models/llama" in line and "dtype=float32" in line, line
    assert "None" not in line and "seed" not in line and "init_std" not in line, line
    seeded = {"model": None, "random": {"layers": 2}, "seed": 7, "init_std": 0.02}
    (line, *_) = describe_program("model", {"buckets": [4], "config": {**seeded, **common}})
    assert "seed=7" in line and "init_std=0.02" in line and "model=" not in line, line
    (line, *_) = describe_program("attention", {"buckets": [4], "config": {"seed": 3}})
    assert "seed=3" in line, line  # a seed that qualifies nothing is the program's own


def test_bench_separates_the_goals_this_machine_can_judge(capsys) -> None:
    """Issue 43, item 8: on a busy machine (the load average before the run) no ratio is
    judged, and an absolute rate never is: their failures exit 3, not 1, marked so."""
    from graphlane.bench.goals import EXIT_FAILED, EXIT_NOISY, exit_status, format_goals, goals

    def report(rtt: float, zero_cost: float, load: float) -> dict[str, Any]:
        return {"control_plane": {"null": {"step_rtt_vs_raw": rtt}},
                "zero_cost": {"steps_s": zero_cost},
                "machine": {"load_average_1m": load, "cpu_cores": 2}}  # fmt: skip

    quiet, busy = 0.4, 6.5
    assert exit_status(goals(report(2.0, 3000.0, quiet))) == EXIT_FAILED
    assert exit_status(goals(report(2.0, 3000.0, busy))) == EXIT_NOISY
    assert exit_status(goals(report(1.0, 1000.0, quiet))) == EXIT_NOISY  # absolute only
    assert exit_status(goals(report(2.0, 1000.0, quiet))) == EXIT_FAILED
    text = "\n".join(format_goals(report(2.0, 1000.0, busy)))
    assert text.startswith("machine: load average 6.5 on 2 cores when the run began"), text
    assert "goal <= 1.15x: FAIL (not judged here)" in text and "run again when it is quiet" in text
    assert "goal >= 2000: FAIL (not judged here)" in text and "an absolute rate" in text
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "3 when the only failures are goals this machine cannot judge" in help_text
