"""Where graphlane's value lies: the field's costs, a scheduler's work, a device that costs
the host nothing (issue 42).

Everything here runs on npusim's performance mode (``mode = "perf"``, sim/README.md): a
replay is modelled device time off the interpreter lock, and a layer's update costs
``patch_us`` of host time of which ``patch_gil_us`` hold the lock (the Python that prepares
the call) and the rest does not (the op's dispatch and tiling in C++). The program is the
``model`` program (the demo's tiny Llama) with :data:`LAYERS` layers, batch :data:`BATCH`,
at the field's costs: 185 us of host update and 60 us of replay per layer (vllm-ascend on
a 910B3: 3.7 ms of host updates and 1.2 ms of replay per step at 20 layers).

A **scheduler** does host work every step (schedule, prepare inputs, process outputs):
:func:`scheduler_work`, ``sched_ms`` of pure Python holding the lock, the same code in
every way measured. The field's figures for that work: vLLM measured 5-13 ms of GPU bubble
per decode step from the host's work around it (vllm-project/vllm#6854, the multi-step
scheduling RFC) and a 5-6 ms token gap at batch 256 from the interpreter lock
(vllm-project/vllm#10634); hence vLLM's engine core in a process of its own and its
asynchronous scheduling (#19970, #23569). :data:`SCHED_MS` spans 0 to 2 ms.

Three ways, each with the same scheduler, in alternation in one run:

- **the vllm-ascend loop** (:meth:`FieldModel.run_async`): one thread, as vllm-ascend's
  full-graph decode runs under vLLM's async scheduling: the scheduler's work for step
  N+1, then N+1's inputs, its replay launch and its layers' updates (vllm-ascend's
  ``update_attn_params`` after the replay's launch, on the same thread), while the device
  still replays step N; step N's tokens are waited for after N+1 was issued;
- **the threaded loop** (:meth:`FieldModel.run_threaded`): the same, with the updates on
  a thread of their own (as sglang's NPU graph runner runs ``NPUGraph.update`` in a
  thread): the scheduler's thread schedules and launches, the update thread patches;
  both share one interpreter lock;
- **through the daemon** (:func:`daemon_ahead`): ``graphlane serve`` at its default
  config, the scheduler in this process decoding ahead (every row's token ``-1``,
  :data:`WINDOW` steps in flight); its work and the worker's updates run in two
  processes.

The in-process loops feed the step's tokens from the host (a copy per step); the daemon
feeds them on the device. In every way the scheduler takes each step's sampled tokens as
a list. Nothing computes in performance mode, so the tokens are whatever the buffers
hold.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import queue
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import msgpack
import torch
import zmq
from npusim import configure
from zmq.backend import zmq_poll

from graphlane.client import Client
from graphlane.client.transport import shared_context
from graphlane.workers import affinity
from graphlane.workers.backends.sim import SimBackend
from graphlane.workers.programs.model import ModelConfig, ModelProgram

from . import control_plane, decode
from .daemon import BenchDaemon

LAYERS = 20
BATCH = decode.BATCH
WINDOW = decode.WINDOW
PATCH_US, REPLAY_US = 185.0, 60.0  # per layer: vllm-ascend on a 910B3
PATCH_GIL_US = 25.0  # npusim's default (sim/README.md, "Performance mode")
SCHED_MS = (0.0, 0.5, 2.0)
TABLE = decode.TABLE


def scheduler_work(ms: float) -> None:
    """A scheduler's host work for one step: ``ms`` of the calling thread's CPU time in
    pure Python (holding the interpreter lock, as a scheduler's Python does; when another
    thread takes the lock the work takes longer, as it does in one process)."""
    if ms <= 0:
        return
    end = time.thread_time() + ms * 1e-3
    while time.thread_time() < end:
        pass


#: The field's dtype on an A2 (fused attention takes no float32); perf mode computes
#: nothing in a replay, so the figures do not depend on it.
DTYPE = "bfloat16"


def architecture(layers: int = LAYERS) -> dict[str, Any]:
    return {**decode.ARCHITECTURE, "num_hidden_layers": layers}


def model_config(layers: int = LAYERS) -> ModelConfig:
    c = decode.model_config()
    return ModelConfig(
        random=architecture(layers), seed=c.seed, init_std=c.init_std, dtype=DTYPE,
        block_size=c.block_size, num_blocks=c.num_blocks,
        max_blocks_per_seq=c.max_blocks_per_seq, buckets=c.buckets,
    )  # fmt: skip


def program_table(layers: int = LAYERS) -> dict[str, Any]:
    """The same program as a daemon's ``[[programs]]`` table."""
    table = {**decode.program_config(), "random": architecture(layers), "dtype": DTYPE}
    return {k: v if k == "name" else decode._toml(v) for k, v in table.items()}


def sim_settings(task_us: float, patch_us: float = PATCH_US,
                 gil_us: float = PATCH_GIL_US) -> dict[str, Any]:  # fmt: skip
    return {"mode": "perf", "patch_us": patch_us, "task_us": task_us, "patch_gil_us": gil_us}


class FieldModel:
    """The model program captured ``depth`` times on this process's sim (a ring: step N+1
    patches another instance than the one step N replays), then performance mode at the
    field's costs. One per process at a time."""

    def __init__(self, layers: int = LAYERS, patch_us: float = PATCH_US,
                 replay_us: float = REPLAY_US, gil_us: float = PATCH_GIL_US,
                 depth: int = 2) -> None:  # fmt: skip
        self.layers = layers
        self.program = p = ModelProgram(model_config(layers))
        configure(mode="compute")
        b = self.backend = SimBackend()
        self.S, self.U = b.new_stream(), b.new_stream(priority=-1)
        self.instances: list[dict[str, Any]] = []
        for _ in range(depth):
            bufs = p.allocate(b, BATCH)
            events = [b.new_external_event() for _ in range(layers)]
            graph = b.new_graph()
            b.synchronize()
            with b.capture(graph, self.S):
                handles, _ = p.capture(b, self.S, BATCH, bufs, events)
            self.instances.append({"graph": graph, "bufs": bufs, "events": events,
                                   "handles": handles, "done": None})  # fmt: skip
        b.synchronize()
        tasks = sum(decode.graph_tasks(self.instances[0]["graph"]))
        self.task_us = layers * replay_us / tasks
        self.sim = sim_settings(self.task_us, patch_us, gil_us)
        configure(**self.sim)
        self.tokens = torch.zeros(BATCH, dtype=torch.int64)
        self.n = 0

    def _plan(self, i: int) -> Any:
        params = {"actual_seq_lengths_kv": decode._lengths(i % decode.MAX_STEPS)}
        return self.program.plan(BATCH, params, {"tokens": self.tokens, "block_table": TABLE})

    def launch(self, i: int) -> tuple[dict[str, Any], Any, Any]:
        """Step ``i``'s inputs and replay on S, its tokens' copy to the host (the
        instance's ``host``) and done event after it; returns (instance, plan, the
        previous done event of that instance)."""
        b, S = self.backend, self.S
        g = self.instances[self.n % len(self.instances)]
        self.n += 1
        plan = self._plan(i)
        with b.use_stream(S):
            for dst, src in self.program.input_writes(g["bufs"], plan, 0):
                b.copy_in(dst, src)
        b.replay(g["graph"], S)
        previous = g["done"]
        with b.use_stream(S):
            g["host"] = g["bufs"]["tokens"][:BATCH].to("cpu", non_blocking=True)
            g["done"] = torch.npu.Event(enable_timing=True)  # type: ignore[attr-defined]
            g["done"].record(S)
        return g, plan, previous

    def update(self, g: dict[str, Any], plan: Any, previous: Any) -> None:
        """The step's layer updates on U (vllm-ascend's update_attn_params), fenced after
        the previous replay of the same instance."""
        b, U = self.backend, self.U
        if previous is not None:
            b.wait(U, previous)
        for layer in range(self.layers):
            op, args, kwargs = self.program.group_call(g["bufs"], plan, layer)
            b.patch(U, g["handles"][layer], op, args, kwargs, g["events"][layer])

    # ------------------------------------------------------------ the ways
    def lone(self, steps: int) -> list[float]:
        """Each step waited for before the next (no scheduler work): wall seconds each."""
        out = []
        for i in range(steps):
            t0 = time.perf_counter()
            g, plan, previous = self.launch(i)
            self.update(g, plan, previous)
            _took((g, plan, previous))
            out.append(time.perf_counter() - t0)
        return out

    def run_async(self, steps: int, sched_ms: float) -> float:
        """The vllm-ascend loop under async scheduling, one thread: steps/s."""
        pending: collections.deque[Any] = collections.deque()
        t0 = time.perf_counter()
        for i in range(steps):
            scheduler_work(sched_ms)
            g, plan, previous = self.launch(i)
            self.update(g, plan, previous)
            pending.append((g, plan, previous))
            if len(pending) > 1:  # step N's tokens, once N+1 is issued
                _took(pending.popleft())
        while pending:
            _took(pending.popleft())
        return steps / (time.perf_counter() - t0)

    def run_threaded(self, steps: int, sched_ms: float) -> float:
        """The same with the updates on a thread of their own: steps/s.

        The step's plan and host tensors are freed by the scheduler's thread, once it has
        the step's tokens, never by the update thread: freeing a tensor now and then lets
        the interpreter lock go, and the update thread then waits for the other thread's
        Python to give it back (up to the switch interval) between two steps' patches:
        1-3% of the limit, measured (docs/performance.md, the thirteenth session).
        vLLM's loop frees nothing per step: its host inputs are persistent buffers."""
        launches: queue.Queue[Any] = queue.Queue(maxsize=1)

        def updater() -> None:
            self.backend.enter_thread()  # the device is per host thread, as in torch_npu
            while True:
                launched = launches.get()
                if launched is None:
                    return
                self.update(*launched)
                del launched  # (the scheduler's thread holds it, and frees it)

        thread = threading.Thread(target=updater, name="field-updates", daemon=True)
        thread.start()
        pending: collections.deque[Any] = collections.deque()
        t0 = time.perf_counter()
        try:
            for i in range(steps):
                scheduler_work(sched_ms)
                launched = self.launch(i)
                launches.put(launched)
                pending.append(launched)
                if len(pending) > 1:
                    _took(pending.popleft())
            while pending:
                _took(pending.popleft())
            return steps / (time.perf_counter() - t0)
        finally:
            launches.put(None)
            thread.join()


def _took(launched: tuple[dict[str, Any], Any, Any]) -> list[int]:
    """A launched step's sampled tokens, as the scheduler takes them: its done event
    waited for, then its host copy as a list (vLLM's async output, ``tolist()`` after
    the copy's event; the daemon's scheduler takes them as lists too, ``as_lists``).
    The step (its plan, its host tensors) is freed when this returns, by the caller's
    thread (see run_threaded)."""
    g = launched[0]
    g["done"].synchronize()
    tokens: list[int] = g["host"].tolist()
    return tokens


# ------------------------------------------------------------ through a daemon
async def _prefill(c: Client, prompts: list[list[int]]) -> None:
    """Each prompt added as sequence r (its row's blocks), freed first if a run before
    added it: what a scheduler on the typed sequence operations sends (docs/models.md,
    "Sequences"); the steps then name the sequences alone."""
    rows = list(range(len(prompts)))
    await c.free_sequences("model", 0, rows)
    for r, prompt in enumerate(prompts):
        await c.add_sequence("model", 0, r, torch.tensor(prompt), TABLE[r].tolist())


async def daemon_ahead(c: Client, steps: int, sched_ms: float, window: int = WINDOW,
                       token: int = -1) -> float:  # fmt: skip
    """The scheduler decoding ahead through the daemon: before each step its work, then
    ``window`` steps in flight: steps/s. ``token`` -1: a ``decode`` of the sequences
    :func:`_prefill` added (each fed on the device the token it sampled last); else the
    generic step with every row's token ``token`` and its block table (a device that
    keeps no KV cache). The scheduler takes each step's sampled tokens, a decode's as a
    list (``as_lists``: what vLLM's output processing makes of them)."""
    rows = list(range(BATCH))
    feed = {"tokens": torch.full((BATCH,), token, dtype=torch.int64), "block_table": TABLE}
    sent: collections.deque[asyncio.Future[Any]] = collections.deque()
    taken = 0
    t0 = time.perf_counter()
    for i in range(steps):
        scheduler_work(sched_ms)
        while len(sent) >= window:
            taken += len((await sent.popleft()).outputs["tokens"])
        # Sent in the order made, with no task per step (Client.send_decode).
        if token < 0:
            sent.append(c.send_decode("model", 0, rows, as_lists=True))
        else:
            params = {"actual_seq_lengths_kv": decode._lengths(i)}
            sent.append(c.send_step("model", 0, params, feed, outputs=["tokens"]))
    while sent:
        taken += len((await sent.popleft()).outputs["tokens"])
    elapsed = time.perf_counter() - t0
    if taken != steps * BATCH:
        raise RuntimeError(f"{taken} tokens came back for {steps} steps of {BATCH} rows")
    return steps / elapsed


async def daemon_lone(c: Client, steps: int) -> list[float]:
    """Each step waited for before the next: wall seconds each."""
    out = []
    rows = list(range(BATCH))
    for _ in range(steps):
        t0 = time.perf_counter()
        await c.decode("model", 0, rows, as_lists=True)
        out.append(time.perf_counter() - t0)
    return out


def process_cpu_s(pid: int) -> float:
    """CPU seconds of every live thread of process ``pid`` (schedstat: nanoseconds)."""
    total = 0
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total * 1e-9


# ------------------------------------------------------------ figures
@dataclass
class FieldFigures:
    layers: int
    patch_us: float
    replay_us: float
    patch_gil_us: float
    limit_steps_s: float  # 1 / (layers * max(patch, replay))
    load_average: list[float]  # os.getloadavg() at the start
    load_average_end: list[float] = field(default_factory=list)
    steps_s: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # way -> sched
    lone_ms: dict[str, list[float]] = field(default_factory=dict)  # way -> mean per rep
    worker_cpu_us: list[float] = field(default_factory=list)  # per step, outside modelled
    # ... and what it is made of: all of the worker's CPU, less its patches' dispatch
    # and its poll for the next request while idle (idle_spin_us)
    worker_all_cpu_us: list[float] = field(default_factory=list)
    worker_patch_us: list[float] = field(default_factory=list)
    worker_spin_us: list[float] = field(default_factory=list)
    client_cpu_us: list[float] = field(default_factory=list)
    # a raw pyzmq+msgpack client's and its echo server's, beside it: how fast the host
    # was (RawAhead)
    raw_client_cpu_us: list[float] = field(default_factory=list)
    raw_server_cpu_us: list[float] = field(default_factory=list)
    # ... and just before it
    raw_client_before_cpu_us: list[float] = field(default_factory=list)
    raw_server_before_cpu_us: list[float] = field(default_factory=list)
    # per rep of the own CPU: the host at its speed around it (OwnCpu.quiet)
    own_quiet: list[bool] = field(default_factory=list)
    null_rtt_vs_raw: float | None = None

    def quiet(self, figures: list[float]) -> list[float]:
        """The own CPU ``figures`` the goals judge (:func:`quiet_reps`)."""
        return quiet_reps(figures, self.own_quiet)

    def med(self, way: str, sched: float) -> float:
        return statistics.median(self.steps_s[way][f"{sched:g}"])

    def ratios(self) -> dict[str, float]:
        r: dict[str, float] = {}
        for s in SCHED_MS:
            k = f"{s:g}"
            if k not in self.steps_s.get("daemon", {}):
                continue
            r[f"sched {k} ms: daemon vs vllm-ascend loop"] = self.med("daemon", s) / self.med(
                "vllm", s
            )
            r[f"sched {k} ms: daemon vs threaded loop"] = self.med("daemon", s) / self.med(
                "threaded", s
            )
            for way in ("daemon", "vllm", "threaded"):
                r[f"sched {k} ms: {way} vs limit"] = self.med(way, s) / self.limit_steps_s
        if self.lone_ms:
            r["lone step: daemon vs in-process"] = statistics.median(
                self.lone_ms["daemon"]
            ) / statistics.median(self.lone_ms["inprocess"])
        return r

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratios"] = {k: round(v, 3) for k, v in self.ratios().items()}
        return d


#: Issue 42's goals: (label, key of :meth:`FieldFigures.ratios` or a figure, op, goal).
FIELD_GOALS = (
    ("no scheduler work: daemon vs vllm-ascend loop", "sched 0 ms: daemon vs vllm-ascend loop",
     ">=", 1.0),
    ("no scheduler work: daemon vs threaded loop", "sched 0 ms: daemon vs threaded loop",
     ">=", 1.0),
    ("no scheduler work: daemon vs limit", "sched 0 ms: daemon vs limit", ">=", 0.95),
    # The device model's own goal (issue 42, item 1): an in-process loop reaches its
    # modelled limit. The threaded loop's: its launch overlaps the update chain, where the
    # one-thread loop adds the launch's host Python (the sim's eager copies) to each step.
    ("no scheduler work: threaded loop vs limit (the device model)",
     "sched 0 ms: threaded vs limit", ">=", 0.95),
    ("lone step: daemon vs in-process", "lone step: daemon vs in-process", "<=", 1.25),
    ("2 ms scheduler work: daemon vs vllm-ascend loop",
     "sched 2 ms: daemon vs vllm-ascend loop", ">=", 1.4),
    ("2 ms scheduler work: daemon vs threaded loop", "sched 2 ms: daemon vs threaded loop",
     ">=", 1.0),
    ("worker's own CPU per step, us", "worker_cpu_us", "<=", 150.0),
    ("client's own CPU per step, us", "client_cpu_us", "<=", 100.0),
    ("control-plane round trip on null vs raw pyzmq", "null_rtt_vs_raw", "<=", 1.3),
)  # fmt: skip


def quiet_reps(figures: list[float], quiet: list[bool]) -> list[float]:
    """The own CPU ``figures`` of the reps marked ``quiet`` (:meth:`OwnCpu.quiet`), or
    all of them where fewer than three were (a host never at its speed is judged as it
    was): the goals judge the median of these."""
    kept = [x for x, q in zip(figures, quiet, strict=False) if q]
    return kept if len(kept) >= 3 else figures


def field_goals(report: dict[str, Any]) -> list[tuple[str, float, str, float]]:
    """(label, value, op, goal) of each goal the report has a figure for."""
    r = report.get("field")
    if not r:
        return []
    out = []
    for label, key, op, goal in FIELD_GOALS:
        value: Any = r["ratios"].get(key, r.get(key))
        if isinstance(value, list):  # the own CPU's reps
            value = quiet_reps(value, r.get("own_quiet", []))
            value = statistics.median(value) if value else None
        if isinstance(value, (int, float)):
            out.append((f"field {label}", float(value), op, goal))
    return out


def measure(steps: int = 120, reps: int = 5, lone_steps: int = 40,
            sched_ms: tuple[float, ...] = SCHED_MS, layers: int = LAYERS,
            null_rtt: bool = True, own_reps: int = 7) -> FieldFigures:  # fmt: skip
    """Every way at every scheduler load, in alternation ``reps`` times, one run; then
    graphlane's own CPU until ``own_reps`` reps were quiet, at most three times as many
    (:func:`own_cpu`).

    The goals judge medians. Each rep is short (a fraction of a second a way), and this
    host's speed moves by up to 2x within minutes (docs/performance.md): of three reps,
    two slow windows made the median. Five reps of the ways judge the middle of the run;
    the own CPU, in microseconds, is judged on its quiet reps (:meth:`OwnCpu.quiet`). The
    table prints every rep's range."""
    if not 1 <= steps <= decode.MAX_STEPS:
        raise ValueError(f"steps must be in 1..{decode.MAX_STEPS} (the sequences' room)")
    loop = FieldModel(layers)
    figures = FieldFigures(
        layers=layers, patch_us=PATCH_US, replay_us=REPLAY_US, patch_gil_us=PATCH_GIL_US,
        limit_steps_s=1e6 / (layers * max(PATCH_US, REPLAY_US)),
        load_average=list(os.getloadavg()),
    )  # fmt: skip
    daemon = BenchDaemon(program_table(layers), sim=loop.sim)
    try:
        asyncio.run(_alternate(loop, daemon.endpoint, figures, steps, reps, lone_steps,
                               sched_ms))  # fmt: skip
    finally:
        daemon.close()
    f = figures
    own = own_cpu(layers, steps, own_reps)
    f.worker_all_cpu_us, f.worker_patch_us, f.worker_spin_us = own.worker, own.patches, own.spins
    f.client_cpu_us, f.raw_client_cpu_us, f.raw_server_cpu_us = (
        own.client, own.raw_client, own.raw_server
    )
    f.raw_client_before_cpu_us, f.raw_server_before_cpu_us = (
        own.raw_client_before, own.raw_server_before
    )
    f.own_quiet = own.quiet()
    parts = zip(f.worker_all_cpu_us, f.worker_patch_us, f.worker_spin_us, strict=True)
    f.worker_cpu_us = [a - p - s for a, p, s in parts]
    if null_rtt:
        figures.null_rtt_vs_raw = null_round_trip_ratio()
    figures.load_average_end = list(os.getloadavg())
    return figures


async def _alternate(loop: FieldModel, endpoint: str, f: FieldFigures, steps: int, reps: int,
                     lone_steps: int, sched_ms: tuple[float, ...]) -> None:  # fmt: skip
    ways = ("vllm", "threaded", "daemon")
    f.steps_s = {w: {f"{s:g}": [] for s in sched_ms} for w in ways}
    f.lone_ms = {"inprocess": [], "daemon": []}
    async with Client(endpoint, timeout=120) as c:
        ps = decode.prompts()

        async def ahead(s: float) -> float:
            await _prefill(c, ps)
            return await daemon_ahead(c, steps, s)

        await ahead(0.0)  # warm every path up
        loop.run_async(steps, 0.0)
        loop.run_threaded(steps, 0.0)
        for _ in range(reps):
            for s in sched_ms:
                k = f"{s:g}"
                f.steps_s["vllm"][k].append(loop.run_async(steps, s))
                f.steps_s["threaded"][k].append(loop.run_threaded(steps, s))
                f.steps_s["daemon"][k].append(await ahead(s))
            f.lone_ms["inprocess"].append(1000 * statistics.fmean(loop.lone(lone_steps)))
            await _prefill(c, ps)
            f.lone_ms["daemon"].append(1000 * statistics.fmean(await daemon_lone(c, lone_steps)))


class OwnCpu(NamedTuple):
    """:func:`own_cpu`'s figures, in microseconds per decode step, one per rep."""

    worker: list[float]  # all of the worker's CPU
    patches: list[float]  # its patches' dispatch (inside the modelled update cost)
    spins: list[float]  # its poll for the next request while idle (idle_spin_us)
    client: list[float]  # the client's CPU
    # beside each rep, a raw pyzmq+msgpack client's and its echo server's (per round trip)
    raw_client: list[float]
    raw_server: list[float]
    # the raw pair's, just before each rep
    raw_client_before: list[float]
    raw_server_before: list[float]

    def quiet(self) -> list[bool]:
        """Which reps ran while the host was at its speed: the raw pair measured just
        before and just after the rep each within :data:`QUIET_X` of the run's fast
        speed, its client and its server apiece (they run on two cores, whose speeds
        change apart). The fast speed is the tenth percentile of the raw pair's reps
        (one rep faster than all others does not set it). This host's cores switch
        between two speeds 1.5-1.7x apart in stretches of 50-100 ms (a pure Python loop
        with no I/O shows it; docs/performance.md, the twelfth session), and a rep is
        20-30 ms: in a slow stretch every process is slower, the raw pair with it."""
        ok = [True] * len(self.worker)
        for sides in ((self.raw_client_before, self.raw_client),
                      (self.raw_server_before, self.raw_server)):  # fmt: skip
            fast = _tenth(sides[0] + sides[1])
            for i, (b, a) in enumerate(zip(*sides, strict=True)):
                ok[i] = ok[i] and max(b, a) <= QUIET_X * fast
        return ok


def _tenth(xs: list[float]) -> float:
    """The tenth percentile of ``xs`` (the lowest of them below 10 values)."""
    return sorted(xs)[len(xs) // 10] if xs else 0.0


#: A rep is quiet when the raw pair beside it ran within this factor of its fast speed
#: (:meth:`OwnCpu.quiet`): the host's two speeds are 1.5-1.7x apart, and 1.25 is about
#: the middle of them on a log scale.
QUIET_X = 1.25


def own_cpu(layers: int = LAYERS, steps: int = 120, reps: int = 3,
            max_reps: int | None = None) -> OwnCpu:  # fmt: skip
    """The worker's CPU, its patches' dispatch, its poll for the next request and the
    client's CPU per decode step, in microseconds, one figure per rep: the same program
    and the same requests decoding ahead, through a daemon on the ``null`` backend (no
    device: what is left is graphlane's socket, decode, plan, issue, patches, completion
    and reply, and the client's send and receive): the sequences added, then decoded
    ahead by name, as the perf-mode daemon runs them. The worker's is the CPU of all its
    threads (``/proc``), the client's this process's. The patches' dispatch is the host
    time the worker measured patching each step (its ``dispatch_seconds``): the Python
    that prepares each patch is inside the modelled update cost (perf mode's 185 us a
    layer, 25 of it under the lock, is what vllm-ascend's Python and the op's dispatch
    take). The poll is the CPU its socket thread spent polling for the next request
    while idle (``idle_spin_us``, its ``spin_seconds``): CPU of no step, spent to answer
    the next one sooner. The worker's own CPU outside the modelled costs is the first
    less the second and the third; the report shows all three.

    Just before and just after each rep, the same steps by a raw pyzmq+msgpack client
    (:class:`RawAhead`) against an echo server placed as the worker is (its cores and
    scheduling policy), and the CPU of both: what the transport alone costs a client and
    a server on this host at that moment. The reps go on until ``reps`` of them were
    quiet (:meth:`OwnCpu.quiet`: the host at its speed on both sides of the rep), or
    ``max_reps`` (three times ``reps`` unless given) were run."""
    most = 3 * reps if max_reps is None else max(reps, max_reps)
    daemon = BenchDaemon(program_table(layers), backend="null")
    try:
        return control_plane.with_raw_server(
            lambda raw: _own_cpu(daemon.endpoint, raw, steps, reps, most)
        )
    finally:
        daemon.close()


async def _own_cpu(endpoint: str, raw_endpoint: str, steps: int, reps: int,
                   most: int) -> OwnCpu:  # fmt: skip
    out = OwnCpu([], [], [], [], [], [], [], [])
    raw = RawAhead(raw_endpoint)
    try:
        raw_pid = (await asyncio.wait_for(raw.call("pid", {}), 60))["body"]["pid"]
        async with Client(endpoint, timeout=120) as c:
            pid = (await c.status())["workers"][0]["pid"]
            affinity.place_as(raw_pid, pid)
            prompts = [[1 + r] * decode.PROMPT for r in range(BATCH)]
            warm = True  # the first rep warms up
            while len(out.worker) < reps or (
                len(out.worker) < most and sum(out.quiet()) < reps
            ):
                await _prefill(c, prompts)
                # The null device computes a prefill on the host, and torch's OpenMP
                # threads spin for a few ms after it (the worker's CPU, but no decode
                # step's): let them park first.
                await asyncio.sleep(_SETTLE_S)
                before = await _raw_rep(raw, raw_pid, steps)
                p0, s0 = await _worker_counters(c)
                w0, c0 = process_cpu_s(pid), time.process_time()
                await daemon_ahead(c, steps, 0.0)
                w1, c1 = process_cpu_s(pid), time.process_time()
                p1, s1 = await _worker_counters(c)
                after = await _raw_rep(raw, raw_pid, steps)
                if warm:
                    warm = False
                    continue
                out.worker.append(1e6 * (w1 - w0) / steps)
                out.patches.append(1e6 * (p1 - p0) / steps)
                out.spins.append(1e6 * (s1 - s0) / steps)
                out.client.append(1e6 * (c1 - c0) / steps)
                out.raw_client.append(after[0])
                out.raw_server.append(after[1])
                out.raw_client_before.append(before[0])
                out.raw_server_before.append(before[1])
    finally:
        await raw.stop()
    return out


async def _raw_rep(raw: RawAhead, pid: int, steps: int) -> tuple[float, float]:
    """The raw pair's client and server CPU per round trip, in microseconds, over
    ``steps`` steps decoded ahead (the server: process ``pid``)."""
    r0, e0 = time.process_time(), process_cpu_s(pid)
    await raw.ahead(steps)
    r1, e1 = time.process_time(), process_cpu_s(pid)
    return 1e6 * (r1 - r0) / steps, 1e6 * (e1 - e0) / steps


class RawAhead:
    """A raw pyzmq+msgpack client decoding ahead as :func:`daemon_ahead` does (the same
    window, a future per step, a scheduler awaiting the oldest), on a plain DEALER socket
    whose descriptor the event loop watches, as graphlane's client's (no zmq.asyncio):
    each step's request a msgpack envelope naming its sequences, each reply unpacked.
    Against :func:`.control_plane._echo_server`: no checks, ids, deadlines or types: the
    transport and the event loop alone."""

    def __init__(self, endpoint: str) -> None:
        self.sock = shared_context().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self._in = [(self.sock, zmq.POLLIN)]
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._ids = 0
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sock.FD, self._readable)

    def _readable(self) -> None:
        while zmq_poll(self._in, 0):
            reply = msgpack.unpackb(self.sock.recv(zmq.NOBLOCK))
            fut = self._pending.pop(reply["id"], None)
            if fut is not None:
                fut.set_result(reply)

    def call(self, op: str, body: dict[str, Any]) -> asyncio.Future[Any]:
        self._ids += 1
        fut = self._pending[self._ids] = self._loop.create_future()
        self.sock.send(msgpack.packb({"v": 1, "id": self._ids, "op": op, "body": body}))
        if zmq_poll(self._in, 0):  # the send may have taken a reply's edge
            self._loop.call_soon(self._readable)
        return fut

    async def ahead(self, steps: int, window: int = WINDOW) -> None:
        body = {"program": "model", "device": 0, "sequences": list(range(BATCH))}
        sent: collections.deque[asyncio.Future[Any]] = collections.deque()
        for _ in range(steps):
            scheduler_work(0.0)
            while len(sent) >= window:
                await sent.popleft()
            sent.append(self.call("decode", body))
        while sent:
            await sent.popleft()

    async def stop(self, wait: float = 5.0) -> None:
        """Stop the echo server (its answer to ``stop`` is its last) and close. A server
        that does not answer within ``wait`` s is left to
        :func:`.control_plane.with_raw_server`, which kills it: an error that ended the
        measurement is not hidden by this one."""
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.call("stop", {}), wait)
        finally:
            self._loop.remove_reader(self.sock.FD)
            self.sock.close(0)


async def _worker_counters(c: Client) -> tuple[float, float]:
    """The worker's host time patching steps so far and its CPU polling for requests
    (its metrics' dispatch_seconds and spin_seconds)."""
    metrics = (await c.worker_status(0))["metrics"]
    return float(metrics["dispatch_seconds"]["sum"]), float(metrics["spin_seconds"])


_SETTLE_S = 0.2


def null_round_trip_ratio(n: int = 500) -> float:
    """The step round trip on the ``null`` backend over a raw pyzmq+msgpack round trip
    measured beside it (:mod:`.control_plane`)."""
    import functools

    daemon = BenchDaemon(control_plane.TINY, backend="null")
    try:
        r = control_plane.with_raw_server(
            functools.partial(control_plane._control_plane, daemon, n=n)
        )
    finally:
        daemon.close()
    return float(r["step_rtt_vs_raw"])


def table(f: FieldFigures) -> str:
    def rng(xs: list[float], fmt: str) -> str:
        return f"{min(xs):{fmt}}-{max(xs):{fmt}}" if xs else "-"

    lines = [
        f"field decode: model program, {f.layers} layers, batch {BATCH}, npusim perf mode, "
        f"update {f.patch_us:g} us ({f.patch_gil_us:g} under the lock) / replay "
        f"{f.replay_us:g} us per layer; limit {f.limit_steps_s:.0f} steps/s; "
        f"load average {f.load_average[0]:.2f} at the start"
        + (f", {f.load_average_end[0]:.2f} at the end" if f.load_average_end else ""),
        f"{'sched ms':>8} {'vllm-ascend loop':>17} {'threaded loop':>14} {'daemon ahead':>13} "
        f"{'daemon/vllm':>11} {'daemon/thr':>10} {'daemon/limit':>12}",
    ]
    for k in f.steps_s.get("daemon", {}):
        s = float(k)
        lines.append(
            f"{k:>8} {rng(f.steps_s['vllm'][k], '.0f'):>17} "
            f"{rng(f.steps_s['threaded'][k], '.0f'):>14} {rng(f.steps_s['daemon'][k], '.0f'):>13} "
            f"{f.med('daemon', s) / f.med('vllm', s):10.2f}x "
            f"{f.med('daemon', s) / f.med('threaded', s):9.2f}x "
            f"{f.med('daemon', s) / f.limit_steps_s:12.2f}"
        )
    if f.lone_ms:
        lines.append(f"lone step ms: in-process {rng(f.lone_ms['inprocess'], '.3f')}, "
                     f"daemon {rng(f.lone_ms['daemon'], '.3f')}")  # fmt: skip
    lines.append(
        f"own CPU per step (us, outside the modelled costs): worker "
        f"{rng(f.worker_cpu_us, '.0f')}, client {rng(f.client_cpu_us, '.0f')}"
    )
    if f.own_quiet and f.worker_cpu_us:
        med = statistics.median
        lines.append(
            f"  medians of the {sum(f.own_quiet)} quiet reps of {len(f.own_quiet)} (the raw "
            f"pair's client and server each within {QUIET_X:g}x their fast speed before and "
            f"after the rep; all reps where fewer than 3): worker "
            f"{med(f.quiet(f.worker_cpu_us)):.0f}, client "
            f"{med(f.quiet(f.client_cpu_us)):.0f}; of all reps: worker "
            f"{med(f.worker_cpu_us):.0f}, client {med(f.client_cpu_us):.0f}"
        )
    if f.worker_all_cpu_us:
        lines.append(
            f"  (the worker's CPU {rng(f.worker_all_cpu_us, '.0f')} less its patches' "
            f"dispatch {rng(f.worker_patch_us, '.0f')}, inside the modelled update cost, and "
            f"{rng(f.worker_spin_us, '.0f')} polling for the next request while idle, "
            "idle_spin_us)"
        )
    if f.raw_client_cpu_us:
        lines.append(
            f"  (beside them, a raw pyzmq+msgpack client decoding ahead against an echo server: "
            f"client {rng(f.raw_client_cpu_us, '.0f')}, server "
            f"{rng(f.raw_server_cpu_us, '.0f')} per round trip: the transport alone, on this "
            "host at that moment)"
        )
    if f.null_rtt_vs_raw is not None:
        lines.append(f"control-plane round trip on null: {f.null_rtt_vs_raw:.2f}x raw pyzmq")
    return "\n".join(lines)


__all__ = ["FIELD_GOALS", "QUIET_X", "FieldFigures", "FieldModel", "OwnCpu", "RawAhead",
           "daemon_ahead", "field_goals", "measure", "own_cpu", "quiet_reps", "scheduler_work",
           "table"]  # fmt: skip
