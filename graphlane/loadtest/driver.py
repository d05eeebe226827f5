""":func:`run_load`: connect, pick the shape of load from the program's ``hello`` entry
(:class:`Plan`: calls, :mod:`.attention`; sequences, :mod:`.paged`; requests,
:mod:`.serving`; any other program is refused with what its entry says), drive, report."""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from graphlane.client import Client
from graphlane.client.scheduler import ModelShape

from . import attention
from .attention import ATTENTION_SHAPE, AttentionWorkload, attention_shape, not_attention
from .config import LoadConfig
from .generation import check_reference
from .paged import PagedShape, drive_sequences
from .progress import Progress
from .record import Recorder, window_for
from .report import build_report
from .report_files import write_report
from .run import TOLERANCE, LoadTestError, Run
from .serving import Serving

#: What the load test drives, for the message refusing another program.
DRIVES = (f"attention-shaped ({ATTENTION_SHAPE}; e.g. attention)",
          "a paged KV cache on the device, e.g. paged_attention",
          "a model (state op prefill, e.g. model)")  # fmt: skip


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

    return LoadTestError(
        f"--program: cannot drive {config.program!r}: {why}. loadtest drives programs "
        f"whose inputs and parameters it knows how to fill ({'; '.join(DRIVES)}); "
        f"{config.program!r} has parameters: {names('parameters')}; inputs: "
        f"{names('inputs')}; outputs: {names('outputs')}; state operations: "
        f"{names('state_ops')}. Drive it with graphlane.Client"
    )


def _described(shape: Any, config: LoadConfig, info: Mapping[str, Any]) -> Any:
    """``shape.from_description(info)``, or the refusal naming why it is not one."""
    try:
        return shape.from_description(info)
    except ValueError as exc:
        raise _refuse(config, info, str(exc)) from None


def _not_for(load: str, config: LoadConfig) -> None:
    """Refuse the settings the other shape of load reads (named by their flags)."""
    c = config
    flags = ({"--batch-sizes": c.batch_sizes, "--shape": c.shape or None,
              "--max-outstanding": c.max_outstanding} if load == "sequences" else
             {"--prompt-lens": c.prompt_lens, "--decode-tokens": c.decode_tokens,
              "--num-prompts": c.num_prompts})  # fmt: skip
    given = [flag for flag, value in flags.items() if value is not None]
    why = ("a program without device state gets independent calls, not sequences"
           if load == "calls" else f"{c.program!r} keeps device state: its batches are its "
           "live sequences and its shapes come from the daemon")  # fmt: skip
    if given:
        raise ValueError(f"{', '.join(given)}: not for --program {c.program} ({why})")


class Plan:
    """What a run drives, resolved against hello: the shape of load and its workload."""

    def __init__(self, config: LoadConfig, hello: Mapping[str, Any]) -> None:
        devices, info = _served(config, hello)
        self.info, self.devices = info, devices
        self.calls: AttentionWorkload | None = None
        self.paged: PagedShape | None = None
        self.model: ModelShape | None = None
        #: why the default check of a model's tokens cannot run here (None: it can)
        self.verify_skipped: str | None = None
        self.load = "sequences" if info.get("state_ops") else "calls"
        self.verify = config.verify_share(self.load)
        _not_for(self.load, config)
        self.resolved: dict[str, Any] = {"devices": list(devices)}
        if "prefill" in (info.get("state_ops") or ()):
            self.model = _described(ModelShape, config, info)
            _check_lengths(config, self.model)
            try:
                check_reference(info)  # a check that cannot run is known now
            except ValueError as exc:
                if config.verify:  # asked for: refused; by default: not checked, said so
                    raise ValueError(f"--verify {config.verify:g}: {exc}") from None
                if self.verify:
                    self.verify_skipped = f"{exc} (the default --verify {self.verify:g})"
                self.verify = 0.0
            self.tolerance = 0.0  # tokens: equal or wrong
            self.resolved.update(buckets=list(self.model.buckets), shape=asdict(self.model),
                                 verify=self.verify)  # fmt: skip
        elif info.get("state_ops"):
            kind = (info.get("state") or {}).get("kind")
            if kind != "paged_kv":
                raise _refuse(config, info, f"its device state is of kind {kind!r}")
            self.paged = _described(PagedShape, config, info)
            if config.num_prompts is not None:
                raise ValueError("--num-prompts: only for a model program (its requests)")
            if not (config.prompt_lens or (1, 1))[1] < self.paged.max_len:
                raise ValueError(f"--prompt-lens must lie in 1..{self.paged.max_len - 1} "
                                 "(max_blocks_per_seq * block_size - 1)")  # fmt: skip
            self.tolerance = TOLERANCE.get(self.paged.torch_dtype, 1e-2)
            shape = self.paged.describe()
            self.resolved.update(shape=shape, buckets=shape["buckets"])
        else:
            self.calls = self._calls(config, info, devices)
            shown = self.calls.describe()
            self.tolerance = float(shown["tolerance"])
            self.resolved.update(batch_sizes=list(self.calls.batch_sizes),
                                 buckets=list(self.calls.buckets),
                                 shape=shown["shape"])  # fmt: skip

    @staticmethod
    def _calls(config: LoadConfig, info: Mapping[str, Any], devices: tuple[int, ...]) -> Any:
        buckets = tuple(sorted(int(b) for b in info.get("buckets", [])))
        if not buckets:
            raise LoadTestError(f"the daemon reports no buckets for {config.program!r}")
        batch_sizes = config.batch_sizes if config.batch_sizes is not None else buckets
        too_big = [b for b in batch_sizes if b > buckets[-1]]
        if too_big:
            raise ValueError(f"--batch-sizes: {too_big} larger than the largest bucket "
                             f"{buckets[-1]} of {config.program!r} (buckets {list(buckets)})")
        problem = not_attention(info)
        if problem is not None:
            raise _refuse(config, info, f"not attention-shaped: {problem}")
        shape, described = attention_shape(config.program, info, config.shape)
        return AttentionWorkload(shape, devices, tuple(batch_sizes), buckets, seed=config.seed,
                                 verify=config.verify_share("calls"),
                                 described=described)  # fmt: skip


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
    """Run the load test (bounded: docs/loadtest.md, "The end of a run"); returns the
    report, also written to ``config.report_dir`` if set. ``started`` is called with the
    run and its plan when sending begins (to watch a run from outside)."""
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    client = Client(
        config.endpoint, timeout=config.timeout_s, name="graphlane-loadtest",
        server_key=config.server_key, client_key=config.client_key,
    )  # fmt: skip
    # Every task that calls the client; all are ended before it closes (a call still in
    # flight while the client closes could open a socket that then blocks its shutdown).
    spawned: set[asyncio.Future[Any]] = set()
    progress: Progress | None = None
    try:
        hello = await client.connect()
        plan = Plan(config, hello)
        checked = (
            {} if plan.calls is None
            else await attention.preflight(client, config, plan.calls, spawned)
        )
        start = time.monotonic()
        rec = Recorder(start, window_for(config.duration_s), config.seed)
        run = Run(
            config, client, rec, stop_at=start + config.duration_s,
            stop=stop or asyncio.Event(), tasks=spawned, verify=plan.verify,
        )  # fmt: skip
        if config.progress:
            progress = Progress(run)
            spawned.add(asyncio.create_task(progress.tick()))
        if started is not None:
            started(run, plan)
        serving: Serving | None = None
        if plan.calls is not None:
            await attention.drive_calls(run, plan.calls)
        elif plan.paged is not None:
            await drive_sequences(run, plan.paged, plan.devices)
        else:
            assert plan.model is not None
            serving = Serving(run, plan.model, plan.devices)
            if progress is not None:
                progress.detail = serving.progress_line
            await serving.drive()
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
