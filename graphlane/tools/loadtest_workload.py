"""The plan and workload of ``graphlane loadtest``: what a run sends, resolved against the
daemon's ``hello``, its verified cases and the eager attention they are checked against
(:func:`reference`, written here with torch, not taken from the simulator).

See :mod:`graphlane.tools.loadtest`.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graphlane.workers.programs.attention import AttentionConfig

if TYPE_CHECKING:
    from .loadtest_config import LoadConfig

#: Keys of ``--shape`` / ``LoadConfig.shape`` (defaults from AttentionConfig).
SHAPE_KEYS = ("layers", "num_heads", "num_kv_heads", "head_dim", "max_kv_len", "dtype")
#: Verified cases made per batch size before the run.
VERIFY_POOL = 4
#: Unverified queries made per batch size before the run.
QUERY_POOL = 4
#: Tolerances (atol = rtol) of verification, by output dtype.
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 6e-2, torch.float32: 1e-4}
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


# ---------------------------------------------------------------------------- plan and workload
@dataclass(frozen=True)
class Plan:
    """What the run sends, resolved against the daemon's hello."""

    devices: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    buckets: tuple[int, ...]
    shape: AttentionConfig
    #: the daemon described the program's shapes (hello's "config"): --shape is not needed
    shape_described: bool = False

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.shape.dtype]

    def shape_dict(self) -> dict[str, Any]:
        return {k: getattr(self.shape, k) for k in SHAPE_KEYS}


def resolve_plan(config: LoadConfig, hello: Mapping[str, Any]) -> Plan:
    """Check the config against the daemon's ``hello``; ValueError names the flag."""
    from .loadtest import LoadTestError

    workers = [w for w in hello.get("workers", []) if isinstance(w, Mapping)]
    served = sorted(int(w["device"]) for w in workers if "device" in w)
    if not served:
        raise LoadTestError(f"the daemon at {config.endpoint} serves no device")
    devices = config.devices if config.devices is not None else tuple(served)
    missing = [d for d in devices if d not in served]
    if missing:
        raise ValueError(f"--devices: {missing} not served by the daemon (serving {served})")
    info: Mapping[str, Any] | None = None
    known: set[str] = set()
    for w in workers:
        programs = w.get("programs") or {}
        known |= set(programs)
        if w.get("device") in devices and config.program in programs and info is None:
            info = programs[config.program]
    if info is None:
        raise ValueError(
            f"--program: {config.program!r} is not served on devices {list(devices)} "
            f"(serving {sorted(known) or 'nothing yet: are the workers ready?'})"
        )
    buckets = tuple(sorted(int(b) for b in info.get("buckets", [])))
    if not buckets:
        raise LoadTestError(f"the daemon reports no buckets for {config.program!r}")
    problem = _not_drivable(info)
    if problem is not None:
        def names(key: str) -> str:
            return ", ".join(info.get(key) or ()) or "none"

        raise LoadTestError(
            f"--program: cannot drive {config.program!r}: {problem}. loadtest drives "
            f"attention-shaped programs ({ATTENTION_SHAPE}; e.g. attention) and programs with a "
            "paged KV cache (e.g. paged_attention), whose inputs and parameters it knows how "
            f"to fill; {config.program!r} has parameters: {names('parameters')}; inputs: "
            f"{names('inputs')}; outputs: {names('outputs')}. Drive it with graphlane.Client"
        )
    groups = int(info.get("groups", 0)) or None
    shape = dict(config.shape)
    described = info.get("config")
    if isinstance(described, Mapping):  # the daemon says its shapes: --shape is not needed
        for key in SHAPE_KEYS:
            if key not in described:
                continue
            if key in shape and shape[key] != described[key]:
                raise ValueError(
                    f"--shape: {key}={shape[key]} but {config.program!r} on the daemon has "
                    f"{key}={described[key]} (leave --shape out: the daemon describes it)"
                )
            shape[key] = described[key]
    if "layers" in shape and groups is not None and shape["layers"] != groups:
        raise ValueError(
            f"--shape: layers={shape['layers']} but {config.program!r} on the daemon has "
            f"{groups} layers (task groups)"
        )
    if groups is not None:
        shape.setdefault("layers", groups)
    attention = AttentionConfig.from_mapping(shape, "--shape")
    batch_sizes = config.batch_sizes if config.batch_sizes is not None else buckets
    too_big = [b for b in batch_sizes if b > buckets[-1]]
    if too_big:
        raise ValueError(
            f"--batch-sizes: {too_big} larger than the largest bucket {buckets[-1]} "
            f"of {config.program!r} (buckets {list(buckets)})"
        )
    return Plan(
        tuple(devices), tuple(batch_sizes), buckets, attention, isinstance(described, Mapping)
    )


#: What an attention-shaped program takes and gives, as the load test fills it.
ATTENTION_SHAPE = "step parameter actual_seq_lengths_kv, inputs query, key and value, output out"


def _not_drivable(info: Mapping[str, Any]) -> str | None:
    """Why the load test cannot build steps for a (non-paged) program, or None. Only
    what the program's hello entry describes is checked."""
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
    if info.get("state_ops"):
        differs.append(f"device state ({', '.join(info['state_ops'])})")
    return "; ".join(differs) if differs else None


def reference(
    shape: AttentionConfig,
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
    """A verified step: its lengths and inputs, and the output eager attention gives."""

    lengths: list[int]
    inputs: dict[str, torch.Tensor]
    expected: torch.Tensor


@dataclass(frozen=True)
class Step:
    device: int
    batch: int
    lengths: list[int]
    inputs: dict[str, torch.Tensor]
    case: Case | None


class Workload:
    """Makes the steps of a run from pools built up front (see the module docstring)."""

    def __init__(self, plan: Plan, seed: int, verify: float) -> None:
        self.plan = plan
        self.verify = verify
        s = plan.shape
        gen = torch.Generator().manual_seed(seed)
        self.queries: dict[int, list[torch.Tensor]] = {
            b: [self._randn((b, s.num_heads, 1, s.head_dim), gen) for _ in range(QUERY_POOL)]
            for b in plan.batch_sizes
        }
        cases_per_batch = VERIFY_POOL if verify > 0 else 0
        self.cases: dict[int, list[Case]] = {
            b: [self.make_case(b, gen) for _ in range(cases_per_batch)] for b in plan.batch_sizes
        }
        self._turn: Counter[tuple[int, int]] = Counter()

    def _randn(self, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(self.plan.dtype)

    def make_case(self, batch: int, gen: torch.Generator) -> Case:
        s = self.plan.shape
        lengths = torch.randint(1, s.max_kv_len + 1, (batch,), generator=gen).tolist()
        kv = (s.layers, batch, s.num_kv_heads, s.max_kv_len, s.head_dim)
        inputs = {
            "query": self._randn((batch, s.num_heads, 1, s.head_dim), gen),
            "key": self._randn(kv, gen),
            "value": self._randn(kv, gen),
        }
        expected = reference(s, inputs["query"], inputs["key"], inputs["value"], lengths)
        return Case(lengths, inputs, expected)

    def verified_step(self, device: int, batch: int) -> Step:
        turn = self._turn[device, batch]
        self._turn[device, batch] += 1
        case = self.cases[batch][turn % len(self.cases[batch])]
        return Step(device, batch, case.lengths, case.inputs, case)

    def draw(self, rng: random.Random) -> Step:
        device = rng.choice(self.plan.devices)
        batch = rng.choice(self.plan.batch_sizes)
        if self.verify > 0 and rng.random() < self.verify:
            return self.verified_step(device, batch)
        top = self.plan.shape.max_kv_len
        lengths = [rng.randint(1, top) for _ in range(batch)]
        query = self.queries[batch][rng.randrange(QUERY_POOL)]
        return Step(device, batch, lengths, {"query": query}, None)


def check_output(case: Case, out: torch.Tensor, dtype: torch.dtype) -> float | None:
    """The max |out - expected|, or None when the output is wrong (shape or tolerance)."""
    if tuple(out.shape) != tuple(case.expected.shape):
        return None
    tol = TOLERANCE.get(dtype, 1e-2)
    got, want = out.float(), case.expected.float()
    err = float((got - want).abs().max()) if got.numel() else 0.0
    if not torch.allclose(got, want, rtol=tol, atol=tol) or not math.isfinite(err):
        return None
    return err
