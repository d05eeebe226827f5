"""What npusim's collectives cost in wall time, outside any daemon (issue 44, item 6):
N rank processes (N = 1, 2, 4) joined by a file store, performance mode with a modelled
20 us per collective, replay a captured graph of 40 all_reduces of 1 KiB 20 times. Per
replayed collective and rank: the wall time, the process's CPU time and its voluntary
context switches. At N = 1 the wall time is the modelled 20 us; beyond it is the sim's
handoff between the ranks' processes and the machine's cores (docs/performance.md,
"Tensor parallel"). Counts, not goals: it prints what it measured.

.venv/bin/python benchmarks/collective_handoff.py [--ranks 1,2,4] [--json]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

COLLECTIVES, REPLAYS, LATENCY_US = 40, 20, 20.0


def rank_main(rank: int, world: int, init: str) -> None:
    import npusim
    import torch
    import torch.distributed as dist
    from npusim import torch_npu  # noqa: F401  (the "npu" device and the "hccl" backend)

    torch.npu.set_device(rank)
    dist.init_process_group("hccl", init_method=f"file://{init}", rank=rank, world_size=world)
    npusim.configure(mode="perf", collective_us=LATENCY_US)
    x = torch.ones(256).npu()  # 1 KiB of float32
    s, g = torch.npu.Stream(), torch.npu.NPUGraph()
    with torch.npu.stream(s), torch.npu.graph(g, stream=s):
        for _ in range(COLLECTIVES):
            dist.all_reduce(x)
    g.replay()
    torch.npu.synchronize()
    dist.barrier()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(REPLAYS):
        g.replay()
    torch.npu.synchronize()
    n = COLLECTIVES * REPLAYS
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - usage.ru_nvcsw
    print(json.dumps({"wall_us": wall / n * 1e6, "cpu_us": cpu / n * 1e6,
                      "switches": switches / n}), flush=True)  # fmt: skip
    dist.barrier()


def measure(world: int) -> dict[str, float]:
    """Medians over the ranks of one run of ``world`` rank processes."""
    init = os.path.join(tempfile.mkdtemp(prefix="npusim-handoff-"), "init")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank", str(r), str(world), init],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    rows = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            if p.returncode != 0:
                raise SystemExit(f"a rank exited with {p.returncode}")
            rows.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        raise SystemExit(0)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="1,2,4", help="group sizes, comma-separated")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    figures = {n: measure(int(n)) for n in args.ranks.split(",")}
    if args.json:
        print(json.dumps({"load_average": load, "per_collective": figures}, indent=2))
    else:
        print(f"per replayed collective ({COLLECTIVES} x {REPLAYS}, modelled {LATENCY_US:g} us), "
              f"{os.cpu_count()} cores, load average {load:.2f} at the start")  # fmt: skip
        print(f"{'ranks':>5} {'wall us':>8} {'CPU us':>7} {'switches':>9}")
        for n, f in figures.items():
            print(f"{n:>5} {f['wall_us']:8.0f} {f['cpu_us']:7.0f} {f['switches']:9.2f}")
