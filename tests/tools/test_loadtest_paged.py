"""The load test of a program with device state (a paged KV cache) against real daemons:
``graphlane loadtest`` drives it as a continuous-batching decode loop because the
daemon's hello says it keeps state, writes the same report as for any program (JSON and
HTML with plots), refuses the settings of independent calls, blocks are reused, its
verification catches a KV slot corrupted behind the scheduler's back, and a worker
killed mid-run yields no verified number computed on the emptied cache."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from daemons import RunningDaemon
from test_loadtest import check_report_files

from graphlane import cli
from graphlane.client import Client
from graphlane.loadtest import LoadConfig, run_load
from graphlane.loadtest.driver import Plan
from graphlane.loadtest.run import Run

pytestmark = pytest.mark.timeout(180)

# 6 blocks of 128 tokens, sequences of up to 256: a few sequences fill the cache, so
# admissions wait for blocks and blocks are reused. One bucket: each capture costs time.
PAGED = {"name": "paged_attention", "layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 16, "block_size": 128, "num_blocks": 6, "max_blocks_per_seq": 2,
         "buckets": [4]}  # fmt: skip


async def _until(predicate: Any, what: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {limit_s:g} s waiting for {what}")
        await asyncio.sleep(0.01)


def _config(d: RunningDaemon, **kw: Any) -> LoadConfig:
    base: dict[str, Any] = dict(endpoint=d.endpoint, duration_s=60.0, concurrency=4,
                                program="paged_attention", verify=1.0, prompt_lens=(1, 200),
                                decode_tokens=(3, 8), progress=False)  # fmt: skip
    return LoadConfig(**{**base, **kw})


class Watched:
    """A run of ``config`` in a task, with its state once sending began."""

    def __init__(self, config: LoadConfig) -> None:
        self.run: Run | None = None
        self.plan: Plan | None = None
        self.task = asyncio.create_task(run_load(config, started=self._started))

    def _started(self, run: Run, plan: Plan) -> None:
        self.run, self.plan = run, plan

    def rec(self) -> Any:
        return None if self.run is None else self.run.rec

    async def stop(self) -> dict[str, Any]:
        assert self.run is not None
        self.run.stop.set()
        return await self.task


def test_the_cli_runs_the_paged_workload_and_verification_catches_a_corrupted_slot(
    start_daemon: Any, tmp_path: Path, capsys: Any
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["loadtest", "--help"])
    assert "paged KV cache" in capsys.readouterr().out
    # Blocks are reused once sequences end: short ones, over a run long enough for a
    # loaded machine to finish some (a step can take half a second there).
    d: RunningDaemon = start_daemon(devices=1, programs=[PAGED])
    argv = ["loadtest", "--connect", d.endpoint, "--program", "paged_attention",
            "--concurrency", "4", "--duration", "4", "--prompt-lens", "1,200",
            "--decode-tokens", "1,2", "--verify", "0.5", "--report", str(tmp_path / "rep"),
            "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "tokens" in printed and "blocks reused" in printed and "p99.9" in printed
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    check_report_files(tmp_path / "rep", report)  # one report format for every program
    assert report["load"] == "sequences"
    assert report["config"]["shape"]["num_blocks"] == 6  # from hello, no --shape
    assert report["config"]["verify"] == 0.5
    assert report["verified"] > 0 and report["verify_failures"] == 0
    assert report["blocks_reused"] > 0
    assert report["sequences"]["finished"] > 0
    assert report["tokens"] >= report["steps"] > 0
    assert 0 < report["occupancy"] <= 1
    assert report["request_bytes"]["min"] > 0
    assert report["latency_ms"]["count"] == report["steps"] == sum(
        s["steps"] for s in report["per_device"].values()
    )
    assert report["verdict"]["exit_code"] == 0

    # Settings of independent calls, for a program with device state: refused, naming them.
    for extra in (["--batch-sizes", "2"], ["--shape", "head_dim=16"]):
        wrong = [*argv[:-3], *extra, "--report", str(tmp_path / "wrong"), "--no-progress"]
        assert cli.main(wrong) == 2
        assert extra[0] in capsys.readouterr().err
    assert not (tmp_path / "wrong").exists()

    # Corrupt the first slot of a live sequence with more tokens to decode: its next
    # (verified) step must be found wrong, and the run must say so.
    async def corrupted() -> dict[str, Any]:
        w = Watched(_config(d))
        await _until(lambda: w.rec() is not None and w.rec().steps >= 2, "the run's first steps")
        assert w.run is not None
        loop: Any = w.run.loops[0]
        await _until(lambda: any(s.remaining >= 3 for s in loop.live.values()),
                     "a sequence with tokens to decode")  # fmt: skip
        seq = next(s for s in loop.live.values() if s.remaining >= 3)
        shape = (PAGED["layers"], 1, PAGED["num_kv_heads"], PAGED["head_dim"])
        junk = torch.full(shape, 30.0, dtype=torch.float16)
        async with Client(d.endpoint, timeout=20) as other:
            await other.hello()
            slot = seq.blocks[0] * PAGED["block_size"]
            await other.kv_write("paged_attention", 0, torch.tensor([slot]), junk, -junk)
        await _until(lambda: w.rec().verify_failures > 0, "the corruption to be caught")
        return await w.stop()

    report = asyncio.run(corrupted())
    assert report["verify_failures"] >= 1
    assert report["verdict"]["exit_code"] == 1


def test_a_worker_killed_mid_run_yields_no_verified_numbers_from_the_empty_cache(
    start_daemon: Any,
) -> None:
    d: RunningDaemon = start_daemon(devices=1, programs=[PAGED])
    pid, first = d.worker(0)["pid"], d.worker(0)["generation"]

    async def main() -> dict[str, Any]:
        w = Watched(_config(d, max_unavailable=1.0))  # availability: not what this checks
        await _until(lambda: w.rec() is not None and w.rec().verified >= 2,
                     "verified steps before the kill")  # fmt: skip
        os.kill(pid, signal.SIGKILL)
        # Every live sequence is written again in the new generation, then verified.
        await _until(lambda: w.rec().verified_by_generation[first + 1] >= 3,
                     "verified steps after the restart")  # fmt: skip
        return await w.stop()

    report = asyncio.run(main())
    d.worker_pids_seen.add(pid)
    assert report["state_lost"] >= 1
    assert report["sequences"]["reprefilled"] >= 1
    assert report["verify_failures"] == 0
    assert report["verified_by_generation"][str(first)] >= 2
    assert set(report["verified_by_generation"]) == {str(first), str(first + 1)}
    # The worker was lost for a while: errors it answered meanwhile are retryable.
    assert report["non_retryable_errors"] == 0, report["errors"]
    assert report["interrupted"] and report["verdict"]["exit_code"] == 0, report["verdict"]
