"""The fused attention .out check, remembered: once a call passed, a call that differs
only in its lengths is checked by the plan's length rules alone (the same code the
first call ran). Each case here makes a call remembered, then asks about another:
its lengths are still held to every rule, naming the argument that breaks one."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from npusim import SimUsageError, torch_npu
from npusim.opcall import HOST_CHECKS, RememberedCheck

OUT = torch.ops.npu.npu_fused_infer_attention_score.out
B, N, NKV, D, KV = 2, 4, 2, 16, 64
BLOCK, BLOCKS, PER_SEQ = 16, 6, 4
assert torch_npu is not None


def dense(kv: int = KV, **over: Any) -> dict[str, Any]:
    a = dict(
        query=torch.zeros(B, N, 1, D, dtype=torch.float16),
        key=torch.zeros(B, NKV, kv, D, dtype=torch.float16),
        value=torch.zeros(B, NKV, kv, D, dtype=torch.float16),
        actual_seq_lengths_kv=[KV, KV], num_heads=N, num_key_value_heads=NKV,
        input_layout="BNSD", scale=1 / math.sqrt(D),
        out=[torch.zeros(B, N, 1, D, dtype=torch.float16), torch.zeros(1)],
    )  # fmt: skip
    a.update(over)
    return a


def paged(**over: Any) -> dict[str, Any]:
    a = dict(
        query=torch.zeros(B, 1, N * D, dtype=torch.float16),
        key=torch.zeros(BLOCKS, BLOCK, NKV * D, dtype=torch.float16),
        value=torch.zeros(BLOCKS, BLOCK, NKV * D, dtype=torch.float16),
        block_table=torch.zeros(B, PER_SEQ, dtype=torch.int32),
        block_size=BLOCK, actual_seq_lengths_kv=[BLOCK, BLOCK], num_heads=N,
        num_key_value_heads=NKV, input_layout="BSH", scale=1 / math.sqrt(D),
        out=[torch.zeros(B, 1, N * D, dtype=torch.float16), torch.zeros(1)],
    )  # fmt: skip
    a.update(over)
    return a


def workspace_for(lengths: list[int], **over: Any) -> torch.Tensor:
    """The workspace the get_max_workspace helper sizes for these lengths."""
    args = dense(actual_seq_lengths_kv=lengths, **over)
    args.pop("out")
    q = args.pop("query").npu()
    k, v = args.pop("key").npu(), args.pop("value").npu()
    ws = torch_npu._npu_fused_infer_attention_score_get_max_workspace(q, k, v, **args)
    return torch.empty(ws.numel(), dtype=torch.uint8)


def answer(check: Any, args: dict[str, Any]) -> str:
    try:
        check(**args)
    except SimUsageError as exc:
        return str(exc)
    return "accepted"


def check() -> RememberedCheck:
    c = HOST_CHECKS[OUT]
    assert isinstance(c, RememberedCheck)
    return c


KV_LENS = "actual_seq_lengths_kv"


@pytest.mark.parametrize(
    ("base", "lengths", "refused"),
    [
        (dense, [KV, 1], None),
        (dense, [KV + 1, 1], KV_LENS),  # over the cache
        (dense, [-1, 1], KV_LENS),
        (dense, [1, 2, 3], None),  # more entries than the batch: the first B count
        (dense, [5], None),  # one entry for every batch
        (dense, [], KV_LENS),  # too few
        (dense, [1, True], KV_LENS),  # a bool is no length
        (dense, [1.5, 1], KV_LENS),
        (dense, None, None),  # absent: the whole cache
        (paged, [PER_SEQ * BLOCK, 1], None),  # 4 + 1 blocks of 6
        (paged, [PER_SEQ * BLOCK, PER_SEQ * BLOCK], "blocknum"),  # 8 blocks, 6 in the cache
        (paged, [PER_SEQ * BLOCK + 1, 1], KV_LENS),  # past the block table's reach
        (paged, None, KV_LENS),  # required with page attention
        (paged, [0, 0], None),
    ],
)
def test_a_remembered_call_is_still_held_to_every_length_rule(
    base: Any, lengths: list[Any] | None, refused: str | None
) -> None:
    c = check()
    c(**base())  # passes: remembered
    got = answer(c, base(actual_seq_lengths_kv=lengths))
    if refused is None:
        assert got == "accepted"
    else:
        assert refused in got


def test_a_workspace_got_for_short_lengths_holds_longer_ones() -> None:
    """torch_npu sizes the workspace once, at capture, by ``_get_max_workspace``: its size
    follows the shapes, so updates to any lengths they hold reuse it."""
    c = check()
    ws = workspace_for([8, 8], kv=512)
    c(**dense(512, actual_seq_lengths_kv=[8, 8], workspace=ws))
    for lengths in ([300, 8], [512, 512], [1, 128]):
        assert answer(c, dense(512, actual_seq_lengths_kv=lengths, workspace=ws)) == "accepted"


def test_query_lengths_are_rechecked_beyond_the_incremental_branch() -> None:
    """Query S of 2: the query lengths are read (per batch, within S)."""
    c = check()
    q2 = dict(query=torch.zeros(B, N, 2, D, dtype=torch.float16),
              out=[torch.zeros(B, N, 2, D, dtype=torch.float16), torch.zeros(1)])  # fmt: skip
    c(**dense(actual_seq_lengths=[2, 2], **q2))
    assert "actual_seq_lengths" in answer(c, dense(actual_seq_lengths=[3, 1], **q2))
    for lengths in ([1, 2], [1], None):
        assert answer(c, dense(actual_seq_lengths=lengths, **q2)) == "accepted"


def test_a_call_whose_lengths_decide_its_shape_is_checked_in_full_every_time() -> None:
    """TND: the cumulative query ends set the batch; such calls are not remembered."""
    c = check()
    tnd = dict(
        query=torch.zeros(3, N, D, dtype=torch.float16),
        key=torch.zeros(5, NKV, D, dtype=torch.float16),
        value=torch.zeros(5, NKV, D, dtype=torch.float16),
        input_layout="TND", actual_seq_lengths=[1, 3], actual_seq_lengths_kv=[2, 5],
        out=[torch.zeros(3, N, D, dtype=torch.float16), torch.zeros(1)],
    )  # fmt: skip
    assert answer(c, dense(**tnd)) == "accepted"
    bad = dense(**{**tnd, "actual_seq_lengths": [1, 2, 3]})  # three batches, two kv lengths
    assert KV_LENS in answer(c, bad)


def test_everything_but_the_lengths_is_still_checked_in_full() -> None:
    c = check()
    c(**dense())
    assert "num_heads" in answer(c, dense(num_heads=N * 2))
