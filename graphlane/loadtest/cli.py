"""The command line of ``graphlane loadtest``: its flags, the summary table and :func:`main`.

See :mod:`graphlane.loadtest`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from graphlane.client import Client
from graphlane.orchestrator.config import DEFAULT_LISTEN
from graphlane.protocol.endpoints import InvalidEndpoint
from graphlane.protocol.errors import GraphlaneError, Timeout

from .attention import SHAPE_KEYS
from .availability import MAX_UNAVAILABLE
from .config import DECODE_TOKENS, VERIFY, LoadConfig
from .driver import run_load
from .report import load_text
from .workload import LoadTestError


# ---------------------------------------------------------------------------- command line
def _int_list(flag: str) -> Callable[[str], tuple[int, ...]]:
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} takes comma-separated integers, not {text!r}"
            ) from None
        if not values:
            raise argparse.ArgumentTypeError(f"{flag} needs at least one value")
        return values

    return parse


def parse_shape(text: str) -> dict[str, Any]:
    """``layers=2,num_heads=4,dtype=float16`` -> a shape mapping (integers except dtype)."""
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in SHAPE_KEYS:
            raise argparse.ArgumentTypeError(
                f"--shape takes KEY=VALUE pairs with KEY in {', '.join(SHAPE_KEYS)}, not {item!r}"
            )
        if key == "dtype":
            out[key] = value.strip()
            continue
        try:
            out[key] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--shape {key} must be an integer") from None
    return out


def _number(flag: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes a number, not {text!r}") from None
        return v

    return parse


_DESCRIPTION = """\
Drive a program of a running graphlane daemon for --duration seconds, as its
hello entry describes it, and measure it. Shows live progress, prints a summary
and writes DIR/report.json and DIR/report.html (with PNG plots).

Programs it can drive (--program): attention-shaped ones (step parameter
actual_seq_lengths_kv, inputs query/key/value, output out; e.g. attention), and
ones with a paged KV cache (e.g. paged_attention).

A program without device state (e.g. attention) gets independent calls:
  closed loop (--concurrency C): C calls in flight, each caller sending its next
      call when the previous one is answered;
  open loop (--rate R): Poisson arrivals at R calls/s, latency measured from each
      arrival's scheduled time, so a stalled server shows as latency, not as
      fewer arrivals.
  With --verify F, a share F of the calls carry their own query/key/value and
  their output is checked against eager attention; the others send lengths and
  a query only. --batch-sizes and --shape apply.

A program that keeps a paged KV cache on the device (its hello entry says so, e.g.
paged_attention) gets a scheduler's decode loop instead, with its shapes from
hello: sequences arrive (--concurrency C: C live sequences, a new one when one
ends; --rate R: R sequence arrivals/s), get blocks from a client-side allocator,
have a random prompt (--prompt-lens) written into their slots with kv_write, and
decode --decode-tokens tokens in continuously batched steps (one step in flight
per device; arrivals join, finished sequences leave and their blocks are reused).
A --verify share of the steps (default 0.2) is checked against
scaled_dot_product_attention over the client's own copy of the KV. After a
worker restart (STATE_LOST) the live sequences are written again; nothing
computed on an emptied cache counts as verified. The report adds tokens/s, batch
occupancy (mean batch / bucket), request bytes per step and the sequences.

Errors are counted by code, never retried as the same call. After an error on a
device, that device is held back: a random pause in [d/2, d], d doubling per
consecutive error from 10 ms up to 1 s, reset by a success; callers draw other
devices meanwhile and wait only when every device is held.

Any other program is refused with what its hello entry describes: the load test
cannot know what values another program's inputs and parameters take; drive it
with graphlane.Client."""

_EPILOG = """\
exit status:
  0  steps succeeded, no verified output was wrong, every error was retryable
     (BUSY, TIMEOUT, WORKER_LOST, SHUTTING_DOWN, CLIENT_OVERLOAD, CLIENT_DEADLINE)
     and the server was unavailable for at most --max-unavailable of the time;
  1  a verification failed, an error was not retryable, no step succeeded, or
     the server was unavailable for more than --max-unavailable of the sending
     time: a window of the time series (~1/120 of the run, >= 0.25 s) is
     unavailable when no step succeeded in it and calls got WORKER_LOST,
     SHUTTING_DOWN, TIMEOUT or CLIENT_DEADLINE (or none ended, right after such
     a window);
  2  invalid flags (also a flag the program's shape of load does not read), or
     a run that could not start (the program is not served or not one loadtest
     can drive, its shapes differ, --connect is no daemon's);
  3  nothing answered at --connect within --connect-timeout (no daemon there,
     or one with other CurveZMQ keys);
  130  Ctrl-C: one line, "interrupted". After the run started, the first Ctrl-C
     ends the sending, prints the summary and writes the report of the steps
     so far, then exits 130; a second one aborts at once.

examples:
  graphlane loadtest --connect tcp://127.0.0.1:7450 --rate 200 --duration 30 \\
      --verify 0.05 --report out/
  graphlane loadtest --connect tcp://127.0.0.1:7450 --program paged_attention \\
      --concurrency 16 --duration 30 --report out-paged/"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``loadtest`` subcommand to an ``add_subparsers()`` object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "loadtest",
        help="drive a running daemon with steps and report latency and throughput",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--connect",
        metavar="ENDPOINT",
        default=DEFAULT_LISTEN,
        help=f"the daemon's endpoint, tcp://HOST:PORT or ipc://PATH (default {DEFAULT_LISTEN})",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--concurrency",
        type=int,
        metavar="C",
        help="closed loop: keep C calls in flight, each caller sending its next call when "
        "the previous one is answered (a program with device state: C live sequences)",
    )
    mode.add_argument(
        "--rate",
        type=_number("--rate"),
        metavar="R",
        help="open loop: Poisson arrivals at R calls/s, whatever the server does (a program "
        "with device state: R sequence arrivals/s)",
    )
    p.add_argument(
        "--duration",
        type=_number("--duration"),
        required=True,
        metavar="SECONDS",
        help="how long to send steps; calls in flight then get at most --timeout more",
    )
    p.add_argument(
        "--program",
        default="attention",
        metavar="NAME",
        help="program to drive (default attention): a stateless attention-shaped one, or "
        "one with a paged KV cache (e.g. paged_attention: the decode loop above); "
        "loadtest refuses others, see above",
    )
    p.add_argument(
        "--devices",
        type=_int_list("--devices"),
        metavar="LIST",
        help="device ids to send to, e.g. 0,1 (default: every device the daemon serves)",
    )
    p.add_argument(
        "--batch-sizes",
        type=_int_list("--batch-sizes"),
        metavar="LIST",
        help="independent calls: batch sizes to draw from uniformly, e.g. 1,3,8 (default: "
        "the program's buckets)",
    )
    p.add_argument(
        "--verify",
        type=_number("--verify"),
        default=None,
        metavar="FRACTION",
        help="fraction of steps (0..1) checked against a reference computed here (default "
        f"{VERIFY['calls']:g} for independent calls, {VERIFY['sequences']:g} for sequences)",
    )
    p.add_argument(
        "--prompt-lens",
        type=_int_list("--prompt-lens"),
        metavar="LO,HI",
        help="sequences: prompt lengths drawn uniformly in LO..HI "
        "(default 1..half the longest sequence)",
    )
    p.add_argument(
        "--decode-tokens",
        type=_int_list("--decode-tokens"),
        metavar="LO,HI",
        help="sequences: tokens each sequence decodes, drawn uniformly in LO..HI "
        f"(default {DECODE_TOKENS[0]},{DECODE_TOKENS[1]})",
    )
    p.add_argument(
        "--report",
        metavar="DIR",
        required=True,
        help="directory for report.json, report.html and its PNG plots (created if needed)",
    )
    p.add_argument(
        "--shape",
        type=parse_shape,
        default={},
        metavar="KEY=VALUE,...",
        help="independent calls: the shapes of an attention-shaped program whose hello "
        "entry has no "
        "'config' (the daemon's built-in programs describe themselves): keys "
        + ", ".join(SHAPE_KEYS)
        + " (defaults num_heads=8,num_kv_heads=2,head_dim=64,max_kv_len=256,dtype=float16; "
        "layers from the daemon)",
    )
    p.add_argument(
        "--timeout",
        type=_number("--timeout"),
        default=30.0,
        metavar="SECONDS",
        help="deadline of each call, and the most the run waits after --duration (default 30)",
    )
    p.add_argument(
        "--connect-timeout",
        type=_number("--connect-timeout"),
        default=10.0,
        metavar="SECONDS",
        help="how long to wait for the daemon's first answer; then exit 3 (default 10)",
    )
    p.add_argument(
        "--max-outstanding",
        type=int,
        metavar="N",
        help="open loop of calls: most calls in flight; arrivals over it count as "
        "CLIENT_OVERLOAD "
        "(default 10 x rate, within 100..10000)",
    )
    p.add_argument("--server-key", metavar="FILE", help="CurveZMQ: the daemon's server.key")
    p.add_argument(
        "--client-key", metavar="FILE", help="CurveZMQ: this client's NAME.key_secret"
    )
    p.add_argument(
        "--max-unavailable",
        type=_number("--max-unavailable"),
        default=MAX_UNAVAILABLE,
        metavar="FRACTION",
        help="fail the run when the server was unavailable for more than this fraction of "
        f"the sending time (default {MAX_UNAVAILABLE:g})",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of arrivals, draws and inputs (default 0)"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live progress on stderr (default: when stderr is a terminal)",
    )
    return p


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """The LoadConfig of parsed ``loadtest`` arguments (ValueError names the flag)."""
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    return LoadConfig(
        endpoint=args.connect,
        duration_s=args.duration,
        concurrency=args.concurrency,
        rate=args.rate,
        program=args.program,
        devices=args.devices,
        batch_sizes=args.batch_sizes,
        verify=args.verify,
        report_dir=args.report,
        seed=args.seed,
        timeout_s=args.timeout,
        progress=progress,
        shape=args.shape or {},
        max_outstanding=args.max_outstanding,
        max_unavailable=args.max_unavailable,
        server_key=args.server_key,
        client_key=args.client_key,
        prompt_lens=_pair("--prompt-lens", args.prompt_lens),
        decode_tokens=_pair("--decode-tokens", args.decode_tokens),
    )


def _pair(flag: str, values: tuple[int, ...] | None) -> tuple[int, int] | None:
    if values is None:
        return None
    if len(values) != 2:
        raise ValueError(f"{flag} takes two integers LO,HI")
    return values[0], values[1]


def print_summary(report: Mapping[str, Any], console: Any = None) -> None:
    """A rich table of the run's results."""
    console = console or Console()
    lat = report["latency_ms"]
    cfg = report["config"]
    t = Table(title=f"graphlane loadtest: {load_text(report)}", show_header=False,
              title_justify="left")  # fmt: skip
    t.add_column(style="bold")
    t.add_column()

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    t.add_row("endpoint", str(cfg["endpoint"]))
    t.add_row("program / devices", f"{cfg['program']} on {cfg['devices']}")
    sending = (
        f"interrupted after {report['sending_s']:.2f} s of {report['duration_s']:g} s"
        if report.get("interrupted")
        else f"sending for {report['duration_s']:g} s"
    )
    t.add_row("elapsed", f"{report['elapsed_s']:.2f} s ({sending})")
    t.add_row("steps", f"{report['steps']} of {report['sent']} sent")
    t.add_row("throughput", f"{report['throughput']:.1f} steps/s")
    t.add_row(
        f"latency ms ({report['latency_basis']})",
        "  ".join(f"{k} {ms(lat[k])}" for k in ("p50", "p90", "p99", "p99.9", "max")),
    )
    if "send_lag_ms" in report:
        lag = report["send_lag_ms"]
        t.add_row("send lag ms", f"p50 {ms(lag['p50'])}  p99 {ms(lag['p99'])}")
    if report.get("load") == "sequences":
        seqs, rb = report["sequences"], report["request_bytes"]
        t.add_row("tokens", f"{report['tokens']} ({report['tokens_per_s']:.1f}/s)")
        t.add_row("batch occupancy", f"{report['occupancy']:.2f} (mean batch "
                  f"{report['mean_batch']})")  # fmt: skip
        t.add_row(
            "sequences",
            f"{seqs['arrived']} arrived, {seqs['admitted']} admitted, {seqs['finished']} "
            f"finished, {seqs['cut']} cut at the end, {seqs['never_admitted']} still queued, "
            f"{seqs['reprefilled']} written again",
        )
        if rb["mean"] is not None:
            t.add_row("request bytes/step", f"mean {rb['mean']:.0f}  min {rb['min']}  "
                      f"max {rb['max']}")  # fmt: skip
        if "blocks_reused" in report:
            t.add_row("blocks reused", str(report["blocks_reused"]))
        t.add_row("state lost", str(report["state_lost"]))
    errors = ", ".join(f"{k}: {v}" for k, v in report["errors"].items()) or "none"
    t.add_row("errors", f"[red]{errors}[/]" if report["errors"] else errors)
    if report["verify_fraction"]:
        t.add_row(
            "verified",
            f"{report['verified']} checked, {report['verify_failures']} wrong "
            f"(max |out - reference| {report['verify_max_abs_error']:.2g})",
        )
    verdict = report["verdict"]
    t.add_row(
        "result",
        "[green]ok[/]" if verdict["ok"] else "[red]FAILED[/]: " + "; ".join(verdict["reasons"]),
    )
    if "files" in report:
        t.add_row("report", f"{report['files']['html']}\n{report['files']['json']}")
    console.print(t)


#: Exit status when nothing answered at --connect within --connect-timeout.
EXIT_NO_ANSWER = 3
#: Exit status after Ctrl-C (128 + SIGINT), wherever it landed.
EXIT_INTERRUPTED = 130


class NoAnswer(Exception):
    """Nothing answered hello at the endpoint in time."""


def main(args: argparse.Namespace) -> int:
    """Run ``graphlane loadtest`` from parsed arguments; returns the exit status."""
    try:
        config = config_from_args(args)
        if not args.connect_timeout > 0:
            raise ValueError("--connect-timeout must be a positive number of seconds")
    except ValueError as exc:
        print(f"graphlane loadtest: {exc}", file=sys.stderr)
        return 2
    try:
        return _main(args, config)
    except (KeyboardInterrupt, asyncio.CancelledError):  # wherever Ctrl-C lands
        print("graphlane loadtest: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(args: argparse.Namespace, config: LoadConfig) -> int:
    try:
        asyncio.run(_first_hello(config, args.connect_timeout))
    except NoAnswer as exc:
        print(f"graphlane loadtest: {exc}", file=sys.stderr)
        return EXIT_NO_ANSWER
    except InvalidEndpoint as exc:  # malformed, or a worker's endpoint
        print(f"graphlane loadtest: --connect: {exc.message}", file=sys.stderr)
        return 2
    except (ValueError, GraphlaneError) as exc:
        print(f"graphlane loadtest: {exc}", file=sys.stderr)
        return 2
    try:
        report, interrupted = asyncio.run(_run_interruptible(config))
    except (ValueError, LoadTestError, GraphlaneError) as exc:
        print(f"graphlane loadtest: {exc}", file=sys.stderr)
        return 2
    print_summary(report)
    if interrupted:  # the steps so far are summed up and written; the run did not end
        print("graphlane loadtest: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return int(report["verdict"]["exit_code"])


async def _first_hello(config: LoadConfig, wait_s: float) -> dict[str, Any]:
    """The daemon's hello, or NoAnswer naming the endpoint, the wait and its flag."""
    client = Client(
        config.endpoint, timeout=wait_s,
        server_key=config.server_key, client_key=config.client_key,
    )  # fmt: skip
    # Ctrl-C cancels the wait through the loop (its wake-up pipe), not as an exception
    # raised wherever the interpreter happens to be: one that landed while the client
    # was connecting was once lost, and the command waited out --connect-timeout.
    loop, me = asyncio.get_running_loop(), asyncio.current_task()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # main thread only
        loop.add_signal_handler(signal.SIGINT, me.cancel if me is not None else _no_op)
    try:
        return await client.connect()
    except Timeout:
        keys = " (or it has other keys: CurveZMQ does not answer a client it refuses)"
        raise NoAnswer(
            f"nothing answered at {config.endpoint} within {wait_s:g} s (--connect-timeout): "
            "is the daemon running there?" + (keys if config.server_key else "")
        ) from None
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        await client.close()


def _no_op() -> None:
    pass


async def _run_interruptible(config: LoadConfig) -> tuple[dict[str, Any], bool]:
    """run_load where the first Ctrl-C ends sending early (the report of
    the steps so far is still written) and a second one aborts; the report, and
    whether a Ctrl-C came."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()

    def on_sigint() -> None:
        if stop.is_set() and me is not None:
            me.cancel()
        stop.set()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
        return await run_load(config), False
    try:
        return await run_load(config, stop=stop), stop.is_set()
    finally:
        loop.remove_signal_handler(signal.SIGINT)
