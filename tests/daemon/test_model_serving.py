"""The ``model`` program served by a daemon, token for token as transformers' eager
``generate``: tiny Llama (GQA, llama3 rope scaling, untied) and Qwen2 (q/k/v bias, tied)
models with seeded weights saved to a directory the daemon loads, fp32, five sequences
of different prompt lengths (one over a block, prefilled in chunks) joining and leaving
a continuously batched decode, 64 new tokens each. One daemon serves both models (the
second under its module path: a daemon names each program once)."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest
import torch
from model_ref import Sequence, reference, run_ahead, run_batching, save, tiny_model

from graphlane import GraphlaneError
from graphlane.client import Client, SyncClient

NEW = 64
BLOCK, BLOCKS, MAX_BLOCKS = 128, 10, 2
SERVING = dict(block_size=BLOCK, num_blocks=BLOCKS, max_blocks_per_seq=MAX_BLOCKS,
               buckets=[1, 2, 4], prefill_chunk=48, dtype="float32")  # fmt: skip
QWEN = "graphlane.workers.programs.model:ModelProgram"
PROMPTS = {0: 5, 1: 17, 2: 130, 3: 1, 4: 60}  # sid -> prompt length
JOINS = {0: 0, 1: 0, 2: 9, 3: 30, 4: 66}  # at most 4 at once: buckets 1, 2 and 4 all run


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, str]]:
    root = tmp_path_factory.mktemp("models")
    out = {}
    for program, kind in (("model", "llama"), (QWEN, "qwen2")):
        m = tiny_model(kind, seed=3)
        out[program] = (m, save(m, root / kind))
    return out


@pytest.fixture
def daemon(shared_daemon: Any, models: dict[str, tuple[Any, str]]) -> Any:
    programs = [{"name": p, "model": d, **SERVING} for p, (_, d) in models.items()]
    return shared_daemon(devices=1, programs=programs)


def _sequences(seed: int) -> list[Sequence]:
    g = torch.Generator().manual_seed(seed)
    return [
        Sequence(sid, torch.randint(0, 256, (n,), generator=g).tolist(), JOINS[sid])
        for sid, n in PROMPTS.items()
    ]


@pytest.mark.parametrize("program", ["model", QWEN], ids=["llama", "qwen2"])
def test_continuous_batching_gives_transformers_greedy_tokens(
    daemon: Any, models: dict[str, tuple[Any, str]], program: str
) -> None:
    model = models[program][0]
    seqs = _sequences(7)
    with SyncClient(daemon.endpoint, timeout=60) as c:
        worker = c.hello()["workers"][0]
        # float32 models: their fused attention runs as the sim's extension, said so
        assert worker["sim_extensions"] == ["float32_attention"]
        described = worker["programs"][program]
        assert {"prefill", "kv_write", "kv_read"} <= set(described["state_ops"])
        assert described["config"]["architecture"]["vocab_size"] == 256
        assert described["inputs"]["tokens"] == {"shape": ["batch"], "dtype": "int64"}

        def prefill(tokens: list[int], table: list[int]) -> int:
            r = c.prefill(program, 0, tokens, table)
            assert r.outputs["tokens"].dtype == torch.int64
            return int(r.outputs["tokens"][0])

        def step(tokens: list[int], lengths: list[int], tables: list[list[int]]) -> list[int]:
            inputs = {
                "tokens": torch.tensor(tokens),
                "block_table": torch.tensor(tables, dtype=torch.int32),
            }
            lengths_param = {"actual_seq_lengths_kv": lengths}
            r = c.step(program, 0, lengths_param, inputs, outputs=["tokens"])
            assert set(r.outputs) == {"tokens"}  # nothing else unless asked
            return r.outputs["tokens"].tolist()

        got = run_batching(seqs, NEW, BLOCK, BLOCKS, MAX_BLOCKS, prefill, step)
    for s in seqs:
        assert got[s.sid] == reference(model, s.prompt, NEW), f"sequence {s.sid}"


@pytest.mark.parametrize("program", ["model", QWEN], ids=["llama", "qwen2"])
async def test_decoding_ahead_gives_transformers_greedy_tokens(
    daemon: Any, models: dict[str, tuple[Any, str]], program: str
) -> None:
    """The same sequences as above, every row fed on the device the token its sequence
    sampled in its previous step, each step sent before the replies of the two before it
    (docs/models.md, "Decoding ahead")."""
    model = models[program][0]
    seqs = _sequences(7)
    async with Client(daemon.endpoint, timeout=60) as c:
        got = await run_ahead(c, program, seqs, NEW, BLOCK, BLOCKS, MAX_BLOCKS, window=3)
        status = await c.worker_status(0)
    for s in seqs:
        assert got[s.sid] == reference(model, s.prompt, NEW), f"sequence {s.sid}"
    assert status["failure"] is None


async def test_two_clients_with_the_same_sequence_ids_each_get_their_own_tokens(
    daemon: Any, models: dict[str, tuple[Any, str]]
) -> None:
    """A sequence is the client's that added it (docs/models.md, "Decoding ahead"): two
    schedulers decoding ahead at once on one worker, naming the same sequence ids over
    blocks of their own, each get their own prompts' tokens; a client naming an id only
    the other has added is refused, and the other's sequence goes on unharmed."""
    model = models["model"][0]
    mine = [Sequence(sid, s.prompt, 0) for sid, s in enumerate(_sequences(11)[:2])]
    theirs = [Sequence(sid, s.prompt, 0) for sid, s in enumerate(_sequences(12)[:2])]
    half = BLOCKS // 2
    async with Client(daemon.endpoint, timeout=60) as a, Client(daemon.endpoint, timeout=60) as b:
        got_a, got_b = await asyncio.gather(
            run_ahead(a, "model", mine, NEW, BLOCK, half, MAX_BLOCKS, window=3),
            run_ahead(b, "model", theirs, NEW, BLOCK, half, MAX_BLOCKS, window=3,
                      first_block=half),
        )  # fmt: skip
        for s in mine:
            assert got_a[s.sid] == reference(model, s.prompt, NEW), f"A's sequence {s.sid}"
        for s in theirs:
            assert got_b[s.sid] == reference(model, s.prompt, NEW), f"B's sequence {s.sid}"
        # A adds sequence 7; B cannot advance it by naming its id
        prompt = mine[0].prompt
        table = [0] + [BLOCKS] * (MAX_BLOCKS - 1)
        first = await a.prefill("model", 0, prompt, table, params={"sequence_id": 7})
        ahead = {"actual_seq_lengths_kv": [len(prompt) + 1], "sequence_id": [7]}
        inputs = {"tokens": torch.tensor([-1]),
                  "block_table": torch.tensor([table], dtype=torch.int32)}  # fmt: skip
        with pytest.raises(GraphlaneError) as err:
            await b.step("model", 0, ahead, inputs, outputs=["tokens"])
        assert err.value.code == "NO_PREVIOUS_TOKEN"
        r = await a.step("model", 0, ahead, inputs, outputs=["tokens"])
        want = reference(model, prompt, 2)
        assert [int(first.outputs["tokens"][0]), int(r.outputs["tokens"][0])] == want


async def _decode_sequences(
    c: Client, prompts: dict[int, list[int]], blocks: dict[int, list[int]], window: int = 3,
    as_lists: bool = False,
) -> dict[int, list[int]]:  # fmt: skip
    """The typed sequence operations: add each sequence, then decode them all ahead (up
    to ``window`` requests unanswered), the second block of each given by a decode's
    new_blocks when its length needs it; ``as_lists``: each decode's tokens as a list of
    ints, no tensor. Returns the NEW tokens of each."""
    sent: list[tuple[asyncio.Task[Any], list[int]]] = []

    async def send(coro: Any, sids: list[int]) -> None:
        while sum(not t.done() for t, _ in sent) >= window:
            await asyncio.wait([t for t, _ in sent if not t.done()],
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        task = asyncio.create_task(coro)
        await asyncio.sleep(0)  # tasks start in order: requests go in order
        sent.append((task, sids))

    lengths = {}
    for sid, prompt in prompts.items():
        await send(c.add_sequence("model", 0, sid, prompt, blocks[sid][:1]), [sid])
        lengths[sid] = len(prompt)
    for _ in range(NEW - 1):
        sids = list(prompts)
        more = {s: blocks[s][1:] for s in sids if lengths[s] == BLOCK}  # token BLOCK + 1
        await send(c.decode("model", 0, sids, new_blocks=more, as_lists=as_lists), sids)
        for s in sids:
            lengths[s] += 1
    out: dict[int, list[int]] = {sid: [] for sid in prompts}
    for i, (task, sids) in enumerate(sent):
        tokens = (await task).outputs["tokens"]
        if i >= len(prompts) and as_lists:  # a decode's: a list of Python ints
            assert type(tokens) is list and all(type(t) is int for t in tokens), tokens
        else:
            tokens = tokens.tolist()
        for sid, tok in zip(sids, tokens, strict=True):
            out[sid].append(tok)
    return out


async def test_sequence_operations_keep_each_clients_sequences_on_the_worker(
    daemon: Any, models: dict[str, tuple[Any, str]]
) -> None:
    """add / decode / free (docs/models.md, "Sequences"): the worker keeps each
    sequence's blocks, length and last token; two clients numbering their sequences
    alike, decoding ahead at once, each get transformers' tokens for their own prompts
    (one crosses into its second block through new_blocks); neither can decode or free
    the other's. One of them takes its decodes' tokens as lists (``as_lists``)."""
    model = models["model"][0]
    g = torch.Generator().manual_seed(5)
    prompts_a = {0: torch.randint(0, 256, (100,), generator=g).tolist(),
                 1: torch.randint(0, 256, (9,), generator=g).tolist()}  # fmt: skip
    prompts_b = {0: torch.randint(0, 256, (30,), generator=g).tolist(),
                 1: torch.randint(0, 256, (3,), generator=g).tolist()}  # fmt: skip
    blocks_a = {0: [0, 1], 1: [2, 3]}
    blocks_b = {0: [5, 6], 1: [7, 8]}
    async with Client(daemon.endpoint, timeout=60) as a, Client(daemon.endpoint, timeout=60) as b:
        got_a, got_b = await asyncio.gather(
            _decode_sequences(a, prompts_a, blocks_a),
            _decode_sequences(b, prompts_b, blocks_b, as_lists=True),
        )
        for sid, prompt in prompts_a.items():
            assert got_a[sid] == reference(model, prompt, NEW), f"A's sequence {sid}"
        for sid, prompt in prompts_b.items():
            assert got_b[sid] == reference(model, prompt, NEW), f"B's sequence {sid}"
        assert (await b.free_sequences("model", 0, [0]))["freed"] == [0]  # B's own 0
        with pytest.raises(GraphlaneError) as err:  # B's 0 is gone; A's is not B's
            await b.decode("model", 0, [0])
        assert err.value.code == "BAD_REQUEST" and "not one this client added" in str(err.value)
        # A's sequence 0 goes on, one token more, as transformers
        r = await a.decode("model", 0, [0], as_lists=True)
        want = reference(model, prompts_a[0], NEW + 1)[-1]
        assert r.outputs["tokens"] == [want]
        with pytest.raises(GraphlaneError) as err:
            a.send_decode("model", 0, [1], as_lists=1)  # type: ignore[arg-type]
        assert err.value.code == "BAD_REQUEST" and "as_lists" in str(err.value)
        assert (await a.free_sequences("model", 0, [0, 1, 9]))["freed"] == [0, 1]


def test_logprobs_and_refusals(daemon: Any, models: dict[str, tuple[Any, str]]) -> None:
    """Outputs only when asked, and a bad request names its field (no step runs)."""
    model = models["model"][0]
    prompt = [3, 1, 4, 1, 5]
    with SyncClient(daemon.endpoint, timeout=60) as c:
        r = c.prefill("model", 0, prompt, [9, 0], outputs=["tokens", "logprobs", "logprob_ids"])
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, -1]
        top = torch.topk(torch.log_softmax(logits, -1), 5)
        assert r.outputs["logprob_ids"][0].tolist() == top.indices.tolist()
        torch.testing.assert_close(r.outputs["logprobs"][0], top.values, atol=1e-4, rtol=1e-4)
        assert int(r.outputs["tokens"][0]) == int(top.indices[0])
        table = torch.tensor([[9, 0]], dtype=torch.int32)
        for params, inputs, field in [
            ({"actual_seq_lengths_kv": [6], "top_p": [0.0]}, {}, "top_p"),
            ({"actual_seq_lengths_kv": [6]}, {"tokens": torch.tensor([256])}, "tokens"),
            ({"actual_seq_lengths_kv": [6], "beam": [2]}, {}, "beam"),
        ]:
            sent = {"tokens": torch.tensor([1]), "block_table": table} | inputs
            with pytest.raises(GraphlaneError) as err:
                c.step("model", 0, params, sent, outputs=["tokens"])
            assert err.value.code == "BAD_REQUEST"
            assert field in str(err.value)
        with pytest.raises(GraphlaneError) as err:  # a prefill's unknown params too
            c.prefill("model", 0, prompt, [9, 0], params={"temprature": 1.0})
        assert err.value.code == "BAD_REQUEST" and "temprature" in str(err.value)
        # Out of range but documented: top_k past int64 is off, a tiny temperature 0.01.
        params = {"actual_seq_lengths_kv": [6], "top_k": [2**63], "temperature": [1e-38]}
        sent = {"tokens": torch.tensor([1]), "block_table": table}
        assert c.step("model", 0, params, sent, outputs=["tokens"]).outputs["tokens"].shape == (1,)
        worker = c.hello()["workers"][0]
        assert worker["sim_extensions"] == ["float32_attention"]  # float32: the sim's own
        for profile in worker["programs"]["model"]["graph_profiles"].values():
            graphs = [profile["graph"], *profile["tails"].values()]
            assert all(g["aicpu"] == 0 for g in graphs), profile


def test_a_restarted_worker_answers_state_lost_until_the_prompts_are_prefilled_again(
    start_daemon: Any, models: dict[str, tuple[Any, str]]
) -> None:
    """The cache and the weights die with the worker: no step or prefill after the
    restart runs until the scheduler adopts the new generation; then, prefilled again,
    the sequence goes on with the tokens it would have had."""
    model, path = models["model"]
    d = start_daemon(devices=1, programs=[{"name": "model", "model": path, **SERVING}])
    prompt = [11, 22, 33, 44]
    expected = reference(model, prompt, 4)
    table = torch.tensor([[3, 0]], dtype=torch.int32)

    def decode(c: SyncClient, first: int, steps: int, ahead: bool = False) -> list[int]:
        out = [first]
        for _ in range(steps):
            token = torch.tensor([-1] if ahead else out[-1:])  # -1: decoding ahead
            inputs = {"tokens": token, "block_table": table}
            params = {"actual_seq_lengths_kv": [len(prompt) + len(out)], "sequence_id": [5]}
            r = c.step("model", 0, params, inputs, outputs=["tokens"])
            out += r.outputs["tokens"].tolist()
        return out

    with SyncClient(d.endpoint, timeout=60) as c:
        first = int(c.prefill("model", 0, prompt, table[0]).outputs["tokens"][0])
        assert decode(c, first, 1) == expected[:2]  # sequence 5's token is on the device
        generation = c.generation(0)
        os.kill(c.status()["workers"][0]["pid"], signal.SIGKILL)
        codes: list[str] = []
        while not codes or codes[-1] != "STATE_LOST":
            assert len(codes) < 50, codes
            try:
                c.prefill("model", 0, prompt, table[0])
            except GraphlaneError as exc:
                codes.append(str(exc.code))
                if exc.code == "WORKER_LOST":
                    c.wait_ready(timeout=120)
                continue
            pytest.fail("a prefill after the restart ran on the lost generation")
        assert set(codes) <= {"WORKER_LOST", "STATE_LOST"}
        assert c.reset_state(0) == generation + 1
        # Its next row may not ask for the token it sampled before the restart.
        after = {"actual_seq_lengths_kv": [len(prompt) + 2], "sequence_id": [5]}
        with pytest.raises(GraphlaneError) as err:
            c.step("model", 0, after, {"tokens": torch.tensor([-1]), "block_table": table})
        assert err.value.code == "NO_PREVIOUS_TOKEN"
        again = c.prefill("model", 0, prompt, table[0], params={"sequence_id": 5})
        assert decode(c, int(again.outputs["tokens"][0]), 3, ahead=True) == expected
