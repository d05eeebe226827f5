"""The load test of a model program against a real daemon (the demo's tiny Llama):
``graphlane loadtest`` serves requests with the continuous-batching loop that decodes
ahead and reports what vLLM's benchmark_serving reports (request and token throughput,
TTFT, TPOT, ITL), in the same report with TTFT/ITL plots; a checked request whose tokens
differ from transformers' fails the run."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import signal
import tomllib
from pathlib import Path
from typing import Any

import pytest
from model_ref import save, tiny_model

from graphlane import cli
from graphlane.demo_model import PROGRAM_TOML
from graphlane.loadtest import LoadConfig, run_load
from graphlane.loadtest.driver import Plan
from graphlane.loadtest.run import Run

PROGRAMS = tomllib.loads(PROGRAM_TOML)["programs"]
pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def daemon(shared_daemon: Any) -> Any:
    return shared_daemon(devices=1, programs=PROGRAMS)


def test_a_model_is_served_as_a_serving_benchmark_measures_it(
    daemon: Any, tmp_path: Path, capsys: Any
) -> None:
    out = tmp_path / "report"
    argv = ["loadtest", "--connect", daemon.endpoint, "--program", "model",
            "--request-rate", "inf", "--num-prompts", "6", "--prompt-len", "40",
            "--output-len", "8", "--range-ratio", "0.5", "--duration", "60",
            "--verify", "1", "--report", str(out), "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    for name in ("Request throughput (req/s):", "Mean TTFT (ms):", "P99 TPOT (ms):",
                 "Median ITL (ms):"):  # fmt: skip
        assert name in printed
    r = json.loads((out / "report.json").read_text())
    s = r["serving"]
    assert (s["completed"], s["failed"], s["cut"]) == (6, 0, 0)
    assert r["verified"] == 6 and r["verify_failures"] == 0
    assert 4 <= s["total_output_tokens"] / 6 <= 12  # --output-len 8, range ratio 0.5
    assert s["total_output_tokens"] == r["tokens"]
    assert r["steps"] > 0 and r["sequences"]["finished"] == 6
    # vLLM's definitions: TPOT excludes the first token; ITL is every gap of a request.
    samples = s["samples"]
    assert len(samples["ttft_ms"]) == 6
    assert len(samples["itl_ms"]) == s["total_output_tokens"] - 6
    assert all(t <= e for t, e in zip(samples["ttft_ms"], samples["e2el_ms"], strict=True))
    gaps = sum(samples["itl_ms"])
    assert math.isclose(gaps, sum(samples["e2el_ms"]) - sum(samples["ttft_ms"]), rel_tol=1e-3)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        m = s[key]
        assert 0 <= m["min"] <= m["median"] <= m["p99"] <= m["max"], (key, m)
    assert s["request_throughput"] > 0 and s["output_throughput"] > 0
    page = (out / "report.html").read_text()
    images = re.findall(r'<img src="([^"]+)"', page)
    assert {"token_latency.png", "ttft_over_time.png"} <= set(images)
    assert all((out / name).read_bytes()[:4] == b"\x89PNG" for name in images)
    assert "TTFT ms" in page and "ITL ms" in page


async def test_a_wrong_token_is_counted_and_fails_the_run(daemon: Any) -> None:
    """The reference here is another seed's model: every checked request differs."""

    def other_seed(run: Run, plan: Plan) -> None:
        plan.info["config"]["seed"] += 1

    config = LoadConfig(endpoint=daemon.endpoint, duration_s=60.0, rate=math.inf,
                        num_prompts=3, program="model", verify=1.0, prompt_lens=(5, 20),
                        decode_tokens=(6, 6), progress=False)  # fmt: skip
    report = await asyncio.wait_for(run_load(config, started=other_seed), 120)
    assert report["serving"]["completed"] == 3
    assert report["verified"] == 3 and report["verify_failures"] == 3
    assert report["verdict"]["exit_code"] == 1


def test_model_flags_are_checked(daemon: Any, tmp_path: Path, capsys: Any) -> None:
    base = ["loadtest", "--connect", daemon.endpoint, "--duration", "5",
            "--report", str(tmp_path), "--no-progress"]  # fmt: skip
    # every request at once needs a number of requests
    assert cli.main([*base, "--program", "model", "--rate", "inf"]) == 2
    assert "--num-prompts" in capsys.readouterr().err
    # a sequence longer than the program's (2 blocks of 128)
    too_long = ["--program", "model", "--concurrency", "2", "--prompt-lens", "1,250",
                "--decode-tokens", "8,8"]  # fmt: skip
    assert cli.main([*base, *too_long]) == 2
    assert "--prompt-lens" in capsys.readouterr().err


def test_a_worker_killed_mid_run_fails_no_request_and_the_tokens_stay_right(
    start_daemon: Any,
) -> None:
    """Issue 43: after a worker restart the model loop prefills its requests again (their
    prompt and the tokens they got) and goes on, as the paged loop writes its sequences
    again; no request fails for it, and every token is still transformers'."""
    d = start_daemon(devices=1, programs=PROGRAMS)
    pid, first = d.worker(0)["pid"], d.worker(0)["generation"]
    runs: list[Run] = []
    config = LoadConfig(endpoint=d.endpoint, duration_s=120.0, concurrency=4, num_prompts=16,
                        program="model", verify=1.0, prompt_lens=(5, 40), decode_tokens=(16, 24),
                        max_unavailable=1.0, progress=False)  # fmt: skip

    async def main() -> dict[str, Any]:
        task = asyncio.create_task(run_load(config, started=lambda run, plan: runs.append(run)))
        deadline = asyncio.get_running_loop().time() + 60
        while not runs or runs[0].rec.steps < 10:  # requests mid-generation: kill
            assert not task.done() and asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(task, 150)

    report = asyncio.run(main())
    d.worker_pids_seen.add(pid)
    assert d.worker(0)["generation"] > first  # the supervisor restarted it
    s = report["serving"]
    assert (s["completed"], s["failed"], s["cut"]) == (16, 0, 0), report["errors"]
    assert report["state_lost"] >= 1 and report["sequences"]["reprefilled"] >= 1
    assert report["verified"] == 16 and report["verify_failures"] == 0
    assert report["verify_ties"] == 0  # float32: every token equal
    assert report["non_retryable_errors"] == 0, report["errors"]
    assert report["verdict"]["exit_code"] == 0, report["verdict"]


def test_help_says_the_model_loop_recovers_from_a_worker_restart(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        cli.main(["loadtest", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "After a worker restart (STATE_LOST, WORKER_LOST) each live request is " \
           "prefilled again" in text  # fmt: skip
    assert "near tie" in text and "verify_skipped" in text


def test_a_check_that_cannot_run_is_said_at_the_start_and_in_the_report(
    start_daemon: Any, tmp_path: Path, capsys: Any
) -> None:
    """Issue 43: the model directory is not on the load-test machine (here: moved away
    after the workers loaded it): the default check is skipped, in one line at the
    start and in report.json; the run is still ok."""
    model = tiny_model("llama", seed=3)
    directory = Path(save(model, tmp_path / "m"))
    program = {"name": "model", "model": str(directory), "dtype": "float32",
               "block_size": 128, "num_blocks": 8, "max_blocks_per_seq": 1,
               "buckets": [1, 2]}  # fmt: skip
    d = start_daemon(devices=1, programs=[program])
    directory.rename(tmp_path / "elsewhere")
    out = tmp_path / "report"
    argv = ["loadtest", "--connect", d.endpoint, "--program", "model", "--concurrency", "2",
            "--num-prompts", "2", "--prompt-len", "8", "--output-len", "4", "--duration", "60",
            "--report", str(out), "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "not checking tokens" in line]
    assert len(said) == 1 and str(directory) in said[0] and "not on this machine" in said[0]
    r = json.loads((out / "report.json").read_text())
    assert "not on this machine" in r["verify_skipped"]
    assert r["verified"] == 0 and r["verdict"]["ok"]
    assert "not checked" in (out / "report.html").read_text()
