"""The ranks of a tensor-parallel ``model`` program (run by test_tensor_parallel.py).

``python tp_ranks.py WORLD INIT_METHOD JOB_JSON``: imports once, then forks one process
per rank (the imports cost more than a tiny model's run). Each rank sets its npu device,
joins the "hccl" group (``INIT_METHOD``: ``tcp://127.0.0.1:PORT``, rank 0 serving the
TCP store) as a worker of a group does before it loads its programs, then for each model
of the job builds the program with ``tensor_parallel = WORLD`` on a step engine of its
own device and generates each prompt's tokens three ways:

- ``steps``: a prefill per prompt, then steps fed the tokens the host read back (decoding
  ahead off: each step waits for the previous one's reply);
- ``ahead``: ``add`` per prompt then ``decode`` steps issued back to back, each row fed
  on the device the token its sequence sampled in its previous step (decoding ahead on);
- ``sampled``: as ``ahead``, sampling with a temperature, top-k and a seed.

Prints one JSON line per rank, model and mode: the tokens per prompt, and what the rank
holds. Exits non-zero if a rank failed.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: issuer, daemons

import torch
import torch.distributed as dist
from issuer import Issuer
from npusim import extensions, graph_profile, torch_npu

from graphlane.workers.backends.npu import NpuBackend
from graphlane.workers.job import Job, JobKind
from graphlane.workers.programs import ModelConfig, ModelProgram

SERVING = dict(block_size=128, num_blocks=4, max_blocks_per_seq=1, buckets=(2,))


def steps(eng: Issuer, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Prefill, then decode with the tokens read back (one step in flight)."""
    outs = []
    for block, prompt in enumerate(prompts):
        fields = {"tokens": torch.tensor(prompt),
                  "block_table": torch.tensor([block], dtype=torch.int32)}  # fmt: skip
        (s,) = eng.wait([eng.state("model", "prefill", fields)], 60)
        assert s.results is not None
        outs.append([int(s.results["tokens"][0])])
    for _ in range(new - 1):
        lengths = [len(p) + len(o) for p, o in zip(prompts, outs, strict=True)]
        inputs = {"tokens": torch.tensor([o[-1] for o in outs]),
                  "block_table": torch.tensor([[b] for b in range(len(prompts))],
                                              dtype=torch.int32)}  # fmt: skip
        step = eng.step(len(prompts), lengths, inputs=inputs, program="model",
                        params={"actual_seq_lengths_kv": lengths}, outputs=("tokens",))  # fmt: skip
        (s,) = eng.wait([step], 60)
        assert s.results is not None
        for o, t in zip(outs, s.results["tokens"].tolist(), strict=True):
            o.append(t)
    return outs


def ahead(
    eng: Issuer, prompts: list[list[int]], new: int, params: dict[str, Any] | None = None
) -> list[list[int]]:
    """``add`` each prompt (sampling with ``params``, else greedy), then ``decode`` steps
    issued without waiting for replies."""
    engine, owner = eng.engine, "client"
    jobs: list[Job] = []
    sids = list(range(len(prompts)))
    for sid, prompt in zip(sids, prompts, strict=True):
        fields = {"sequence": sid, "tokens": torch.tensor(prompt), "blocks": [sid],
                  "params": params}  # fmt: skip
        plan = engine.plan_sequences("model", "add", fields, owner)
        jobs.append(eng.issue(Job(JobKind.STATE, plan, owner=owner)))
    for _ in range(new - 1):
        plan = engine.plan_sequences("model", "decode", {"sequences": sids}, owner, ("tokens",))
        jobs.append(eng.issue(Job(JobKind.STEP, plan, ("tokens",), owner=owner)))
    eng.wait(jobs, 120)
    engine.programs["model"].sequence_change("free", {"sequences": sids}, owner)
    outs: list[list[int]] = [[] for _ in prompts]
    for job in jobs:
        assert job.results is not None
        tokens = job.results["tokens"].reshape(-1).tolist()
        rows = [job.plan.values["sequence"]] if job.kind is JobKind.STATE else sids
        for sid, t in zip(rows, tokens, strict=True):
            outs[sid].append(t)
    return outs


def sampled(eng: Issuer, prompts: list[list[int]], new: int) -> list[list[int]]:
    """:func:`ahead`, sampling: temperature, top-k (the candidates' draw), one seed."""
    return ahead(eng, prompts, new, {"temperature": 1.5, "top_k": 40, "seed": 11})


MODES = {"steps": steps, "ahead": ahead, "sampled": sampled}


def run_rank(rank: int, world: int, init: str, job: dict[str, Any]) -> None:
    torch.npu.set_device(rank)
    dist.init_process_group("hccl", init_method=init, rank=rank, world_size=world)
    with extensions.enabled("float32_attention"):
        for model in job["models"]:
            config = ModelConfig(model=model["path"], dtype="float32", tensor_parallel=world,
                                 **SERVING)  # fmt: skip
            program = ModelProgram(config)
            with Issuer(NpuBackend(torch_npu, rank), [program]) as eng:
                for mode, run in MODES.items():
                    tokens = run(eng, job["prompts"], job["new"])
                    (decode,) = eng.engine.graphs.values()  # one bucket, one instance
                    kernels = graph_profile(decode.graph).kernels
                    held = {"collectives": {k: n for k, n in kernels.items() if "hccl" in k},
                            "leader": program.leader, "tp_rank": program.tp_rank,
                            "tp_size": program.tp_size, "kv_heads": program.kv_heads,
                            "cache": list(program.kv._state(eng.engine.backend)
                                          ["key_cache_0"].shape)}  # fmt: skip
                    line = {"model": model["name"], "mode": mode, "rank": rank,
                            "tokens": tokens, **held}  # fmt: skip
                    # one write of under PIPE_BUF bytes: the ranks' lines do not mix
                    os.write(1, (json.dumps(line) + "\n").encode())
    dist.destroy_process_group()


def main() -> None:
    world, init, job = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    torch.set_num_threads(1)
    importlib.import_module("torch._dynamo")  # the first capture imports it: once, here

    children = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:  # a rank: dies with the launcher, exits without its atexit work
            libc = ctypes.CDLL(None)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            code = 0
            try:
                run_rank(rank, world, init, job)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
    failed = []
    while children:
        pid, status = os.wait()
        rank = children.pop(pid)
        if status:
            failed.append(rank)
    if failed:
        sys.exit(f"ranks {failed} failed")


if __name__ == "__main__":
    main()
