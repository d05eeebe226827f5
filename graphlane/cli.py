"""The ``graphlane`` command line (also ``python -m graphlane``): ``serve`` and ``status``
run the daemon and ask it (graphlane.orchestrator, graphlane.client), the other commands
are tools (graphlane.loadtest, graphlane.bench, graphlane.demo; the example is npusim's)."""

from __future__ import annotations

# Few imports here: a Ctrl-C before main() starts is Python's own traceback, so the
# module that main() lives in loads fast; each command imports what it needs.
import argparse
import os
import sys
from typing import Any


class _Parser(argparse.ArgumentParser):
    """No abbreviated flags (``--device 2`` must not mean ``--devices 2``); subcommands'
    parsers are of the same class, so this holds for every one of them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


class _CommandParser(_Parser):
    """A subcommand's parser: a flag it does not know is its own error, with its usage
    (``graphlane serve --devises 2`` shows serve's, not the top-level one, as argparse
    would by handing the leftovers up), and a near miss is named."""

    def parse_known_args(  # type: ignore[override]
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._near_miss(extras)}")
        return parsed, extras

    def _near_miss(self, extras: list[str]) -> str:
        import difflib

        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        for word in extras:
            if word.startswith("--"):
                close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1)
                if close:
                    return f" (did you mean {close[0]}?)"
        return ""


def _parser() -> argparse.ArgumentParser:
    from graphlane import __version__
    from graphlane.orchestrator.config import DEFAULT_LISTEN

    p = _Parser(
        prog="graphlane",
        description="Keep captured NPU graphs hot and patch their parameters between replays.",
    )
    p.add_argument("--version", action="version", version=f"graphlane {__version__}")
    sub = p.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_CommandParser
    )

    s = sub.add_parser(
        "serve",
        help="run the daemon: one worker process per device",
        description="Run the graphlane daemon: an orchestrator on --listen and one worker "
        "process per device, each with its programs captured. Settings come from --config "
        "(TOML), then these flags. Without any, it serves the 'attention' program on 2 "
        "simulated devices on " + DEFAULT_LISTEN + ". SIGTERM/SIGINT drain and stop it.",
    )
    s.add_argument("--config", metavar="FILE", help="TOML configuration file")
    s.add_argument(
        "--backend",
        choices=["sim", "npu", "null"],
        help="device backend: sim (default), npu (torch_npu), null (no device: for measuring "
        "graphlane itself)",
    )
    s.add_argument("--devices", metavar="N|LIST", help="device count (2) or ids (0,3)")
    s.add_argument(
        "--cpu-affinity",
        choices=["auto", "off"],
        help="auto (default): each sim/null worker on a core of its own; off: no pinning "
        "(cores per device: cpu_affinity in --config)",
    )
    s.add_argument(
        "--listen", metavar="ENDPOINT", help=f"tcp:// or ipc:// (default {DEFAULT_LISTEN})"
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on this port (0: any free port)",
    )
    s.add_argument(
        "--auth-dir",
        metavar="DIR",
        help="CurveZMQ: serve with DIR/server.key_secret, admit the keys in DIR/clients/",
    )
    s.add_argument(
        "--advertise-host",
        metavar="HOST",
        help="host clients should use to reach the workers (with a wildcard --listen)",
    )
    s.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback tcp --listen without --auth-dir",
    )
    s.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    s.add_argument("--log-format", choices=["text", "json"], help="log lines as text or JSON")
    s.add_argument("--ready-file", metavar="PATH", help=argparse.SUPPRESS)

    st = sub.add_parser(
        "status",
        help="show the daemon's workers",
        description="Ask a running daemon for its status. With --wait, wait until every "
        "worker is ready: exit 0 then, 1 at the deadline. Exit 1 also when no daemon "
        "answers within --timeout, 2 when --connect is not a daemon's endpoint (malformed, "
        "or a device's worker endpoint as status lists them).",
    )
    st.add_argument(
        "--connect",
        metavar="ENDPOINT[,ENDPOINT...]",
        default=DEFAULT_LISTEN,
        help="the daemon, or several (one per host), or a DNS name of several",
    )
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    st.add_argument("--wait", type=float, metavar="SECONDS", help="wait for readiness")
    st.add_argument("--timeout", type=float, default=5.0, help="per-request timeout (5 s)")
    _add_key_flags(st)

    k = sub.add_parser(
        "keys",
        help="generate CurveZMQ keypairs",
        description="Generate a CurveZMQ keypair: DIR/NAME.key (public) and DIR/NAME.key_secret. "
        "For the daemon, use --name server in its --auth-dir; for a client, copy its "
        "NAME.key into the daemon's DIR/clients/ to admit it. Secret keys belong outside "
        "any repository (default DIR: ~/.config/graphlane/keys); in a repository, ignore "
        "them ('*.key_secret' in .gitignore).",
    )
    ksub = k.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    kg = ksub.add_parser(
        "generate",
        help="write DIR/NAME.key and DIR/NAME.key_secret",
        description="Write a CurveZMQ keypair: DIR/NAME.key (public, to share) and "
        "DIR/NAME.key_secret (owner-only). Warns when the secret would land in a git "
        "repository that does not ignore it.",
    )
    kg.add_argument(
        "directory",
        metavar="DIR",
        nargs="?",
        help="where to write the keys, created if needed (default "
        "$XDG_CONFIG_HOME/graphlane/keys, else ~/.config/graphlane/keys)",
    )
    kg.add_argument("--name", required=True, help="key name, e.g. server or scheduler-1")

    ex = sub.add_parser(
        "example",
        help="capture, patch and replay a layered attention graph on the simulated NPU",
        description="Capture a decode-attention graph once on the simulated NPU, then patch "
        "its sequence lengths between replays and check each result against eager compute.",
    )
    ex.add_argument("--steps", type=int, default=8, help="steps to run (default 8)")
    ex.add_argument("--layers", type=int, default=4, help="attention layers (default 4)")

    cf = sub.add_parser(
        "config",
        help="check a configuration file",
        description="Check a TOML configuration as 'serve --config FILE' would read it, "
        "without starting anything: every key, the programs and their keys.",
    )
    cfsub = cf.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    cc = cfsub.add_parser(
        "check",
        help="load FILE and print the resolved settings, or the first error",
        description="Load FILE as the daemon would; print the resolved settings and exit 0, "
        "or print the setting to change and exit 2.",
    )
    cc.add_argument("file", metavar="FILE", help="the TOML configuration to check")

    from graphlane.loadtest.cli import add_parser as add_loadtest_parser

    add_loadtest_parser(sub)

    b = sub.add_parser(
        "bench",
        help="measure pipelining, the control plane and scaling side by side",
        description="Measure, side by side in one run, and print as ratios: the step "
        "pipeline on the timed sim (serial vs pipelined vs the limit, latency vs the floor), "
        "the control plane (step round trip, windowed throughput and tensor bandwidth "
        "against a raw pyzmq+msgpack baseline between two processes), and scaling over 1, 2 "
        "and 4 simulated devices. It starts its own daemons on private ipc endpoints, without "
        "authentication, so it takes no keys: to measure a daemon that requires CurveZMQ, run "
        "'graphlane loadtest --connect EP --server-key FILE --client-key FILE' against it.",
    )
    b.epilog = (
        "exit status: 0 when every goal is met; 1 when a goal failed; 3 when the only "
        "failures are goals this machine cannot judge, marked so with the reason: noisy "
        "(the repeats spread too much for the figure to mean much), a busy machine (a "
        "load average above half the cores when the run began), or an absolute figure "
        "(it measures this machine's CPU as much as graphlane). Run again on a quiet "
        "machine for a verdict on the first two."
    )
    b.add_argument("--json", action="store_true", help="print the figures as JSON")
    b.add_argument("--quick", action="store_true", help="fewer repetitions (noisier)")
    b.add_argument(
        "--field",
        action="store_true",
        help="only the field's costs on npusim's perf mode (issue 42: a scheduler's work, "
        "the vllm-ascend and threaded in-process loops, graphlane's own CPU; minutes)",
    )
    b.add_argument(
        "--tp",
        action="store_true",
        help="only tensor parallel on npusim's perf mode (issue 44: tokens/s decoding ahead "
        "and a lone step's latency through a daemon at TP 1, 2 and 4, HCCL's cost modelled)",
    )

    d = sub.add_parser(
        "demo",
        help="start a daemon on simulated NPUs, load-test it with verification, stop it",
        description="Start the daemon on simulated NPUs serving attention and "
        "paged_attention, and drive every device for half the duration each: a closed-loop "
        "attention load test with a share of the outputs checked against eager attention, "
        "then a scheduler's paged decode loop (sequences prefilled with kv_write, "
        "continuously batched decode steps, blocks reused) with a share of the steps checked "
        "against SDPA over the demo's own copy of the KV; then a tiny Llama (the model "
        "program) generating in a continuously batched loop that decodes ahead, a share of "
        "its sequences checked against transformers' generate. Print the summaries and where "
        "the reports are, stop the daemon and exit: 0 when every checked number and token was "
        "right, 1 otherwise.",
    )
    d.add_argument("--devices", type=int, default=2, help="simulated devices (default 2)")
    d.add_argument("--duration", type=float, default=20.0, help="seconds of load (default 20)")
    d.add_argument("--concurrency", type=int, default=8, help="calls in flight (default 8)")
    d.add_argument(
        "--verify", type=float, default=0.25, help="share of outputs and steps checked (0.25)"
    )
    d.add_argument("--report", metavar="DIR", help="report directory (default reports/demo-TIME)")
    d.add_argument(
        "--deadline",
        type=float,
        metavar="S",
        help="give up after S seconds in all, saying what the demo waited for, stop the "
        "daemon and exit 3 (default: the duration plus 300)",
    )
    return p


def _add_key_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server-key", metavar="FILE", help="the daemon's public key (server.key)")
    p.add_argument("--client-key", metavar="FILE", help="this client's NAME.key_secret")


#: The exit status of a command whose stdout was closed early (``graphlane status | head
#: -1``). The common Unix tools (coreutils' yes, seq, cat) are killed by SIGPIPE there,
#: which the shell reports as 128 + 13 = 141; exiting 141 quietly looks the same to a
#: shell (``$?``, PIPESTATUS, ``set -o pipefail``) without Python's traceback.
EXIT_BROKEN_PIPE = 141
#: The exit status after Ctrl-C (SIGINT): 128 + 2, as a shell reports a command it ended.
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    """Run one ``graphlane`` command; its exit status. Ctrl-C is one line ("interrupted")
    and :data:`EXIT_INTERRUPTED`, except for ``serve``, whose handler drains the daemon
    and exits 0; a stdout closed early (a pipe into ``head``) ends a command quietly with
    :data:`EXIT_BROKEN_PIPE`."""
    words = sys.argv[1:] if argv is None else argv
    command = words[0] if words and not words[0].startswith("-") else ""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not as a traceback at exit
    except KeyboardInterrupt:
        print(f"graphlane{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null first (the recipe of
        # the Python docs, "Note on SIGPIPE").
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "status":
        return _status(args)
    if args.command == "config":
        from graphlane.cli_support import check_config

        return check_config(args.file)
    if args.command == "example":
        from npusim.example import run

        return run(steps=args.steps, layers=args.layers)
    if args.command == "keys":
        from graphlane.cli_support import default_keys_dir, unignored_in_repo
        from graphlane.protocol.security import SecurityError, generate

        try:
            public, secret = generate(args.directory or default_keys_dir(), args.name)
        except SecurityError as exc:
            print(f"graphlane keys: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {public} (public) and {secret} (secret, owner-only)")
        repo = unignored_in_repo(secret)
        if repo is not None:
            print(
                f"graphlane keys: warning: {secret} is inside the git repository {repo} and "
                "not ignored: add '*.key_secret' to its .gitignore, or keep keys outside it "
                f"(e.g. {default_keys_dir()})",
                file=sys.stderr,
            )
        return 0
    if args.command == "loadtest":
        from graphlane.loadtest.cli import main as loadtest_main

        return loadtest_main(args)
    if args.command == "bench":
        import json

        from graphlane.bench.goals import exit_status, goals, machine
        from graphlane.bench.suite import (
            format_field,
            format_report,
            format_tp,
            run_all,
            run_field,
            run_tp,
        )

        before = machine()  # before bench's own processes load the cores
        if args.tp:
            report = run_tp(quick=args.quick)
        elif args.field:
            report = run_field(quick=args.quick)
        else:
            report = run_all(quick=args.quick)
        report = {**report, "machine": before}
        verdicts = goals(report)
        if args.json:
            report["goals"] = verdicts
            for table in ("pipeline_table", "field_table", "tp_table"):
                report.pop(table, None)
            print(json.dumps(report, indent=2))
        elif args.tp:
            print(format_tp(report))
        else:
            print(format_field(report) if args.field else format_report(report))
        return exit_status(verdicts)
    if args.command == "demo":
        from graphlane.demo import run as run_demo

        return run_demo(
            devices=args.devices,
            duration_s=args.duration,
            concurrency=args.concurrency,
            verify=args.verify,
            report_dir=args.report,
            deadline_s=args.deadline,
        )
    return 2


def _serve(args: argparse.Namespace) -> int:
    from graphlane.logs import setup_logging
    from graphlane.orchestrator import config as cfg
    from graphlane.orchestrator.daemon import serve

    try:
        conf = cfg.load(
            args.config,
            {
                "backend": args.backend,
                "devices": args.devices,
                "cpu_affinity": args.cpu_affinity,
                "listen": args.listen,
                "metrics_port": args.metrics_port,
                "log_format": args.log_format,
                "auth_dir": args.auth_dir,
                "insecure": True if args.insecure else None,
                "advertise_host": args.advertise_host,
            },
        )
    except cfg.ConfigError as exc:
        print(f"graphlane serve: configuration error: {exc}", file=sys.stderr)
        return 2
    from graphlane.orchestrator.ports import PortInUse, check_ports
    from graphlane.protocol.security import SecurityError

    try:
        check_ports(conf)  # one line naming the port, before anything starts
    except PortInUse as exc:
        print(f"graphlane serve: {exc}", file=sys.stderr)
        return 1
    setup_logging(args.log_level.upper(), conf.log_format, "daemon")
    try:
        return serve(conf, ready_file=args.ready_file)
    except (PortInUse, SecurityError) as exc:  # taken since the check; an unsafe ipc dir
        print(f"graphlane serve: {exc}", file=sys.stderr)
        return 1


def _status(args: argparse.Namespace) -> int:
    import asyncio

    from graphlane.cli_support import key_flags_problem
    from graphlane.client import Client
    from graphlane.protocol.errors import GraphlaneError, Timeout

    problem = key_flags_problem(args.server_key, args.client_key)
    if problem is not None:
        print(f"graphlane status: {problem}", file=sys.stderr)
        return 2

    async def fetch() -> dict[str, Any]:
        client = Client(
            [e for e in args.connect.split(",") if e],
            timeout=args.timeout,
            server_key=args.server_key,
            client_key=args.client_key,
        )
        try:
            # No answer to hello is said as loadtest says it: whether a daemon runs there.
            from graphlane.cli_support import connect_within, no_daemon

            if args.wait is not None:
                # The wait covers connecting too: the daemon may not be up yet.
                try:
                    left = await connect_within(client, args.wait, args.timeout)
                except Timeout:
                    raise no_daemon(args.connect, args.wait, "--wait", args.server_key) from None
                return await client.wait_ready(left)
            try:
                await client.connect()
            except Timeout:
                raise no_daemon(args.connect, args.timeout, "--timeout", args.server_key) from None
            return await client.status()
        finally:
            await client.close()

    from graphlane.protocol.endpoints import InvalidEndpoint

    try:
        st = asyncio.run(fetch())
    except InvalidEndpoint as exc:  # malformed, or a worker's: --connect is to change
        print(f"graphlane status: --connect: {exc.message}", file=sys.stderr)
        return 2
    except GraphlaneError as exc:
        print(f"graphlane status: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # keys that cannot be used (a public key as the secret one)
        print(f"graphlane status: {exc}", file=sys.stderr)
        return 2
    if args.json:
        import json

        print(json.dumps(st, indent=2, sort_keys=True))
        return 0
    for host in st.get("hosts", [st]):
        print(
            f"daemon {host['state']} at {host['endpoint']} (pid {host['pid']}), "
            f"ready={host['ready']}"
        )
        described: dict[str, Any] = {}
        for w in host["workers"]:
            programs = ", ".join(sorted(w.get("programs") or {}))
            print(
                f"  device {w['device']}: {w['state']:<8} pid {w['pid']} restarts {w['restarts']} "
                f"generation {w.get('generation', 0)} endpoint {w['endpoint']} "
                f"programs [{programs}]"
            )
            if w.get("group"):  # a rank of a tensor-parallel group
                g = w["group"]
                print(
                    f"    group {g['index']} rank {g['rank']} of {g['size']} (devices "
                    f"{g['devices']}, leader {g['leader']}), steps {w.get('steps', 0)}, "
                    f"behind the leader {g.get('behind', 0)}"
                )
            if w.get("last_error") and w["state"] != "ready":
                print(f"    last error: {w['last_error']}")
            for name, d in (w.get("programs") or {}).items():
                described.setdefault(name, d)
        for name, d in sorted(described.items()):
            for line in describe_program(name, d):
                print(f"  {line}")
    return 0


#: Settings that qualify another one, shown only when it is set: a model's seed and
#: init_std make its random weights, and mean nothing for a checkpoint's.
_QUALIFIES = {"seed": "random", "init_std": "random"}


def _applies(key: str, config: dict[str, Any]) -> bool:
    """Whether ``status`` shows a program's setting: not the buckets (shown apart), not
    an option left unset, not one that qualifies an option left unset."""
    if key == "buckets" or config[key] is None:
        return False
    return key not in _QUALIFIES or config.get(_QUALIFIES[key], True) is not None


def describe_program(name: str, d: Any) -> list[str]:
    """A program's hello entry, readably: config, inputs and outputs (``batch``: the
    batch dimension, one of the buckets), parameters and device-state operations."""
    if not isinstance(d, dict):
        return [f"program {name}"]
    config = d.get("config") or {}
    settings = " ".join(f"{k}={v}" for k, v in config.items() if _applies(k, config))
    lines = [f"program {name}: buckets {d.get('buckets')} {settings}".rstrip()]

    def tensor(kind: str, n: str, spec: Any) -> str:
        if not isinstance(spec, dict):
            return f"  {kind:<6} {n}"
        shape = ", ".join(str(x) for x in spec.get("shape", []))
        return f"  {kind:<6} {n} [{shape}] {spec.get('dtype', '')}".rstrip()

    for n, spec in (d.get("inputs") or {}).items():
        lines.append(tensor("input", n, spec))
    shapes = d.get("output_shapes") or {}
    for n in d.get("outputs") or []:
        lines.append(tensor("output", n, shapes.get(n)))
    for n, what in (d.get("parameters") or {}).items():
        lines.append(f"  param  {n}: {what}")
    for n, what in (d.get("state_ops") or {}).items():
        lines.append(f"  kv op  {n}: {what}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
