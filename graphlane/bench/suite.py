"""``graphlane bench``: everything measured side by side in one run, printed as ratios.

- pipeline: through a real daemon at serve's default config on the timed sim,
  pipelined vs the limit and vs a serial daemon, latency vs the floor, and the
  zero-cost rate (:mod:`.pipeline`);
- control plane: a raw pyzmq+msgpack round trip between two processes against
  the daemon, in the same run: sequential round trips, windowed throughput, and
  large-tensor bandwidth (:mod:`.control_plane`);
- scaling: windowed steps/s over 1, 2 and 4 simulated devices (:mod:`.control_plane`);
- the model's decode: decoding ahead through a daemon beside the field's in-process
  loop and beside the same daemon waiting for each step's tokens (:mod:`.decode`);
- paged decode: request bytes per step at three context lengths, and pipelined paged
  decode through a daemon on the timed sim vs the limit and vs serial
  (:mod:`.paged`);
- the field's costs on npusim's performance mode (``--field`` runs it alone): decoding
  ahead through a daemon beside the vllm-ascend loop and a threaded loop, with a
  scheduler's work of 0, 0.5 and 2 ms per step (:mod:`.field`);
- tensor parallel on the same perf mode (``--tp`` runs it alone): tokens/s decoding
  ahead and a lone step's latency through a daemon at TP 1, 2 and 4, each collective
  costing HCCL's latency plus its bytes over an HCCS link (:mod:`.tensor_parallel`).

The reliability figures (:mod:`.reliability`) are a run of their own:
``benchmarks/reliability.py``.
"""

from __future__ import annotations

from typing import Any

from . import control_plane, decode, field, paged, worker
from . import pipeline as pipeline_bench
from . import tensor_parallel as tp_bench
from .goals import format_goals, progress


def run_field(quick: bool = False) -> dict[str, Any]:
    """Issue 42's part alone (``graphlane bench --field``, a few minutes)."""
    with progress(
        f"the field's decode on npusim's perf mode ({field.LAYERS} layers, 185/60 us): the "
        "vllm-ascend loop, the threaded loop and a daemon, 0/0.5/2 ms of scheduler work; "
        "graphlane's own CPU on null; the null round trip"
    ):
        f = field.measure(steps=60 if quick else 120, reps=2 if quick else 5,
                          lone_steps=20 if quick else 40,
                          own_reps=3 if quick else 7)  # fmt: skip
    return {"field": f.as_dict(), "field_table": field.table(f)}


def run_tp(quick: bool = False) -> dict[str, Any]:
    """Issue 44's measurement alone (``graphlane bench --tp``, a minute or two)."""
    with progress(
        f"tensor parallel on npusim's perf mode ({tp_bench.LAYERS} layers, 185/60 us, "
        f"collectives {tp_bench.HCCL_LATENCY_US:g} us + bytes at {tp_bench.HCCS_LINK_GB_S:g} "
        "GB/s): a daemon at TP 1, 2 and 4, decoding ahead and lone steps"
    ):
        f = tp_bench.measure(steps=40 if quick else 100, reps=1 if quick else 2,
                             lone_steps=10 if quick else 20)  # fmt: skip
    return {"tensor_parallel": f.as_dict(), "tp_table": tp_bench.table(f)}


def format_tp(r: dict[str, Any]) -> str:
    """``graphlane bench --tp``'s report: its table (it sets no goals)."""
    return r["tp_table"]


def run_all(quick: bool = False) -> dict[str, Any]:
    steps = 30 if quick else 60
    with progress("the step pipeline through daemons on the timed sim: 4 profiles, serial too"):
        pipe = pipeline_bench.run(steps=steps)
    with progress("the zero-cost rate through a daemon (4 layers, no modelled cost)"):
        zero = pipeline_bench.zero_cost(steps=1000 if quick else 2000)
    with progress("the control plane against raw pyzmq+msgpack, null device then timed sim"):
        cp = control_plane.control_plane(200 if quick else 500)
    with progress("the worker's own CPU time per bundled step, in-process, null device"):
        cp["worker_in_process"] = worker.per_step_us(1000 if quick else 2000)
    with progress("tensor bandwidth against raw pyzmq, null device then timed sim"):
        bw = control_plane.bandwidth(10 if quick else 30)
    with progress("scaling over 1, 2 and 4 simulated devices"):
        sc = control_plane.scaling(steps=100 if quick else 200)
    with progress("paged decode: request bytes, then pipelined vs serial daemons"):
        paged_figures = {
            "request_bytes": paged.request_bytes(),
            "pipeline": paged.pipeline(steps=steps, reps=2 if quick else 3),
        }
    with progress("the model's decode: ahead and waiting through a daemon, in process; 3 profiles"):
        dec = [decode.measure(name, *costs, steps=steps, reps=2 if quick else 3)
               for name, costs in decode.PROFILES.items()]  # fmt: skip
    return {
        **run_field(quick),
        **run_tp(quick),
        "pipeline": [r.as_dict() for r in pipe],
        "decode": [r.as_dict() for r in dec],
        "decode_table": decode.table(dec),
        "paged": paged_figures,
        "pipeline_table": pipeline_bench.table(pipe),
        "zero_cost": zero,
        "control_plane": cp,
        "bandwidth": bw,
        "scaling": sc,
    }


def format_field(r: dict[str, Any]) -> str:
    """``graphlane bench --field``'s report: the field table and its goals."""
    return "\n".join([r["field_table"], "", *format_goals(r)])


def format_report(r: dict[str, Any]) -> str:
    cp, bw, sc = r["control_plane"], r["bandwidth"], r["scaling"]
    lines = ["pipeline (through a daemon at the default config; timed sim, 4 layers):"]
    lines += [r["pipeline_table"]]
    if "zero_cost" in r:
        lines.append(pipeline_bench.format_zero_cost(r["zero_cost"]))
    lines.append("")
    lines.append("control plane (ms; ratio to the raw round trip measured beside it):")
    lines.append(f"  {'':34} {'null device':>20} {'timed sim':>20}")

    def row(label: str, key: str, ratio: str | None = None) -> str:
        cells = []
        for b in ("null", "sim"):
            f = cp[b]
            cell = f"{f[key]:.3f}"
            if ratio:
                cell += f" ({f[ratio]:.2f}x)"
            cells.append(f"{cell:>20}")
        return f"  {label:<34} {' '.join(cells)}"

    lines += [
        row("raw pyzmq+msgpack round trip", "raw_rtt_ms"),
        row("step round trip", "step_rtt_ms", "step_rtt_vs_raw"),
        row("  of which the worker held it", "step_server_ms"),
        row("  outside the worker", "step_outside_worker_ms", "outside_worker_vs_raw"),
        row("worker status round trip", "worker_status_rtt_ms"),
        row("no-step round trip (resume)", "floor_rtt_ms", "floor_rtt_vs_raw"),
        row("worker CPU polling while idle", "worker_spin_ms"),
        f"  {'windowed steps/s (raw msgs/s)':<34} "
        + " ".join(
            f"{cp[b]['windowed_steps_s']:>9.0f} ({cp[b]['raw_windowed_msgs_s']:.0f}, "
            f"{cp[b]['windowed_vs_raw']:.2f}x)"
            for b in ("null", "sim")
        ),
        f"  {'tensor inputs MB/s (raw MB/s)':<34} "
        + " ".join(
            f"{bw[b]['step_inputs_mb_s']:>9.0f} ({bw[b]['raw_mb_s']:.0f}, "
            f"{bw[b]['bandwidth_vs_raw']:.2f}x)"
            for b in ("null", "sim")
        ),
        f"  ({bw['null']['bytes_per_request'] / 2**20:.0f} MiB of inputs per request)",
        f"  {'worker CPU per bundled step, us':<34} "
        f"{cp['worker_in_process']['per_step_us']:>20.1f}  (in-process, bundles of "
        f"{cp['worker_in_process']['bundle']})",
        "",
        f"scaling (timed sim 1000/1000 us, 4 layers, {sc['cpu_cores']} CPU cores):",
    ]
    for n, rate in sc["steps_s"].items():
        lines.append(
            f"  {n} device(s): {rate:.1f} steps/s ({sc['vs_one_device'][n]:.2f}x one device)"
        )
    if "paged" in r:
        lines += ["", *paged.format_paged(r["paged"])]
    if "decode_table" in r:
        lines += [
            "",
            f"model decode (timed sim, {decode.LAYERS} layers, batch {decode.BATCH}, "
            f"{decode.WINDOW} steps in flight decoding ahead; tokens/s):",
            r["decode_table"],
        ]
    if "field_table" in r:
        lines += ["", r["field_table"]]
    if "tp_table" in r:
        lines += ["", r["tp_table"]]
    return "\n".join([*lines, "", *format_goals(r)])
