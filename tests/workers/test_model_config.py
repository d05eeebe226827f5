"""The ``model`` program reads a config.json as transformers does: every key its math
reads, with transformers' own default when the file lacks it; what it cannot serve is
refused naming the key the file has; request parameters out of range are refused or
clamped as documented, never a device error. No device: configs and plans only (and
tiny transformers models for the weight shapes)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from graphlane.hf_model import DEFAULTS, ModelSpec
from graphlane.workers.programs import ModelConfig, ModelProgram, ProgramConfigError, StepError
from graphlane.workers.programs.sampling import MIN_TEMPERATURE

TINY = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
# Keys of transformers' config classes that change nothing a served decode computes.
NO_MATH = {
    "transformers_version",
    "architectures",
    "output_hidden_states",
    "return_dict",
    "dtype",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
    "initializer_range",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "attention_dropout",
    "pretraining_tp",
    "rope_parameters",
}  # fmt: skip  (rope_parameters: read, checked below)


def _hf_config(raw: dict[str, Any]) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
    return cls[raw["model_type"]](**{k: v for k, v in raw.items() if k != "model_type"})


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_every_math_key_of_transformers_config_is_read(model_type: str) -> None:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[model_type]
    # head_dim: Qwen2's modeling reads it too (getattr), though its config has no field
    keys = {f.name for f in dataclasses.fields(cls)} - NO_MATH | {"head_dim"}
    assert keys == set(DEFAULTS[model_type]) - {"rope_theta"}, (
        "transformers' config has keys the spec does not read (or the reverse)"
    )


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
def test_an_absent_key_means_transformers_default(model_type: str) -> None:
    base = {"model_type": model_type, **TINY, "num_key_value_heads": 4}
    if model_type != "llama":  # a window longer than anything served: not refused
        base["sliding_window"] = None
    for key in [*TINY, "rms_norm_eps", "tie_word_embeddings", "head_dim",
                "max_position_embeddings"]:  # fmt: skip
        raw = {k: v for k, v in base.items() if k != key}
        if key in ("num_attention_heads", "num_key_value_heads"):
            # 32 heads (the default), so that any default of kv heads divides them
            raw |= {"hidden_size": 32 * 8, "num_attention_heads": 32}
        ref, spec = _hf_config(raw), ModelSpec.from_hf(raw, "r")
        assert (spec.vocab_size, spec.hidden_size, spec.intermediate_size, spec.num_layers,
                spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps,
                spec.tie_word_embeddings, spec.max_position_embeddings) == (
            ref.vocab_size, ref.hidden_size, ref.intermediate_size, ref.num_hidden_layers,
            ref.num_attention_heads, ref.num_key_value_heads,
            getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads,
            ref.rms_norm_eps, ref.tie_word_embeddings, ref.max_position_embeddings,
        ), key  # fmt: skip


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("llama", {}),
        ("llama", {"attention_bias": True, "mlp_bias": True, "head_dim": 32}),
        ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 5e5}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                },
                "max_position_embeddings": 64,
            },
        ),
        ("qwen2", {"num_key_value_heads": 4, "tie_word_embeddings": True, "mlp_bias": True}),
        ("mistral", {"sliding_window": None, "attention_bias": True, "head_dim": 8}),
    ],
)
def test_weights_and_rope_are_those_transformers_builds(
    model_type: str, extra: dict[str, Any]
) -> None:
    """Keys a model's transformers class ignores (a Mistral's attention_bias, a Qwen2's
    mlp_bias) are ignored; the others shape the weights and the rope as there."""
    from transformers import AutoModelForCausalLM

    raw = {"model_type": model_type, **TINY, **extra}
    spec = ModelSpec.from_hf(raw, "r")
    model = AutoModelForCausalLM.from_config(_hf_config(raw))
    ours = {k: tuple(v) for k, v in spec.weight_shapes().items()}
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items() if "rotary" not in k}
    if spec.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert ours == theirs
    assert torch.equal(spec.inv_freq(), model.model.rotary_emb.inv_freq)


def _random(raw: dict[str, Any], **over: Any) -> ModelConfig:
    return ModelConfig(random=raw, block_size=128, num_blocks=8, **over).validated()


def test_a_sliding_window_is_served_only_where_no_sequence_is_longer() -> None:
    mistral = {"model_type": "mistral", **TINY}
    # No sliding_window key: transformers' default window of 4096 applies.
    with pytest.raises(ProgramConfigError) as err:
        _random(mistral, max_blocks_per_seq=33)  # 4224 tokens
    assert err.value.key == "programs.model.random.sliding_window"
    assert "4096" in str(err.value) and "default" in str(err.value)
    assert _random(mistral, max_blocks_per_seq=32).spec.sliding_window == 4096  # exact: 4096
    assert _random(mistral | {"sliding_window": None}, max_blocks_per_seq=64)
    qwen = {"model_type": "qwen2", **TINY, "use_sliding_window": True, "sliding_window": 256,
            "max_window_layers": 1}  # fmt: skip
    with pytest.raises(ProgramConfigError) as err:
        _random(qwen, max_blocks_per_seq=3)
    assert err.value.key == "programs.model.random.use_sliding_window"
    assert _random(qwen, max_blocks_per_seq=2)
    # Without use_sliding_window, Qwen2's sliding_window (default 4096) is not applied.
    assert _random(qwen | {"use_sliding_window": False}, max_blocks_per_seq=64)
    # Every layer full attention: no window either.
    assert _random(qwen | {"max_window_layers": 2}, max_blocks_per_seq=64)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
        ({"rope_parameters": {"rope_type": "linear"}}, "rope_parameters.factor"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_a_refusal_names_the_key_of_the_file(change: dict[str, Any], key: str) -> None:
    with pytest.raises(ProgramConfigError) as err:
        ModelSpec.from_hf({"model_type": "llama", **TINY, **change}, "programs.model.random")
    assert err.value.key == f"programs.model.random.{key}"


def test_a_qwen2_without_num_key_value_heads_has_transformers_32() -> None:
    raw = {"model_type": "qwen2", **TINY}
    del raw["num_key_value_heads"]
    with pytest.raises(ProgramConfigError) as err:  # 32 kv heads for 4 heads: refused
        ModelSpec.from_hf(raw, "r")
    assert err.value.key == "r.num_key_value_heads" and "default" in str(err.value)
    raw |= {"num_attention_heads": 32, "hidden_size": 256}
    assert ModelSpec.from_hf(raw, "r").num_kv_heads == 32


def _program() -> ModelProgram:
    raw = {"model_type": "llama", **TINY}
    return ModelProgram(
        ModelConfig(random=raw, block_size=128, num_blocks=4, max_blocks_per_seq=1, buckets=(1, 2))
    )


def _step(program: ModelProgram, **params: Any) -> Any:
    inputs = {"tokens": torch.tensor([1]), "block_table": torch.tensor([[0]], dtype=torch.int32)}
    return program.plan(1, {"actual_seq_lengths_kv": [1], **params}, inputs)


def _prefill(program: ModelProgram, **params: Any) -> Any:
    fields = {"tokens": torch.tensor([1, 2]), "block_table": torch.tensor([0], dtype=torch.int32),
              "params": params}  # fmt: skip
    return program.plan_state("prefill", fields)


def test_sampling_parameters_out_of_range_are_refused_or_clamped_as_documented() -> None:
    p = _program()
    # top_k past int64, or past the vocabulary: off (every token kept), not an error.
    for k in (2**63, 2**64 - 1, TINY["vocab_size"]):
        assert _step(p, top_k=[k], temperature=[1.0]).inputs["sampling"][0, 0] == 0
        assert _prefill(p, top_k=k, temperature=1.0).inputs["sampling"][0, 0] == 0
    assert _step(p, top_k=[5], temperature=[1.0]).inputs["sampling"][0, 0] == 5
    # A temperature too small to divide by samples at the documented minimum.
    for t in (1e-38, 5e-324, MIN_TEMPERATURE / 2):
        assert _step(p, temperature=[t]).inputs["floats"][0, 0] == pytest.approx(MIN_TEMPERATURE)
        assert _prefill(p, temperature=t).inputs["temperature"].item() == pytest.approx(
            MIN_TEMPERATURE
        )
    assert _step(p, temperature=[0.0]).inputs["floats"][0, 0] == 0.0
    refused = [("temperature", float("inf")), ("temperature", float("nan")),
               ("temperature", -1.0), ("top_k", -1), ("top_k", 1.5), ("top_p", 0.0),
               ("top_p", 1.5), ("top_p", float("nan")), ("seed", 1.0)]  # fmt: skip
    for key, value in refused:
        with pytest.raises(StepError) as err:
            _step(p, **{key: [value]})
        assert err.value.field == f"params.{key}[0]", (key, value)
        with pytest.raises(StepError) as err:
            _prefill(p, **{key: value})
        assert err.value.field == f"params.{key}", (key, value)


def test_unknown_step_and_prefill_parameters_are_refused_by_name() -> None:
    p = _program()
    with pytest.raises(StepError) as err:
        _step(p, temprature=[1.0])
    assert err.value.field == "params.temprature"
    with pytest.raises(StepError) as err:
        _prefill(p, temprature=1.0)
    assert err.value.field == "params.temprature"
    assert _prefill(p, temperature=1.0, top_k=3, top_p=0.5, seed=2, sequence_id=9)
