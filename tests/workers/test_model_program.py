"""The ``model`` program on the step engine (sim, in this process): seeded sampling is
reproducible wherever a sequence runs, bfloat16 against transformers under the policy
of docs/models.md ("Precision"), a sharded checkpoint, and configs that are refused
naming the key. Serving through a daemon, fp32 token for token: tests/daemon/
test_model_serving.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from issuer import Issuer
from model_ref import save, tiny_model
from npusim import torch_npu

from graphlane.workers.backends.npu import NpuBackend
from graphlane.workers.programs import (
    ModelConfig,
    ModelProgram,
    ProgramConfigError,
    StepError,
    load_program,
)

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
    two differing tokens are within 8 * 2**-8 of the logit scale; nothing after."""
    model = tiny_model("llama", seed=11, dtype=torch.bfloat16)
    program = ModelProgram(ModelConfig(model=save(model, tmp_path / "m"), **SERVING))
    assert program.config.dtype == "bfloat16"  # the checkpoint's own
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 20, 41)]
    new = 32
    with _engine(program) as eng:
        got, _ = Runner(eng).decode([(p, i, {}) for i, p in enumerate(prompts)], new)
    agreed = 0
    for prompt, ours in zip(prompts, got, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
        theirs = ref.sequences[0, len(prompt) :].tolist()
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), new)
        agreed += first
        if first < new:
            logits = ref.logits[first][0].float()
            scale = float(logits.abs().max())
            gap = float(logits[theirs[first]] - logits[ours[first]])
            assert 0 <= gap <= 8 * 2**-8 * scale, (first, gap, scale)
    assert agreed >= len(prompts) * new // 2  # near ties are rare: most tokens agree


def test_a_sharded_checkpoint_gives_transformers_greedy_tokens(tmp_path: Path) -> None:
    model = tiny_model("qwen2", seed=4)
    model.save_pretrained(tmp_path / "m", max_shard_size="60KB")
    assert (tmp_path / "m" / "model.safetensors.index.json").exists()
    program = ModelProgram(ModelConfig(model=str(tmp_path / "m"), **SERVING))
    prompt = [5, 6, 7, 8, 9, 10]
    with _engine(program) as eng:
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
    ]:
        with pytest.raises(StepError) as err:
            program.plan_state("prefill", fields)
        assert err.value.field == field
