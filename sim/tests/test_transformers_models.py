"""transformers' own Llama and Qwen2 forwards on the simulated NPU, unmodified.

Tiny configs (2 layers, hidden 64, vocab 256) with seeded random weights, nothing
downloaded. The forward and ``generate`` run eagerly on the sim and give the CPU's
logits and greedy tokens; one decode step captured with a ``StaticCache`` (its write
position and length are device tensors the step advances) and replayed gives the eager
step's logits, step after step. transformers is an independent reference: these tests
exercise what a real model asks of a device (factories, ``torch.tensor(data,
device=...)``, boolean masks, host reads).
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
import transformers

# transformers 5's StaticCache keeps its write position on the device: a captured decode
# step needs no host read (4.x reads it with .item(), which a capture refuses).
assert int(transformers.__version__.split(".")[0]) >= 5, transformers.__version__

SIZES = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),  # QKV bias
}


class Pair:
    """One model on the CPU and the same weights on the sim."""

    def __init__(self, arch: str) -> None:
        config_cls, model_cls = (getattr(transformers, n) for n in ARCHS[arch])
        self.config = config_cls(**SIZES)
        torch.manual_seed(0)
        self.cpu = model_cls(self.config).eval()
        self.npu = copy.deepcopy(self.cpu).to("npu")
        # the cache argument's name: `cache` since transformers renamed `past_key_values`
        params = inspect.signature(model_cls.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request: pytest.FixtureRequest) -> Pair:
    return Pair(request.param)


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of different lengths, left-padded (the second by 3 tokens)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 256, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :3] = 0
    mask[1, :3] = 0
    return ids, mask


@torch.no_grad()
def test_forward_gives_the_cpu_logits(pair: Pair) -> None:
    ids, mask = _prompts()
    expected = pair.cpu(ids, attention_mask=mask).logits
    got = pair.npu(ids.npu(), attention_mask=mask.npu()).logits
    assert got.device.type == "npu"
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=1e-5)


@torch.no_grad()
def test_generate_gives_the_cpu_greedy_tokens(pair: Pair) -> None:
    ids, mask = _prompts()
    kwargs: dict[str, Any] = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    expected = pair.cpu.generate(ids, attention_mask=mask, **kwargs)
    got = pair.npu.generate(ids.npu(), attention_mask=mask.npu(), **kwargs)
    assert got.shape == expected.shape
    assert got.cpu().tolist() == expected.tolist()


@torch.no_grad()
def test_decode_step_captured_with_a_static_cache_replays_the_eager_logits(pair: Pair) -> None:
    model = pair.npu
    prompt = _prompts()[0][:1].npu()
    graph_cache = transformers.StaticCache(config=pair.config, max_cache_len=32)
    eager_cache = transformers.StaticCache(config=pair.config, max_cache_len=32)
    kw = pair.cache_kw
    first = model(prompt, **{kw: graph_cache}).logits[:, -1:].argmax(-1)  # prefill, eager
    model(prompt, **{kw: eager_cache})

    token = first.clone()  # the graph's static input
    s = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g, stream=s):
        logits = model(token, **{kw: graph_cache}).logits  # nothing runs

    following = first
    for _ in range(3):
        token.copy_(following)
        g.replay()
        expected = model(following, **{kw: eager_cache}).logits
        torch.testing.assert_close(logits.cpu(), expected.cpu(), rtol=0, atol=0)
        following = expected[:, -1:].argmax(-1)
    # the replays advanced the cache as the eager steps did
    assert int(graph_cache.get_seq_length()) == int(eager_cache.get_seq_length()) == 9 + 3
