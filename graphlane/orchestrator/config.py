"""The daemon's configuration: typed and frozen, built once at the edge from the
TOML file, then CLI flags, validated there, and passed whole.

Every key, with its default (``graphlane config check FILE`` loads a file as
``serve`` would, builds its programs as the workers will, and prints the settings or the
one to change; ``serve`` leaves the programs' own keys to its workers: this process
imports no torch):

```toml
listen = "tcp://127.0.0.1:7450"   # the daemon's endpoint (tcp or ipc); the worker of
                                   # device d listens on port + 1 + d (ipc: NAME-worker-d.sock);
                                   # port 0 (or *): any free port, for the daemon and each
                                   # worker (the log and `graphlane status` show which)
backend = "sim"                    # "sim" (simulated NPU), "npu" (torch_npu) or "null" (no device)
devices = 2                        # a count (0..N-1) or a list of device ids, e.g. [0, 3]
depth = 2                          # graph instances per bucket (a ring); why 2: see
                                   #   ServeConfig.depth
pipeline = true                    # false: serial update, replay, wait (the baseline)
record_order = "after-replay"      # pipelined: launch a step's replay, then patch and record
                                   #   (current CANN); "before-replay": records first (ENPU,
                                   #   where a wait issued before its record hangs)
cpu_affinity = "auto"              # "auto": each sim/null worker on a core of its own (its
                                   #   threads share one interpreter lock; why: see
                                   #   graphlane/workers/affinity.py), npu workers and
                                   #   perf-mode sim workers unpinned;
                                   #   "off"; or cores per device, e.g. [[0, 1], [2, 3]]
idle_spin_us = "auto"              # how long an idle worker polls for the next request before
                                   #   it sleeps (while requests come that quickly); "auto":
                                   #   250 when the host has more cores than workers, else 0
                                   #   (off); a number of microseconds (graphlane/workers/loop.py)
max_queued = 256                   # steps a worker accepts beyond those on the device; then BUSY
max_unread_reply_bytes = 268435456 # replies to one connection its reader has not taken yet; past
                                   #   it that connection's device requests get BUSY
startup_timeout_s = 120.0          # a worker's capture and handshake must end within this
max_restarts = 5                   # restarts of a device's worker within restart_window_s,
restart_window_s = 60.0            #   then it is marked failed (all failed: the daemon exits 1)
shutdown_timeout_s = 30.0          # drain: in-flight work gets this long, then SIGTERM, SIGKILL
hang_timeout_s = 30.0              # requests open and none answered (or a health check unanswered)
                                   #   means a hung worker: it is killed and restarted
sequence_grace_s = 10.0            # a client key's sequences outlive its last connection this
                                   #   long (a connection without a key: none; docs/models.md)
log_format = "text"                # or "json": one JSON object per line
metrics_port = 7460                # Prometheus metrics on this port (0: any free port;
                                   #   default: no metrics server)
metrics_host = "127.0.0.1"         # the metrics server's address
auth_dir = "/etc/graphlane/keys"   # CurveZMQ: DIR/server.key_secret, clients in DIR/clients/
                                   #   (default: none, no authentication)
admin_keys = ["ops"]               # with auth_dir: the client keys (clients/NAME.key) that may
                                   #   drain and shut down (default: every admitted key;
                                   #   docs/security.md)
insecure = false                   # allow a non-loopback tcp listen without auth_dir
advertise_host = "node-3"          # the host clients use to reach workers (with a wildcard
                                   #   listen such as tcp://0.0.0.0:7450; default: none)

[sim]                              # backend "sim" only
mode = "compute"                   # or "timed": cost model instead of compute; or "perf":
                                   #   timed, device work costs the host nothing, no checks
task_us = 0.0                      # timed: device time per replayed task
patch_us = 0.0                     # timed: host time per task-group patch
patch_gil_us = 25.0                # perf: the part of patch_us holding the interpreter lock
watchdog_s = 30.0                  # a device wait that nothing satisfies is a deadlock after this
event_mode = "cann"                # or "enpu": an ExternalEvent wait issued before its record is
                                   #   reported (ENPU hangs there; current CANN allows it);
                                   #   or "legacy": older CANN, a wait leaves the flag set
                                   #   until reset
device_memory = 68719476736        # bytes of each simulated device (default 64 GiB)
collective_us = 0.0                # timed/perf: a "hccl" collective's latency
collective_gb_s = 0.0              # timed/perf: its link GB/s (0: latency only)

[faults]                           # for tests only: fail_start = true,
                                   #   hang_device_after = N, device_fault_after = N

[[programs]]                       # one table per program (default: one "attention")
name = "attention"                 # a built-in, an entry point, or module:attr (docs/programs.md)
clients = ["sched-a"]              # with auth_dir: the only client keys this program serves,
                                   #   its device state included (default: every admitted key)
layers = 4                         # the attention program's keys, with their defaults:
num_heads = 8                      #   query heads
num_kv_heads = 2                   #   key/value heads (divides num_heads; GQA when fewer)
head_dim = 64
max_kv_len = 256                   #   static key/value length; step lengths are 1..max_kv_len
buckets = [1, 2, 4, 8]             #   batch sizes captured; a step runs on the smallest that fits
dtype = "float16"                  #   or "bfloat16", "float32"
tensor_parallel = 2                # a model's: groups of N consecutive devices serve it
                                   #   together (devices must be a multiple of N; one
                                   #   endpoint per group, its first device's; default 1)
```

Other programs take the keys their own factory reads (docs/programs.md).

An error names the setting to change: a key of the file as written (``sim.task_us``), a
program's key as ``programs.NAME.KEY`` (the ``[[programs]]`` table whose ``name`` is
NAME; ``programs[i].name`` when that name is missing or repeats), and a value given by a
``serve`` flag as the flag (``--devices``).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .groups import program_key

DEFAULT_LISTEN = "tcp://127.0.0.1:7450"
#: An idle worker polls at most this long (microseconds): past it a sleep's wake-up is
#: a small part of the wait.
MAX_IDLE_SPIN_US = 10_000.0


class ConfigError(ValueError):
    """A setting that cannot be used; ``key`` names it (file key or CLI flag)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


@dataclass(frozen=True)
class SimSettings:
    """The ``[sim]`` table: how the simulated NPU of each worker behaves (backend "sim").

    The daemon does not import the simulator: the worker's sim provider turns these
    settings into the sim's own config (npusim.SimConfig, same fields).
    """

    mode: str = "compute"  # or "timed": a cost model instead of compute; "perf": timed,
    # device work off the interpreter lock, no correctness checks (sim/README.md)
    task_us: float = 0.0  # timed: device time per replayed task
    patch_us: float = 0.0  # timed: host time per task-group patch
    patch_gil_us: float = 25.0  # perf: the part of patch_us that holds the interpreter lock
    watchdog_s: float = 30.0  # a device wait nothing can satisfy is a deadlock after this
    event_mode: str = "cann"  # "enpu": report a wait issued before its record; "legacy": a
    # wait leaves the flag set until reset (older CANN)
    device_memory: int = 64 << 30  # bytes of each simulated device (out of memory beyond)
    collective_us: float = 0.0  # timed/perf: a tensor-parallel collective's latency
    collective_gb_s: float = 0.0  # timed/perf: the link GB/s its bytes cross (0: none)


@dataclass(frozen=True)
class ServeConfig:
    listen: str = DEFAULT_LISTEN
    backend: str = "sim"
    devices: tuple[int, ...] = (0, 1)
    #: Graph instances per bucket, used in turn. 2, by measurement and by what the sim
    #: does not model. Since the engine's update thread dispatches the patches, depth 1,
    #: 2 and 3 measure alike through a daemon (``benchmarks/pipeline.py --depths``,
    #: timed sim, 4 layers, 8 steps in flight, workers pinned: 0.99 of the limit at
    #: depth 1, 2 and 3 for balanced 1500/1500 us, update-bound 1800/600 and
    #: replay-bound 600/1800, single-step latency 1.17-1.23x the floor at each): the host's
    #: dispatch of step N+1's patches overlaps replay N at any depth. The device
    #: differs: with one instance, U applies step N+1's updates only once replay N is
    #: done with the graph, between the two replays, which costs the NPU each update's
    #: device time per step (the sim charges it as zero); with two they are applied on
    #: the other instance during replay N. A third adds nothing measurable and costs
    #: another copy of every static buffer (a program's device memory grows with
    #: depth; steps rotate over instances, so a step without key/value sees what the
    #: latest step on its instance wrote).
    depth: int = 2
    pipeline: bool = True
    #: When a pipelined step's releases (ExternalEvent records) are issued relative to its
    #: replay: "after-replay" (current CANN: the replay of layer k overlaps the dispatch of
    #: layer k+1's patch) or "before-replay" (ENPU, where a wait issued before its record
    #: hangs). README "Deploying" says when to choose which.
    record_order: str = "after-replay"
    #: "auto", "off", or one tuple of cores per device (graphlane.workers.affinity).
    cpu_affinity: str | tuple[tuple[int, ...], ...] = "auto"
    sim: SimSettings = field(default_factory=SimSettings)
    programs: tuple[dict[str, Any], ...] = ({"name": "attention"},)
    #: "auto" or microseconds: how long an idle worker polls its socket before it sleeps
    #: (WorkerLoop._sleep; "auto": :func:`graphlane.workers.affinity.idle_spin_us`).
    idle_spin_us: str | float = "auto"
    max_queued: int = 256
    #: Bytes of replies one connection has not read yet (docs/security.md, "Bounds").
    max_unread_reply_bytes: int = 256 * 2**20
    startup_timeout_s: float = 120.0
    max_restarts: int = 5
    restart_window_s: float = 60.0
    shutdown_timeout_s: float = 30.0
    hang_timeout_s: float = 30.0
    #: How long a CURVE key's sequences are kept after its last connection closed
    #: (docs/models.md, "Whose sequence"); a plain connection's go when it closes.
    sequence_grace_s: float = 10.0
    log_format: str = "text"
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    faults: dict[str, Any] = field(default_factory=dict)
    auth_dir: str | None = None
    #: Names of the client keys (auth_dir/clients/NAME.key) that may drain and shut down;
    #: None: every admitted key (docs/security.md).
    admin_keys: tuple[str, ...] | None = None
    #: A program's ``clients`` (its [[programs]] table's, kept out of the program's own
    #: config): the names of the only keys it serves. A program not here serves every key.
    program_clients: dict[str, tuple[str, ...]] = field(default_factory=dict)
    insecure: bool = False
    advertise_host: str | None = None  # host clients use for workers (with a wildcard listen)
    #: Devices per tensor-parallel group, from the programs' ``tensor_parallel``
    #: (graphlane/orchestrator/groups.py; 1: every device serves alone).
    tensor_parallel: int = 1

    def worker_endpoint(self, device: int) -> str:
        """Where the worker of ``device`` binds: next to the orchestrator's endpoint."""
        from graphlane.protocol.endpoints import worker_endpoint

        return worker_endpoint(self.listen, device)


#: Keys of the file's top level: one per ServeConfig field (programs' clients and
#: tensor_parallel are in their [[programs]] tables).
_TOP_KEYS = frozenset(f.name for f in fields(ServeConfig)) - {"program_clients", "tensor_parallel"}
_FAULTS = {"fail_start": bool, "hang_device_after": int, "device_fault_after": int}


def _int(key: str, v: Any, minimum: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ConfigError(key, f"must be an integer >= {minimum}, not {v!r}")
    return v


def _number(key: str, v: Any, minimum: float = 0.0) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < minimum:
        raise ConfigError(key, f"must be a number >= {minimum}, not {v!r}")
    return float(v)


def parse_devices(key: str, v: Any) -> tuple[int, ...]:
    """A count ("2", 2: devices 0 and 1) or a list ("0,3", [0, 3])."""
    if isinstance(v, str):
        text = v.strip()
        if "," in text or text.startswith("["):
            v = [p for p in text.strip("[]").split(",") if p.strip()]
            try:
                v = [int(p) for p in v]
            except ValueError:
                raise ConfigError(key, f"{text!r} is not a list of device ids") from None
        else:
            try:
                v = int(text)
            except ValueError:
                raise ConfigError(key, f"{text!r} is neither a count nor a list of ids") from None
    if isinstance(v, int) and not isinstance(v, bool):
        if v < 1:
            raise ConfigError(key, "the device count must be >= 1")
        return tuple(range(v))
    if isinstance(v, (list, tuple)) and v:
        ids = tuple(_int(f"{key}[{i}]", d) for i, d in enumerate(v))
        if len(set(ids)) != len(ids):
            raise ConfigError(key, f"device ids repeat: {list(ids)}")
        return ids
    raise ConfigError(key, f"must be a device count or a non-empty list of ids, not {v!r}")


def _listen(key: str, v: Any) -> str:
    """The daemon's endpoint, checked as a client checks one (protocol.endpoints), as a
    bind: tcp or ipc (the workers are other processes), port 1..65535, or 0/* for any."""
    from graphlane.protocol.endpoints import InvalidEndpoint, check_endpoint

    try:
        check_endpoint(v, bind=True, what="endpoint")
    except InvalidEndpoint as exc:
        raise ConfigError(key, exc.message) from None
    if not (v.startswith("tcp://") or v.startswith("ipc://")):
        raise ConfigError(key, f"must be a tcp:// or ipc:// endpoint, not {v!r}")
    return str(v)


def _sim(raw: Any) -> SimSettings:
    if not isinstance(raw, Mapping):
        raise ConfigError("sim", "must be a table")
    for k in raw:
        if k not in ("mode", "task_us", "patch_us", "patch_gil_us", "watchdog_s", "event_mode",
                     "device_memory", "collective_us", "collective_gb_s"):  # fmt: skip
            raise ConfigError(
                f"sim.{k}",
                "unknown key (known: mode, task_us, patch_us, patch_gil_us, watchdog_s, "
                "event_mode, device_memory, collective_us, collective_gb_s)",
            )
    mode = raw.get("mode", "compute")
    if mode not in ("compute", "timed", "perf"):
        raise ConfigError("sim.mode", f"must be 'compute', 'timed' or 'perf', not {mode!r}")
    event_mode = raw.get("event_mode", "cann")
    if event_mode not in ("cann", "legacy", "enpu"):
        raise ConfigError(
            "sim.event_mode", f"must be 'cann', 'legacy' or 'enpu', not {event_mode!r}"
        )
    return SimSettings(
        mode=mode,
        task_us=_number("sim.task_us", raw.get("task_us", 0.0)),
        patch_us=_number("sim.patch_us", raw.get("patch_us", 0.0)),
        patch_gil_us=_number("sim.patch_gil_us", raw.get("patch_gil_us", 25.0)),
        watchdog_s=_number("sim.watchdog_s", raw.get("watchdog_s", 30.0), 0.001),
        event_mode=event_mode,
        device_memory=_bytes("sim.device_memory", raw.get("device_memory", 64 << 30)),
        collective_us=_number("sim.collective_us", raw.get("collective_us", 0.0)),
        collective_gb_s=_number("sim.collective_gb_s", raw.get("collective_gb_s", 0.0)),
    )


def _cpu_affinity(key: str, v: Any) -> str | tuple[tuple[int, ...], ...]:
    """ "auto", "off", or a non-empty list of core lists, each core one this process may use."""
    if v in ("auto", "off"):
        return str(v)
    if not isinstance(v, list) or not v or not all(isinstance(c, list) and c for c in v):
        raise ConfigError(
            key, f"must be 'auto', 'off' or a list of core lists, e.g. [[0], [1]], not {v!r}"
        )
    from graphlane.workers.affinity import available

    cores = set(available())
    out = []
    for i, cpus in enumerate(v):
        for j, c in enumerate(cpus):
            _int(f"{key}[{i}][{j}]", c)
            if cores and c not in cores:
                raise ConfigError(
                    f"{key}[{i}][{j}]",
                    f"core {c} is not available to this process (available: {sorted(cores)})",
                )
        out.append(tuple(cpus))
    return tuple(out)


def _bytes(key: str, v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(key, f"must be a whole number of bytes > 0, not {v!r}")
    return v


def _key_names(key: str, v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(n, str) and n for n in v):
        raise ConfigError(key, f"must be a list of client key names, e.g. ['sched-a'], not {v!r}")
    return tuple(v)


def _programs(raw: Any) -> tuple[tuple[dict[str, Any], ...], dict[str, tuple[str, ...]]]:
    """The programs' configs, and the ``clients`` of those that name them (a setting of
    the daemon's, not of the program: taken out before the program reads its config).
    What a program's own keys say is checked by the program, where it runs: each worker
    builds it at its start (a program it cannot build fails the start, permanently, with
    the key named: the daemon relays that line), and ``graphlane config check`` builds it
    in its own process first (:func:`graphlane.cli_support.check_programs`); the daemon
    imports no torch and reads no model for it."""
    if not isinstance(raw, list) or not raw:
        raise ConfigError("programs", "must be a non-empty array of tables ([[programs]])")
    seen = set()
    out = []
    clients = {}
    for i, p in enumerate(raw):
        if not isinstance(p, Mapping) or not isinstance(p.get("name"), str):
            raise ConfigError(f"programs[{i}].name", "each program needs a name")
        if p["name"] in seen:
            raise ConfigError(f"programs[{i}].name", f"{p['name']!r} appears twice")
        seen.add(p["name"])
        if "clients" in p:
            p = dict(p)
            key = program_key(i, p, "clients")
            clients[p["name"]] = _key_names(key, p.pop("clients"))
        out.append(dict(p))
    return tuple(out), clients


def from_mapping(raw: Mapping[str, Any]) -> ServeConfig:
    for k in raw:
        if k not in _TOP_KEYS:
            raise ConfigError(k, f"unknown key (known: {', '.join(sorted(_TOP_KEYS))})")
    cfg = ServeConfig()
    values: dict[str, Any] = {}
    if "listen" in raw:
        values["listen"] = _listen("listen", raw["listen"])
    if "backend" in raw:
        if raw["backend"] not in ("sim", "npu", "null"):
            raise ConfigError(
                "backend", f"must be 'sim', 'npu' or 'null' (no device), not {raw['backend']!r}"
            )
        values["backend"] = raw["backend"]
    if "devices" in raw:
        values["devices"] = parse_devices("devices", raw["devices"])
    if "depth" in raw:
        values["depth"] = _int("depth", raw["depth"], 1)
    if "pipeline" in raw:
        if not isinstance(raw["pipeline"], bool):
            raise ConfigError("pipeline", "must be true or false")
        values["pipeline"] = raw["pipeline"]
    if "record_order" in raw:
        if raw["record_order"] not in ("after-replay", "before-replay"):
            raise ConfigError(
                "record_order",
                f"must be 'after-replay' or 'before-replay', not {raw['record_order']!r}",
            )
        values["record_order"] = raw["record_order"]
    if "cpu_affinity" in raw:
        values["cpu_affinity"] = _cpu_affinity("cpu_affinity", raw["cpu_affinity"])
    if "idle_spin_us" in raw:
        v = raw["idle_spin_us"]
        if v != "auto":
            v = _number("idle_spin_us", v)
            if v > MAX_IDLE_SPIN_US:
                raise ConfigError(
                    "idle_spin_us", f"must be 'auto' or 0..{MAX_IDLE_SPIN_US:g}, not {v:g}"
                )
        values["idle_spin_us"] = v
    if "sim" in raw:
        values["sim"] = _sim(raw["sim"])
    if "programs" in raw:
        values["programs"], values["program_clients"] = _programs(raw["programs"])
    for k in ("max_queued", "max_restarts", "max_unread_reply_bytes"):
        if k in raw:
            values[k] = _int(k, raw[k], 0 if k == "max_restarts" else 1)
    for k in ("startup_timeout_s", "restart_window_s", "shutdown_timeout_s", "hang_timeout_s"):
        if k in raw:
            values[k] = _number(k, raw[k], 0.001)
    if "sequence_grace_s" in raw:
        values["sequence_grace_s"] = _number("sequence_grace_s", raw["sequence_grace_s"], 0.0)
    if raw.get("metrics_port") is not None:
        values["metrics_port"] = _int("metrics_port", raw["metrics_port"], 0)
        if values["metrics_port"] > 65535:
            raise ConfigError("metrics_port", "must be a TCP port (0..65535)")
    if "metrics_host" in raw:
        if not isinstance(raw["metrics_host"], str) or not raw["metrics_host"]:
            raise ConfigError("metrics_host", "must be a host name or address")
        values["metrics_host"] = raw["metrics_host"]
    if "faults" in raw:
        faults = raw["faults"]
        if not isinstance(faults, Mapping):
            raise ConfigError("faults", "must be a table")
        for k, v in faults.items():
            kind = _FAULTS.get(k)
            if kind is bool:
                ok = isinstance(v, bool)
            else:
                ok = kind is int and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            if not ok:
                raise ConfigError(
                    f"faults.{k}",
                    "unknown fault or wrong value (known: fail_start = true, "
                    "hang_device_after = <steps>, device_fault_after = <steps>)",
                )
        values["faults"] = dict(faults)
    if raw.get("auth_dir") is not None:
        from graphlane.protocol.security import SecurityError, ServerKeys

        try:
            ServerKeys.load(raw["auth_dir"])
        except SecurityError as exc:
            raise ConfigError("auth_dir", str(exc).split(": ", 1)[-1]) from None
        values["auth_dir"] = str(raw["auth_dir"])
    if raw.get("admin_keys") is not None:
        values["admin_keys"] = _key_names("admin_keys", raw["admin_keys"])
    if raw.get("advertise_host") is not None:
        if not isinstance(raw["advertise_host"], str) or not raw["advertise_host"]:
            raise ConfigError("advertise_host", "must be a host name or address")
        values["advertise_host"] = raw["advertise_host"]
    if "insecure" in raw:
        if not isinstance(raw["insecure"], bool):
            raise ConfigError("insecure", "must be true or false")
        values["insecure"] = raw["insecure"]
    if "log_format" in raw:
        if raw["log_format"] not in ("text", "json"):
            raise ConfigError("log_format", "must be 'text' or 'json'")
        values["log_format"] = raw["log_format"]
    cfg = replace(cfg, **values)
    if not isinstance(cfg.cpu_affinity, str) and len(cfg.cpu_affinity) != len(cfg.devices):
        raise ConfigError(
            "cpu_affinity",
            f"gives cores for {len(cfg.cpu_affinity)} device(s), but {len(cfg.devices)} are "
            "served: one list of cores per device",
        )
    from .groups import GroupError, plan_groups, size_key, tensor_parallel

    try:
        size = tensor_parallel(cfg.programs)
        # not a multiple, not on this host
        plan_groups(cfg.devices, size, cfg.backend, key=size_key(cfg.programs))
    except GroupError as exc:
        raise ConfigError(exc.key, exc.message) from None
    cfg = replace(cfg, tensor_parallel=size)
    _check_roles(cfg, raw)
    _check_port_span(cfg)
    from graphlane.protocol.security import SecurityError, check_bind

    try:
        check_bind(cfg.listen, cfg.auth_dir is not None, cfg.insecure)
    except SecurityError as exc:
        raise ConfigError("listen", str(exc).split(": ", 1)[-1]) from None
    return cfg


def _check_roles(cfg: ServeConfig, raw: Mapping[str, Any]) -> None:
    """Every key name of ``admin_keys`` and of the programs' ``clients`` names a key in
    auth_dir/clients/; without auth_dir there are no keys to tell apart, so none may be
    named (a config that seems to restrict shutdown must not serve without it)."""
    named = [("admin_keys", cfg.admin_keys or ())]
    for i, p in enumerate(raw.get("programs") or ()):
        if isinstance(p, Mapping) and p.get("name") in cfg.program_clients:
            named.append((program_key(i, p, "clients"), cfg.program_clients[p["name"]]))
    if cfg.admin_keys is None and not cfg.program_clients:
        return
    if cfg.auth_dir is None:
        setting = "admin_keys" if cfg.admin_keys is not None else named[1][0]
        raise ConfigError(
            setting,
            "names client keys, but authentication is off: roles need CurveZMQ "
            "(set auth_dir or --auth-dir), or remove this setting",
        )
    from graphlane.protocol.security import client_keys

    clients = Path(cfg.auth_dir) / "clients"
    known = client_keys(clients)
    for setting, names in named:
        for name in names:
            if name not in known:
                raise ConfigError(
                    setting,
                    f"no client key named {name!r}: {clients / name}.key does not exist "
                    f"(keys there: {', '.join(sorted(known)) or 'none'})",
                )


def _check_port_span(cfg: ServeConfig) -> None:
    """The workers' tcp ports (listen + 1 + device id) exist, and the metrics port is
    none of the daemon's own."""
    from graphlane.protocol.endpoints import tcp_port

    port = tcp_port(cfg.listen)
    if port is None:
        return
    last = port + 1 + max(cfg.devices)
    if last > 65535:
        raise ConfigError(
            "listen",
            f"port {port} leaves no port for device {max(cfg.devices)}'s worker (workers use "
            f"the listen port + 1 + device id: {last} > 65535); choose a lower port",
        )
    if cfg.metrics_port in (port, *(port + 1 + d for d in cfg.devices)):
        raise ConfigError(
            "metrics_port",
            f"{cfg.metrics_port} is one of the daemon's own ports (listen {port}, workers "
            f"listen + 1 + device id); choose another",
        )


def flag_name(key: str) -> str:
    """The ``serve`` flag that sets file key ``key`` (``cpu_affinity``: ``--cpu-affinity``)."""
    return "--" + key.replace("_", "-")


def load(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> ServeConfig:
    """The file (if any), then ``overrides`` (CLI flags, already named as file keys).

    A setting that came from a flag is named as that flag in a ConfigError (a user who
    typed ``--devices 0,x`` looks for ``--devices``, not for a file key)."""
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError("--config", f"{path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("--config", f"{path} is not valid TOML: {exc}") from None
    flagged = set()
    for k, v in (overrides or {}).items():
        if v is not None:
            raw[k] = v
            flagged.add(k)
    try:
        return from_mapping(raw)
    except ConfigError as exc:
        root = re.split(r"[.\[]", exc.key, maxsplit=1)[0]
        if root not in flagged:
            raise
        raise ConfigError(flag_name(root), exc.message) from None
