"""The strict torch_npu of the tests (tests/strict_npu) serves the sim's fused ops behind
torch_npu 2.14's schemas: a call as the wheel takes it reaches the sim, a call the wheel
would refuse (an unknown keyword) is refused before it does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

STRICT = Path(__file__).parent / "strict_npu"

PROGRAM = """
import torch, torch_npu
torch_npu.npu.set_device(0)
x, w = torch.randn(2, 64).npu(), torch.randn(64).npu()
y, rstd = torch_npu.npu_rms_norm(x, w, epsilon=1e-5)
y, rstd, s = torch_npu.npu_add_rms_norm(x1=x, x2=x, gamma=w)
assert torch_npu.npu_swiglu(x, dim=-1).shape == (2, 32)
kc = torch.zeros(2, 4, 2, 16).npu()
k = torch.randn(3, 2, 16).npu()
slots = torch.tensor([0, 5, -1], dtype=torch.int32).npu()
torch_npu.npu_scatter_pa_kv_cache(key=k, value=k, key_cache=kc, value_cache=kc.clone(),
                                  slot_mapping=slots, cache_mode="Norm")
torch_npu._npu_reshape_and_cache(key=k, value=k, key_cache=kc, value_cache=kc.clone(),
                                 slot_indices=slots)
assert torch.equal(kc.cpu()[1, 1], k.cpu()[1])
q = torch.randn(3, 32).npu()
torch_npu._npu_rotary_embedding(positions=torch.tensor([0, 1, 2]).npu(), query=q, key=q.clone(),
                                head_size=32, cos_sin_cache=torch.randn(4, 32).npu(),
                                is_neox_style=True)
out = torch.zeros(2, 32).npu()
torch_npu._npu_flash_attention_qlens(
    query=torch.randn(2, 32).npu(), key_cache=kc, value_cache=kc.clone(),
    block_table=torch.tensor([[0, 1]], dtype=torch.int32).npu(), mask=torch.zeros(128, 128).npu(),
    seq_len=torch.tensor([2], dtype=torch.int32), context_lens=torch.tensor([6], dtype=torch.int32),
    num_kv_heads=2, num_heads=2, scale_value=0.25, out=out)
logits = torch.randn(2, 8).npu()
torch_npu.npu_top_k_top_p(logits, k=torch.tensor([2, 3], dtype=torch.int32).npu())
try:
    torch_npu.npu_rms_norm(x, w, eps=1e-5)
except TypeError as exc:
    assert "torch_npu 2.14 npu_rms_norm" in str(exc), exc
else:
    raise AssertionError("an unknown keyword was accepted")
print("ok")
"""


def test_the_fused_ops_are_bound_against_the_wheels_schemas() -> None:
    path = os.pathsep.join(p for p in (str(STRICT), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", PROGRAM], env={**os.environ, "PYTHONPATH": path},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
