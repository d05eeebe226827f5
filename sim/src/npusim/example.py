"""A short run on the simulated NPU: capture a layered decode-attention graph once,
then patch its per-layer sequence lengths between replays without re-capturing.

Each step replays the graph on the capture stream while the update stream patches
layer after layer; the graph waits at each layer's ExternalEvent, so the replay
of layer k overlaps the patch of layer k+1. The update stream first waits for an
event recorded after the previous replay, so a patch never races a replay.

    python -m npusim.example    (also ``graphlane example``)
"""

from __future__ import annotations

import math
import time

import torch

from . import torch_npu


def run(steps: int = 8, layers: int = 4, batch: int = 4, heads: int = 8, kv_heads: int = 2,
        head_dim: int = 64, max_kv: int = 256, seed: int = 0) -> int:  # fmt: skip
    npu = torch_npu.npu

    gen = torch.Generator().manual_seed(seed)
    kw = dict(num_heads=heads, num_key_value_heads=kv_heads, input_layout="BNSD",
              scale=1 / math.sqrt(head_dim), softmax_lse_flag=False)  # fmt: skip
    q = torch.randn(batch, heads, 1, head_dim, dtype=torch.float16, generator=gen).to("npu")
    kv_shape = (batch, kv_heads, max_kv, head_dim)
    keys = [
        torch.randn(kv_shape, dtype=torch.float16, generator=gen).to("npu") for _ in range(layers)
    ]
    values = [
        torch.randn(kv_shape, dtype=torch.float16, generator=gen).to("npu") for _ in range(layers)
    ]
    lengths = [max_kv] * batch
    capture, update = npu.Stream(), npu.Stream()
    graph = npu.NPUGraph()
    events = [npu.ExternalEvent() for _ in range(layers)]
    outs = [torch.empty_like(q) for _ in range(layers)]
    lse = [torch.empty(1, dtype=torch.float32, device="npu") for _ in range(layers)]
    ws = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
        q, keys[0], values[0], actual_seq_lengths_kv=lengths, **kw
    )
    handles = []
    with npu.graph(graph, stream=capture):
        x = q
        for layer in range(layers):
            events[layer].wait(capture)
            events[layer].reset(capture)  # older CANN clears the flag only here
            npu.graph_task_group_begin(capture)
            torch_npu.npu_fused_infer_attention_score.out(
                x, keys[layer], values[layer], actual_seq_lengths_kv=lengths, workspace=ws,
                out=[outs[layer], lse[layer]], **kw)  # fmt: skip
            handles.append(npu.graph_task_group_end(capture))
            x = outs[layer]
    print(f"captured {graph.name}: {layers} layers, one task group and ExternalEvent each")
    done = npu.Event()
    worst = 0.0
    t0 = time.perf_counter()
    for step in range(steps):
        lengths = torch.randint(1, max_kv + 1, (batch,), generator=gen).tolist()
        update.wait_event(done)  # the previous replay is finished with the tasks
        with npu.stream(capture):
            graph.replay()
        done.record(capture)
        with npu.stream(update):
            for layer in range(layers):
                npu.graph_task_update_begin(update, handles[layer])
                prev = q if layer == 0 else outs[layer - 1]
                torch_npu.npu_fused_infer_attention_score.out(
                    prev, keys[layer], values[layer], actual_seq_lengths_kv=lengths,
                    workspace=ws, out=[outs[layer], lse[layer]], **kw)  # fmt: skip
                npu.graph_task_update_end(update)
                events[layer].record(update)
        done.synchronize()
        got = outs[-1].cpu()
        x = q
        for layer in range(layers):
            x, _ = torch_npu.npu_fused_infer_attention_score(
                x, keys[layer], values[layer], actual_seq_lengths_kv=lengths, **kw
            )
        err = (got.float() - x.cpu().float()).abs().max().item()
        worst = max(worst, err)
        print(f"step {step}: actual_seq_lengths_kv={lengths}  max |replay - eager| = {err:.3g}")
    took = time.perf_counter() - t0
    print(
        f"{steps} steps patched and replayed in {took:.2f} s without re-capture; "
        f"worst difference from eager {worst:.3g}"
    )
    return 0 if worst == 0.0 else 1


if __name__ == "__main__":
    raise SystemExit(run())
