"""Independent calls of a stateless attention-shaped program (e.g. ``attention``): what
they carry, the eager attention a checked one is compared with (:func:`reference`,
written with torch, not taken from the simulator), and how they are driven (checked
cases are made before the run: the client does no attention math while it measures)."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graphlane.client import Client
from graphlane.protocol.errors import GraphlaneError

from .availability import DeviceBackoff
from .config import SHAPE_KEYS, AttentionShape, LoadConfig
from .run import TOLERANCE, Call, LoadTestError, Run, arrive, close_to, finish, send

#: Checked cases and unchecked queries made per batch size before the run.
POOL = 4
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
#: What an attention-shaped program takes and gives, as the load test fills it.
ATTENTION_SHAPE = "step parameter actual_seq_lengths_kv, inputs query, key and value, output out"


def not_attention(info: Mapping[str, Any]) -> str | None:
    """Why a program's hello entry is not attention-shaped, or None."""
    differs = []
    params, inputs = info.get("parameters"), info.get("inputs")
    if isinstance(params, Mapping) and "actual_seq_lengths_kv" not in params:
        differs.append("no parameter actual_seq_lengths_kv")
    missing = [n for n in ("query", "key", "value") if isinstance(inputs, Mapping)
               and n not in inputs]  # fmt: skip
    if missing:
        differs.append(f"no input {', '.join(missing)}")
    if "out" not in info.get("outputs", ["out"]):
        differs.append("no output out")
    return "; ".join(differs) or None


def attention_shape(
    program: str, info: Mapping[str, Any], given: Mapping[str, Any]
) -> tuple[AttentionShape, bool]:
    """The program's shape from its hello entry, ``given`` (``--shape``) filling what it
    does not say; and whether hello described it. ValueError names the flag."""
    groups = int(info.get("groups", 0)) or None
    shape = dict(given)
    described = info.get("config")
    for key in SHAPE_KEYS:
        if isinstance(described, Mapping) and key in described:
            if key in shape and shape[key] != described[key]:
                raise ValueError(
                    f"--shape: {key}={shape[key]} but {program!r} on the daemon has "
                    f"{key}={described[key]} (leave --shape out: the daemon describes it)"
                )
            shape[key] = described[key]
    if groups is not None and shape.setdefault("layers", groups) != groups:
        raise ValueError(f"--shape: layers={shape['layers']} but {program!r} on the daemon "
                         f"has {groups} layers (task groups)")  # fmt: skip
    return AttentionShape.from_mapping(shape, "--shape"), isinstance(described, Mapping)


def reference(
    shape: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    lengths: Sequence[int],
) -> torch.Tensor:  # fmt: skip
    """Eager attention of ``shape.layers`` layers, l+1 attending from l's output: SDPA
    over BNSD, query [B, N, 1, D], key/value [layers, B, Nkv, S, D], scale 1/sqrt(D), GQA,
    keys at positions >= lengths[b] left out; each layer computed in float32 and stored
    in the query's dtype (as the device buffer holds it); a row with no key is zeros."""
    x = query
    heads, kv_heads, seq = query.shape[1], key.shape[2], key.shape[3]
    valid = torch.arange(seq)[None, :] < torch.tensor(list(lengths))[:, None]  # [B, S]
    for layer in range(shape.layers):
        k, v = (t[layer].float().repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
        out = torch.nn.functional.scaled_dot_product_attention(
            x.float(), k, v, attn_mask=valid[:, None, None, :], scale=1 / math.sqrt(x.shape[-1])
        )
        x = out.masked_fill(~valid.any(dim=1)[:, None, None, None], 0.0).to(query.dtype)
    return x


class AttentionWorkload:
    """The calls of a run, made from pools built up front (see the module docstring)."""

    output = "out"

    def __init__(
        self, shape: AttentionShape, devices: tuple[int, ...], batch_sizes: tuple[int, ...],
        buckets: tuple[int, ...], *, seed: int = 0, verify: float = 0.0, described: bool = False,
    ) -> None:  # fmt: skip
        self.shape, self.devices, self.batch_sizes, self.buckets = (
            shape, devices, batch_sizes, buckets)  # fmt: skip
        self.described = described  # hello gave the shapes: --shape is not needed
        self.verify = verify
        self.dtype = _DTYPES[shape.dtype]
        gen = torch.Generator().manual_seed(seed)
        q = (shape.num_heads, 1, shape.head_dim)
        self.queries = {b: [self._randn((b, *q), gen) for _ in range(POOL)] for b in batch_sizes}
        n = POOL if verify > 0 else 0
        self.cases = {b: [self.make_case(b, gen) for _ in range(n)] for b in batch_sizes}
        self._probe = self.make_case(min(batch_sizes), torch.Generator().manual_seed(seed + 7))
        self._turn: Counter[tuple[int, int]] = Counter()

    def _randn(self, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(self.dtype)

    def make_case(self, batch: int, gen: torch.Generator) -> Call:
        """A checked call of ``batch`` rows on device 0 (its device is set when sent)."""
        s = self.shape
        lengths = torch.randint(1, s.max_kv_len + 1, (batch,), generator=gen).tolist()
        kv = (s.layers, batch, s.num_kv_heads, s.max_kv_len, s.head_dim)
        q, k, v = (self._randn(x, gen) for x in ((batch, s.num_heads, 1, s.head_dim), kv, kv))
        inputs = {"query": q, "key": k, "value": v}
        expected = reference(s, q, k, v, lengths)
        return Call(0, batch, {"actual_seq_lengths_kv": lengths}, inputs, expected)

    def checked(self, device: int, batch: int) -> Call:
        """The next checked case of (device, batch): consecutive ones on a graph differ."""
        turn = self._turn[device, batch]
        self._turn[device, batch] += 1
        case = self.cases[batch][turn % len(self.cases[batch])]
        return Call(device, batch, case.params, case.inputs, case.expected)

    def probe(self, device: int) -> Call:
        p = self._probe
        return Call(device, p.batch, p.params, p.inputs, p.expected)

    def draw(self, rng: random.Random) -> Call:
        device, batch = rng.choice(self.devices), rng.choice(self.batch_sizes)
        if self.verify > 0 and rng.random() < self.verify:
            return self.checked(device, batch)
        lengths = [rng.randint(1, self.shape.max_kv_len) for _ in range(batch)]
        query = self.queries[batch][rng.randrange(POOL)]
        return Call(device, batch, {"actual_seq_lengths_kv": lengths}, {"query": query})

    def check(self, call: Call, out: torch.Tensor) -> float | None:
        assert call.expected is not None
        return close_to(out, call.expected, self.dtype)

    def describe(self) -> dict[str, Any]:
        return {"shape": {k: getattr(self.shape, k) for k in SHAPE_KEYS},
                "shape_from": "hello" if self.described else "--shape",
                "tolerance": TOLERANCE.get(self.dtype, 1e-2)}  # fmt: skip


async def drive_calls(run: Run, work: AttentionWorkload) -> None:
    """Independent calls until the run's end (:func:`.run.arrive`). In the closed loop a
    device that just failed is held back (:mod:`.availability`): a call drawn for it is
    drawn again, and a caller waits only when every device is held."""
    closed = run.config.mode == "closed"
    backoff = DeviceBackoff(random.Random(run.config.seed ^ 0xB0FF))
    draws = random.Random(run.config.seed * 1_000_003 + 1)

    async def one(scheduled: float) -> None:
        call = work.draw(draws)
        while closed and backoff.held(call.device, now := time.monotonic()):
            release = backoff.all_held(work.devices, now)
            if release is not None:
                await run.pause(min(release, run.stop_at) - now)
                if not run.sending():
                    return
            call = work.draw(draws)
        reply = await send(run, call, work.output, scheduled if not closed else time.monotonic())
        if closed:
            (backoff.failure(call.device, time.monotonic()) if reply is None
             else backoff.success(call.device))  # fmt: skip
        if reply is not None and call.expected is not None:
            out = reply.outputs.get(work.output)
            run.rec.verification(call, None if out is None else work.check(call, out),
                                 reply.generation)  # fmt: skip

    cap = run.config.outstanding_cap() if not closed else None
    await finish(run, await arrive(run, one, cap=cap))


async def preflight(
    client: Client, config: LoadConfig, work: AttentionWorkload, spawned: set[asyncio.Future[Any]]
) -> dict[str, str]:
    """One checked call per device, unmeasured: checks the shapes, opens the connections.
    Every probe ends (each within timeout_s) before a failure is raised."""
    shape = work.describe()["shape"]

    async def probe(device: int) -> str:
        call = work.probe(device)
        assert call.expected is not None
        try:
            reply = await client.step(config.program, device, call.params, call.inputs,
                                      (work.output,), batch=call.batch, timeout=config.timeout_s)
        except GraphlaneError as exc:
            if exc.code not in ("BAD_REQUEST", "UNKNOWN_PROGRAM", "UNKNOWN_DEVICE"):
                return str(exc.code)  # retryable or internal: the run will measure it
            hint = "" if work.described else (
                ". Give the daemon's program shape with --shape (e.g. --shape "
                "num_heads=8,num_kv_heads=2,head_dim=64,max_kv_len=256).")  # fmt: skip
            raise LoadTestError(f"device {device} refused a step of {config.program!r} built "
                                f"with the shape {shape}: {exc}{hint}") from None
        out = reply.outputs.get(work.output)
        if out is None or tuple(out.shape) != tuple(call.expected.shape):
            raise LoadTestError(
                f"device {device} answered {work.output!r} of shape "
                f"{None if out is None else list(out.shape)}, expected "
                f"{list(call.expected.shape)} from the shape {shape}")  # fmt: skip
        return "ok" if work.check(call, out) is not None else "wrong output"

    tasks = [asyncio.create_task(probe(d)) for d in work.devices]
    spawned.update(tasks)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return {str(d): str(r) for d, r in zip(work.devices, results, strict=True)}
