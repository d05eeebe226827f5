"""The load test's workload of a stateless attention-shaped program (the built-in
``attention``): what its calls carry, resolved against the program's ``hello`` entry, its
verified cases and the eager attention they are checked against (:func:`reference`,
written here with torch, not taken from the simulator).

* an **unchecked** call sends random lengths and a query taken from a small pool made
  before the run, like a decode step whose KV cache stays on the device: the worker
  computes on whatever key/value its buffers hold;
* a **checked** call (a ``verify`` share of them) sends query, key and value for every
  row, so its output depends on nothing the daemon kept, and is compared with
  :func:`reference`. The cases (lengths, inputs and their reference output) are made
  before the run, a few per batch size, and taken in turn per (device, batch size), so
  consecutive checked calls on one graph differ; the client does no attention math
  while it measures.

Shapes: the program's ``hello`` entry gives its buckets, task groups (= layers) and, for
the built-in programs, every setting (``config``). A program that does not describe its
settings takes them from ``--shape`` (defaults: :class:`AttentionShape`'s, those of the
program's own config).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .config import SHAPE_KEYS, AttentionShape
from .workload import TOLERANCE, Call, LoadTestError, close_to

#: Verified cases made per batch size before the run.
VERIFY_POOL = 4
#: Unverified queries made per batch size before the run.
QUERY_POOL = 4
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
#: What an attention-shaped program takes and gives, as the load test fills it.
ATTENTION_SHAPE = "step parameter actual_seq_lengths_kv, inputs query, key and value, output out"


def not_attention(info: Mapping[str, Any]) -> str | None:
    """Why a program's hello entry is not attention-shaped, or None."""
    differs = []
    params = info.get("parameters")
    if isinstance(params, Mapping) and "actual_seq_lengths_kv" not in params:
        differs.append("no parameter actual_seq_lengths_kv")
    inputs = info.get("inputs")
    if isinstance(inputs, Mapping):
        missing = [n for n in ("query", "key", "value") if n not in inputs]
        if missing:
            differs.append(f"no input {', '.join(missing)}")
    if "out" not in info.get("outputs", ["out"]):
        differs.append("no output out")
    return "; ".join(differs) if differs else None


def attention_shape(
    program: str, info: Mapping[str, Any], given: Mapping[str, Any]
) -> tuple[AttentionShape, bool]:
    """The program's shape from its hello entry, ``given`` (``--shape``) filling what it
    does not say; and whether hello described it. ValueError names the flag."""
    groups = int(info.get("groups", 0)) or None
    shape = dict(given)
    described = info.get("config")
    if isinstance(described, Mapping):  # the daemon says its shapes: --shape is not needed
        for key in SHAPE_KEYS:
            if key not in described:
                continue
            if key in shape and shape[key] != described[key]:
                raise ValueError(
                    f"--shape: {key}={shape[key]} but {program!r} on the daemon has "
                    f"{key}={described[key]} (leave --shape out: the daemon describes it)"
                )
            shape[key] = described[key]
    if "layers" in shape and groups is not None and shape["layers"] != groups:
        raise ValueError(
            f"--shape: layers={shape['layers']} but {program!r} on the daemon has "
            f"{groups} layers (task groups)"
        )
    if groups is not None:
        shape.setdefault("layers", groups)
    return AttentionShape.from_mapping(shape, "--shape"), isinstance(described, Mapping)


def reference(
    shape: AttentionShape,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: Sequence[int],
) -> torch.Tensor:
    """Eager attention of the program: layer l+1 attends from layer l's output.

    Written here, independently of the device's kernel, so that verification checks
    the device rather than agreeing with it: torch's scaled_dot_product_attention
    over the program's layout (see graphlane.workers.programs.attention): BNSD, query
    [B, N, 1, D], key/value [layers, B, Nkv, S, D], scale 1/sqrt(D), GQA (query head h
    uses key/value head h // (N / Nkv)), keys at positions >= actual_seq_lengths_kv[b]
    left out of the softmax. The program does not ask for softmax_lse.
    """
    x = query
    for layer in range(shape.layers):
        x = _attention_layer(x, key[layer], value[layer], lengths)
    return x


def _attention_layer(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: Sequence[int]
) -> torch.Tensor:
    """One BNSD layer, computed in float32 and stored in the query's dtype (as the
    next layer reads it from the device buffer)."""
    heads, kv_heads, seq = query.shape[1], key.shape[1], key.shape[2]
    k = key.float().repeat_interleave(heads // kv_heads, dim=1)  # GQA: one copy per head
    v = value.float().repeat_interleave(heads // kv_heads, dim=1)
    valid = torch.arange(seq)[None, :] < torch.tensor(list(lengths))[:, None]  # [B, S]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.float(),
        k,
        v,
        attn_mask=valid[:, None, None, :],  # True: attend
        scale=1.0 / math.sqrt(query.shape[-1]),
    )
    # A row with no key to attend to is zeros (the op's rule), not SDPA's NaN.
    out = out.masked_fill(~valid.any(dim=1)[:, None, None, None], 0.0)
    return out.to(query.dtype)


@dataclass(frozen=True)
class Case:
    """A checked call's lengths and inputs, and the output eager attention gives."""

    lengths: list[int]
    inputs: dict[str, torch.Tensor]
    expected: torch.Tensor


class AttentionWorkload:
    """The calls of a run, made from pools built up front (see the module docstring)."""

    output = "out"

    def __init__(
        self,
        shape: AttentionShape,
        devices: tuple[int, ...],
        batch_sizes: tuple[int, ...],
        buckets: tuple[int, ...],
        *,
        seed: int = 0,
        verify: float = 0.0,
        described: bool = False,
    ) -> None:
        self.shape, self.devices, self.batch_sizes, self.buckets = (
            shape, devices, batch_sizes, buckets,
        )  # fmt: skip
        #: the daemon described the program's shapes (hello's "config"): --shape is not needed
        self.described = described
        self.verify = verify
        self.dtype = _DTYPES[shape.dtype]
        gen = torch.Generator().manual_seed(seed)
        s = shape
        self.queries: dict[int, list[torch.Tensor]] = {
            b: [self._randn((b, s.num_heads, 1, s.head_dim), gen) for _ in range(QUERY_POOL)]
            for b in batch_sizes
        }
        cases_per_batch = VERIFY_POOL if verify > 0 else 0
        self.cases: dict[int, list[Case]] = {
            b: [self.make_case(b, gen) for _ in range(cases_per_batch)] for b in batch_sizes
        }
        self._probe = self.make_case(min(batch_sizes), torch.Generator().manual_seed(seed + 7))
        self._turn: Counter[tuple[int, int]] = Counter()

    @classmethod
    def from_hello(
        cls,
        program: str,
        info: Mapping[str, Any],
        devices: tuple[int, ...],
        batch_sizes: tuple[int, ...],
        buckets: tuple[int, ...],
        *,
        shape: Mapping[str, Any],
        seed: int,
        verify: float,
    ) -> AttentionWorkload:
        problem = not_attention(info)
        if problem is not None:
            raise LoadTestError(problem)
        attention, described = attention_shape(program, info, shape)
        return cls(attention, devices, batch_sizes, buckets, seed=seed, verify=verify,
                   described=described)  # fmt: skip

    def _randn(self, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(self.dtype)

    def make_case(self, batch: int, gen: torch.Generator) -> Case:
        s = self.shape
        lengths = torch.randint(1, s.max_kv_len + 1, (batch,), generator=gen).tolist()
        kv = (s.layers, batch, s.num_kv_heads, s.max_kv_len, s.head_dim)
        inputs = {
            "query": self._randn((batch, s.num_heads, 1, s.head_dim), gen),
            "key": self._randn(kv, gen),
            "value": self._randn(kv, gen),
        }
        expected = reference(s, inputs["query"], inputs["key"], inputs["value"], lengths)
        return Case(lengths, inputs, expected)

    @staticmethod
    def _call(device: int, batch: int, case: Case) -> Call:
        params = {"actual_seq_lengths_kv": case.lengths}
        return Call(device, batch, params, case.inputs, case.expected)

    def checked(self, device: int, batch: int) -> Call:
        turn = self._turn[device, batch]
        self._turn[device, batch] += 1
        return self._call(device, batch, self.cases[batch][turn % len(self.cases[batch])])

    def probe(self, device: int) -> Call:
        return self._call(device, len(self._probe.lengths), self._probe)

    def draw(self, rng: random.Random) -> Call:
        device = rng.choice(self.devices)
        batch = rng.choice(self.batch_sizes)
        if self.verify > 0 and rng.random() < self.verify:
            return self.checked(device, batch)
        top = self.shape.max_kv_len
        lengths = [rng.randint(1, top) for _ in range(batch)]
        query = self.queries[batch][rng.randrange(QUERY_POOL)]
        return Call(device, batch, {"actual_seq_lengths_kv": lengths}, {"query": query})

    def check(self, call: Call, out: torch.Tensor) -> float | None:
        assert call.expected is not None
        return close_to(out, call.expected, self.dtype)

    def describe(self) -> dict[str, Any]:
        return {
            "shape": {k: getattr(self.shape, k) for k in SHAPE_KEYS},
            "shape_from": "hello" if self.described else "--shape",
            "tolerance": TOLERANCE.get(self.dtype, 1e-2),
        }
