"""Decoding ahead through a daemon beside the field's decode loop, on the ``model`` program
(issue 32, item 4).

The same tiny Llama (:data:`ARCHITECTURE`: the demo's, with :data:`LAYERS` layers),
the same :data:`BATCH` sequences (seeded prompts of :data:`PROMPT` tokens, greedy) and
the same decode steps, on the timed sim with the same modelled costs, driven three ways:

- **in process, the field's way** (:class:`ModelLoop`): vllm-ascend's full-graph
  decode in the process that schedules it. The host prepares the step's inputs (the
  program's own :meth:`~ModelProgram.plan`, copied into the graph's static buffers on
  the capture stream), launches the replay, then dispatches each layer's update on the
  update stream releasing that layer's ExternalEvent (the graph waits per layer on
  it), and waits for the step's sampled tokens before it prepares the next step;
- **through a daemon, waiting** (``graphlane serve`` at its default config, a child
  process), on the sequence operations (docs/models.md, "Sequences"): each sequence
  ``add``-ed, then a scheduler that sends ``decode`` N+1 once decode N's reply is back;
- **through the same daemon, decoding ahead**: the same decodes with :data:`WINDOW` in
  flight (decode N+1 sent before decode N's reply): the worker feeds each row the token
  its sequence sampled last, on the device.

Costs are per layer, as the field reports them: ``patch_us`` of host time per layer's
update (the FIA re-dispatch and tiling) and ``replay_us`` of device time per layer of
the graph's replay. The model's graph has many tasks (projections, norms, rope, the KV
write, FIA, MLP, and after the last layer the LM head and sampling); each is charged
``LAYERS * replay_us / tasks`` so that the whole replay costs ``LAYERS * replay_us``.

Figures (:func:`measure`, the three measured in alternation ``reps`` times, a slow
spell of the machine falling on all of them):

- the modelled limit: ``BATCH / (LAYERS * max(patch_us, replay_us))`` tokens/s (the
  updates of step N+1 overlap the replay of step N; one update thread, one device);
- the floor of a lone step (:func:`lone_floor`): the replay launched at 0, layer l's
  attention released at ``(l + 1) * patch_us``, each stretch of the graph's tasks at
  its modelled cost, up to the sampled tokens;
- tokens/s of each way, and a lone step's latency (in process and waiting through
  the daemon: the mean period of a loop that waits for each step's tokens).

Timed mode computes nothing in a replay, so the tokens a step samples are whatever
its buffer held: the in-process loop feeds them back clamped into the vocabulary
(greedy tokens in compute mode need no clamp: :func:`generate_in_process` and
:func:`generate_through_daemon`, which tests/tools compares token for token).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from npusim import configure, graph_profile

from graphlane.client import Client
from graphlane.demo_model import ARCHITECTURE as DEMO_ARCHITECTURE
from graphlane.demo_model import INIT_STD, SEED
from graphlane.workers.backends.sim import SimBackend
from graphlane.workers.programs.model import ModelConfig, ModelProgram

from .daemon import BenchDaemon

PROFILES: dict[str, tuple[float, float]] = {
    # name: (patch_us, replay_us) per layer
    "field": (185.0, 60.0),  # vllm-ascend on a 910B3 (issue 32)
    "field-x4": (740.0, 240.0),
    "field-x10": (1850.0, 600.0),  # where the modelled costs outweigh the sim's own Python
}
LAYERS = 4
BATCH = 4
WINDOW = 3  # decode steps in flight when decoding ahead
PROMPT = 8  # tokens per prompt
BLOCK_SIZE, MAX_BLOCKS = 128, 2  # sequences of up to 256 tokens: PROMPT + the steps
MAX_STEPS = BLOCK_SIZE * MAX_BLOCKS - PROMPT - 1
ARCHITECTURE: dict[str, Any] = {**DEMO_ARCHITECTURE, "num_hidden_layers": LAYERS}
#: Sequence r's blocks: 2r and 2r+1 (no two rows share a block).
TABLE = torch.tensor([[MAX_BLOCKS * r + i for i in range(MAX_BLOCKS)] for r in range(BATCH)],
                     dtype=torch.int32)  # fmt: skip


def model_config() -> ModelConfig:
    return ModelConfig(
        random=ARCHITECTURE, seed=SEED, init_std=INIT_STD, dtype="float32",
        block_size=BLOCK_SIZE, num_blocks=MAX_BLOCKS * BATCH, max_blocks_per_seq=MAX_BLOCKS,
        buckets=(BATCH,),
    )  # fmt: skip


def program_config() -> dict[str, Any]:
    """The same program as a ``[[programs]]`` table (a daemon's config)."""
    c = model_config()
    return {"name": "model", "random": dict(ARCHITECTURE), "seed": c.seed,
            "init_std": c.init_std, "dtype": "float32", "block_size": c.block_size,
            "num_blocks": c.num_blocks, "max_blocks_per_seq": c.max_blocks_per_seq,
            "buckets": list(c.buckets)}  # fmt: skip


def _toml(v: Any) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    return f"{v!r}".replace("'", '"')


def program_table() -> dict[str, Any]:
    """:func:`program_config` with TOML values, for :class:`BenchDaemon`."""
    return {k: v if k == "name" else _toml(v) for k, v in program_config().items()}


def prompts(seed: int = 0) -> list[list[int]]:
    """:data:`BATCH` prompts of :data:`PROMPT` tokens."""
    rng = random.Random(seed)
    vocab = int(ARCHITECTURE["vocab_size"])
    return [[rng.randrange(vocab) for _ in range(PROMPT)] for _ in range(BATCH)]


def _lengths(step: int) -> list[int]:
    """Every row's length with the token fed at decode step ``step`` (0: the first after
    the prefill, feeding the prefill's token)."""
    return [PROMPT + 1 + step] * BATCH


def _feedable(tokens: torch.Tensor) -> torch.Tensor:
    # Timed mode samples nothing (see the module doc); compute mode's tokens are unchanged.
    return tokens.clamp(0, int(ARCHITECTURE["vocab_size"]) - 1)


def graph_tasks(graph: Any) -> list[int]:
    """The tasks of a captured model graph by stretch: before the first layer's wait,
    between consecutive waits, after the last (npusim's graph profile)."""
    return list(graph_profile(graph).stretches)


def lone_floor(patch_us: float, task_us: float, stretches: list[int]) -> float:
    """Seconds from a lone step's replay launch to its tokens, in the timed model: the
    device runs each stretch of tasks, layer l's from when its update is released."""
    t = stretches[0] * task_us
    for layer, n in enumerate(stretches[1:]):
        t = max(t, (layer + 1) * patch_us) + n * task_us
    return t * 1e-6


class ModelLoop:
    """The model program captured once (one bucket of :data:`BATCH`) on this process's
    sim, driven as vllm-ascend drives its full-graph decode (see the module doc).

    ``mode`` "timed" configures the sim at ``patch_us``/``replay_us`` per layer once the
    graph is captured; "compute" leaves it computing (the tokens are real). One loop per
    process at a time."""

    def __init__(self, patch_us: float, replay_us: float, mode: str = "timed") -> None:
        self.program = p = ModelProgram(model_config())
        configure(mode="compute")
        b = self.backend = SimBackend()
        b.use_extensions([p])  # its float32 is the exact reference, a sim extension
        self.S, self.U = b.new_stream(), b.new_stream(priority=-1)
        self.bufs = p.allocate(b, BATCH)
        self.events = [b.new_external_event() for _ in range(LAYERS)]
        self.graph = b.new_graph()
        b.synchronize()
        with b.capture(self.graph, self.S):
            self.handles, _ = p.capture(b, self.S, BATCH, self.bufs, self.events)
        b.synchronize()
        self.stretches = graph_tasks(self.graph)
        self.task_us = LAYERS * replay_us / sum(self.stretches)
        self.floor_s = lone_floor(patch_us, self.task_us, self.stretches)
        if mode == "timed":
            configure(mode="timed", patch_us=patch_us, task_us=self.task_us)
        self.done: Any = None

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        """Each row's prompt into the cache (its blocks in :data:`TABLE`); the first tokens."""
        p, b = self.program, self.backend
        first = []
        for r, prompt in enumerate(prompts):
            fields = {"tokens": torch.tensor(prompt), "block_table": TABLE[r]}
            plan = p.plan_state("prefill", fields)
            with b.use_stream(self.S):
                first.append(p.run_state(b, plan)["tokens"].to("cpu"))
        b.synchronize()
        return torch.cat(first)

    def step(self, tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """One decode step, the host waiting for its sampled tokens (returned)."""
        p, b, S, U, bufs = self.program, self.backend, self.S, self.U, self.bufs
        params = {"actual_seq_lengths_kv": lengths}
        plan = p.plan(BATCH, params, {"tokens": tokens, "block_table": TABLE})
        with b.use_stream(S):
            for dst, src in p.input_writes(bufs, plan, 0):
                b.copy_in(dst, src)
        b.replay(self.graph, S)
        previous = self.done
        with b.use_stream(S):
            out = bufs["tokens"][:BATCH].to("cpu", non_blocking=True)
            self.done = done = torch.npu.Event(enable_timing=True)  # type: ignore[attr-defined]
            done.record(S)
        if previous is not None:  # the previous replay read the groups about to be patched
            b.wait(U, previous)
        for layer in range(LAYERS):
            op, args, kwargs = p.group_call(bufs, plan, layer)
            b.patch(U, self.handles[layer], op, args, kwargs, self.events[layer])
        done.synchronize()
        return out

    def run(self, tokens: torch.Tensor, steps: int) -> tuple[list[float], list[float], list[int]]:
        """``steps`` decode steps from the prefill's ``tokens``: wall seconds per step (one
        sampled output to the next), modelled seconds between consecutive ends, and the
        sampled tokens, row-major by step."""
        wall, gaps, out = [], [], []
        t0 = time.perf_counter()
        last = None
        for i in range(steps):
            tokens = self.step(_feedable(tokens), _lengths(i))
            t1 = time.perf_counter()
            wall.append(t1 - t0)
            t0 = t1
            if last is not None:
                gaps.append(last.elapsed_time(self.done) / 1000)
            last = self.done
            out += tokens.tolist()
        return wall, gaps, out


# ------------------------------------------------------------ through a daemon
async def _add(c: Client, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt added as sequence r over its blocks (``TABLE[r]``), after freeing the
    sequences of a previous round: their first tokens."""
    rows = list(range(BATCH))
    await c.free_sequences("model", 0, rows)
    first = []
    for r, prompt in enumerate(prompts):
        reply = await c.add_sequence("model", 0, r, torch.tensor(prompt), TABLE[r].tolist())
        first.append(reply.outputs["tokens"])
    return torch.cat(first)


async def daemon_waiting(c: Client, steps: int) -> tuple[list[float], list[int]]:
    """A scheduler that sends each decode once the previous one's reply is back: wall
    seconds per step (reply to reply) and the tokens."""
    rows = list(range(BATCH))
    period, out = [], []
    t0 = time.perf_counter()
    for _ in range(steps):
        reply = await c.decode("model", 0, rows, as_lists=True)
        t1 = time.perf_counter()
        period.append(t1 - t0)
        t0 = t1
        out += reply.outputs["tokens"]
    return period, out


async def daemon_ahead(c: Client, steps: int, window: int = WINDOW) -> tuple[float, list[int]]:
    """A scheduler decoding ahead: ``window`` decodes in flight (decode N+1 sent before
    decode N's reply; the worker feeds each row the token its sequence sampled last, on
    the device). Wall seconds for the ``steps`` and the tokens."""
    rows = list(range(BATCH))
    sent: list[asyncio.Future[Any]] = []
    t0 = time.perf_counter()
    for i in range(steps):
        if i >= window:
            await sent[i - window]  # at most window in flight
        # sent now, with no task per step; its tokens come back as a list
        sent.append(c.send_decode("model", 0, rows, as_lists=True))
    replies = await asyncio.gather(*sent)
    elapsed = time.perf_counter() - t0
    return elapsed, [t for r in replies for t in r.outputs["tokens"]]


# ------------------------------------------------------------ correctness (compute mode)
def generate_in_process(steps: int, seed: int = 0) -> list[int]:
    """Greedy tokens of the in-process loop (compute mode): the prefill's, then each step's."""
    old = configure()
    try:
        loop = ModelLoop(0.0, 0.0, mode="compute")
        first = loop.prefill(prompts(seed))
        return first.tolist() + loop.run(first, steps)[2]
    finally:
        configure(mode=old.mode, task_us=old.task_us, patch_us=old.patch_us)


async def generate_through_daemon(
    endpoint: str, steps: int, seed: int = 0, ahead: bool = True
) -> list[int]:
    """The same through a daemon (a compute-mode sim): decoding ahead or waiting."""
    async with Client(endpoint, timeout=120) as c:
        await c.worker_status(0)  # the client sends calls in order once it has the connection
        first = await _add(c, prompts(seed))
        run = daemon_ahead(c, steps) if ahead else daemon_waiting(c, steps)
        rest = (await run)[1]
    return first.tolist() + rest


# ------------------------------------------------------------ figures
@dataclass
class DecodeFigures:
    profile: str
    patch_us: float
    replay_us: float  # per layer
    task_us: float  # per task of the graph
    layers: int
    batch: int
    window: int
    limit_tokens_s: float
    floor_ms: float  # a lone step's, modelled
    ahead_tokens_s: list[float]  # each rep's: the daemon decoding ahead
    waiting_tokens_s: list[float]  # the daemon, the scheduler waiting for each step
    inprocess_tokens_s: list[float]
    waiting_latency_ms: list[float]  # mean period of a loop waiting per step
    inprocess_latency_ms: list[float]
    inprocess_modelled_ms: float  # the timed model's own lone step (median)

    @staticmethod
    def _med(xs: list[float]) -> float:
        return statistics.median(xs)

    @property
    def ahead_vs_limit(self) -> float:
        return self._med(self.ahead_tokens_s) / self.limit_tokens_s

    @property
    def ahead_vs_inprocess(self) -> float:
        return self._med(self.ahead_tokens_s) / self._med(self.inprocess_tokens_s)

    @property
    def ahead_vs_waiting(self) -> float:
        return self._med(self.ahead_tokens_s) / self._med(self.waiting_tokens_s)

    @property
    def latency_vs_inprocess(self) -> float:
        return self._med(self.waiting_latency_ms) / self._med(self.inprocess_latency_ms)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("ahead_vs_limit", "ahead_vs_inprocess", "ahead_vs_waiting",
                    "latency_vs_inprocess"):  # fmt: skip
            d[key] = round(getattr(self, key), 3)
        return d


def measure(profile: str, patch_us: float, replay_us: float, steps: int = 60,
            reps: int = 3) -> DecodeFigures:  # fmt: skip
    """The three ways at one profile, in alternation ``reps`` times."""
    if not 1 <= steps <= MAX_STEPS:
        raise ValueError(f"steps must be in 1..{MAX_STEPS} (the sequences' room)")
    loop = ModelLoop(patch_us, replay_us)
    sim = {"mode": "timed", "patch_us": patch_us, "task_us": loop.task_us}
    daemon = BenchDaemon(program_table(), sim=sim)
    try:
        f = asyncio.run(_alternate(loop, daemon.endpoint, steps, reps))
    finally:
        daemon.close()
    return DecodeFigures(
        profile=profile, patch_us=patch_us, replay_us=replay_us, task_us=loop.task_us,
        layers=LAYERS, batch=BATCH, window=WINDOW,
        limit_tokens_s=BATCH * 1e6 / (LAYERS * max(patch_us, replay_us)),
        floor_ms=1000 * loop.floor_s, **f,
    )  # fmt: skip


async def _alternate(loop: ModelLoop, endpoint: str, steps: int, reps: int) -> dict[str, Any]:
    # Wall periods are averaged (see graphlane/bench/inprocess.py: a stall of the machine
    # is made up by the timed model's next steps, so a median flatters).
    out: dict[str, list[float]] = {k: [] for k in ("a", "w", "i", "wl", "il")}
    modelled: list[float] = []
    ps = prompts()
    async with Client(endpoint, timeout=120) as c:
        await c.worker_status(0)  # the client sends calls in order once it has the connection
        for rep in range(reps + 1):  # the first round warms every path up
            wall, gaps, _ = loop.run(loop.prefill(ps), steps)
            await _add(c, ps)
            period, _ = await daemon_waiting(c, steps)
            await _add(c, ps)
            elapsed, _ = await daemon_ahead(c, steps)
            if rep == 0:
                continue
            out["il"].append(1000 * statistics.fmean(wall))
            out["i"].append(BATCH / statistics.fmean(wall))
            modelled += gaps
            out["wl"].append(1000 * statistics.fmean(period))
            out["w"].append(BATCH / statistics.fmean(period))
            out["a"].append(BATCH * steps / elapsed)
    return {
        "ahead_tokens_s": out["a"],
        "waiting_tokens_s": out["w"],
        "inprocess_tokens_s": out["i"],
        "waiting_latency_ms": out["wl"],
        "inprocess_latency_ms": out["il"],
        "inprocess_modelled_ms": 1000 * statistics.median(modelled),
    }


def table(results: list[DecodeFigures]) -> str:
    def rng(xs: list[float], f: str) -> str:
        return f"{min(xs):{f}}-{max(xs):{f}}"

    head = (
        f"{'profile':<9} {'update/replay us':>16} {'limit tok/s':>11} {'ahead tok/s':>12} "
        f"{'/limit':>6} {'waiting tok/s':>13} {'in-proc tok/s':>13} {'ahead/in':>8} "
        f"{'ahead/wait':>10} {'floor ms':>8} {'lone ms in-proc':>15} {'lone ms daemon':>14} "
        f"{'daemon/in':>9}"
    )
    lines = [head]
    for r in results:
        lines.append(
            f"{r.profile:<9} {f'{r.patch_us:g}/{r.replay_us:g}':>16} {r.limit_tokens_s:11.0f} "
            f"{rng(r.ahead_tokens_s, '.0f'):>12} {r.ahead_vs_limit:6.2f} "
            f"{rng(r.waiting_tokens_s, '.0f'):>13} {rng(r.inprocess_tokens_s, '.0f'):>13} "
            f"{r.ahead_vs_inprocess:7.2f}x {r.ahead_vs_waiting:9.2f}x {r.floor_ms:8.3f} "
            f"{rng(r.inprocess_latency_ms, '.3f'):>15} {rng(r.waiting_latency_ms, '.3f'):>14} "
            f"{r.latency_vs_inprocess:8.2f}x"
        )
    return "\n".join(lines)


__all__ = [
    "ARCHITECTURE", "PROFILES", "DecodeFigures", "ModelLoop", "daemon_ahead", "daemon_waiting",
    "generate_in_process", "generate_through_daemon", "lone_floor", "measure", "program_config",
    "table",
]  # fmt: skip
