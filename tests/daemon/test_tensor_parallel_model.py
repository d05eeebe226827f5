"""The ``model`` program split over a tensor-parallel group of two, through a real
daemon (issue 44's "done when"): a tiny Llama (GQA, its 2 KV heads one per rank) and a
tiny Qwen2 (q/k/v bias, tied embeddings) loaded shard by shard from their safetensors
files on two devices, fp32, token for token as transformers' greedy ``generate``, with
continuous batching (generic steps, decoding ahead off) and decoding ahead (the typed
``add``/``decode`` and the generic step's token -1). Each rank holds half of every
split weight: the status says so, and a rank that skipped a step would leave the
layers' all-reduces unmet (a deadlock, not a wrong token)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from daemons import SHARED_PIDS, RunningDaemon, finish, launch
from model_ref import Sequence, reference, run_ahead, run_batching, save, tiny_model

from graphlane.client import Client, SyncClient

NEW = 24
BLOCK, BLOCKS, MAX_BLOCKS = 128, 10, 2
SERVING = dict(block_size=BLOCK, num_blocks=BLOCKS, max_blocks_per_seq=MAX_BLOCKS,
               buckets=[1, 2, 4], prefill_chunk=48, dtype="float32",
               tensor_parallel=2)  # fmt: skip
QWEN = "graphlane.workers.programs.model:ModelProgram"
PROMPTS = {0: 5, 1: 17, 2: 130, 3: 1}  # sid -> prompt length (one over a block)
JOINS = {0: 0, 1: 0, 2: 4, 3: 9}


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RunningDaemon, dict]]:
    root = tmp_path_factory.mktemp("tp_models")
    models: dict[str, Any] = {}
    programs = []
    for program, kind in (("model", "llama"), (QWEN, "qwen2")):
        m = tiny_model(kind, seed=3)
        models[program] = m
        programs.append({"name": program, "model": save(m, root / kind), **SERVING})
    d = launch(root, "tp", devices=2, programs=programs)
    SHARED_PIDS.add(d.proc.pid)
    try:
        yield d, models
    finally:
        SHARED_PIDS.discard(d.proc.pid)
        finish(d)


def _sequences(seed: int) -> list[Sequence]:
    g = torch.Generator().manual_seed(seed)
    return [
        Sequence(sid, torch.randint(0, 256, (n,), generator=g).tolist(), JOINS[sid])
        for sid, n in PROMPTS.items()
    ]


@pytest.mark.parametrize("program", ["model", QWEN], ids=["llama", "qwen2"])
def test_a_group_of_two_gives_transformers_greedy_tokens(
    group: tuple[RunningDaemon, dict], program: str
) -> None:
    d, models = group
    seqs = _sequences(7)
    with SyncClient(d.endpoint, timeout=120) as c:
        (leader,) = c.hello()["workers"]  # one endpoint: the group's leader
        assert leader["group"]["devices"] == [0, 1]

        def prefill(tokens: list[int], table: list[int]) -> int:
            return int(c.prefill(program, 0, tokens, table).outputs["tokens"][0])

        def step(tokens: list[int], lengths: list[int], tables: list[list[int]]) -> list[int]:
            inputs = {"tokens": torch.tensor(tokens),
                      "block_table": torch.tensor(tables, dtype=torch.int32)}  # fmt: skip
            r = c.step(program, 0, {"actual_seq_lengths_kv": lengths}, inputs,
                       outputs=["tokens"])  # fmt: skip
            return r.outputs["tokens"].tolist()

        got = run_batching(seqs, NEW, BLOCK, BLOCKS, MAX_BLOCKS, prefill, step)
    for s in seqs:
        assert got[s.sid] == reference(models[program], s.prompt, NEW), f"sequence {s.sid}"


async def test_a_group_of_two_decoding_ahead_gives_transformers_greedy_tokens(
    group: tuple[RunningDaemon, dict],
) -> None:
    d, models = group
    seqs = _sequences(8)
    async with Client(d.endpoint, timeout=120) as c:
        got = await run_ahead(c, "model", seqs, NEW, BLOCK, BLOCKS, MAX_BLOCKS, window=3)
        # the typed sequence operations: the worker keeps the sequence on every rank
        prompt = seqs[1].prompt
        await c.add_sequence("model", 0, 42, prompt, [0])
        tokens = [int((await c.decode("model", 0, [42])).outputs["tokens"][0])
                  for _ in range(NEW - 1)]  # fmt: skip
        assert (await c.free_sequences("model", 0, [42]))["freed"] == [42]
        status = await c.status()
        shard = (await c.worker_status(0))["programs"]["model"]
    for s in seqs:
        assert got[s.sid] == reference(models["model"], s.prompt, NEW), f"sequence {s.sid}"
    assert tokens == reference(models["model"], prompt, NEW)[1:]
    ranks = [(w["device"], w["group"]["rank"], w["state"], w["restarts"])
             for w in status["workers"]]  # fmt: skip
    assert ranks == [(0, 0, "ready", 0), (1, 1, "ready", 0)]
    # the leader's shard: one of the 2 KV heads, the layers' and embedding's all-reduces
    # (2 per layer + 1) and the logits' all-gather captured in each bucket's graph
    assert shard["config"]["tensor_parallel"] == 2
    assert shard["state"]["ops"]["kv_write"]["key"]["shape"] == [2, "n", 1, 16]
    ops = shard["graph_profiles"]["4"]["graph"]["kernels_by_op"]
    assert (ops["hccl all_reduce"], ops["hccl all_gather_into_tensor"]) == (5, 1)
