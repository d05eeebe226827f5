"""The ``model`` program on the step engine (sim, in this process): seeded sampling is
reproducible wherever a sequence runs, bfloat16 against transformers under the policy
of docs/models.md ("Precision"), a sharded checkpoint, and configs that are refused
naming the key. Serving through a daemon, fp32 token for token: tests/daemon/
test_model_serving.py."""

from __future__ import annotations

import ast
import copy
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from daemons import wait_for
from issuer import Issuer
from model_ref import reference, save, tiny_model
from npusim import extensions, torch_npu

from graphlane.protocol import Codec, ops
from graphlane.protocol.errors import NoPreviousToken
from graphlane.workers.backends.npu import NpuBackend
from graphlane.workers.programs import (
    ModelConfig,
    ModelProgram,
    ProgramConfigError,
    StepError,
    load_program,
)
from graphlane.workers.programs.model import PREVIOUS

# The random models are float32, compared token for token with transformers: their fused
# attention in float32 is the sim's extension (the NPU's takes float16 and bfloat16).
pytestmark = pytest.mark.usefixtures("float32_attention")

SERVING = dict(block_size=128, num_blocks=6, max_blocks_per_seq=1, buckets=(1, 2, 4))


class Runner:
    """Prefills and decodes sequences on an engine: one row per sequence, in the order
    given, each with its own block."""

    def __init__(self, eng: Issuer) -> None:
        self.eng = eng

    def prefill(self, prompt: list[int], block: int, params: dict[str, Any]) -> int:
        fields = {"tokens": torch.tensor(prompt), "block_table": torch.tensor([block],
                  dtype=torch.int32), "params": params}  # fmt: skip
        (s,) = self.eng.wait([self.eng.state("model", "prefill", fields)], 60)
        assert s.results is not None
        return int(s.results["tokens"][0])

    def decode(
        self, seqs: list[tuple[list[int], int, dict[str, Any]]], new: int
    ) -> tuple[list[list[int]], list[Any]]:
        """(prompt, block, sampling) per row -> each row's ``new`` tokens, and each
        step's top logprob ids."""
        outs = [[self.prefill(p, b, sp)] for p, b, sp in seqs]
        ids = []
        for _ in range(new - 1):
            lengths = [len(p) + len(o) for (p, _, _), o in zip(seqs, outs, strict=True)]
            params: dict[str, Any] = {"actual_seq_lengths_kv": lengths}
            for key in ("temperature", "top_k", "top_p", "seed"):
                if any(key in sp for _, _, sp in seqs):
                    params[key] = [sp.get(key, d) for _, _, sp in seqs for d in [_DEFAULT[key]]]
            inputs = {
                "tokens": torch.tensor([o[-1] for o in outs]),
                "block_table": torch.tensor([[b] for _, b, _ in seqs], dtype=torch.int32),
            }
            step = self.eng.step(len(seqs), lengths, inputs=inputs, program="model",
                                 params=params, outputs=("tokens", "logprob_ids"))  # fmt: skip
            (s,) = self.eng.wait([step], 60)
            assert s.results is not None
            for o, t in zip(outs, s.results["tokens"].tolist(), strict=True):
                o.append(t)
            ids.append(s.results["logprob_ids"])
        return outs, ids


_DEFAULT = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}


def _engine(program: ModelProgram) -> Issuer:
    return Issuer(NpuBackend(torch_npu, 0), [program])


def _random_program(**over: Any) -> ModelProgram:
    arch = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}  # fmt: skip
    return ModelProgram(ModelConfig(random=arch, seed=5, init_std=0.3, **SERVING, **over))


def test_seeded_sampling_is_the_same_in_any_batch_row_and_differs_by_seed() -> None:
    prompt = [7, 100, 3, 55]
    hot = {"temperature": 1.5, "top_p": 0.95, "seed": 1234}
    with _engine(_random_program()) as eng:
        r = Runner(eng)
        (alone,), _ = r.decode([(prompt, 0, hot)], 12)
        # Third of three rows (bucket 4, a padding row), beside greedy and other seeds.
        rows, _ = r.decode(
            [([9, 9], 1, {}), ([1, 2, 3], 2, {"temperature": 1.0, "seed": 7}), (prompt, 3, hot)],
            12,
        )
        assert rows[2] == alone
        (other,), _ = r.decode([(prompt, 4, {**hot, "seed": 99})], 12)
        assert other != alone
        (greedy,), _ = r.decode([(prompt, 5, {})], 12)
        (top1,), _ = r.decode([(prompt, 0, {"temperature": 3.0, "top_k": 1, "seed": 5})], 12)
        assert top1 == greedy  # top_k 1 leaves the argmax only
        (top3,), ids = r.decode([(prompt, 1, {"temperature": 5.0, "top_k": 3, "seed": 8})], 12)
        for token, best in zip(top3[1:], ids, strict=True):
            assert token in best[0, :3].tolist()  # K of the logprobs is 5 >= 3


def test_bfloat16_follows_transformers_up_to_a_near_tie(tmp_path: Path) -> None:
    """docs/models.md, "Precision": tokens agree until transformers' own logits of the
    two differing tokens are within 8 * 2**-8 of the logit scale, or ours is the token
    float32 picks there; nothing after. And ours agree with float32 at least as long as
    transformers' bfloat16 tokens do."""
    model = tiny_model("llama", seed=11, dtype=torch.bfloat16)
    program = ModelProgram(ModelConfig(model=save(model, tmp_path / "m"), **SERVING))
    assert program.config.dtype == "bfloat16"  # the checkpoint's own
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 20, 41)]
    new = 32
    with _engine(program) as eng:
        got, _ = Runner(eng).decode([(p, i, {}) for i, p in enumerate(prompts)], new)
    ours_exact = theirs_exact = 0
    exact_model = copy.deepcopy(model).float()
    for prompt, ours in zip(prompts, got, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
        theirs = ref.sequences[0, len(prompt) :].tolist()
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), new)
        exact_tokens = reference(exact_model, prompt, new)
        ours_exact += _agreed(ours, exact_tokens)
        theirs_exact += _agreed(theirs, exact_tokens)
        if first < new:
            logits = ref.logits[first][0].float()
            scale = float(logits.abs().max())
            gap = float(logits[theirs[first]] - logits[ours[first]])
            # Or ours is the token exact (float32) arithmetic picks from the same context:
            # the fused kernels round once where transformers' bfloat16 path rounds at
            # every op, so a bfloat16 rounding of transformers' decided the difference.
            with torch.no_grad():
                context = torch.tensor([prompt + theirs[:first]])
                exact = exact_model(context).logits[0, -1]
            assert 0 <= gap <= 8 * 2**-8 * scale or int(exact.argmax()) == ours[first], (
                first, gap, scale,
            )  # fmt: skip
    # Rounding once per fused op, ours is no further from exact arithmetic than
    # transformers' own bfloat16 (tokens in agreement with float32, before the first
    # difference).
    assert ours_exact >= theirs_exact, (ours_exact, theirs_exact)


def _agreed(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def test_a_mistral_without_a_window_gives_transformers_greedy_tokens(tmp_path: Path) -> None:
    model = tiny_model("mistral", seed=6)
    program = ModelProgram(ModelConfig(model=save(model, tmp_path / "m"), dtype="float32",
                                       **SERVING))  # fmt: skip
    prompts = [[5, 6, 7], [200, 1, 2, 3, 4, 90, 17]]
    with extensions.enabled("float32_attention"), _engine(program) as eng:
        got, _ = Runner(eng).decode([(p, i, {}) for i, p in enumerate(prompts)], 24)
    assert got == [reference(model, p, 24) for p in prompts]


def test_a_sharded_checkpoint_gives_transformers_greedy_tokens(tmp_path: Path) -> None:
    model = tiny_model("qwen2", seed=4)
    model.save_pretrained(tmp_path / "m", max_shard_size="60KB")
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    program = ModelProgram(ModelConfig(model=str(tmp_path / "m"), dtype="float32", **SERVING))
    prompt = [5, 6, 7, 8, 9, 10]
    with extensions.enabled("float32_attention"), _engine(program) as eng:  # a reference
        (ours,), _ = Runner(eng).decode([(prompt, 2, {})], 16)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16,
                             do_sample=False)  # fmt: skip
    assert ours == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"model_type": "deepseek_v3"}, "model_type"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_local_experts": 8}, "num_local_experts"),
        ({"vocab_size": 0}, "vocab_size"),
    ],
)
def test_an_architecture_that_is_not_served_is_refused_naming_the_key(
    change: dict[str, Any], key: str
) -> None:
    arch = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}  # fmt: skip
    with pytest.raises(ProgramConfigError) as err:
        load_program("model", {"name": "model", "random": arch | change})
    assert err.value.key.endswith(key)


def test_config_mistakes_are_refused_at_the_edge(tmp_path: Path) -> None:
    with pytest.raises(ProgramConfigError) as err:
        load_program("model", {"name": "model"})
    assert err.value.key == "programs.model.model"
    with pytest.raises(ProgramConfigError) as err:
        load_program("model", {"name": "model", "model": str(tmp_path)})
    assert err.value.key == "programs.model.model"  # no config.json
    model = tiny_model("llama", seed=1)
    path = save(model, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(ProgramConfigError) as err:
        load_program("model", {"name": "model", "model": path})
    assert "safetensors" in str(err.value)


def test_a_checkpoint_without_a_tensor_is_refused_naming_it(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = save(tiny_model("llama", seed=1), tmp_path / "m")
    tensors = load_file(f"{path}/model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f"{path}/model.safetensors")
    program = ModelProgram(ModelConfig(model=path, **SERVING))
    with pytest.raises(ProgramConfigError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        program.allocate(NpuBackend(torch_npu, 0), 1)


def test_steps_and_prefills_that_cannot_run_name_the_field() -> None:
    program = _random_program()
    table = torch.zeros(1, 1, dtype=torch.int32)
    ok = {"tokens": torch.tensor([1]), "block_table": table}
    cases = [
        ({"actual_seq_lengths_kv": [129]}, ok, "params.actual_seq_lengths_kv[0]"),
        ({"actual_seq_lengths_kv": [3], "temperature": [-1.0]}, ok, "params.temperature[0]"),
        ({"actual_seq_lengths_kv": [3], "seed": [0.5]}, ok, "params.seed[0]"),
        ({"actual_seq_lengths_kv": [3]}, {**ok, "tokens": torch.tensor([-1])}, "inputs.tokens"),
        ({"actual_seq_lengths_kv": [3, 3], "sequence_id": [4, 4]},
         {"tokens": torch.tensor([1, 2]), "block_table": torch.tensor([[0], [1]],
          dtype=torch.int32)}, "params.sequence_id"),
        ({"actual_seq_lengths_kv": [3], "sequence_id": ["a"]}, ok, "params.sequence_id[0]"),
        ({"actual_seq_lengths_kv": [3]}, {**ok, "block_table": table + 6},
         "inputs.block_table[0]"),
        ({"actual_seq_lengths_kv": [3, 3]},
         {"tokens": torch.tensor([1, 2]), "block_table": torch.zeros(2, 1, dtype=torch.int32)},
         "inputs.block_table"),
    ]  # fmt: skip
    for params, inputs, field in cases:
        with pytest.raises(StepError) as err:
            program.plan(len(params["actual_seq_lengths_kv"]), params, inputs)
        assert err.value.field == field
    prompt = {"tokens": torch.tensor([1, 2]), "block_table": torch.tensor([0], dtype=torch.int32)}
    for fields, field in [
        ({**prompt, "start": 127}, "tokens"),
        ({**prompt, "block_table": torch.tensor([6], dtype=torch.int32)}, "block_table"),
        ({**prompt, "outputs": ["out"]}, "outputs"),
        ({**prompt, "params": {"top_k": [1]}}, "params.top_k"),
        ({**prompt, "params": {"sequence_id": 1.5}}, "params.sequence_id"),
    ]:
        with pytest.raises(StepError) as err:
            program.plan_state("prefill", fields)
        assert err.value.field == field


def _ahead_step(eng: Issuer, rows: list[tuple[int, int, int]], block_width: int = 1) -> Any:
    """Issue (not wait for) a greedy step of rows (sequence id, length, block), each
    fed the token its sequence sampled in its previous step."""
    params = {"actual_seq_lengths_kv": [n for _, n, _ in rows],
              "sequence_id": [sid for sid, _, _ in rows]}  # fmt: skip
    inputs = {
        "tokens": torch.full((len(rows),), PREVIOUS),
        "block_table": torch.tensor([[b] * block_width for _, _, b in rows], dtype=torch.int32),
    }
    return eng.step(len(rows), params["actual_seq_lengths_kv"], inputs=inputs, program="model",
                    params=params, outputs=("tokens",))  # fmt: skip


def _prefill_ahead(eng: Issuer, sid: int, prompt: list[int], block: int) -> Any:
    fields = {"tokens": torch.tensor(prompt), "block_table": torch.tensor([block],
              dtype=torch.int32), "params": {"sequence_id": sid}}  # fmt: skip
    return eng.state("model", "prefill", fields)


def test_decoding_ahead_feeds_every_row_its_previous_token_on_the_device() -> None:
    """Every step is issued before any reply is read: rows joining (fed the token their
    prefill sampled), leaving, in a new order each step (the copies from the previous
    step's rows are not one run), across the two instances of a bucket and across
    buckets. The tokens are those of steps that were sent each token. A dropped fence
    is a race the sim reports; a dropped feed gives other tokens."""
    prompts = {10: [7, 100, 3, 55], 11: [9, 9], 12: list(range(30, 60)), 13: [200]}
    blocks = {10: 0, 11: 1, 12: 2, 13: 3}
    joins, leaves = {10: 0, 11: 0, 12: 2, 13: 5}, {10: 9, 11: 4, 12: 10, 13: 10}
    program = _random_program()
    with Issuer(NpuBackend(torch_npu, 0), [program], depth=2) as eng:
        runner = Runner(eng)
        expected = {}
        for sid, prompt in prompts.items():  # explicit tokens, one step at a time
            (out,), _ = runner.decode([(prompt, blocks[sid], {})], leaves[sid] - joins[sid] + 1)
            expected[sid] = out
        issued: list[tuple[Any, list[int]]] = []
        firsts = {}
        rng = random.Random(3)
        length = {sid: len(p) for sid, p in prompts.items()}
        for t in range(11):
            for sid in prompts:
                if joins[sid] == t:
                    firsts[sid] = _prefill_ahead(eng, sid, prompts[sid], blocks[sid])
            rows = [sid for sid in prompts if joins[sid] <= t < leaves[sid]]
            rng.shuffle(rows)
            if rows:
                for sid in rows:
                    length[sid] += 1
                step = _ahead_step(eng, [(sid, length[sid], blocks[sid]) for sid in rows])
                issued.append((step, rows))
        eng.wait(list(firsts.values()) + [s for s, _ in issued], 120)
        got = {sid: [int(s.results["tokens"][0])] for sid, s in firsts.items()}
        for step, rows in issued:
            for sid, token in zip(rows, step.results["tokens"].tolist(), strict=True):
                got[sid].append(token)
        assert {sid for step, _ in issued for sid in [step.graph.key.instance]} == {0, 1}
        assert {step.plan.bucket for step, _ in issued} == {2, 4}
    assert got == expected


def test_a_row_with_no_token_to_feed_is_refused_never_fed_a_stale_one() -> None:
    program = _random_program()

    def refused(step: Any) -> bool:
        wait_for(lambda: step.error is not None or step.results is not None, 60, "the step")
        return isinstance(step.error, NoPreviousToken)

    with Issuer(NpuBackend(torch_npu, 0), [program], depth=2) as eng:
        runner = Runner(eng)
        (expected,), _ = runner.decode([([5, 6, 7], 0, {})], 4)
        first = _prefill_ahead(eng, 1, [5, 6, 7], 0)
        assert refused(_ahead_step(eng, [(99, 4, 1)]))  # never seen on this worker
        assert refused(_ahead_step(eng, [(1, 5, 0)]))  # its length-4 step was not sent
        # Refused for another row's sake: sequence 1's length-4 step did not run, so its
        # length-5 row has no token either (the prefill's would be stale).
        assert refused(_ahead_step(eng, [(1, 4, 0), (99, 4, 1)]))
        assert refused(_ahead_step(eng, [(1, 5, 0)]))
        steps = [_ahead_step(eng, [(1, 4, 0)]), _ahead_step(eng, [(1, 5, 0)])]
        # Its token outlives the instance of its last step running other steps (bucket 1
        # has two: two steps without it): the worker keeps a copy of its own.
        other = {"tokens": torch.tensor([3]), "block_table": torch.tensor([[1]], dtype=torch.int32)}
        for n in (2, 3):
            eng.step(1, [n], inputs=other, program="model", params={"actual_seq_lengths_kv": [n]},
                     outputs=("tokens",))  # fmt: skip
        steps.append(_ahead_step(eng, [(1, 6, 0)]))
        eng.wait([first, *steps], 60)
        got = [int(first.results["tokens"][0])] + [int(s.results["tokens"][0]) for s in steps]
        assert got == expected[:4]
        # A row that sends its token itself starts the sequence again.
        resent = {"tokens": torch.tensor(expected[2:3]), "block_table": torch.tensor([[0]],
                  dtype=torch.int32)}  # fmt: skip
        params = {"actual_seq_lengths_kv": [6], "sequence_id": [1]}
        eng.step(1, [6], inputs=resent, program="model", params=params, outputs=("tokens",))
        (last,) = eng.wait([_ahead_step(eng, [(1, 7, 0)])], 60)
        assert last.error is None


def _step_frames(program: ModelProgram, context: int) -> tuple[int, int]:
    """(request bytes, reply bytes) of one decode step of two rows at ``context`` tokens,
    the request as a scheduler sends it and the reply the worker's step gives, tokens
    only, both through the codec."""
    codec = Codec()
    with _engine(program) as eng:
        r = Runner(eng)
        blocks = [0, 1]
        firsts = [r.prefill(list(range(1, context)), b, {}) for b in blocks]
        lengths = [context, context]
        table = torch.tensor([[b] for b in blocks], dtype=torch.int32)
        inputs = {"tokens": torch.tensor(firsts), "block_table": table}
        params = {"actual_seq_lengths_kv": lengths}
        body = ops.Step("model", 0, params, inputs, outputs=["tokens"], generation=1)
        request = sum(len(f) for f in codec.encode_request(7, "step", body))
        (s,) = eng.wait([eng.step(2, lengths, inputs=inputs, program="model",
                                  params=params, outputs=("tokens",))], 60)  # fmt: skip
        assert s.results is not None and set(s.results) == {"tokens"}
        reply = ops.DeviceResult(outputs=dict(s.results), bucket=2, generation=1)
        return request, sum(len(f) for f in codec.encode_reply(7, reply))


def test_a_steps_bytes_grow_neither_with_the_context_nor_with_the_vocabulary() -> None:
    """A decode step carries token ids, block tables and lengths and returns the sampled
    tokens: 4 or 120 tokens of context, a vocabulary of 256 or 4096, the same bytes (up
    to msgpack's wider integers for the longer lengths)."""
    small = _step_frames(_random_program(), 4)
    long_context = _step_frames(_random_program(), 120)
    big_vocab_arch = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 64,
                      "intermediate_size": 128, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    big_vocab = _step_frames(
        ModelProgram(ModelConfig(random=big_vocab_arch, seed=5, init_std=0.3, **SERVING)), 4
    )
    assert abs(long_context[0] - small[0]) <= 4 and long_context[1] == small[1]
    assert big_vocab == small


# vllm-ascend's Llama/Qwen2 decode layer on Atlas A2: npu_add_rms_norm, the QKV matmul,
# query.contiguous() and key.contiguous() (copies of the split's views: no-ops for one
# token), _npu_rotary_embedding, _npu_reshape_and_cache, FIA, the output matmul,
# npu_add_rms_norm, the gate/up matmul, npu_swiglu, the down matmul.
FIELD_LAYER = {1: 10, 4: 12}  # device tasks per layer, by tokens in the step


def _profiles(layers: int, bucket: int) -> dict[str, Any]:
    from graphlane.workers.backends.sim import SimBackend

    arch = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4,
            "num_key_value_heads": 2}  # fmt: skip
    config = ModelConfig(random=arch, seed=5, init_std=0.3, block_size=128, num_blocks=4,
                         max_blocks_per_seq=1, buckets=(bucket,))  # fmt: skip
    with Issuer(SimBackend(0), [ModelProgram(config)]) as eng:
        profile = eng.engine.graph_profiles("model")[str(bucket)]
    return dict(profile)


@pytest.mark.parametrize("bucket", [1, 4])
def test_each_layer_is_the_fields_and_no_graph_runs_an_ai_cpu_task(bucket: int) -> None:
    one, two = _profiles(1, bucket), _profiles(2, bucket)
    for p in (one, two):
        graphs = [p["graph"], *p["tails"].values()]
        assert all(g["aicpu"] == 0 and g["host_syncs"] == 0 for g in graphs), p
    per_layer = two["graph"]["kernels"] - one["graph"]["kernels"]
    assert per_layer <= FIELD_LAYER[bucket] + 1, two["graph"]["kernels_by_op"]
    # The decode graph itself ends with one argmax: an all-greedy step runs no sampler.
    ops_ = two["graph"]["kernels_by_op"]
    assert sum(n for op, n in ops_.items() if op.startswith("argmax")) == 1
    assert not {"sort", "topk", "_softmax", "cumsum", "_log_softmax"} & {
        op.split(".")[0] for op in ops_
    }
    assert "sort" not in {op.split(".")[0] for op in two["tails"]["candidates"]["kernels_by_op"]}


def test_sequence_operations_refuse_what_the_record_cannot_serve_and_are_per_client() -> None:
    """add / decode / append_blocks / free on the host record (no device): each refusal
    names its field, and one client's ids are not another's."""
    arch = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}  # fmt: skip
    program = ModelProgram(ModelConfig(random=arch, **{**SERVING, "max_blocks_per_seq": 2}))

    def refused(op: str, fields: dict[str, Any], owner: Any, where: str) -> None:
        with pytest.raises(StepError) as err:
            if op in ("add", "decode"):
                program.plan_sequences(op, fields, owner)
            else:
                program.sequence_change(op, fields, owner)
        assert str(err.value).startswith(where), str(err.value)

    def add(sid: int, n: int, blocks: list[int], owner: Any = "a") -> None:
        program.plan_sequences("add", {"sequence": sid, "tokens": torch.arange(n),
                                       "blocks": blocks}, owner)  # fmt: skip

    add(1, 127, [0])
    refused("add", {"sequence": 1, "tokens": torch.arange(3), "blocks": [1]}, "a", "sequence")
    refused("add", {"sequence": 2, "tokens": torch.arange(3), "blocks": [6]}, "a", "blocks")
    refused("add", {"sequence": 2, "tokens": torch.arange(3), "blocks": [1, 2, 3]}, "a", "blocks")
    # a prompt longer than its blocks, or than any sequence: named as the add's own fields
    refused("add", {"sequence": 2, "tokens": torch.arange(200), "blocks": [1]}, "a",
            "blocks: a prompt of 200 tokens needs 2 blocks")  # fmt: skip
    refused("add", {"sequence": 2, "tokens": torch.arange(300) % 200, "blocks": [1, 2]}, "a",
            "tokens: a prompt of 300 tokens is longer than 256")  # fmt: skip
    refused("decode", {"sequences": [1]}, "b", "sequences[0]")  # another client's id
    refused("decode", {"sequences": [1, 1]}, "a", "sequences")
    largest = program.buckets[-1]
    refused("decode", {"sequences": list(range(largest + 1))}, "a",
            f"sequences: {largest + 1} sequences, more than the largest")  # fmt: skip
    refused("decode", {"sequences": [1], "new_blocks": {3: [1]}}, "a", "new_blocks.3")
    plan = program.plan_sequences("decode", {"sequences": [1]}, "a")  # token 128: block 0
    # its row's token and block table come from the persistent batch: none on the host
    assert plan.values["lengths"][0] == 128 and "block_table" not in plan.inputs
    # one host tensor: each row's (token, position, slot), then its row in the batch
    assert plan.inputs.keys() == {"ints_rows"} and plan.bucket == 1
    assert plan.inputs["ints_rows"].tolist() == [0, 127, 127, plan.values["decoded"][0].row]
    refused("decode", {"sequences": [1]}, "a", "sequences[0]")  # token 129: no block
    refused("append_blocks", {"sequence": 1, "blocks": [9]}, "a", "blocks")
    assert program.sequence_change("append_blocks", {"sequence": 1, "blocks": [4]}, "a") == {
        "blocks": 2
    }
    plan = program.plan_sequences("decode", {"sequences": [1]}, "a")
    assert int(plan.inputs["ints_rows"][2]) == 4 * 128  # token 129's slot: block 4's first
    add(1, 5, [2], owner="b")  # b's sequence 1 is its own
    assert program.sequence_change("free", {"sequences": [1, 7]}, "b") == {"freed": [1]}
    refused("decode", {"sequences": [1]}, "b", "sequences[0]")
    assert program.plan_sequences("decode", {"sequences": [1]}, "a").values["lengths"][0] == 130


def test_an_adds_parameter_error_lists_exactly_the_parameters_an_add_takes() -> None:
    """An add names its sequence in its field ``sequence``: its refusal of an unknown
    parameter lists what it takes (no ``sequence_id``, which its prefill takes), and it
    takes every parameter it lists."""
    arch = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2}  # fmt: skip
    program = ModelProgram(ModelConfig(random=arch, **SERVING))

    def add(sid: int, params: dict[str, Any]) -> None:
        program.plan_sequences("add", {"sequence": sid, "tokens": torch.arange(3),
                                       "blocks": [sid], "params": params}, "a")  # fmt: skip

    listed: list[list[str]] = []
    messages = []
    for key in ("sequence_id", "temprature"):
        with pytest.raises(StepError) as err:
            add(0, {key: 1})
        assert err.value.field == f"params.{key}"
        messages.append(str(err.value))
        listed.append(ast.literal_eval(re.search(r"known: (\[[^]]*\])", messages[-1])[1]))
    assert listed[0] == listed[1] and "sequence_id" not in listed[0]
    assert "its field sequence" in messages[0]  # where the sequence's id goes
    value = {"temperature": 0.5, "top_k": 3, "top_p": 0.9, "seed": 7}
    for sid, key in enumerate(listed[0]):
        add(sid, {key: value[key]})  # each one listed is taken


def test_added_sequences_are_capped_per_client_and_in_all_and_go_with_their_client(
    monkeypatch: Any,
) -> None:
    """No client adds sequences without end (docs/models.md, "Whose sequence"): past
    max_sequences_per_client its add is BAD_REQUEST, past max_sequences (all clients) BUSY;
    release (its client went) frees them and their blocks. Past CLIENTS clients of
    step/prefill sequence_id, the least recently active one's last tokens go, never the
    sequences a client added."""
    from graphlane.protocol.errors import Busy
    from graphlane.workers.programs import model as model_module

    monkeypatch.setattr(model_module, "CLIENTS", 2)
    arch = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}  # fmt: skip
    caps = dict(max_sequences=3, max_sequences_per_client=2)
    program = ModelProgram(ModelConfig(random=arch, **SERVING, **caps))

    def add(owner: str, sid: int = 1, block: int | None = None) -> None:  # as the engine does
        blocks = [sid if block is None else block]
        plan = program.plan_sequences("add", {"sequence": sid, "tokens": torch.arange(3),
                                              "blocks": blocks}, owner)  # fmt: skip
        program._prefilled = torch.zeros(1, dtype=torch.int64)
        program.issued(plan, None, None, owner)

    add("a", 1)
    add("a", 2)
    with pytest.raises(StepError, match="max_sequences_per_client"):
        add("a", 3)
    add("b", 1, block=3)
    with pytest.raises(Busy, match="max_sequences"):
        add("c", 1, block=4)
    counts = {"clients": 2, "sequences": 3, "blocks_held": 3, "blocks_free": 3}
    assert program.sequence_counts() == counts
    # step-path clients come and go past CLIENTS; a's and b's added sequences stay
    for owner in ("x", "y", "z"):  # a prefill naming sequence_id 1
        plan = program.plan_state("prefill", {
            "tokens": torch.arange(3), "block_table": torch.tensor([5], dtype=torch.int32),
            "params": {"sequence_id": 1}})  # fmt: skip
        program._prefilled = torch.zeros(1, dtype=torch.int64)
        program.issued(plan, None, None, owner)
    assert "x" not in program._clients and "z" in program._clients
    assert {"a", "b"} <= set(program._clients) and set(program._sequences) == {"a", "b"}
    assert program.plan_sequences("decode", {"sequences": [1]}, "b").values["lengths"][0] == 4
    assert program.release("a") == 2 and program.release("a") == 0
    assert program.sequence_counts()["blocks_free"] == 5
    # a client that freed every sequence it added, still connected, holds none: not counted
    monkeypatch.setattr(model_module, "CLIENTS", 10)  # (none forgotten for d's arrival)
    before = program.sequence_counts()["clients"]
    add("d", 1, block=0)
    assert program.sequence_counts()["clients"] == before + 1
    assert program.sequence_change("free", {"sequences": [1]}, "d") == {"freed": [1]}
    assert program.sequence_counts()["clients"] == before
    add("c", 1, block=4)  # room again
    with pytest.raises(StepError, match="not one this client added"):
        program.plan_sequences("decode", {"sequences": [1]}, "a")
