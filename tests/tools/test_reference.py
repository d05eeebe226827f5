"""The load test's reference attention (torch SDPA, written in tools) against the
tests' loop reference and the simulated NPU's op (npu_fused_infer_attention_score on
NPU tensors, as the attention program calls it): three implementations that must
agree, so that verification checks the device instead of agreeing with it."""

from __future__ import annotations

import math

import pytest
import torch
from npusim import extensions, torch_npu
from reference import decode_stack

from graphlane.loadtest.attention import reference
from graphlane.loadtest.run import TOLERANCE
from graphlane.workers.programs.attention import AttentionConfig


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4), (8, 1)])
def test_reference_agrees_with_the_loop_reference_and_the_sim_op(
    dtype: str, heads: int, kv_heads: int
) -> None:
    shape = AttentionConfig(
        layers=3, num_heads=heads, num_kv_heads=kv_heads, head_dim=16, max_kv_len=40, dtype=dtype
    )
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    batch, lengths = 5, [1, 40, 7, 0, 23]  # 0: a row with nothing to attend to
    query = torch.randn(batch, heads, 1, 16, generator=gen).to(torch_dtype)
    key = torch.randn(3, batch, kv_heads, 40, 16, generator=gen).to(torch_dtype)
    value = torch.randn(3, batch, kv_heads, 40, 16, generator=gen).to(torch_dtype)

    got = reference(shape, query, key, value, lengths)

    loop = decode_stack(query, list(key), list(value), lengths)
    x = query.npu()
    # float32 fused attention is the sim's exact-reference extension, not the NPU's.
    with extensions.enabled(*(["float32_attention"] if dtype == "float32" else [])):
        for layer in range(shape.layers):
            x, _ = torch_npu.npu_fused_infer_attention_score(
                x, key[layer].npu(), value[layer].npu(), actual_seq_lengths_kv=lengths,
                num_heads=heads, num_key_value_heads=kv_heads, input_layout="BNSD",
                scale=1 / math.sqrt(16),
            )  # fmt: skip
        sim = x.cpu()
    tol = TOLERANCE[torch_dtype]
    assert got.dtype == torch_dtype and got.shape == query.shape
    assert torch.isfinite(got).all()
    assert torch.allclose(got.float(), loop.float(), rtol=tol, atol=tol)
    assert torch.allclose(got.float(), sim.float(), rtol=tol, atol=tol)
    assert got[3].abs().max() == 0  # no key: zeros, as the op gives
