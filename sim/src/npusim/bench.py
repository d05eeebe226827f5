"""What the simulated NPU itself costs, per op, beside the CPU eager op it stands for.

Each figure times the sim doing one thing (issue N, then synchronize once, so
the stream threads' work is counted) and, in the same run and interleaved with
it, the plain CPU op that the device op stands for; the ratio is the sim's
overhead factor. Small shapes (a decode step of the daemon's test config), so
the figures are the sim's own cost, not the math:

    inplace        x.add_(1) on the current stream         vs x.add_(1) on the CPU
    h2d copy_      dst.copy_(host)                         vs dst.copy_(src) on the CPU
    to(npu)        host.to("npu")                          vs host.clone()
    to(cpu)        dev.to("cpu")                           vs host.clone()
    patch          update_begin + fused attention .out     vs the attention .out op on the CPU
                   + update_end on an update stream
    replay         NPUGraph.replay() of L attention layers vs the L ops on the CPU
                   (compute mode; and timed mode at 0 us: the sim's pure overhead)
    step           what the daemon's engine does per step at 0 us modelled cost: wait,
                   replay, L fused patches with their releases (the fused update
                   binding), D2H copy, done record
    event          Event record on one stream + wait on another
                                                            vs threading.Event set + wait
    ext event      ExternalEvent record + a wait that consumes it
                                                            vs threading.Event set + wait

    python -m npusim.bench [--layers 4] [-n 200] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from . import torch_npu
from .runtime import configure

# Shapes of the daemon's small test program: batch 2, 4 heads over 2 KV heads.
BATCH, HEADS, KV_HEADS, HEAD_DIM, MAX_KV = 2, 4, 2, 16, 32


@dataclass(frozen=True)
class Figure:
    name: str
    sim_us: float  # per op, wall time, median over repeats
    sim_cpu_us: float  # per op, CPU time of the whole process (every stream thread)
    cpu_us: float  # the CPU eager op it stands for, same run, wall time
    cpu_op: str

    @property
    def ratio(self) -> float:
        return self.sim_us / self.cpu_us if self.cpu_us > 0 else math.inf


def _per_op_us(fn: Callable[[int], None], n: int) -> tuple[float, float]:
    """(wall, process CPU) microseconds per op. The CPU time counts every thread of the
    process and not the others' on a shared machine, so it is the steadier figure."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn(n)
    t1, c1 = time.perf_counter(), time.process_time()
    return (t1 - t0) / n * 1e6, (c1 - c0) / n * 1e6


def _measure(
    name: str,
    cpu_op: str,
    sim: Callable[[int], None],
    cpu: Callable[[int], None],
    n: int,
    repeats: int,
) -> Figure:
    sim(max(1, n // 10))  # warm caches (meta kernels, stream threads)
    cpu(max(1, n // 10))
    s, sc, c = [], [], []
    for _ in range(repeats):  # interleaved, so both see the same machine
        wall, proc = _per_op_us(sim, n)
        s.append(wall)
        sc.append(proc)
        c.append(_per_op_us(cpu, n)[0])
    med = statistics.median
    return Figure(name, med(s), med(sc), med(c), cpu_op)


class _Attention:
    """L captured fused attention layers (as the daemon's program captures them)."""

    def __init__(self, npu: Any, fia_out: Any, layers: int, device: str, waits: bool) -> None:
        gen = torch.Generator().manual_seed(0)
        self.kw = dict(
            num_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            input_layout="BNSD",
            scale=1 / math.sqrt(HEAD_DIM),
            softmax_lse_flag=False,
        )
        q_shape = (BATCH, HEADS, 1, HEAD_DIM)
        kv_shape = (BATCH, KV_HEADS, MAX_KV, HEAD_DIM)

        def t(shape: tuple[int, ...]) -> torch.Tensor:
            return torch.randn(shape, dtype=torch.float16, generator=gen).to(device)

        self.fia_out = fia_out
        self.query = t(q_shape)
        self.keys = [t(kv_shape) for _ in range(layers)]
        self.values = [t(kv_shape) for _ in range(layers)]
        self.outs = [
            torch.zeros(q_shape, dtype=torch.float16, device=device) for _ in range(layers)
        ]
        self.lse = torch.zeros(1, device=device)
        self.layers = layers
        self.lengths = [MAX_KV] * BATCH
        self.graph: Any = None
        self.handles: list[Any] = []
        self.events: list[Any] = []
        if npu is None:
            return
        self.capture_stream = npu.Stream()
        self.update_stream = npu.Stream()
        self.graph = npu.NPUGraph()
        npu.synchronize()
        with npu.graph(self.graph, stream=self.capture_stream):
            for layer in range(layers):
                if waits:
                    ev = npu.ExternalEvent()
                    ev.wait(self.capture_stream)
                    self.events.append(ev)
                npu.graph_task_group_begin(self.capture_stream)
                self.layer(layer, self.lengths)
                self.handles.append(npu.graph_task_group_end(self.capture_stream))

    def args(self, layer: int, lengths: list[int]) -> dict[str, Any]:
        return dict(
            query=self.query if layer == 0 else self.outs[layer - 1],
            key=self.keys[layer],
            value=self.values[layer],
            actual_seq_lengths_kv=lengths,
            out=[self.outs[layer], self.lse],
            **self.kw,
        )

    def layer(self, layer: int, lengths: list[int]) -> None:
        self.fia_out(**self.args(layer, lengths))


def run(
    layers: int = 4, n: int = 200, repeats: int = 5, step_n: int | None = None
) -> dict[str, Any]:
    """Measure every figure; returns ``{"figures": {name: {...}}, "layers": ..., ...}``.

    Restores the sim's configuration afterwards; runs torch on one CPU thread.
    ``n`` ops per repeat (graph figures use ``n // layers`` replays, at least 10).
    """
    npu = torch_npu.npu
    fia_out = torch_npu.npu_fused_infer_attention_score.out
    old = configure()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU figures are single ops: no intra-op thread noise
    figures: list[Figure] = []
    try:
        configure(mode="compute", task_us=0.0, patch_us=0.0)
        figures += _eager_figures(npu, n, repeats)
        figures += _graph_figures(npu, fia_out, layers, max(10, n // layers), repeats, step_n)
        figures += _event_figures(npu, n, repeats)
    finally:
        configure(mode=old.mode, task_us=old.task_us, patch_us=old.patch_us)
        torch.set_num_threads(threads)
        npu.synchronize()
    return {
        "layers": layers,
        "n": n,
        "repeats": repeats,
        "figures": {f.name: {**asdict(f), "ratio": f.ratio} for f in figures},
    }


def _eager_figures(npu: Any, n: int, repeats: int) -> list[Figure]:
    x_dev = torch.zeros(BATCH, HEADS, 1, HEAD_DIM, device="npu")
    x_cpu = torch.zeros(BATCH, HEADS, 1, HEAD_DIM)
    host = torch.randn(BATCH, KV_HEADS, MAX_KV, HEAD_DIM, dtype=torch.float16)
    host2 = host.clone()
    dev = host.to("npu")

    def sim_add(k: int) -> None:
        for _ in range(k):
            x_dev.add_(1)
        npu.synchronize()

    def cpu_add(k: int) -> None:
        for _ in range(k):
            x_cpu.add_(1)

    def sim_h2d(k: int) -> None:
        for _ in range(k):
            dev.copy_(host)

    def cpu_copy(k: int) -> None:
        for _ in range(k):
            host2.copy_(host)

    def sim_to_npu(k: int) -> None:
        for _ in range(k):
            host.to("npu")
        npu.synchronize()

    def sim_to_cpu(k: int) -> None:
        for _ in range(k):
            dev.to("cpu")

    def cpu_clone(k: int) -> None:
        for _ in range(k):
            host.clone()

    return [
        _measure("inplace add_", "x.add_(1)", sim_add, cpu_add, n, repeats),
        _measure("h2d copy_", "dst.copy_(src)", sim_h2d, cpu_copy, n, repeats),
        _measure("to(npu)", "x.clone()", sim_to_npu, cpu_clone, n, repeats),
        _measure("to(cpu)", "x.clone()", sim_to_cpu, cpu_clone, n, repeats),
    ]


def _graph_figures(
    npu: Any, fia_out: Any, layers: int, n: int, repeats: int, step_n: int | None
) -> list[Figure]:
    plain = _Attention(npu, fia_out, layers, "npu", waits=False)
    waited = _Attention(npu, fia_out, layers, "npu", waits=True)
    cpu = _Attention(None, fia_out, layers, "cpu", waits=False)
    lengths = [[i % MAX_KV + 1, MAX_KV] for i in range(8)]
    U = plain.update_stream

    def sim_patch(k: int) -> None:
        with npu.stream(U):
            for i in range(k):
                layer = i % layers
                npu.graph_task_update_begin(U, plain.handles[layer])
                plain.layer(layer, lengths[i % 8])
                npu.graph_task_update_end(U)
        U.synchronize()

    def cpu_op(k: int) -> None:
        for i in range(k):
            cpu.layer(i % layers, lengths[i % 8])

    def sim_replay(k: int) -> None:
        with npu.stream(plain.capture_stream):
            for _ in range(k):
                plain.graph.replay()
        plain.capture_stream.synchronize()

    def cpu_layers(k: int) -> None:
        for _ in range(k):
            for layer in range(layers):
                cpu.layer(layer, cpu.lengths)

    S, U2 = waited.capture_stream, waited.update_stream
    fused = torch_npu._C._npu_fused_infer_attention_score_out_graph
    state: dict[str, Any] = {"last": None, "i": 0}

    def sim_step(k: int) -> None:
        # The engine's pipelined step (graphlane.workers.engine), through the sim's
        # torch_npu API: U waits for the previous replay, S replays, U patches and
        # releases each layer (the fused update binding, as the npu provider uses
        # it), S copies the output to the host and records done.
        for _ in range(k):
            i = state["i"] = state["i"] + 1
            if state["last"] is not None:
                U2.wait_event(state["last"])
            with npu.stream(S):
                waited.graph.replay()
            with npu.stream(U2):
                for layer in range(layers):
                    args = waited.args(layer, lengths[(i + layer) % 8])
                    fused(U2, waited.handles[layer], waited.events[layer], **args)
            with npu.stream(S):
                waited.outs[-1].to("cpu", non_blocking=True)
                done = npu.Event()
                done.record(S)
            state["last"] = done
            done.synchronize()

    out = [
        _measure("patch", "attention .out (CPU)", sim_patch, cpu_op, n, repeats),
        _measure(
            f"replay {layers} layers",
            f"{layers} x attention .out (CPU)",
            sim_replay,
            cpu_layers,
            n,
            repeats,
        ),
    ]
    configure(mode="timed", task_us=0.0, patch_us=0.0)
    try:
        out.append(
            _measure(
                f"replay {layers} layers, timed 0us",
                f"{layers} x attention .out (CPU)",
                sim_replay,
                cpu_layers,
                n,
                repeats,
            )
        )
        out.append(
            _measure(
                f"step {layers} layers, timed 0us",
                f"{layers} x attention .out (CPU)",
                sim_step,
                cpu_layers,
                step_n or n,
                repeats,
            )
        )
    finally:
        configure(mode="compute")
    return out


def _event_figures(npu: Any, n: int, repeats: int) -> list[Figure]:
    a, b = npu.Stream(), npu.Stream()
    ext = npu.ExternalEvent()
    ev = npu.Event()
    flag = threading.Event()

    def sim_event(k: int) -> None:
        for _ in range(k):
            ev.record(a)
            b.wait_event(ev)
        b.synchronize()

    def sim_ext(k: int) -> None:
        for _ in range(k):
            ext.wait(b)
            ext.record(a)
            b.synchronize()  # the next record must follow the consuming wait

    def host_event(k: int) -> None:
        for _ in range(k):
            flag.set()
            flag.wait()
            flag.clear()

    return [
        _measure(
            "event record+wait", "threading.Event set+wait", sim_event, host_event, n, repeats
        ),
        _measure(
            "ext event record+wait+sync",
            "threading.Event set+wait",
            sim_ext,
            host_event,
            n,
            repeats,
        ),
    ]


def table(result: dict[str, Any]) -> str:
    """The figures as a text table: sim us/op (wall, and the process's CPU time), the
    CPU op's us/op, and their ratio (wall over wall)."""
    rows = [f"{'op':32} {'sim us':>8} {'(cpu time)':>10} {'cpu op us':>9} {'ratio':>8}  cpu op"]
    for f in result["figures"].values():
        sim, proc, cpu, ratio = f["sim_us"], f["sim_cpu_us"], f["cpu_us"], f["ratio"]
        rows.append(
            f"{f['name']:32} {sim:8.1f} {proc:10.1f} {cpu:9.1f} {ratio:7.1f}x  {f['cpu_op']}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("-n", type=int, default=200, help="ops per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    result = run(layers=args.layers, n=args.n, repeats=args.repeats)
    print(json.dumps(result, indent=2) if args.json else table(result))


if __name__ == "__main__":
    main()
