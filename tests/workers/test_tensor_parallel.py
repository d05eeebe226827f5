"""The ``model`` program split over 2 and 4 ranks (``tensor_parallel``), one process per
rank on its own sim device, the collectives in its captured graphs: token for token
as transformers' greedy ``generate``, decoding ahead off and on, on every rank; and the
config's refusals. The ranks run ``tp_ranks.py``; every process is killed if a run
fails or times out."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from model_ref import reference, save

from graphlane.hf_model import ModelSpec, random_weights
from graphlane.workers.programs import ModelConfig, ModelProgram, ProgramConfigError, StepError
from graphlane.workers.programs.parallel import Shard, random_shard, shard_weights

RANKS = Path(__file__).with_name("tp_ranks.py")
PROMPTS = [[5, 6, 7, 8], [150, 1, 2, 3, 4, 90, 17]]
NEW = 6
# 8 query heads of 16 (hidden 128); vocab 200, padded to 256 over the ranks (the last
# rank's part is mostly padding)
ARCH = dict(vocab_size=200, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=8, max_position_embeddings=512, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)  # fmt: skip


def _model(kind: str, seed: int) -> Any:
    """Llama: 2 KV heads (replicated at TP 4), biases on attention and MLP (o and down:
    row-parallel biases), llama3 rope, untied. Qwen2: 4 KV heads, q/k/v bias, tied."""
    from model_ref import LLAMA3_ROPE
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "llama":
        config = LlamaConfig(**ARCH, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
                             rope_parameters=LLAMA3_ROPE)  # fmt: skip
        model = LlamaForCausalLM(config)
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**ARCH, num_key_value_heads=4,
                                             tie_word_embeddings=True))  # fmt: skip
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.1 if "norm" in name else 0.3
            p.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn(p.shape, generator=g))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each model's directory and transformers' greedy tokens for each prompt."""
    out = {}
    for kind, seed in (("llama", 3), ("qwen2", 8)):
        model = _model(kind, seed)
        path = save(model, tmp_path_factory.mktemp(kind))
        out[kind] = {"path": path, "want": [reference(model, p, NEW) for p in PROMPTS]}
    return out


def run_ranks(world: int, models: dict[str, Any], timeout: float = 120) -> list[Any]:
    """Each rank's lines (tp_ranks.py forks the ranks from one process, killed with
    its ranks, a process group of its own, if the run fails or times out)."""
    job = {"models": [{"name": k, "path": v["path"]} for k, v in models.items()],
           "prompts": PROMPTS, "new": NEW}  # fmt: skip
    env = {**os.environ, "NPUSIM_WATCHDOG_S": "20"}
    with socket.socket() as sock:  # a free port for rank 0's TCP store
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    init = f"tcp://127.0.0.1:{port}"
    argv = [sys.executable, str(RANKS), str(world), init, json.dumps(job)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, start_new_session=True)  # fmt: skip
    try:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"the ranks exited with {p.returncode}:\n{err[-3000:]}"
        return [json.loads(line) for line in out.strip().splitlines()]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_generates_transformers_greedy_tokens(
    world: int, models: dict[str, Any]
) -> None:
    lines = run_ranks(world, models)
    assert len(lines) == world * len(models) * 3
    sampled: dict[str, list[Any]] = {}
    for r in lines:
        assert r["leader"] == (r["rank"] == 0) and r["tp_size"] == world
        # in the decode graph: o and down per layer (2 layers), the embedding; the logits
        assert r["collectives"] == {"hccl all_reduce": 5, "hccl all_gather_into_tensor": 1}
        if r["mode"] == "sampled":  # the same draw on every rank
            sampled.setdefault(r["model"], []).append(r["tokens"])
            continue
        assert r["tokens"] == models[r["model"]]["want"], r
    for model, tokens in sampled.items():
        assert len(tokens) == world and all(t == tokens[0] for t in tokens), model
        assert tokens[0] != models[model]["want"]  # it did sample
    # each rank's cache holds its KV heads only: llama's 2 split at TP 2, replicated at
    # TP 4 (one each); qwen2's 4 split
    kv = {(r["model"], r["rank"]): r["kv_heads"] for r in lines}
    want_kv = {"llama": max(1, 2 // world), "qwen2": 4 // world}
    assert all(n == want_kv[m] for (m, _), n in kv.items())
    cache = {r["model"]: r["cache"] for r in lines}
    assert cache["qwen2"][-1] == (4 // world) * 16  # [blocks, block_size, kv_heads * D]


# ---------------------------------------------------------------- config and shards
def _spec(**over: Any) -> dict[str, Any]:
    return {"model_type": "llama", "vocab_size": 200, "hidden_size": 128,
            "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 8,
            "num_key_value_heads": 2, **over}  # fmt: skip


@pytest.mark.parametrize(
    ("n", "over", "says"),
    [
        (3, {}, "divide num_attention_heads 8"),
        (2, {"intermediate_size": 129}, "divide intermediate_size 129"),
        (4, {"num_attention_heads": 12, "num_key_value_heads": 3}, "replicate num_key"),
        (2, {"num_attention_heads": 6, "num_key_value_heads": 3}, "divide num_key_value_heads"),
        (0, {}, "positive integer"),
    ],
)
def test_a_split_the_model_cannot_take_is_refused_naming_tensor_parallel(
    n: int, over: dict[str, Any], says: str
) -> None:
    with pytest.raises(ProgramConfigError) as err:
        ModelConfig(random=_spec(**over), tensor_parallel=n).validated()
    assert err.value.key == "programs.model.tensor_parallel"
    assert says in str(err.value)


def test_tensor_parallel_without_a_process_group_is_refused_at_load() -> None:
    """The config alone is valid (``graphlane config check`` builds the program); the
    group is joined when the weights load, in the worker."""
    program = ModelProgram(ModelConfig(random=_spec(), tensor_parallel=2, block_size=128))
    assert program.tp_size == 2 and program.heads == 4 and program.kv_heads == 1
    assert program.describe()["config"]["tensor_parallel"] == 2
    with pytest.raises(StepError, match=r"^op: kv_write addresses one rank's KV heads"):
        program.plan_state("kv_write", {})
    with pytest.raises(ProgramConfigError) as err:
        _ = program.tp_rank
    assert err.value.key == "programs.model.tensor_parallel"
    assert "init_process_group" in str(err.value)


def test_shards_read_from_the_files_are_the_whole_tensors_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank's part, read slice by slice, is its cut of the whole tensor (the vocab
    padded with zero rows, KV heads replicated past their number); no tensor of a split
    weight is read whole."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    spec = ModelSpec.from_hf(_spec(attention_bias=True), "m")
    full = random_weights(spec, 1, 0.3, torch.float32)
    (tmp_path / "config.json").write_text("{}")
    save_file(full, str(tmp_path / "model.safetensors"))
    whole: list[str] = []
    real = safe_open

    class Spy:
        def __init__(self, *a: Any, **k: Any) -> None:
            self.f = real(*a, **k)

        def __enter__(self) -> Any:
            f = self.f.__enter__()

            class Handle:
                keys = f.keys
                get_slice = f.get_slice

                def get_tensor(self, name: str) -> Any:
                    whole.append(name)
                    return f.get_tensor(name)

            return Handle()

        def __exit__(self, *exc: Any) -> None:
            self.f.__exit__(*exc)

    import safetensors

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    for world in (2, 4):
        parts = [shard_weights(spec, str(tmp_path), torch.float32, Shard(spec, r, world), "m")
                 for r in range(world)]  # fmt: skip
        assert whole == []
        for r, part in enumerate(parts):
            assert set(part) == set(full)
            seeded = random_shard(spec, 1, 0.3, torch.float32, Shard(spec, r, world))
            for name, t in part.items():
                assert torch.equal(t, seeded[name]), name
        q = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(torch.cat([p[q] for p in parts]), full[q])
        o = "model.layers.0.self_attn.o_proj.weight"
        assert torch.equal(torch.cat([p[o] for p in parts], dim=1), full[o])
        bias = "model.layers.0.self_attn.o_proj.bias"  # whole on every rank (rank 0 adds it)
        assert all(torch.equal(p[bias], full[bias]) for p in parts)
        emb = torch.cat([p["model.embed_tokens.weight"] for p in parts])
        assert emb.shape == (256, 128) and torch.equal(emb[:200], full["model.embed_tokens.weight"])
        assert not emb[200:].any()
        if world == 4:  # a vocabulary of 65: padded to 128, parts of 32; rank 3's is past 65
            small = Shard(ModelSpec.from_hf(_spec(vocab_size=65), "m"), 3, 4)
            assert small.vocab_range == (96, 96)
            assert not small.take("model.embed_tokens.weight", torch.ones(65, 128)).any()
        k = "model.layers.0.self_attn.k_proj.weight"
        if world == 4:  # 2 KV heads on 4 ranks: ranks 0, 1 hold head 0; 2, 3 head 1
            assert torch.equal(parts[1][k], full[k][:16]) and torch.equal(parts[2][k], full[k][16:])
        else:
            assert torch.equal(torch.cat([p[k] for p in parts]), full[k])
