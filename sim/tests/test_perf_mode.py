"""Performance mode: device work is modelled time that costs the host nothing.

No wall-clock bound is asserted: the sim's CPU per replay is compared between two graphs
in the same run, and a patch's CPU against its modelled cost.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from npusim import HazardError, SimConfig, configure, fault, torch_npu


@pytest.fixture
def restore_config() -> Iterator[None]:
    old = configure()
    yield
    configure(mode=old.mode, task_us=old.task_us, patch_us=old.patch_us,
              patch_gil_us=old.patch_gil_us)  # fmt: skip


def _graph(tasks: int) -> tuple[torch.npu.NPUGraph, torch.Tensor]:  # type: ignore[name-defined]
    x = torch.zeros(4).npu()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        for _ in range(tasks):
            x.add_(1)
    torch.npu.synchronize()
    return g, x


def _cpu_per_replay(g: torch.npu.NPUGraph, n: int = 1) -> float:  # type: ignore[name-defined]
    """CPU seconds per replay and device synchronize of ``g`` on the current stream, of
    the two threads that do the work: this one and the stream's (other threads of the
    process, a test's before this one's, are not counted; their CPU grows with the
    wall time a replay takes, which grows with its modelled time)."""
    g.replay()  # the stream's thread exists
    torch.npu.synchronize()
    stream = torch.npu.current_stream()._thread
    t0, s0 = time.thread_time(), _thread_cpu_s(stream)
    for _ in range(n):
        g.replay()
        torch.npu.synchronize()
    return (time.thread_time() - t0 + _thread_cpu_s(stream) - s0) / n


def test_cpu_per_replay_does_not_grow_with_the_graphs_task_count(restore_config: None) -> None:
    """A 200-task graph's replay costs the process about as much CPU as a 10-task one's
    (timed mode checks and steps every task: about 2 us of Python each)."""
    small, _ = _graph(10)
    large, x = _graph(200)
    configure(mode="perf", task_us=1.0)
    for g in (small, large):  # warm up (the replay plan is made once per capture)
        _cpu_per_replay(g)
    # Both replays take 200 us of modelled time (the 10 tasks 20 us each): a replay
    # shorter than the sim's own host work ends before its synchronize waits, a longer
    # one costs the waiting threads a sleep and a wake-up each, and on a busy machine
    # their caches refilled (at load average 10, 1.6-2x for 200 tasks of 1 us against
    # 10 of 1 us, task count aside).
    cpu: dict[int, list[float]] = {10: [], 200: []}
    for _ in range(30):  # interleaved: a busy spell of the machine falls on both
        for n, g in ((10, small), (200, large)):
            configure(task_us=200.0 / n)
            cpu[n].append(_cpu_per_replay(g, 2))
    # the median of each round's pair (a busy machine's cache misses and preemptions add
    # CPU to some replays; one lucky replay of either made a ratio of minimums 0.95-1.56)
    ratio = statistics.median(b / a for a, b in zip(cpu[10], cpu[200], strict=True))
    assert ratio < 1.5, f"CPU per replay: 200 tasks {ratio:.2f}x 10 tasks"
    assert torch.count_nonzero(x.cpu()) == 0  # nothing computed


class _Lines:
    """A trace function counting the Python lines run while ``on`` (in every thread it is
    set on): the host work of the simulator, counted, which a busy machine cannot change
    (its CPU time moved 2x between runs at load average 4, as threads landed on one core
    or two, and no reference measured alongside moved with it)."""

    def __init__(self) -> None:
        self.on = False
        self.count = 0

    def __call__(self, frame: object, event: str, arg: object) -> _Lines:
        if self.on and event == "line":
            self.count += 1
        return self


def _history(streams: int, events: int, graphs: int, threads: int) -> list[object]:
    """What a long-lived process made before (in compute mode, every clock kept): streams
    that waited on each other's events, graphs captured and replayed on them, host
    threads that issued work. Returns what must stay alive."""
    ss = [torch.npu.Stream() for _ in range(streams)]
    x = torch.zeros(4).npu()
    for i in range(events):
        s = ss[i % streams]
        with torch.npu.stream(s):
            x.add_(1)
        e = s.record_event()
        ss[(i + 1) % streams].wait_event(e)
    gs = []
    for i in range(graphs):
        s = ss[i % streams]
        with torch.npu.stream(s):
            g = torch.npu.NPUGraph()
            with torch.npu.graph(g, stream=s):
                x.add_(1)
            g.replay()
        gs.append(g)

    def issue() -> None:
        torch.zeros(4).npu().add_(1)
        torch.npu.synchronize()

    workers = [threading.Thread(target=issue) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    torch.npu.synchronize()
    return [ss, gs, x]


def test_host_work_per_replay_does_not_grow_with_what_the_process_made_before(
    restore_config: None,
) -> None:
    """A small graph's replay and synchronize run as many lines of the simulator's Python,
    on the issuing thread and on the stream's, after the process made 50 more streams,
    200 events waited across them, 20 graphs and 10 issuing threads as before:
    performance mode keeps no vector clocks (an entry per actor the process has seen,
    copied and joined per replay), and a device synchronize visits the streams with work
    no host observed, not every stream the process made. Counted, not timed: the lines
    are the same on a busy machine. Before: 356 lines, then 12,981 after the history
    (the synchronize walked every stream, each joining clocks of 60 entries)."""
    g, _ = _graph(10)
    configure(mode="perf", task_us=1.0)
    lines = _Lines()
    threading.settrace(lines)  # the stream's thread, made at its first work, is counted
    try:
        s = torch.npu.Stream()  # type: ignore[attr-defined]
        with torch.npu.stream(s):  # type: ignore[attr-defined]
            g.replay()
            torch.npu.synchronize()
    finally:
        threading.settrace(None)  # type: ignore[arg-type]

    def counted(n: int) -> list[int]:
        out = []
        previous = sys.gettrace()
        sys.settrace(lines)
        try:
            with torch.npu.stream(s):  # type: ignore[attr-defined]
                for _ in range(n):
                    lines.count, lines.on = 0, True
                    g.replay()
                    torch.npu.synchronize()
                    lines.on = False
                    out.append(lines.count)
        finally:
            sys.settrace(previous)
        return out

    counted(5)  # warm up (the replay plan is made once per capture)
    before = counted(20)
    configure(mode="compute")
    kept = _history(streams=50, events=200, graphs=20, threads=10)
    configure(mode="perf")
    after = counted(20)
    assert kept
    assert min(before) > 20, before  # both threads' lines were counted
    # a wait that wakes before its work is done runs its loop once more: the median
    ratio = statistics.median(after) / statistics.median(before)
    assert ratio < 1.2, f"lines per replay: {before} before the history, {after} after"


def test_after_perf_mode_the_checks_take_what_it_ordered_and_report_what_it_did_not(
    restore_config: None,
) -> None:
    """Performance mode keeps no clocks; leaving it, the host has observed what the device
    finished, so a write its synchronize ordered is no race afterwards (without that, the
    checking mode would report one), and a race after the switch is reported as ever."""
    a, b = torch.npu.Stream(), torch.npu.Stream()  # type: ignore[attr-defined]
    x = torch.zeros(8).npu()
    torch.npu.synchronize()
    with torch.npu.stream(a):  # type: ignore[attr-defined]
        x.fill_(1.0)  # compute mode: its write is recorded when it runs
    deadline = time.monotonic() + 30
    while not bool(x._data[0] == 1.0):  # type: ignore[attr-defined]  # ran, unobserved
        assert time.monotonic() < deadline, "the write did not run"
        time.sleep(0.001)
    configure(mode="perf", task_us=1.0)
    torch.npu.synchronize()  # orders it before what follows
    configure(mode="compute")
    with torch.npu.stream(b):  # type: ignore[attr-defined]
        x.fill_(2.0)
    torch.npu.synchronize()
    assert fault() is None and x.cpu().eq(2.0).all()
    with pytest.raises(HazardError, match="race on npu memory"):
        with torch.npu.stream(a):  # type: ignore[attr-defined]
            x.fill_(3.0)
        with torch.npu.stream(b):  # type: ignore[attr-defined]
            x.fill_(4.0)  # not ordered after a's write
        torch.npu.synchronize()


def test_a_replay_is_its_tasks_modelled_time(restore_config: None) -> None:
    g, x = _graph(3)
    start, end = (torch.npu.Event(enable_timing=True) for _ in range(2))  # type: ignore[attr-defined]
    configure(mode="perf", task_us=20_000)
    torch.npu.synchronize()
    t0 = time.perf_counter()
    start.record()
    g.replay()
    end.record()
    issued_ms = (time.perf_counter() - t0) * 1e3
    end.synchronize()
    assert time.perf_counter() - t0 >= 3 * 0.020  # never earlier than modelled
    # modelled: the three tasks, after the host's Python between the two issues (as long
    # as this run's host took to issue them: on a busy machine, more than a quiet one's)
    assert 60.0 <= start.elapsed_time(end) <= 60.0 + issued_ms + 1.0
    assert torch.count_nonzero(x.cpu()) == 0


def _fused_patch_setup() -> tuple[object, ...]:
    q = torch.randn(2, 4, 1, 8, dtype=torch.float16).npu()
    kv = torch.randn(2, 4, 16, 8, dtype=torch.float16).npu()
    out = torch.zeros_like(q)
    lse = torch.zeros(1, device="npu")
    s = torch.npu.Stream()
    u = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        torch.npu.graph_task_group_begin(s)
        torch_npu.npu_fused_infer_attention_score.out(
            q, kv, kv, num_heads=4, input_layout="BNSD", actual_seq_lengths_kv=[16, 16],
            out=[out, lse],
        )
        handle = torch.npu.graph_task_group_end(s)
    torch.npu.synchronize()
    return q, kv, out, lse, u, handle


def test_a_patch_holds_the_interpreter_lock_only_for_its_python_share(
    restore_config: None,
) -> None:
    """A 30 ms patch whose share under the lock is 2 ms spends well under 30 ms of its
    thread's CPU: the rest is a sleep off the lock (the op's C++ dispatch)."""
    q, kv, out, lse, u, handle = _fused_patch_setup()
    configure(mode="perf", patch_us=30_000, patch_gil_us=2_000)
    t0, c0 = time.perf_counter(), time.thread_time()
    with torch.npu.stream(u):  # type: ignore[attr-defined]
        torch.npu.graph_task_update_begin(u, handle)
        torch_npu.npu_fused_infer_attention_score.out(
            q, kv, kv, num_heads=4, input_layout="BNSD", actual_seq_lengths_kv=[8, 8],
            out=[out, lse],
        )
        torch.npu.graph_task_update_end(u)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    torch.npu.synchronize()
    assert wall >= 0.030  # the whole modelled cost, in wall time
    assert cpu < 0.020, f"the patching thread used {cpu * 1e3:.1f} ms of CPU"


def test_perf_mode_runs_the_program_at_its_own_switch_interval(restore_config: None) -> None:
    """Compute and timed modes hand the interpreter lock over within 0.2 ms (the stream
    threads' Python); performance mode gives the program back the interval it had, and
    an interval the program set itself stays."""
    from npusim import runtime

    program = runtime._program_switch_interval_s
    assert program is not None  # the backend shortened it
    configure(mode="compute")
    assert sys.getswitchinterval() == pytest.approx(runtime.SIM_SWITCH_INTERVAL_S, rel=1e-3)
    configure(mode="perf")
    assert sys.getswitchinterval() == pytest.approx(program, rel=1e-3)
    configure(mode="timed")
    assert sys.getswitchinterval() == pytest.approx(runtime.SIM_SWITCH_INTERVAL_S, rel=1e-3)
    try:
        sys.setswitchinterval(0.003)  # the program's own, while the sim's is in force
        configure(mode="perf")
        assert sys.getswitchinterval() == pytest.approx(0.003, rel=1e-3)
        configure(mode="compute")
        assert sys.getswitchinterval() == pytest.approx(0.003, rel=1e-3)
    finally:
        sys.setswitchinterval(runtime.SIM_SWITCH_INTERVAL_S)


@pytest.mark.parametrize("kwargs", [{"mode": "fast"}, {"patch_gil_us": -1.0}])
def test_invalid_perf_config_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SimConfig(**kwargs)  # type: ignore[arg-type]


def test_perf_mode_is_timed() -> None:
    c = SimConfig(mode="perf")
    assert c.timed and c.perf
    assert SimConfig(mode="timed").timed and not SimConfig(mode="timed").perf
    assert not SimConfig().timed


def test_a_layer_by_layer_replay_waits_for_each_release_in_modelled_time(
    restore_config: None,
) -> None:
    """Replay, then update each layer releasing its wait (vllm-ascend's order): the
    replay blocks once for the whole stretch of waits, but each layer's tasks still start
    at its own release in the model, so the step is never shorter than its floor:
    releases at 2, 4, 6 ms (2 ms patches), each layer's two 1 ms tasks after its release:
    done at 8 ms after the replay's issue."""
    layers = 3
    q = torch.randn(2, 4, 1, 8, dtype=torch.float16).npu()
    kv = torch.randn(2, 4, 16, 8, dtype=torch.float16).npu()
    outs = [(torch.zeros_like(q), torch.zeros(1, device="npu")) for _ in range(layers)]
    x = torch.zeros(4).npu()
    events = [torch.npu.ExternalEvent() for _ in range(layers)]
    s, u = torch.npu.Stream(), torch.npu.Stream()
    g = torch.npu.NPUGraph()
    handles = []
    fia = dict(num_heads=4, input_layout="BNSD")
    with torch.npu.graph(g, stream=s):
        for layer in range(layers):
            events[layer].wait(s)
            events[layer].reset(s)
            torch.npu.graph_task_group_begin(s)
            torch_npu.npu_fused_infer_attention_score.out(
                q, kv, kv, actual_seq_lengths_kv=[16, 16], out=list(outs[layer]), **fia
            )
            handles.append(torch.npu.graph_task_group_end(s))
            x.add_(1)
    torch.npu.synchronize()
    configure(mode="perf", patch_us=2_000, patch_gil_us=100, task_us=1_000)
    start, done = (torch.npu.Event(enable_timing=True) for _ in range(2))  # type: ignore[attr-defined]
    with torch.npu.stream(s):  # type: ignore[attr-defined]
        start.record()
        g.replay()
        done.record()
    for layer in range(layers):
        with torch.npu.stream(u):  # type: ignore[attr-defined]
            torch.npu.graph_task_update_begin(u, handles[layer])
            torch_npu.npu_fused_infer_attention_score.out(
                q, kv, kv, actual_seq_lengths_kv=[8, 8], out=list(outs[layer]), **fia
            )
            torch.npu.graph_task_update_end(u)
            events[layer].record(u)
    done.synchronize()
    assert start.elapsed_time(done) >= 8.0
    assert torch.count_nonzero(x.cpu()) == 0


# ------------------------------------------------------------ the field's update loop
def _layered_graph(layers: int, streams: tuple[object, object] | None = None) -> dict[str, object]:
    """A decode-like graph: per layer, a wait on the layer's ExternalEvent (its release),
    the fused attention op in a task group, and one more task; updated with the fused
    binding on a stream of its own, as the field does (vllm-ascend, graphlane)."""
    q = torch.randn(2, 4, 1, 8, dtype=torch.float16).npu()
    kv = torch.randn(2, 4, 16, 8, dtype=torch.float16).npu()
    outs = [[torch.zeros_like(q), torch.zeros(1, device="npu")] for _ in range(layers)]
    x = torch.zeros(4).npu()
    events = [torch.npu.ExternalEvent() for _ in range(layers)]
    s, u = streams or (torch.npu.Stream(), torch.npu.Stream())
    g = torch.npu.NPUGraph()
    handles = []
    with torch.npu.graph(g, stream=s):
        for layer in range(layers):
            events[layer].wait(s)
            events[layer].reset(s)
            torch.npu.graph_task_group_begin(s)
            torch_npu.npu_fused_infer_attention_score.out(
                q, kv, kv, num_heads=4, input_layout="BNSD", actual_seq_lengths_kv=[16, 16],
                out=outs[layer],
            )
            handles.append(torch.npu.graph_task_group_end(s))
            x.add_(1)
    torch.npu.synchronize()
    return {"g": g, "s": s, "u": u, "q": q, "kv": kv, "outs": outs, "events": events,
            "handles": handles, "x": x}  # fmt: skip


def _launch(m: dict[str, object]) -> torch.npu.Event:  # type: ignore[name-defined]
    """A decode step's replay (vllm-ascend's order: it is issued before the updates that
    release its layers), and the update stream's wait for the previous replay of the
    same graph (its patches must not land while that replay runs them); the step's done
    event."""
    s, u = m["s"], m["u"]
    done = torch.npu.Event()  # type: ignore[attr-defined]
    previous = m.get("done")
    with torch.npu.stream(s):  # type: ignore[attr-defined]
        m["g"].replay()  # type: ignore[attr-defined]
        done.record()
    m["done"] = done
    if previous is not None:
        u.wait_event(previous)  # type: ignore[attr-defined]
    return done


def _update(m: dict[str, object], lengths: list[int]) -> None:
    """Each layer's update with the fused binding, releasing the layer's wait."""
    fused = torch_npu._C._npu_fused_infer_attention_score_out_graph
    u, q, kv = m["u"], m["q"], m["kv"]
    for handle, event, out in zip(m["handles"], m["events"], m["outs"], strict=True):  # type: ignore[call-overload]
        fused(u, handle, event, query=q, key=kv, value=kv, num_heads=4, input_layout="BNSD",
              actual_seq_lengths_kv=lengths, out=out)  # fmt: skip


def _update_unfused(m: dict[str, object], lengths: list[int]) -> None:
    """The same updates as :func:`_update`, each made of its four calls (begin, the op on
    the update stream, end, the release's record), as field code without the fused
    binding makes them."""
    u, q, kv = m["u"], m["q"], m["kv"]
    with torch.npu.stream(u):  # type: ignore[attr-defined]
        for handle, event, out in zip(m["handles"], m["events"], m["outs"], strict=True):  # type: ignore[call-overload]
            torch.npu.graph_task_update_begin(u, handle)
            torch_npu.npu_fused_infer_attention_score.out(
                q, kv, kv, num_heads=4, input_layout="BNSD", actual_seq_lengths_kv=lengths,
                out=out,
            )
            torch.npu.graph_task_update_end(u)
            event.record(u)


def _step(m: dict[str, object], lengths: list[int]) -> torch.npu.Event:  # type: ignore[name-defined]
    done = _launch(m)
    _update(m, lengths)
    return done


def _thread_cpu_s(thread: object) -> float:
    """CPU seconds of a sim stream's thread (0 when it never started)."""
    tid = getattr(thread, "native_id", None)
    if tid is None:
        return 0.0
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) * 1e-9
    except FileNotFoundError:
        return 0.0


def test_the_sims_own_cpu_per_update_fits_inside_the_modelled_lock_share(
    restore_config: None,
) -> None:
    """The sim's own host work of a fused update (its binding, routing, charge and the
    update stream's entries, on whatever thread runs them) costs less CPU than the
    modelled share of an update under the interpreter lock (patch_gil_us: 25 us), so a
    loop sees the modelled costs. Measured with no modelled cost (patch_gil_us=0 and a
    patch_us too short to sleep): what is left is the sim's own, every line of it Python
    holding the lock. Not counted: the kernel's CPU for the sleep that models the rest of
    an update (7-16 us of thread CPU per sleep in these VMs, more on a busy host: CI
    counted it and saw 27-32 us), which runs off the lock, as the binding's C++ does in
    the field. Before the fast path: about 40 us of the updating thread plus the update
    stream thread's entries."""
    layers = 10
    m = _layered_graph(layers)
    configure(mode="perf", task_us=1.0, patch_us=0.001, patch_gil_us=0.0)
    for i in range(3):  # warm up: plans, bindings learned
        _step(m, [8 + i, 8]).synchronize()
    u = m["u"]
    per_update: dict[object, list[float]] = {_update: [], _update_unfused: []}
    for rep in range(5):  # interleaved: a busy spell of the machine falls on both
        for update, runs in per_update.items():
            cpu, stream0 = 0.0, _thread_cpu_s(getattr(u, "_thread", None))
            for i in range(10):
                done = _launch(m)
                c0 = time.thread_time()
                update(m, [8 + (rep + i) % 8, 9])  # type: ignore[operator]
                cpu += time.thread_time() - c0
                done.synchronize()
            cpu += _thread_cpu_s(getattr(u, "_thread", None)) - stream0  # its entries, if any
            runs.append(1e6 * cpu / (10 * layers))
    fused, unfused = min(per_update[_update]), min(per_update[_update_unfused])
    share = SimConfig().patch_gil_us  # the modelled lock share, this run's config default
    assert fused < share, (
        f"the sim's own CPU per update {sorted(per_update[_update])} us, modelled lock "
        f"share {share} us"
    )
    # Against the same updates made as four calls, in this run: the fused binding binds
    # its arguments itself, never through torch's dispatcher and the op's issue-time
    # checks, and its patch and release are one entry run at its issue (12-13 us against
    # 80-81 us on a quiet machine).
    assert fused < 0.5 * unfused, (
        f"fused update {fused:.1f} us, the same update as four calls {unfused:.1f} us"
    )
    assert torch.count_nonzero(m["x"].cpu()) == 0  # type: ignore[call-overload]


def _reference_step(layers: int, patch_us: float, gil_us: float) -> None:
    """What a host with no simulator pays for a step's updates: per layer ``gil_us`` of
    pure Python, the rest a sleep, the layers back to back."""
    end = time.perf_counter()
    for _ in range(layers):
        end += patch_us * 1e-6
        hold = end - (patch_us - gil_us) * 1e-6
        while time.perf_counter() < hold:
            pass
        while (left := end - time.perf_counter()) > 0:
            time.sleep(left)


class _Sections:
    """A trace function counting, per thread, the simulator's critical sections entered
    (``with RUNTIME.cond``: a Python-level ``Condition.__enter__``) while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.by_thread: dict[int, int] = {}
        self.code = threading.Condition.__enter__.__code__

    def __call__(self, frame: Any, event: str, arg: object) -> None:
        if self.on and event == "call" and frame.f_code is self.code:
            ident = threading.get_ident()
            self.by_thread[ident] = self.by_thread.get(ident, 0) + 1


def test_a_replays_stretch_of_releases_is_one_critical_section_of_its_stream(
    restore_config: None,
) -> None:
    """The replay stream passes a layer-by-layer graph's waits and resets in one critical
    section, however many layers: each was one before (two per layer, 40 for a 20-layer
    decode step), and each is a turn at the interpreter lock that an NPU's stream does not
    take from the host's threads. Counted on the replay stream's thread, per step, for 4
    and 24 layers (the updates release the layers after the replay is issued, as
    vllm-ascend's and graphlane's steps do)."""
    models = {n: _layered_graph(n) for n in (4, 24)}
    configure(mode="perf", task_us=1.0, patch_us=20.0, patch_gil_us=5.0)
    sections = _Sections()
    threading.settrace(sections)  # a stream's thread starts at its first work: a step's
    try:
        for m in models.values():
            _step(m, [8, 8]).synchronize()
    finally:
        threading.settrace(None)  # type: ignore[arg-type]
    per_step: dict[int, list[int]] = {4: [], 24: []}
    for _ in range(5):
        for n, m in models.items():
            ident = m["s"]._thread.ident  # type: ignore[attr-defined]
            before = sections.by_thread.get(ident, 0)
            sections.on = True
            _step(m, [8, 8]).synchronize()
            torch.npu.synchronize()
            sections.on = False
            per_step[n].append(sections.by_thread.get(ident, 0) - before)
    small, large = statistics.median(per_step[4]), statistics.median(per_step[24])
    assert small > 0, per_step  # the replay stream's thread was counted
    # the same sections for 24 layers as for 4: the replay's entry, its stretch, its
    # record; a wake-up that finds the stretch unreleased waits once more
    assert large <= small + 2, f"sections per step: 4 layers {per_step[4]}, 24 {per_step[24]}"


def test_a_20_layer_loop_runs_at_its_modelled_rate_relative_to_the_same_run(
    restore_config: None,
) -> None:
    """The field's costs (20 layers, 185 us updates with 25 us under the lock, 60 us of
    replay each): vllm-ascend's one-thread loop (the replay of step N+1 and its updates
    issued while step N's tokens are still to be waited for) reaches >= 0.75 of the rate
    of a loop that only pays the modelled host costs, measured alternately in this run
    (so a busy machine slows both: 0.80-0.9 at load average 10 on 2 cores, 0.40 before the
    sim's update path was cut). The limit both approach is one update
    chain per step: 1 / (20 x 185 us); graphlane bench --field asks 0.95 of it on a quiet
    machine."""
    layers, patch_us, gil_us = 20, 185.0, 25.0
    streams = (torch.npu.Stream(), torch.npu.Stream())
    ring = [_layered_graph(layers, streams) for _ in range(2)]  # step N+1 patches the other
    tasks = 2 * layers  # the graph's tasks: one attention op and one add per layer
    configure(mode="perf", task_us=layers * 60.0 / tasks, patch_us=patch_us, patch_gil_us=gil_us)

    def sim_loop(steps: int) -> float:
        t0, pending = time.perf_counter(), None
        for i in range(steps):
            done = _step(ring[i % 2], [8 + i % 8, 8])
            if pending is not None:
                pending.synchronize()
            pending = done
        assert pending is not None
        pending.synchronize()
        return steps / (time.perf_counter() - t0)

    def reference(steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            _reference_step(layers, patch_us, gil_us)
        return steps / (time.perf_counter() - t0)

    sim_loop(5)
    rates: dict[str, list[float]] = {"sim": [], "reference": []}
    for _ in range(5):  # interleaved: a busy spell of the machine falls on both
        rates["sim"].append(sim_loop(25))
        rates["reference"].append(reference(25))
    # The best of the five pairs: a busy spell slows the sim's loop (three threads) more
    # than the reference (one), so a loaded machine pulls the median down (one loaded
    # run: under 0.75); what the sim's own cost allows shows in its best pair.
    ratio = max(s / r for s, r in zip(rates["sim"], rates["reference"], strict=True))
    limit = 1e6 / (layers * patch_us)
    assert ratio >= 0.75, (
        f"20-layer loop {statistics.median(rates['sim']):.0f} steps/s, a loop paying only "
        f"the modelled costs {statistics.median(rates['reference']):.0f} (limit {limit:.0f}): "
        f"{ratio:.2f}x"
    )


def test_an_eager_copy_costs_a_few_plain_host_copies_and_a_launch_no_walk_of_memory(
    restore_config: None,
) -> None:
    """On an NPU an eager input copy (``aclrtMemcpyAsync``) and a replay's launch are C
    calls of a few microseconds with the interpreter lock released. In performance mode
    the sim's CPU per eager copy, every thread of the process counted (the stream's
    thread may run it), stays a small multiple of what this run measures for a plain
    torch copy between host tensors of the same size (the least of 3 reps each: a ratio,
    not a wall time; 30-35 before its fast path), and a replay's launch costs the
    issuing thread about as much for a graph holding 200 tensors as for one holding one
    (before, the launch walked every tensor the graph holds: 1.6-2x)."""
    configure(mode="compute")
    xs = [torch.zeros(4).npu() for _ in range(200)]
    graphs = {1: torch.npu.NPUGraph(), 200: torch.npu.NPUGraph()}
    for n, g in graphs.items():
        with torch.npu.graph(g):
            for x in xs[:n]:
                x.add_(1)
    torch.npu.synchronize()
    configure(mode="perf", task_us=1.0)
    dev = torch.zeros(64, dtype=torch.int64, device="npu")
    src, host = torch.arange(64), torch.zeros(64, dtype=torch.int64)

    def plain(n: int = 2000) -> float:
        t0 = time.process_time()
        for _ in range(n):
            host.copy_(src, non_blocking=True)
        return (time.process_time() - t0) / n

    def copy(n: int = 2000) -> float:
        t0 = time.process_time()
        for _ in range(n):
            dev.copy_(src, non_blocking=True)
        torch.npu.synchronize()
        return (time.process_time() - t0) / n

    def launch(g: torch.npu.NPUGraph) -> float:  # type: ignore[name-defined]
        t0 = time.thread_time()
        g.replay()
        spent = time.thread_time() - t0
        torch.npu.synchronize()
        return spent

    base = min(plain() for _ in range(3))
    per_copy = min(copy() for _ in range(3))
    # Launches of ~10 us, one of each graph after the other, in turn first (the second
    # of a pair runs warmer): each pair's two launches share the host's speed, which
    # switches by 1.5x in stretches of tens of ms (docs/performance.md, the twelfth
    # session of issue 42). Blocks of 30 launches each, their least compared, failed on
    # one run of the suite in a few (1.41x); these pairs measured 1.00-1.02x in 40
    # runs, 20 of them beside two busy loops.
    pairs = []
    for i in range(240):
        order = (1, 200) if i % 2 else (200, 1)
        took = {n: launch(graphs[n]) for n in order}
        pairs.append(took[200] / max(took[1], 1e-9))
    assert torch.equal(dev.cpu(), src)
    assert torch.count_nonzero(xs[0].cpu()) == 0  # replays are modelled, not computed
    assert per_copy < 20 * base, f"an eager copy costs {per_copy / base:.1f} plain copies"
    ratio = statistics.median(pairs)
    assert ratio < 1.3, f"a launch: 200-tensor graph {ratio:.2f}x a 1-tensor one"


def test_a_copy_behind_queued_replays_runs_at_issue_and_behind_eager_work_in_order(
    restore_config: None,
) -> None:
    """Performance mode: a replay computes nothing, so a copy queued behind only
    replays and records runs at its issue (the stream's thread does not run it: the
    destination holds it before the replay's wait is released); behind an eager op,
    which does write memory, it still runs in stream order."""
    ev = torch.npu.ExternalEvent()  # type: ignore[attr-defined]
    s = torch.npu.Stream()  # type: ignore[attr-defined]
    g = torch.npu.NPUGraph()
    x = torch.zeros(4).npu()
    with torch.npu.graph(g, stream=s):
        ev.wait(s)
        ev.reset(s)
        x.add_(1)
    torch.npu.synchronize()
    configure(mode="perf", task_us=1.0)
    dev = torch.zeros(4, dtype=torch.int64, device="npu")
    # the zeros are written on the current stream, the copies below go on s: without
    # this the copy may land first and the zeros after (a race on an NPU too, which this
    # mode does not report: 130 of 200 runs lost the copy)
    torch.npu.synchronize()
    src = torch.arange(4)
    with torch.npu.stream(s):  # type: ignore[attr-defined]
        g.replay()  # blocked on ev until the host records it
        dev.copy_(src, non_blocking=True)
        early = dev._data.clone()  # type: ignore[attr-defined]  # the device memory itself
        back = dev.to("cpu", non_blocking=True)
    ev.record(torch.npu.Stream())  # type: ignore[attr-defined]  # the release
    torch.npu.synchronize()
    assert torch.equal(early, src) and torch.equal(back, src)
    with torch.npu.stream(s):  # type: ignore[attr-defined]
        dev.mul_(10)  # eager: queued (s is idle, but an op is never run at issue)
        later = dev.to("cpu", non_blocking=True)
    torch.npu.synchronize()
    assert torch.equal(later, src * 10)


def test_a_copy_run_at_its_issue_copies_off_the_runtime_lock(
    restore_config: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Performance mode runs a host copy at its issue on an idle stream, or behind
    replays alone: its data is copied after the runtime lock is let go. torch's copy
    lets the interpreter lock go; under the runtime lock, a thread that took the
    interpreter lock then and asked for the runtime lock (an update thread's next patch)
    would wait for it, then again for the interpreter lock, behind the copying thread's
    Python. Both copies' data still arrive (the values are read back)."""
    from npusim.runtime import RUNTIME

    configure(mode="perf", task_us=1.0)
    s = torch.npu.Stream()  # type: ignore[attr-defined]
    dev = torch.zeros(4, dtype=torch.int64, device="npu")
    torch.npu.synchronize()
    src = torch.arange(4)
    held: list[bool] = []  # for each copy of host tensors: the runtime lock held?
    plain_copy = torch.Tensor.copy_

    def copy_(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if type(self) is torch.Tensor:  # the simulator's own, of CPU memory
            held.append(RUNTIME.cond._lock.locked())  # type: ignore[attr-defined]
        return plain_copy(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    with torch.npu.stream(s):  # type: ignore[attr-defined]
        dev.copy_(src, non_blocking=True)  # to the device, at its issue (s is idle)
        back = dev.to("cpu", non_blocking=True)  # and back
    monkeypatch.undo()
    torch.npu.synchronize()
    assert torch.equal(back, src)
    assert held and not any(held), held


def test_an_eager_op_issued_as_before_runs_little_of_the_simulators_python(
    restore_config: None,
) -> None:
    """The issuing thread's Python for an eager op in performance mode (a decode step's
    gather and scatter of its persistent batch: index_select into a buffer, index_put_),
    counted in function calls, which a busy machine cannot change: its meta kernel's
    cached result is not copied per call, the cache's key is built without a generic
    walk, and no footprint is built (the mode checks none). Before: 191 and 180 calls
    per op; now 144 and 136. On an NPU the launch is torch_npu's C++."""
    import cProfile
    import pstats

    configure(mode="perf", task_us=1.0)
    idx = torch.arange(8, dtype=torch.int32, device="npu")
    table = torch.zeros(64, 32, dtype=torch.int32, device="npu")
    out = torch.zeros(8, 32, dtype=torch.int32, device="npu")
    last = torch.zeros(64, dtype=torch.int64, device="npu")
    tokens = torch.zeros(8, dtype=torch.int64, device="npu")
    s = torch.npu.Stream()  # type: ignore[attr-defined]
    calls = {}
    with torch.npu.stream(s):  # type: ignore[attr-defined]
        for name, op in (("index_select", lambda: torch.index_select(table, 0, idx, out=out)),
                         ("index_put_", lambda: last.index_put_((idx,), tokens))):  # fmt: skip
            op()  # its meta kernel's result is cached
            torch.npu.synchronize()
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(20):
                op()
            profile.disable()
            torch.npu.synchronize()
            calls[name] = pstats.Stats(profile).total_calls / 20  # type: ignore[attr-defined]
    assert all(n < 160 for n in calls.values()), calls
