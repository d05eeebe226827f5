"""Tensor parallel on npusim's performance mode (issue 44, item 6): tokens/s decoding
ahead and a lone step's latency through a real daemon at TP 1, 2 and 4.

The program and the costs are the field bench's (:mod:`.field`): the ``model`` program
(the demo's tiny Llama, 4 heads, 2 KV heads) at :data:`field.LAYERS` layers, batch
:data:`field.BATCH`, ``mode = "perf"``, 185 us of host update (25 us of it under the
interpreter lock) and 60 us of replay per layer at TP 1. At TP N (one daemon, one group
of N ranks, ``tensor_parallel = N``):

- **a rank's replay is 1/N of TP 1's**: decode at a small batch reads every weight once
  per step, so a rank holding 1/N of each split weight does about 1/N of the work (the
  norms, rotary and sampling, whole on every rank, are a small part and are taken to
  shrink too: the model's per-task cost is ``task_us / N``, on the same task count);
- **a rank's updates cost what TP 1's do**: each rank patches every layer of its own
  graph (its heads' attention parameters); an update's host cost is the Python and the
  op's dispatch and tiling around the call, not the number of heads, so ``patch_us``
  stays 185 us per layer, paid by every rank in its own process, in parallel;
- **each collective costs HCCL's latency plus its bytes over an HCCS link**
  (``collective_us`` + 2(N-1)/N x bytes / ``collective_gb_s`` for the all-reduces,
  npusim's :func:`npusim.collectives.collective_cost_us`): a decode step runs
  ``2 * layers + 2`` of them (o and down per layer, the embedding's all-reduce, the
  logits' all-gather), from when the last rank reached it.

The HCCL figures (docs/performance.md, "Tensor parallel", cites them):
:data:`HCCS_LINK_GB_S` is the per-link figure of a 910B's HCCS (an Atlas 800T A2's eight
NPUs are a full mesh, seven links each, 392 GB/s in all); :data:`HCCL_LATENCY_US` is a
small all-reduce's latency, an assumption of the order the field reports (no published
hccl_test figure for small messages was found). A decode step's all-reduce is batch x
hidden x 2 bytes (bfloat16): at a 70B model's hidden size of 8192 and batch 4, 64 KiB,
1-2 us over a 56 GB/s link, so the latency dominates; the bench's tiny model moves
512 bytes.
"""

from __future__ import annotations

import asyncio
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from npusim import configure

from graphlane.client import Client

from . import decode
from . import field as fieldbench
from .daemon import BenchDaemon

TP_SIZES = (1, 2, 4)
#: One HCCS link of a 910B, GB/s (an 8-NPU full mesh: 7 links, 392 GB/s per chip).
HCCS_LINK_GB_S = 56.0
#: A small HCCL all-reduce's latency within a host, us (an assumption: see the module).
HCCL_LATENCY_US = 20.0
LAYERS = fieldbench.LAYERS
BATCH = fieldbench.BATCH


def tp1_task_us(layers: int = LAYERS) -> float:
    """The modelled device time per replayed task at TP 1: :data:`field.REPLAY_US` per
    layer spread over the captured graph's tasks (as the field bench sets it)."""
    old = configure()
    try:
        return fieldbench.FieldModel(layers, depth=1).task_us
    finally:
        configure(mode=old.mode, task_us=old.task_us, patch_us=old.patch_us,
                  patch_gil_us=old.patch_gil_us)  # fmt: skip


def sim_settings(tp: int, task_us: float, latency_us: float = HCCL_LATENCY_US,
                 gb_s: float = HCCS_LINK_GB_S) -> dict[str, Any]:  # fmt: skip
    """The daemon's ``[sim]`` table at TP ``tp``: a rank's tasks cost 1/tp of TP 1's, its
    updates the same, each collective HCCL's latency plus its bytes over a link."""
    return {**fieldbench.sim_settings(task_us / tp), "collective_us": latency_us,
            "collective_gb_s": gb_s}  # fmt: skip


def program_table(tp: int, layers: int = LAYERS) -> dict[str, Any]:
    return {**fieldbench.program_table(layers), "tensor_parallel": str(tp)}


def limit_steps_s(tp: int, layers: int = LAYERS, latency_us: float = HCCL_LATENCY_US) -> float:
    """The model's decode-ahead limit at TP ``tp``: a step takes, per layer, the longer of
    its update and its replay (1/tp of TP 1's, plus two collectives' latency at tp > 1);
    the embedding's and the logits' collectives are left out (2 of ``2 * layers + 2``)."""
    replay = fieldbench.REPLAY_US / tp + (2 * latency_us if tp > 1 else 0.0)
    return 1e6 / (layers * max(fieldbench.PATCH_US, replay))


@dataclass
class TpFigures:
    layers: int
    patch_us: float
    replay_us: float  # per layer at TP 1
    collective_us: float
    collective_gb_s: float
    steps: int
    load_average: list[float]  # os.getloadavg() at the start
    load_average_end: list[float] = field(default_factory=list)
    cpu_cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    tokens_s: dict[str, list[float]] = field(default_factory=dict)  # TP -> one per rep
    lone_ms: dict[str, list[float]] = field(default_factory=dict)  # TP -> mean per rep
    limit_tokens_s: dict[str, float] = field(default_factory=dict)

    def ratios(self) -> dict[str, float]:
        """Each TP's median against TP 1's, and against its modelled limit."""
        r: dict[str, float] = {}
        if "1" not in self.tokens_s:
            return r
        base_t = statistics.median(self.tokens_s["1"])
        base_l = statistics.median(self.lone_ms["1"])
        for tp in self.tokens_s:
            t = statistics.median(self.tokens_s[tp])
            r[f"TP {tp}: tokens/s vs TP 1"] = t / base_t
            r[f"TP {tp}: lone step vs TP 1"] = statistics.median(self.lone_ms[tp]) / base_l
            r[f"TP {tp}: tokens/s vs limit"] = t / self.limit_tokens_s[tp]
        return r

    def excess_ms_per_collective(self) -> dict[str, float]:
        """How much longer a lone step at TP N took than at TP 1, per collective of the
        step (``2 * layers + 2``): the wall cost of the sim's rendezvous and of the
        ranks' processes sharing the cores, beyond the modelled cost (which the update-bound
        step hides)."""
        if "1" not in self.lone_ms:
            return {}
        base = statistics.median(self.lone_ms["1"])
        n = 2 * self.layers + 2
        return {tp: (statistics.median(v) - base) / n for tp, v in self.lone_ms.items()
                if tp != "1"}  # fmt: skip

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratios"] = {k: round(v, 3) for k, v in self.ratios().items()}
        d["excess_ms_per_collective"] = {
            k: round(v, 3) for k, v in self.excess_ms_per_collective().items()
        }
        return d


def measure(tp_sizes: tuple[int, ...] = TP_SIZES, steps: int = 120, reps: int = 3,
            lone_steps: int = 40, layers: int = LAYERS, latency_us: float = HCCL_LATENCY_US,
            gb_s: float = HCCS_LINK_GB_S) -> TpFigures:  # fmt: skip
    """A daemon per TP size in turn (one group of that size), each decoding ahead
    ``steps`` steps and then ``lone_steps`` lone steps, ``reps`` times."""
    if not 1 <= steps <= decode.MAX_STEPS:
        raise ValueError(f"steps must be in 1..{decode.MAX_STEPS} (the sequences' room)")
    task_us = tp1_task_us(layers)
    f = TpFigures(layers=layers, patch_us=fieldbench.PATCH_US, replay_us=fieldbench.REPLAY_US,
                  collective_us=latency_us, collective_gb_s=gb_s, steps=steps,
                  load_average=list(os.getloadavg()))  # fmt: skip
    for tp in tp_sizes:
        k = str(tp)
        f.limit_tokens_s[k] = BATCH * limit_steps_s(tp, layers, latency_us)
        daemon = BenchDaemon(program_table(tp, layers), devices=tp,
                             sim=sim_settings(tp, task_us, latency_us, gb_s))  # fmt: skip
        try:
            f.tokens_s[k], f.lone_ms[k] = asyncio.run(
                _one(daemon.endpoint, steps, reps, lone_steps)
            )
        finally:
            daemon.close()
    f.load_average_end = list(os.getloadavg())
    return f


async def _one(endpoint: str, steps: int, reps: int, lone_steps: int
               ) -> tuple[list[float], list[float]]:  # fmt: skip
    tokens, lone = [], []
    async with Client(endpoint, timeout=120) as c:
        ps = decode.prompts()
        await fieldbench._prefill(c, ps)  # warm every path up
        await fieldbench.daemon_ahead(c, steps, 0.0)
        for _ in range(reps):
            await fieldbench._prefill(c, ps)
            tokens.append(BATCH * await fieldbench.daemon_ahead(c, steps, 0.0))
            await fieldbench._prefill(c, ps)
            lone.append(1000 * statistics.fmean(await fieldbench.daemon_lone(c, lone_steps)))
    return tokens, lone


def table(f: TpFigures) -> str:
    def rng(xs: list[float], fmt: str) -> str:
        return f"{min(xs):{fmt}}-{max(xs):{fmt}}" if xs else "-"

    r = f.ratios()
    lines = [
        f"tensor parallel: model program, {f.layers} layers, batch {BATCH}, npusim perf mode, "
        f"update {f.patch_us:g} us / replay {f.replay_us:g} us per layer at TP 1 (1/N at TP N), "
        f"collectives {f.collective_us:g} us + bytes at {f.collective_gb_s:g} GB/s; "
        f"{f.cpu_cores} CPU cores, load average {f.load_average[0]:.2f} at the start"
        + (f", {f.load_average_end[0]:.2f} at the end" if f.load_average_end else ""),
        f"{'TP':>3} {'tokens/s ahead':>15} {'vs TP 1':>8} {'vs limit':>9} "
        f"{'lone step ms':>13} {'vs TP 1':>8}",
    ]
    for tp in f.tokens_s:
        lines.append(
            f"{tp:>3} {rng(f.tokens_s[tp], '.0f'):>15} {r[f'TP {tp}: tokens/s vs TP 1']:7.2f}x "
            f"{r[f'TP {tp}: tokens/s vs limit']:8.2f} {rng(f.lone_ms[tp], '.2f'):>13} "
            f"{r[f'TP {tp}: lone step vs TP 1']:7.2f}x"
        )
    excess = f.excess_ms_per_collective()
    if excess:
        lines.append(
            "lone step beyond TP 1's, per collective (the sim's rendezvous and the ranks "
            "sharing the cores, not the modelled cost): "
            + ", ".join(f"TP {tp} {ms:.2f} ms" for tp, ms in excess.items())
        )
    return "\n".join(lines)


__all__ = ["HCCL_LATENCY_US", "HCCS_LINK_GB_S", "TP_SIZES", "TpFigures", "limit_steps_s",
           "measure", "sim_settings", "table"]  # fmt: skip
