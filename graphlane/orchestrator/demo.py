"""``graphlane demo``: a daemon on simulated devices, driven as a scheduler would.

Starts ``graphlane serve`` as a child process on a private ipc endpoint, waits
until its workers are ready, sends steps with random batch sizes, sequence
lengths and inputs to every device concurrently, checks every output against
eager attention computed here on the CPU, prints what happened, then stops the
daemon with SIGTERM and exits.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from .client import Client

LAYERS, HEADS, KV_HEADS, DIM, MAX_KV, BUCKETS = 4, 8, 2, 64, 256, (1, 2, 4, 8)


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    from graphlane.workers.sim.attention_kernel import fused_infer_attention

    x = q
    for layer in range(LAYERS):
        x, _ = fused_infer_attention(
            x, k[layer], v[layer], actual_seq_lengths_kv=lengths, num_heads=HEADS,
            num_key_value_heads=KV_HEADS, input_layout="BNSD", scale=1 / math.sqrt(DIM),
        )  # fmt: skip
    return x


async def drive_device(client: Client, device: int, steps: int, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    latencies, worst, buckets = [], 0.0, set()
    for _ in range(steps):
        batch = int(torch.randint(1, BUCKETS[-1] + 1, (1,), generator=gen))
        lengths = torch.randint(1, MAX_KV + 1, (batch,), generator=gen).tolist()
        q = torch.randn(batch, HEADS, 1, DIM, dtype=torch.float16, generator=gen)
        kv_shape = (LAYERS, batch, KV_HEADS, MAX_KV, DIM)
        k = torch.randn(kv_shape, dtype=torch.float16, generator=gen)
        v = torch.randn(kv_shape, dtype=torch.float16, generator=gen)
        t0 = time.perf_counter()
        r = await client.step(
            "attention", device, {"actual_seq_lengths_kv": lengths},
            {"query": q, "key": k, "value": v}, timeout=60,
        )  # fmt: skip
        latencies.append(time.perf_counter() - t0)
        buckets.add(r.bucket)
        err = (r.outputs["out"].float() - reference(q, k, v, lengths).float()).abs().max().item()
        worst = max(worst, err)
    return {
        "device": device,
        "steps": steps,
        "p50_ms": 1000 * statistics.median(latencies),
        "worst_error": worst,
        "buckets": sorted(buckets),
    }


async def drive(endpoint: str, devices: int, steps: int) -> list[dict[str, Any]]:
    async with Client(endpoint, timeout=30) as client:
        st = await client.wait_ready(300)
        for w in st["workers"]:
            print(f"  device {w['device']}: worker pid {w['pid']} ready at {w['endpoint']}")
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(drive_device(client, d, steps, seed=100 + d) for d in range(devices))
        )
        took = time.perf_counter() - t0
        print(
            f"sent {devices * steps} steps in {took:.1f} s ({devices * steps / took:.1f} steps/s)"
        )
        return list(results)


def run(devices: int = 2, steps: int = 40) -> int:
    with tempfile.TemporaryDirectory(prefix="graphlane-demo-") as tmp:
        endpoint = f"ipc://{tmp}/daemon.sock"
        serve_args = ["--listen", endpoint, "--devices", str(devices), "--log-level", "WARNING"]
        cmd = [sys.executable, "-m", "graphlane.orchestrator.cli", "serve", *serve_args]
        print(f"starting: graphlane serve --listen {endpoint} --devices {devices} (simulated NPUs)")
        daemon = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            results = asyncio.run(drive(endpoint, devices, steps))
        except BaseException:
            daemon.kill()
            daemon.wait()
            raise
        ok = True
        for r in results:
            good = r["worst_error"] < 1e-2
            ok &= good
            verdict = "ok" if good else "WRONG"
            print(
                f"  device {r['device']}: {r['steps']} steps, p50 {r['p50_ms']:.1f} ms, buckets "
                f"{r['buckets']}, max |out - eager| {r['worst_error']:.2g} {verdict}"
            )
        daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(timeout=120)
        print(f"daemon stopped with exit code {code}")
        return 0 if ok and code == 0 else 1
