"""The command line of ``graphlane loadtest``: its flags, the summary and :func:`main`.
The run itself (the client, torch, rich) is imported when a run starts: graphlane's
command line builds this parser for every command, ``serve`` included (which imports
no torch)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Mapping
from typing import Any

from graphlane.orchestrator.config import DEFAULT_LISTEN
from graphlane.protocol.endpoints import InvalidEndpoint
from graphlane.protocol.errors import GraphlaneError, Timeout

from .availability import MAX_UNAVAILABLE
from .config import DECODE_TOKENS, SHAPE_KEYS, VERIFY, LoadConfig


def _typed(flag: str, convert: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes {what}, not {text!r}") from None

    return parse


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    if not values:
        raise ValueError(text)
    return values


def _number(flag: str) -> Callable[[str], float]:
    return _typed(flag, float, "a number")


def _int_list(flag: str) -> Callable[[str], tuple[int, ...]]:
    return _typed(flag, _ints, "comma-separated integers")


def parse_shape(text: str) -> dict[str, Any]:
    """``layers=2,num_heads=4,dtype=float16`` -> a shape mapping (integers except dtype)."""
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = (x.strip() for x in item.partition("="))
        if not sep or key not in SHAPE_KEYS:
            raise argparse.ArgumentTypeError(
                f"--shape takes KEY=VALUE pairs with KEY in {', '.join(SHAPE_KEYS)}, not {item!r}")
        out[key] = value if key == "dtype" else _typed(f"--shape {key}", int, "an integer")(value)
    return out


_DESCRIPTION = """\
Drive a program of a running graphlane daemon for --duration seconds, as its
hello entry describes it, and measure it: live progress, a summary, and
DIR/report.json and DIR/report.html with PNG plots (docs/loadtest.md).

Programs it can drive (--program): attention-shaped ones (step parameter
actual_seq_lengths_kv, inputs query/key/value, output out; e.g. attention) get
independent calls; one with a paged KV cache (e.g. paged_attention) gets a
decode loop of sequences, continuously batched; a model (e.g. model) gets
requests, measured as vLLM's benchmark_serving does (TTFT, TPOT, ITL). Load:
--concurrency C (closed loop: C calls, live sequences or requests) or --rate R
(open loop: Poisson arrivals at R/s). A --verify share is checked against a
reference computed here; a model's tokens against transformers' greedy
generate, where in bfloat16 or float16 a near tie is not a failure (said in
verify_skipped when the check cannot run here). After a worker restart
(STATE_LOST, WORKER_LOST) each live request is prefilled again and goes on
(a paged sequence is written again). Errors are counted by code; a device
that failed is held back (backoff 10 ms doubling to 1 s)."""

_EPILOG = """\
exit status:
  0  steps succeeded, no checked output was wrong, every error was retryable
     and the server was unavailable for at most --max-unavailable of the time;
  1  a check failed, an error was not retryable, no step succeeded, or the
     server was unavailable for more than --max-unavailable;
  2  invalid flags, or a run that could not start (program not served or not
     one loadtest can drive, shapes differ, --connect is no daemon's);
  3  nothing answered at --connect within --connect-timeout;
  130  Ctrl-C: the first ends the run within a second (summary and report of
     what ran), a second one aborts.

examples:
  graphlane loadtest --connect tcp://127.0.0.1:7450 --program model --request-rate 20 \\
      --num-prompts 200 --prompt-len 64 --output-len 32 --duration 60 --report out-model/
  graphlane loadtest --connect tcp://127.0.0.1:7450 --rate 200 --duration 30 \\
      --verify 0.05 --report out/"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``loadtest`` subcommand to an ``add_subparsers()`` object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "loadtest", help="drive a running daemon with steps and report latency and throughput",
        description=_DESCRIPTION, epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add = p.add_argument
    add("--connect", metavar="ENDPOINT", default=DEFAULT_LISTEN,
        help=f"the daemon's endpoint, tcp://HOST:PORT or ipc://PATH (default {DEFAULT_LISTEN})")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=int, metavar="C",
                      help="closed loop: C calls in flight (live sequences, requests at a time)")
    mode.add_argument("--rate", "--request-rate", dest="rate", type=_number("--rate"),
                      metavar="R", help="open loop: Poisson arrivals at R/s whatever the "
                      "server does (a model: inf sends every one of --num-prompts at once)")
    add("--duration", type=_number("--duration"), required=True, metavar="SECONDS",
        help="how long to send; calls in flight then get at most --timeout more")
    add("--program", default="attention", metavar="NAME",
        help="program to drive (default attention; see above)")
    add("--devices", type=_int_list("--devices"), metavar="LIST",
        help="device ids to send to, e.g. 0,1 (default: every device the daemon serves)")
    add("--batch-sizes", type=_int_list("--batch-sizes"), metavar="LIST",
        help="independent calls: batch sizes drawn uniformly (default: the buckets)")
    add("--verify", type=_number("--verify"), metavar="FRACTION",
        help=f"share of steps (0..1) checked (default {VERIFY['calls']:g} for independent "
        f"calls, {VERIFY['sequences']:g} for sequences and requests)")
    add("--prompt-lens", type=_int_list("--prompt-lens"), metavar="LO,HI",
        help="sequences, requests: prompt lengths drawn in LO..HI (default 1..half the longest)")
    add("--decode-tokens", type=_int_list("--decode-tokens"), metavar="LO,HI",
        help="sequences, requests: tokens to decode, drawn in LO..HI "
        f"(default {DECODE_TOKENS[0]},{DECODE_TOKENS[1]})")
    add("--num-prompts", type=int, metavar="N",
        help="a model: send N requests, end when they are answered (--duration still bounds)")
    add("--prompt-len", type=int, metavar="N", help="a model, as vLLM's random dataset: "
        "prompt lengths in N*(1-RATIO)..N*(1+RATIO) (sets --prompt-lens)")
    add("--output-len", type=int, metavar="N",
        help="as --prompt-len, for the tokens a request generates (sets --decode-tokens)")
    add("--range-ratio", type=_number("--range-ratio"), default=0.0, metavar="RATIO",
        help="the spread of --prompt-len and --output-len, in [0, 1) (default 0)")
    add("--report", metavar="DIR", required=True,
        help="directory for report.json, report.html and its plots (created if needed)")
    add("--shape", type=parse_shape, default={}, metavar="KEY=VALUE,...",
        help="independent calls: the shape of a program whose hello has no 'config': keys "
        f"{', '.join(SHAPE_KEYS)} (defaults those of the attention program)")
    add("--timeout", type=_number("--timeout"), default=30.0, metavar="SECONDS",
        help="deadline of each call, and the most the run waits after --duration (default 30)")
    add("--connect-timeout", type=_number("--connect-timeout"), default=10.0, metavar="SECONDS",
        help="how long to wait for the daemon's first answer; then exit 3 (default 10)")
    add("--max-outstanding", type=int, metavar="N", help="open loop of calls: most calls in "
        "flight; more arrivals count as CLIENT_OVERLOAD (default 10 x rate, 100..10000)")
    add("--server-key", metavar="FILE", help="CurveZMQ: the daemon's server.key")
    add("--client-key", metavar="FILE", help="CurveZMQ: this client's NAME.key_secret")
    add("--max-unavailable", type=_number("--max-unavailable"), default=MAX_UNAVAILABLE,
        metavar="FRACTION", help="fail when the server was unavailable for more than this "
        f"share of the sending time (default {MAX_UNAVAILABLE:g})")
    add("--seed", type=int, default=0, help="seed of arrivals, draws and inputs (default 0)")
    add("--progress", action=argparse.BooleanOptionalAction, default=None,
        help="live progress on stderr (default: when stderr is a terminal)")
    return p


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    """The LoadConfig of parsed ``loadtest`` arguments (ValueError names the flag)."""
    for pair, single in (("prompt_lens", "prompt_len"), ("decode_tokens", "output_len")):
        if getattr(args, pair) is not None and getattr(args, single) is not None:
            flags = f"--{pair.replace('_', '-')} and --{single.replace('_', '-')}"
            raise ValueError(f"{flags} say the same: give one")
    a = args
    return LoadConfig(
        endpoint=a.connect, duration_s=a.duration, concurrency=a.concurrency, rate=a.rate,
        program=a.program, devices=a.devices, batch_sizes=a.batch_sizes, verify=a.verify,
        report_dir=a.report, seed=a.seed, timeout_s=a.timeout, shape=a.shape or {},
        progress=a.progress if a.progress is not None else sys.stderr.isatty(),
        max_outstanding=a.max_outstanding, max_unavailable=a.max_unavailable,
        server_key=a.server_key, client_key=a.client_key, num_prompts=a.num_prompts,
        prompt_lens=_lengths("--prompt-len", a.prompt_len, a.range_ratio) or a.prompt_lens,
        decode_tokens=_lengths("--output-len", a.output_len, a.range_ratio) or a.decode_tokens,
    )  # fmt: skip


def _lengths(flag: str, n: int | None, ratio: float) -> tuple[int, int] | None:
    """vLLM's random dataset: lengths drawn in int(n*(1-ratio))..int(n*(1+ratio))."""
    if n is None:
        return None
    if n < 1:
        raise ValueError(f"{flag} must be >= 1, not {n}")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--range-ratio must lie in [0, 1), not {ratio:g}")
    return max(1, int(n * (1 - ratio))), max(1, int(n * (1 + ratio)))


def print_summary(report: Mapping[str, Any], console: Any = None) -> None:
    """A table of the run's results (:func:`.report.summary_rows`)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from .report import load_text, summary_rows

    t = Table(title=f"graphlane loadtest: {load_text(report)}", show_header=False,
              title_justify="left")  # fmt: skip
    t.add_column(style="bold")
    t.add_column()
    bad = {"errors": bool(report["errors"]), "verified": bool(report["verify_failures"]),
           "result": not report["verdict"]["ok"]}  # fmt: skip
    for name, text in summary_rows(report):
        t.add_row(name, Text(text, style="red" if bad.get(name) else ""))
    if "files" in report:
        t.add_row("report", f"{report['files']['html']}\n{report['files']['json']}")
    (console or Console()).print(t)


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
    from .report import serving_text
    from .run import LoadTestError

    def fail(message: str, code: int = 2) -> int:
        print(f"graphlane loadtest: {message}", file=sys.stderr)
        return code

    try:
        asyncio.run(_first_hello(config, args.connect_timeout))
        report, interrupted = asyncio.run(_run_interruptible(config))
    except NoAnswer as exc:
        return fail(str(exc), EXIT_NO_ANSWER)
    except InvalidEndpoint as exc:  # malformed, or a worker's endpoint
        return fail(f"--connect: {exc.message}")
    except (ValueError, LoadTestError, GraphlaneError) as exc:
        return fail(str(exc))
    print_summary(report)
    if report.get("serving") is not None:
        print(serving_text(report))
    if interrupted:  # the steps so far are summed up and written; the run did not end
        print("graphlane loadtest: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return int(report["verdict"]["exit_code"])


async def _first_hello(config: LoadConfig, wait_s: float) -> dict[str, Any]:
    """The daemon's hello, or NoAnswer naming the endpoint, the wait and its flag."""
    from graphlane.client import Client

    client = Client(config.endpoint, timeout=wait_s, server_key=config.server_key,
                    client_key=config.client_key)  # fmt: skip
    # Ctrl-C cancels the wait through the loop (its wake-up pipe), not as an exception
    # raised wherever the interpreter happens to be: one that landed while the client
    # was connecting was once lost, and the command waited out --connect-timeout.
    loop, me = asyncio.get_running_loop(), asyncio.current_task()
    assert me is not None
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # main thread only
        loop.add_signal_handler(signal.SIGINT, me.cancel)
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


def _announce(run: Any, plan: Any) -> None:
    """What the user must know before the run: a default check that will not run."""
    if plan.verify_skipped:
        print(f"graphlane loadtest: not checking tokens: {plan.verify_skipped}",
              file=sys.stderr)  # fmt: skip


async def _run_interruptible(config: LoadConfig) -> tuple[dict[str, Any], bool]:
    """run_load where the first Ctrl-C ends sending early (the report of
    the steps so far is still written) and a second one aborts; the report, and
    whether a Ctrl-C came."""
    from .driver import run_load
    from .run import STOP_DRAIN_S

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()

    def on_sigint() -> None:
        if stop.is_set() and me is not None:
            me.cancel()
            return
        # Said at once: the drain and the report's plots take a few seconds more.
        print(f"graphlane loadtest: stopping (Ctrl-C): the calls in flight get "
              f"{STOP_DRAIN_S:g} s, then the report is written; Ctrl-C again aborts",
              file=sys.stderr, flush=True)  # fmt: skip
        stop.set()

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
        return await run_load(config, started=_announce), False
    try:
        return await run_load(config, stop=stop, started=_announce), stop.is_set()
    finally:
        loop.remove_signal_handler(signal.SIGINT)
