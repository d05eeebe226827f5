"""``backend = "npu"`` through real daemons (issue 29), over the strict torch_npu of
tests/strict_npu: found by ``import torch_npu`` as in a deployment, every call bound
against torch_npu 2.14's signatures, only the devices ``ASCEND_RT_VISIBLE_DEVICES`` names
visible (numbered from 0), a thread that never set the device refused, and every call
traced. Each test checks the numbers and then the traces: the runtime's device index,
``set_device`` first in every thread, the capture sequence (wait, reset, group begin,
op, group end), the update sequence (update begin, op, update end, record), the update
stream's priority and pinned staging of the inputs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from daemons import SMALL, RunningDaemon, wait_for
from paged_kv import Scheduler

from graphlane.client import Client
from graphlane.workers.programs import PagedAttentionConfig

STRICT = Path(__file__).parents[1] / "strict_npu"
PAGED = {"name": "paged_attention", "layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 16, "block_size": 128, "num_blocks": 8, "max_blocks_per_seq": 2,
         "buckets": [1, 2, 4]}  # fmt: skip
CFG = PagedAttentionConfig(
    **{k: v for k, v in PAGED.items() if k != "name"} | {"buckets": (1, 2, 4)}
)  # type: ignore[arg-type]
L, N, NKV, D, MAXKV = (SMALL[k] for k in ("layers", "num_heads", "num_kv_heads", "head_dim",
                                          "max_kv_len"))  # fmt: skip
FIA_OUT = "npu_fused_infer_attention_score.out"
TOL = dict(atol=3e-3, rtol=3e-3)


def npu_env(trace: Path, event_mode: str | None = None) -> dict[str, str]:
    trace.mkdir()
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(STRICT), os.environ.get("PYTHONPATH")) if p),
        "STRICT_TORCH_NPU_TRACE": str(trace),
    }
    if event_mode is not None:
        env["NPUSIM_EVENT_MODE"] = event_mode
    return env


# ------------------------------------------------------------------ requests
async def attention_steps(c: Client, device: int, seed: int, count: int = 6) -> None:
    """``count`` steps sent at once (several on the device together), numbers checked."""
    from reference import decode_stack

    gen = torch.Generator().manual_seed(seed)
    calls, wants = [], []
    for i in range(count):
        batch = 1 + i % 3
        lengths = torch.randint(1, MAXKV + 1, (batch,), generator=gen).tolist()
        kv = (L, batch, NKV, MAXKV, D)
        inputs = {
            "query": torch.randn(batch, N, 1, D, generator=gen).half(),
            "key": torch.randn(kv, generator=gen).half(),
            "value": torch.randn(kv, generator=gen).half(),
        }
        want = decode_stack(inputs["query"], list(inputs["key"]), list(inputs["value"]), lengths)
        calls.append(c.step("attention", device, {"actual_seq_lengths_kv": lengths}, inputs))
        wants.append(want)
    for r, want in zip(await asyncio.gather(*calls), wants, strict=True):
        torch.testing.assert_close(r.outputs["out"], want, **TOL)


async def paged_steps(c: Client, device: int, seed: int, steps: int = 3) -> None:
    sched = Scheduler(CFG, torch.Generator().manual_seed(seed))
    for sid, n in {0: 100, 1: 7, 2: 129}.items():
        slots, k, v = sched.prefill(sid, n)
        await c.kv_write("paged_attention", device, slots, k, v)
    for _ in range(steps):
        inputs, lengths = sched.decode([0, 1, 2])
        want = sched.expected([0, 1, 2], inputs["query"])
        r = await c.step("paged_attention", device, {"actual_seq_lengths_kv": lengths}, inputs)
        torch.testing.assert_close(r.outputs["out"], want, **TOL)


# ------------------------------------------------------------------ traces
def traces(trace: Path) -> dict[int, list[dict[str, Any]]]:
    """Each worker process's calls, by pid (the first entry names what it saw)."""
    out = {}
    for path in sorted(trace.glob("trace-*.jsonl")):
        entries = [json.loads(line) for line in path.read_text().splitlines() if line]
        out[entries[0]["pid"]] = entries
    return out


def by_thread(entries: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    threads: dict[str, list[dict[str, Any]]] = {}
    for e in entries[1:]:
        threads.setdefault(e["thread"], []).append(e)
    return threads


def check_process(entries: list[dict[str, Any]], physical: int, pipelined: bool) -> None:
    """One worker's trace against what the wheel's own capture paths issue."""
    assert entries[0]["visible"] == [physical]  # pinned by the daemon
    threads = by_thread(entries)
    for name, calls in threads.items():  # the device is per host thread: set first
        assert calls[0]["call"] == "set_device", (name, calls[0])
        assert calls[0]["args"]["device"] == 0, (name, calls[0])  # the runtime's index
    if pipelined:
        assert {"graphlane-update", "graphlane-completion"} <= set(threads), set(threads)
    streams = [e for e in entries[1:] if e["call"] == "Stream"]
    assert streams and all(e["args"].get("device") == "npu:0" for e in streams)
    for e in entries[1:]:  # every stream named is the runtime's device 0
        for v in e["args"].values():
            if isinstance(v, dict) and "stream" in v:
                assert v["device"] == 0, e
    priority = {e["stream"]["stream"]: e["priority"] for e in streams}

    main = threads["MainThread"]
    captures = [i for i, e in enumerate(main) if e["call"] == "ExternalEvent.wait"]
    assert captures
    for i in captures:  # wait, reset, group begin, op, group end: on one stream
        wait, reset, begin, op, end = main[i : i + 5]
        s = wait["args"]["stream"]
        assert reset["call"] == "ExternalEvent.reset" and reset["self"] == wait["self"], reset
        assert reset["args"]["stream"] == s
        assert begin["call"] == "graph_task_group_begin" and begin["args"]["stream"] == s
        assert op["call"] == FIA_OUT
        assert end["call"] == "graph_task_group_end" and end["args"]["stream"] == s

    updates = 0
    for calls in threads.values():
        for i, e in enumerate(calls):
            if e["call"] != "graph_task_update_begin":
                continue
            u = e["args"]["stream"]
            op, end, record = calls[i + 1 : i + 4]
            assert op["call"] == FIA_OUT, op
            assert end["call"] == "graph_task_update_end" and end["args"]["stream"] == u
            assert record["call"] == "ExternalEvent.record" and record["args"]["stream"] == u
            assert priority[u["stream"]] == -1  # as npugraph_ex gives its update stream
            updates += 1
    assert updates
    pins = [e for e in entries[1:] if e["call"] == "Tensor.pin_memory"]
    assert pins  # inputs are staged in pinned memory before their asynchronous copy


# ------------------------------------------------------------------ tests
def test_two_devices_serve_both_programs_and_a_killed_worker_comes_back(
    start_daemon: Any, tmp_path: Path
) -> None:
    trace = tmp_path / "trace"
    d: RunningDaemon = start_daemon(
        backend="npu", devices=2, programs=[SMALL, PAGED], env=npu_env(trace)
    )
    st = d.status()
    assert [(w["device"], w["state"]) for w in st["workers"]] == [(0, "ready"), (1, "ready")]

    async def serve(seed: int) -> None:
        async with Client(d.endpoint, timeout=60) as c:
            for device in (0, 1):
                await attention_steps(c, device, seed + device)
                await paged_steps(c, device, seed + device)

    asyncio.run(serve(10))
    first, generation = d.worker(1)["pid"], d.worker(1)["generation"]
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: d.worker(1)["state"] == "ready" and d.worker(1)["pid"] != first, 60,
             "device 1's worker to be restarted")  # fmt: skip

    async def again() -> None:
        async with Client(d.endpoint, timeout=60) as c:
            await attention_steps(c, 1, 30)

    asyncio.run(again())
    assert d.worker(1)["generation"] == generation + 1  # the daemon's instance, one restart
    pids = {w["device"]: w["pid"] for w in d.status()["workers"]}
    found = traces(trace)
    assert set(found) >= {pids[0], pids[1], first}
    for device, pid in ((0, pids[0]), (1, pids[1]), (1, first)):
        check_process(found[pid], device, pipelined=True)


def test_serial_mode_on_two_devices(start_daemon: Any, tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    d: RunningDaemon = start_daemon(
        backend="npu", devices=2, programs=[SMALL, PAGED], pipeline=False, env=npu_env(trace)
    )

    async def serve() -> None:
        async with Client(d.endpoint, timeout=60) as c:
            for device in (0, 1):
                await attention_steps(c, device, 40 + device, count=3)
                await paged_steps(c, device, 40 + device, steps=2)

    asyncio.run(serve())
    pids = {w["device"]: w["pid"] for w in d.status()["workers"]}
    found = traces(trace)
    for device, pid in pids.items():
        check_process(found[pid], device, pipelined=False)


@pytest.mark.parametrize(
    ("event_mode", "order"), [("enpu", "before-replay"), ("legacy", "after-replay")]
)
def test_event_modes_of_other_devices(
    start_daemon: Any, tmp_path: Path, event_mode: str, order: str
) -> None:
    """ENPU hangs on a wait issued before its record: records first, by config. Older
    CANN clears an ExternalEvent only in reset: the captured reset keeps replays right.
    (Physical device 1, the only one its worker sees, as npu:0.)"""
    trace = tmp_path / "trace"
    d: RunningDaemon = start_daemon(
        backend="npu", devices=[1], programs=[SMALL, PAGED], record_order=order,
        env=npu_env(trace, event_mode),
    )  # fmt: skip

    async def serve() -> None:
        async with Client(d.endpoint, timeout=60) as c:
            for seed in (50, 51):  # every graph instance replayed more than once
                await attention_steps(c, 1, seed)
            await paged_steps(c, 1, 52, steps=4)

    asyncio.run(serve())
    worker = d.worker(1)
    assert worker["restarts"] == 0 and worker["state"] == "ready", worker
    check_process(traces(trace)[worker["pid"]], 1, pipelined=order == "after-replay")


MODEL = {"name": "model", "seed": 5, "init_std": 0.3, "block_size": 128, "num_blocks": 8,
         "max_blocks_per_seq": 2, "buckets": [1, 2, 4], "prefill_chunk": 48,
         "random": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
                    "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2}}  # fmt: skip
NEW = 10


def _sequences() -> list[Any]:
    from model_ref import Sequence

    g = torch.Generator().manual_seed(4)
    lengths = {0: 5, 1: 17, 2: 130, 3: 1, 4: 60}
    joins = {0: 0, 1: 0, 2: 3, 3: 5, 4: 9}
    return [Sequence(sid, torch.randint(0, 256, (n,), generator=g).tolist(), joins[sid])
            for sid, n in lengths.items()]  # fmt: skip


def _in_process() -> dict[int, list[int]]:
    """The same sequences on an engine in this process over the sim (the same kernels)."""
    from issuer import Issuer
    from model_ref import run_batching

    from graphlane.workers.backends.sim import SimBackend
    from graphlane.workers.programs import load_program

    program = load_program("model", MODEL)
    with Issuer(SimBackend(0), [program]) as eng:

        def prefill(tokens: list[int], table: list[int]) -> int:
            fields = {"tokens": torch.tensor(tokens),
                      "block_table": torch.tensor(table, dtype=torch.int32)}  # fmt: skip
            (s,) = eng.wait([eng.state("model", "prefill", fields)], 60)
            return int(s.results["tokens"][0])

        def step(tokens: list[int], lengths: list[int], tables: list[list[int]]) -> list[int]:
            inputs = {"tokens": torch.tensor(tokens),
                      "block_table": torch.tensor(tables, dtype=torch.int32)}  # fmt: skip
            params = {"actual_seq_lengths_kv": lengths}
            (s,) = eng.wait([eng.step(len(tokens), lengths, inputs=inputs, program="model",
                                      params=params, outputs=("tokens",))], 60)  # fmt: skip
            return s.results["tokens"].tolist()

        return run_batching(_sequences(), NEW, 128, 8, 2, prefill, step)


def test_the_model_program_on_two_devices_decodes_ahead_and_survives_a_restart(
    start_daemon: Any, tmp_path: Path
) -> None:
    """bfloat16 (the default on an NPU), two devices, every row decoding ahead, a worker
    killed and restarted: the tokens are those of the same model on the sim in process,
    on both devices and after the restart; the traces are the wheel's sequences."""
    from model_ref import run_ahead

    want = _in_process()
    trace = tmp_path / "trace"
    d: RunningDaemon = start_daemon(backend="npu", devices=2, programs=[MODEL],
                                    env=npu_env(trace))  # fmt: skip
    worker = d.status()["workers"][0]
    assert worker["programs"]["model"]["config"]["dtype"] == "bfloat16"
    assert "sim_extensions" not in worker  # nothing of the sim's own on an NPU

    async def ahead(devices: list[int]) -> list[dict[int, list[int]]]:
        async with Client(d.endpoint, timeout=60) as c:
            return [await run_ahead(c, "model", _sequences(), NEW, 128, 8, 2, device=dev)
                    for dev in devices]  # fmt: skip

    assert asyncio.run(ahead([0, 1])) == [want, want]
    first = d.worker(1)["pid"]
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: d.worker(1)["state"] == "ready" and d.worker(1)["pid"] != first, 60,
             "device 1's worker to be restarted")  # fmt: skip
    assert asyncio.run(ahead([1])) == [want]  # a new client: the new generation's cache
    pids = {w["device"]: w["pid"] for w in d.status()["workers"]}
    found = traces(trace)
    for device, pid in ((0, pids[0]), (1, pids[1]), (1, first)):
        check_process(found[pid], device, pipelined=True)
        calls = {e["call"] for e in found[pid][1:]}
        assert {"npu_add_rms_norm", "npu_rotary_mul", "npu_swiglu",
                "_npu_reshape_and_cache"} <= calls, calls  # fmt: skip
