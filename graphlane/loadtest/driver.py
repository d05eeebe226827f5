""":func:`run_load`: connect, pick the shape of load and the workload from the program's
``hello`` entry (see :mod:`.workload` for the rule), drive it, report.

The workloads the load test knows, by what the entry says:

* no device state: :data:`CALL_WORKLOADS`, the first that accepts the entry
  (attention-shaped programs, e.g. ``attention``);
* device state: a model (a state op ``prefill``, e.g. ``model``): requests served by a
  continuous-batching generation loop (:mod:`.serving`); otherwise
  :data:`SEQUENCE_WORKLOADS` by the state's kind (``paged_kv``, e.g.
  ``paged_attention``).

Any other program is refused with what its entry describes.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import torch

from graphlane.client import Client
from graphlane.client.scheduler import ModelShape

from .attention import ATTENTION_SHAPE, AttentionWorkload
from .batching import Sequences
from .calls import drive_calls, preflight
from .config import LoadConfig
from .generation import check_reference
from .paged import PagedScheduler, PagedShape
from .progress import Progress
from .record import Recorder, window_for
from .report import build_report
from .report_files import write_report
from .run import Run
from .serving import Serving
from .workload import TOLERANCE, CallWorkload, LoadTestError, SequenceWorkload


def _attention(
    config: LoadConfig,
    info: Mapping[str, Any],
    devices: tuple[int, ...],
    batch_sizes: tuple[int, ...],
    buckets: tuple[int, ...],
) -> CallWorkload:
    return AttentionWorkload.from_hello(
        config.program, info, devices, batch_sizes, buckets,
        shape=config.shape, seed=config.seed, verify=config.verify_share("calls"),
    )  # fmt: skip


def _paged_kv(
    config: LoadConfig, info: Mapping[str, Any], devices: tuple[int, ...]
) -> tuple[dict[int, SequenceWorkload], dict[str, Any]]:
    try:
        shape = PagedShape.from_description(info)
    except ValueError as exc:
        raise LoadTestError(str(exc)) from None
    if config.num_prompts is not None:
        raise ValueError("--num-prompts: only for a model program (its requests)")
    hi = (config.prompt_lens or (1, 1))[1]
    if not hi < shape.max_len:
        raise ValueError(
            f"--prompt-lens must lie in 1..{shape.max_len - 1} "
            "(max_blocks_per_seq * block_size - 1)"
        )
    schedulers: dict[int, SequenceWorkload] = {
        d: PagedScheduler(shape, torch.Generator().manual_seed(config.seed * 1000 + d))
        for d in devices
    }
    shown = {"shape": shape.describe(), "buckets": list(shape.buckets),
             "tolerance": TOLERANCE.get(shape.torch_dtype, 1e-2)}  # fmt: skip
    return schedulers, shown


#: Stateless programs: a workload from (config, hello entry, devices, batch sizes,
#: buckets), or LoadTestError saying why the entry is not one it drives.
CALL_WORKLOADS: dict[
    str,
    Callable[
        [LoadConfig, Mapping[str, Any], tuple[int, ...], tuple[int, ...], tuple[int, ...]],
        CallWorkload,
    ],
] = {f"attention-shaped ({ATTENTION_SHAPE}; e.g. attention)": _attention}
#: Programs with device state, by the state's kind: what they are (for messages), and
#: one scheduler per device with what the report shows of the program (``shape``,
#: ``buckets``, ``tolerance``).
SEQUENCE_WORKLOADS: dict[
    str,
    tuple[
        str,
        Callable[
            [LoadConfig, Mapping[str, Any], tuple[int, ...]],
            tuple[dict[int, SequenceWorkload], dict[str, Any]],
        ],
    ],
] = {"paged_kv": ("a paged KV cache on the device, e.g. paged_attention", _paged_kv)}


#: Programs that generate tokens (a state op ``prefill``, input and output ``tokens``):
#: requests served by a continuous-batching loop that decodes ahead (:mod:`.serving`).
MODEL_WORKLOAD = "a model (state op prefill, e.g. model)"


def _served(config: LoadConfig, hello: Mapping[str, Any]) -> tuple[tuple[int, ...], Any]:
    """The devices to drive and the program's hello entry; ValueError names the flag."""
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
    return tuple(devices), info


def _refuse(config: LoadConfig, info: Mapping[str, Any], why: str) -> LoadTestError:
    def names(key: str) -> str:
        return ", ".join(info.get(key) or ()) or "none"

    known = "; ".join([*CALL_WORKLOADS, *(what for what, _ in SEQUENCE_WORKLOADS.values()),
                       MODEL_WORKLOAD])  # fmt: skip
    return LoadTestError(
        f"--program: cannot drive {config.program!r}: {why}. loadtest drives programs "
        f"whose inputs and parameters it knows how to fill ({known}); {config.program!r} "
        f"has parameters: {names('parameters')}; inputs: {names('inputs')}; outputs: "
        f"{names('outputs')}; state operations: {names('state_ops')}. "
        "Drive it with graphlane.Client"
    )


def _not_for(load: str, config: LoadConfig) -> None:
    """Refuse the settings the other shape of load reads (named by their flags)."""
    flags: dict[str, Any] = {
        "--prompt-lens": config.prompt_lens,
        "--decode-tokens": config.decode_tokens,
        "--num-prompts": config.num_prompts,
    }
    if load == "sequences":
        flags = {
            "--batch-sizes": config.batch_sizes,
            "--shape": config.shape or None,
            "--max-outstanding": config.max_outstanding,
        }
    given = [flag for flag, value in flags.items() if value is not None]
    if given:
        why = (
            "a program without device state gets independent calls, not sequences"
            if load == "calls"
            else f"{config.program!r} keeps device state: its batches are its live "
            "sequences and its shapes come from the daemon"
        )
        raise ValueError(f"{', '.join(given)}: not for --program {config.program} ({why})")


class Plan:
    """What a run drives, resolved against hello: the shape of load and its workload."""

    def __init__(self, config: LoadConfig, hello: Mapping[str, Any]) -> None:
        devices, info = _served(config, hello)
        self.calls: CallWorkload | None = None
        self.sequences: dict[int, SequenceWorkload] = {}
        self.model: ModelShape | None = None
        self.verify = config.verify_share("sequences" if info.get("state_ops") else "calls")
        #: why the default check of a model's tokens cannot run here (None: it can)
        self.verify_skipped: str | None = None
        self.info, self.devices = info, devices
        if "prefill" in (info.get("state_ops") or ()):
            self.load = "sequences"
            _not_for(self.load, config)
            try:
                self.model = ModelShape.from_description(info)
            except ValueError as exc:
                raise _refuse(config, info, str(exc)) from None
            _check_lengths(config, self.model)
            self.verify = config.verify_share(self.load)
            try:
                check_reference(info)  # a check that cannot run is known now
            except ValueError as exc:
                if config.verify:  # asked for: refused; by default: not checked, said so
                    raise ValueError(f"--verify {config.verify:g}: {exc}") from None
                if self.verify:
                    self.verify_skipped = f"{exc} (the default --verify {self.verify:g})"
                self.verify = 0.0
            self.tolerance = 0.0  # tokens: equal or wrong
            self.resolved = {"devices": list(devices), "buckets": list(self.model.buckets),
                             "shape": asdict(self.model), "verify": self.verify}  # fmt: skip
            return
        if info.get("state_ops"):
            self.load = "sequences"
            _not_for(self.load, config)
            kind = (info.get("state") or {}).get("kind")
            entry = SEQUENCE_WORKLOADS.get(str(kind))
            if entry is None:
                raise _refuse(config, info, f"its device state is of kind {kind!r}")
            try:
                self.sequences, shown = entry[1](config, info, devices)
            except LoadTestError as exc:
                raise _refuse(config, info, str(exc)) from None
            self.tolerance = float(shown.pop("tolerance"))
            self.resolved = {"devices": list(devices), **shown}
            return
        self.load = "calls"
        _not_for(self.load, config)
        buckets = tuple(sorted(int(b) for b in info.get("buckets", [])))
        if not buckets:
            raise LoadTestError(f"the daemon reports no buckets for {config.program!r}")
        batch_sizes = config.batch_sizes if config.batch_sizes is not None else buckets
        too_big = [b for b in batch_sizes if b > buckets[-1]]
        if too_big:
            raise ValueError(
                f"--batch-sizes: {too_big} larger than the largest bucket {buckets[-1]} "
                f"of {config.program!r} (buckets {list(buckets)})"
            )
        reasons = []
        for name, make_calls in CALL_WORKLOADS.items():
            try:
                self.calls = make_calls(config, info, devices, tuple(batch_sizes), buckets)
                break
            except LoadTestError as exc:
                reasons.append(f"not {name.split(' (')[0]}: {exc}")
        if self.calls is None:
            raise _refuse(config, info, "; ".join(reasons))
        shown = self.calls.describe()
        self.tolerance = float(shown["tolerance"])
        self.resolved = {
            "devices": list(devices),
            "batch_sizes": list(batch_sizes),
            "buckets": list(buckets),
            "shape": shown["shape"],
        }


def _check_lengths(config: LoadConfig, shape: ModelShape) -> None:
    longest = min(shape.max_len, shape.block_size * shape.num_blocks)
    hi = (config.prompt_lens or (1, 1))[1]
    out = (config.decode_tokens or (1, 1))[0]
    if hi + out > longest:
        raise ValueError(
            f"--prompt-lens / --decode-tokens: a prompt of {hi} and {out} output tokens "
            f"do not fit a sequence of {config.program!r} ({longest} tokens: "
            "max_blocks_per_seq * block_size, at most the whole cache)"
        )


async def run_load(
    config: LoadConfig,
    *,
    stop: asyncio.Event | None = None,
    started: Callable[[Run, Plan], None] | None = None,
) -> dict[str, Any]:
    """Run the load test; returns the report (also written to ``config.report_dir`` if set).

    Bounded: after the setup (hello, and for independent calls one probe per device,
    each within ``timeout_s``), it sends for ``duration_s`` (or until ``stop`` is set)
    and then waits at most ``timeout_s`` for the calls in flight. ``started`` is called
    with the run and its plan when sending begins (to watch a run from outside).
    """
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    client = Client(
        config.endpoint, timeout=config.timeout_s, name="graphlane-loadtest",
        server_key=config.server_key, client_key=config.client_key,
    )  # fmt: skip
    # Every task that calls the client; all are ended before it closes (a call still in
    # flight while the client closes could open a socket that then blocks its shutdown).
    spawned: set[asyncio.Task[Any]] = set()
    progress: Progress | None = None
    try:
        hello = await client.connect()
        plan = Plan(config, hello)
        checked = (
            await preflight(client, config, plan.calls, spawned) if plan.calls is not None else {}
        )
        start = time.monotonic()
        rec = Recorder(start, window_for(config.duration_s), config.seed)
        run = Run(
            config, client, rec, stop_at=start + config.duration_s,
            stop=stop or asyncio.Event(), tasks=spawned, verify=plan.verify,
        )  # fmt: skip
        if config.progress:
            progress = Progress(config, rec, run.phase)
            spawned.add(asyncio.create_task(progress.tick()))
        if started is not None:
            started(run, plan)
        serving: Serving | None = None
        if plan.calls is not None:
            await drive_calls(run, plan.calls, start)
        elif plan.model is not None:
            serving = Serving(run, plan.model, plan.devices)
            if progress is not None:
                progress.detail = serving.progress_line
            await serving.drive()
        else:
            await Sequences(run, plan.sequences).drive()
        end = time.monotonic()
        if serving is not None and plan.verify > 0:  # transformers' time is not the server's
            if run.stop.is_set():  # a Ctrl-C ends the run now, not after transformers
                plan.verify_skipped = "interrupted before the tokens were checked"
            else:
                await serving.check(plan.info, plan.verify)
    finally:
        for t in spawned:
            t.cancel()
        await asyncio.gather(*spawned, return_exceptions=True)
        if progress is not None:
            progress.close()
        await client.close()
    report = build_report(
        config, rec, hello, load=plan.load, resolved=plan.resolved, tolerance=plan.tolerance,
        preflight=checked, started_at=started_at, start=start, end=end,
        sent_until=run.sent_until, interrupted=run.stop.is_set(), extra=run.extra,
        verify_skipped=plan.verify_skipped,
    )  # fmt: skip
    if config.report_dir:
        json_path, html_path = await asyncio.to_thread(write_report, report, config.report_dir)
        report["files"] = {"json": str(json_path), "html": str(html_path)}
    return report
