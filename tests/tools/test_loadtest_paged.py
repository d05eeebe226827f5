"""The paged decode load test against real daemons: ``graphlane loadtest`` picks it for a
paged program from the daemon's description, blocks are reused, its verification catches
a KV slot corrupted behind the scheduler's back, and a worker killed mid-run yields no
verified number computed on the emptied cache."""

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

from graphlane import cli
from graphlane.client import Client
from graphlane.tools.loadtest_paged import PagedLoadConfig, PagedRun, run_paged

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


def _config(d: RunningDaemon, **kw: Any) -> PagedLoadConfig:
    base: dict[str, Any] = dict(endpoint=d.endpoint, duration_s=60.0, concurrency=4,
                                verify=1.0, prompt_lens=(1, 200), decode_tokens=(3, 8))  # fmt: skip
    return PagedLoadConfig(**{**base, **kw})


def test_the_cli_runs_the_paged_workload_and_verification_catches_a_corrupted_slot(
    start_daemon: Any, tmp_path: Path, capsys: Any
) -> None:
    with pytest.raises(SystemExit):
        cli.main(["loadtest", "--help"])
    assert "paged KV cache" in capsys.readouterr().out
    d: RunningDaemon = start_daemon(devices=1, programs=[PAGED])
    argv = ["loadtest", "--connect", d.endpoint, "--program", "paged_attention",
            "--concurrency", "4", "--duration", "2", "--prompt-lens", "1,200",
            "--decode-tokens", "2,5", "--verify", "0.5", "--report", str(tmp_path / "rep"),
            "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert report["workload"] == "paged"
    assert report["config"]["shape"]["num_blocks"] == 6  # from hello, no --shape
    assert report["verified"] > 0 and report["verify_failures"] == 0
    assert report["blocks_reused"] > 0
    assert report["sequences"]["finished"] > 0
    assert report["tokens"] >= report["steps"] > 0
    assert 0 < report["occupancy"] <= 1
    assert report["request_bytes"]["min"] > 0

    # Corrupt the first slot of a live sequence with more tokens to decode: its next
    # (verified) step must be found wrong, and the run must say so.
    async def corrupted() -> dict[str, Any]:
        run = PagedRun(_config(d))
        task = asyncio.create_task(run_paged(run.config, run=run))
        await _until(lambda: run.counts.steps >= 2 and run.loops, "the run's first steps")
        loop = run.loops[0]
        await _until(lambda: any(s.remaining >= 3 for s in loop.sched.seqs.values()),
                     "a sequence with tokens to decode")  # fmt: skip
        seq = next(s for s in loop.sched.seqs.values() if s.remaining >= 3)
        shape = (PAGED["layers"], 1, PAGED["num_kv_heads"], PAGED["head_dim"])
        junk = torch.full(shape, 30.0, dtype=torch.float16)
        async with Client(d.endpoint, timeout=20) as other:
            await other.hello()
            slot = seq.blocks[0] * PAGED["block_size"]
            await other.kv_write("paged_attention", 0, torch.tensor([slot]), junk, -junk)
        await _until(lambda: run.counts.verify_failures > 0, "the corruption to be caught")
        run.stop_sending.set()
        return await task

    report = asyncio.run(corrupted())
    assert report["verify_failures"] >= 1
    assert report["verdict"]["exit_code"] == 1


def test_a_worker_killed_mid_run_yields_no_verified_numbers_from_the_empty_cache(
    start_daemon: Any,
) -> None:
    d: RunningDaemon = start_daemon(devices=1, programs=[PAGED])
    pid, first = d.worker(0)["pid"], d.worker(0)["generation"]

    async def main() -> dict[str, Any]:
        run = PagedRun(_config(d))
        task = asyncio.create_task(run_paged(run.config, run=run))
        await _until(lambda: run.counts.verified >= 2, "verified steps before the kill")
        os.kill(pid, signal.SIGKILL)
        # Every live sequence is written again in the new generation, then verified.
        await _until(lambda: run.counts.verified_by_generation[first + 1] >= 3,
                     "verified steps after the restart")  # fmt: skip
        run.stop_sending.set()
        return await task

    report = asyncio.run(main())
    d.worker_pids_seen.add(pid)
    assert report["state_lost"] >= 1
    assert report["sequences"]["reprefilled"] >= 1
    assert report["verify_failures"] == 0
    assert report["verified_by_generation"][str(first)] >= 2
    assert set(report["verified_by_generation"]) == {str(first), str(first + 1)}
    assert report["verdict"]["exit_code"] == 0, report["verdict"]
