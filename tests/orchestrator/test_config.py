"""The daemon's configuration: validated once at the edge, errors name the key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from graphlane.orchestrator.config import (
    ConfigError,
    ServeConfig,
    from_mapping,
    load,
    parse_devices,
)
from graphlane.workers import affinity


def test_defaults_serve_attention_on_two_simulated_devices_on_loopback() -> None:
    cfg = load()
    assert (cfg.backend, cfg.devices, cfg.listen) == ("sim", (0, 1), "tcp://127.0.0.1:7450")
    assert [p["name"] for p in cfg.programs] == ["attention"]


def test_file_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text(
        'devices = 4\ndepth = 2\n[sim]\nmode = "timed"\ntask_us = 5.0\n'
        '[[programs]]\nname = "attention"\nlayers = 2\n'
    )
    cfg = load(f, {"devices": "0,3", "listen": None})
    assert cfg.devices == (0, 3) and cfg.depth == 2
    assert cfg.sim.mode == "timed" and cfg.sim.task_us == 5.0
    assert cfg.programs[0]["layers"] == 2


def test_perf_mode_and_its_lock_share_are_read(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[sim]\nmode = "perf"\npatch_us = 185.0\npatch_gil_us = 30.0\n')
    cfg = load(f, {})
    assert cfg.sim.mode == "perf" and cfg.sim.patch_gil_us == 30.0


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"listen": "http://x"}, "listen"),
        ({"listen": "tcp://127.0.0.1"}, "listen"),
        ({"listen": "tcp://0.0.0.0:7450"}, "listen"),  # open bind without auth
        ({"backend": "gpu"}, "backend"),
        ({"devices": 0}, "devices"),
        ({"devices": [1, 1]}, "devices"),
        ({"devices": "a,b"}, "devices"),
        ({"depth": 0}, "depth"),
        ({"pipeline": "yes"}, "pipeline"),
        ({"sim": {"mode": "fast"}}, "sim.mode"),
        ({"sim": {"task_us": -1}}, "sim.task_us"),
        ({"sim": {"speed": 1}}, "sim.speed"),
        ({"programs": []}, "programs"),
        ({"programs": [{"name": "attention"}, {"name": "attention"}]}, "programs[1].name"),
        ({"metrics_port": 70000}, "metrics_port"),
        ({"faults": {"explode": True}}, "faults.explode"),
        ({"auth_dir": "/nonexistent"}, "auth_dir"),
        ({"unknown": 1}, "unknown"),
        ({"cpu_affinity": "fast"}, "cpu_affinity"),
        ({"cpu_affinity": [[0], []]}, "cpu_affinity"),
        ({"cpu_affinity": [[0]], "devices": 2}, "cpu_affinity"),  # one list per device
        ({"cpu_affinity": [[0], [-1]]}, "cpu_affinity[1][0]"),
        ({"cpu_affinity": [[0], [4096]]}, "cpu_affinity[1][0]"),  # not a core of this host
        ({"idle_spin_us": -1}, "idle_spin_us"),
        ({"idle_spin_us": 20_000}, "idle_spin_us"),  # over MAX_IDLE_SPIN_US
        ({"idle_spin_us": "fast"}, "idle_spin_us"),
        ({"idle_spin_us": True}, "idle_spin_us"),
    ],
)
def test_errors_name_the_key(raw: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping(raw)
    assert err.value.key == key


@pytest.mark.parametrize(
    ("program", "key"),
    [({"name": "attention", "layers": 0}, "programs.attention.layers"),
     ({"name": "nope"}, "programs.nope.name")],
)  # fmt: skip
def test_a_programs_own_keys_are_checked_by_the_program_not_by_the_daemons_config(
    program: dict, key: str
) -> None:
    """The daemon's config reads a program's table as is (it imports no torch: the
    worker builds the program); config check builds it and names the key."""
    from graphlane.cli_support import check_programs

    conf = from_mapping({"programs": [program]})
    with pytest.raises(ConfigError) as err:
        check_programs(conf)
    assert err.value.key == key


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"devices": "0,x"}, "--devices"),
        ({"devices": "0,-1"}, "--devices"),
        ({"listen": "tcp://127.0.0.1"}, "--listen"),
        ({"metrics_port": 70000}, "--metrics-port"),
        ({"auth_dir": "/nonexistent"}, "--auth-dir"),
        ({"backend": "gpu"}, "--backend"),
    ],
)
def test_a_setting_from_a_flag_is_named_as_the_flag(
    tmp_path: Path, flags: dict, named: str
) -> None:
    """``serve --devices 0,x`` names ``--devices``, the flag typed, not the file key;
    the same value in the file names the key."""
    with pytest.raises(ConfigError) as err:
        load(None, flags)
    assert err.value.key == named and str(err.value).startswith(f"{named}: ")
    f = tmp_path / "c.toml"
    ((key, value),) = flags.items()
    f.write_text(f"{key} = {value!r}\n".replace("'", '"'))
    with pytest.raises(ConfigError) as err:
        load(f)
    assert err.value.key.split("[")[0] == key


def test_a_flag_only_a_files_setting_contradicts_is_named_as_the_flag(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('devices = 4\n[[programs]]\nname = "attention"\ntensor_parallel = 2\n')
    with pytest.raises(ConfigError) as err:
        load(f, {"devices": "3"})
    assert err.value.key == "--devices" and "multiple of 2" in str(err.value)
    f.write_text(f.read_text().replace("devices = 4", "devices = 3"))
    with pytest.raises(ConfigError) as err:  # the file's own count: its key
        load(f, {"devices": None})
    assert err.value.key == "devices"


TINY_MODEL = {"name": "model", "block_size": 128, "random": {
    "model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}}  # fmt: skip


@pytest.mark.parametrize(
    ("program", "key", "bound"),
    [
        ({**TINY_MODEL, "max_sequences": 8, "max_sequences_per_client": 9},
         "max_sequences_per_client", "max_sequences"),
        ({**TINY_MODEL, "max_sequences_per_client": 4097}, "max_sequences_per_client",
         "max_sequences"),  # above the other's default
    ],
)  # fmt: skip
def test_a_cap_above_the_cap_that_bounds_it_is_refused_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], program: dict, key: str, bound: str
) -> None:
    """A client's sequences above the worker's could never be reached: config check
    refuses it in one line naming both keys."""
    from graphlane.cli import main
    from graphlane.cli_support import check_programs

    name = program["name"]
    with pytest.raises(ConfigError) as err:
        check_programs(from_mapping({"programs": [program]}))
    assert err.value.key == f"programs.{name}.{key}"
    assert f"programs.{name}.{bound}" in str(err.value)
    f = tmp_path / "c.toml"
    lines = [f"{k} = {v!r}" for k, v in program.items() if k != "random"]
    lines += [f"{k} = {v!r}" for k, v in program.get("random", {}).items()]
    if "random" in program:
        lines.insert(len(program) - 1, "[programs.random]")
    f.write_text("[[programs]]\n" + "\n".join(lines).replace("'", '"') + "\n")
    assert main(["config", "check", str(f)]) == 2
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err_lines) == 1 and f"programs.{name}.{bound}" in err_lines[0], err_lines
    fixed = {**program, bound: program[key]}
    check_programs(from_mapping({"programs": [fixed]}))  # equal: taken


def test_open_bind_is_allowed_when_insecure_is_explicit() -> None:
    assert from_mapping({"listen": "tcp://0.0.0.0:7450", "insecure": True}).insecure


def test_worker_endpoints_sit_next_to_the_daemon() -> None:
    assert ServeConfig(listen="tcp://127.0.0.1:7450").worker_endpoint(3) == "tcp://127.0.0.1:7454"
    assert ServeConfig(listen="tcp://127.0.0.1:0").worker_endpoint(3) == "tcp://127.0.0.1:0"
    ipc = ServeConfig(listen="ipc:///run/g/daemon.sock").worker_endpoint(1)
    assert ipc == "ipc:///run/g/daemon-worker-1.sock"


def test_device_lists() -> None:
    assert parse_devices("d", "2") == (0, 1)
    assert parse_devices("d", "[0, 5]") == (0, 5)
    assert parse_devices("d", [2]) == (2,)


def test_cpu_affinity_auto_off_or_cores_per_device() -> None:
    assert load().cpu_affinity == "auto"
    assert from_mapping({"cpu_affinity": "off"}).cpu_affinity == "off"
    cores = sorted(os.sched_getaffinity(0))
    cfg = from_mapping({"devices": 2, "cpu_affinity": [[cores[0]], cores]})
    assert cfg.cpu_affinity == ((cores[0],), tuple(cores))


def test_auto_pins_each_sim_or_null_worker_to_a_core_of_its_own() -> None:
    cores = affinity.available()
    if len(cores) < 2:
        pytest.skip("one core: nothing to choose (auto pins nothing)")
    for backend in ("sim", "null"):
        plan = affinity.core_sets("auto", backend, 2, offset=7)
        assert all(p is not None and len(p) == 1 for p in plan)
        assert plan[0] != plan[1] and {p[0] for p in plan if p} <= set(cores)
    # npu: the patches' host work runs outside the interpreter lock; off: nothing pinned
    assert affinity.core_sets("auto", "npu", 2, offset=7) == [None, None]
    assert affinity.core_sets("off", "sim", 2, offset=7) == [None, None]
    # npusim's perf mode: the modelled host work sleeps off the lock, as an npu worker's
    assert affinity.core_sets("auto", "sim", 2, offset=7, sim_mode="perf") == [None, None]
    assert affinity.core_sets("auto", "sim", 2, offset=7, sim_mode="timed")[0] is not None
    assert affinity.core_sets(((0,), (0, 1)), "npu", 2, offset=7) == [(0,), (0, 1)]


def test_idle_spin_us_auto_spins_only_where_the_host_has_a_core_to_spare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert load().idle_spin_us == "auto"
    assert from_mapping({"idle_spin_us": 0}).idle_spin_us == 0.0
    assert from_mapping({"idle_spin_us": 80.5}).idle_spin_us == 80.5
    monkeypatch.setattr(affinity, "available", lambda: (0, 1))
    assert affinity.idle_spin_us("auto", 1) == affinity.AUTO_IDLE_SPIN_US
    assert affinity.idle_spin_us("auto", 2) == 0.0  # a worker per core: none to spare
    assert affinity.idle_spin_us(40.0, 4) == 40.0  # a number is what it says
    monkeypatch.setattr(affinity, "available", lambda: ())  # the OS cannot say
    assert affinity.idle_spin_us("auto", 1) == 0.0


def _auth_dir(tmp_path: Path) -> str:
    from graphlane.protocol.security import generate

    generate(tmp_path / "keys", "server")
    for name in ("ops", "sched-a"):
        generate(tmp_path / "keys" / "clients", name)
    return str(tmp_path / "keys")


def test_roles_name_client_keys_and_clients_stay_out_of_the_program(tmp_path: Path) -> None:
    keys = _auth_dir(tmp_path)
    f = tmp_path / "c.toml"
    f.write_text(
        f'auth_dir = "{keys}"\nadmin_keys = ["ops"]\n'
        '[[programs]]\nname = "attention"\nlayers = 2\nclients = ["sched-a", "ops"]\n'
        '[[programs]]\nname = "paged_attention"\n'
    )
    cfg = load(f)
    assert cfg.admin_keys == ("ops",)
    assert cfg.program_clients == {"attention": ("sched-a", "ops")}
    # The program's own config (what load_program and hello see) has no clients key.
    assert cfg.programs[0] == {"name": "attention", "layers": 2}
    assert load(None, {"auth_dir": keys}).admin_keys is None  # default: no roles


@pytest.mark.parametrize(
    ("raw", "key", "named"),
    [
        ({"admin_keys": ["ghost"]}, "admin_keys", "ghost"),
        ({"admin_keys": "ops"}, "admin_keys", "client key names"),
        ({"programs": [{"name": "attention"},
                       {"name": "paged_attention", "clients": ["ops", "nobody"]}]},
         "programs.paged_attention.clients", "nobody"),
        ({"programs": [{"name": "attention", "clients": [1]}]}, "programs.attention.clients",
         "client key names"),
    ],
)  # fmt: skip
def test_roles_naming_no_client_key_are_errors_naming_the_setting(
    tmp_path: Path, raw: dict, key: str, named: str
) -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping({"auth_dir": _auth_dir(tmp_path), **raw})
    assert err.value.key == key and named in str(err.value)


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"admin_keys": ["ops"]}, "admin_keys"),
        ({"programs": [{"name": "attention", "clients": ["ops"]}]}, "programs.attention.clients"),
    ],
)
def test_roles_without_authentication_are_an_error(tmp_path: Path, raw: dict, key: str) -> None:
    """Without CurveZMQ there are no keys to tell apart: a config that seems to restrict
    shutdown or a program must not serve as if it did. With auth_dir it loads."""
    with pytest.raises(ConfigError) as err:
        from_mapping(raw)
    assert err.value.key == key and "auth_dir" in str(err.value)
    assert from_mapping({**raw, "auth_dir": _auth_dir(tmp_path)}).auth_dir is not None


def test_the_sim_section_reaches_the_simulators_own_config() -> None:
    """[sim] keys are the simulator's own settings (npusim.SimConfig), checked at load."""
    assert from_mapping({"sim": {"device_memory": 1 << 30}}).sim.device_memory == 1 << 30
    assert from_mapping({}).sim.device_memory == 64 << 30
    with pytest.raises(ConfigError, match="device_memory"):
        from_mapping({"sim": {"device_memory": "16G"}})
    assert from_mapping({"sim": {"event_mode": "enpu"}}).sim.event_mode == "enpu"
    assert from_mapping({}).sim.event_mode == "cann"
    with pytest.raises(ConfigError, match="event_mode"):
        from_mapping({"sim": {"event_mode": "ENPU!"}})


def test_the_sim_section_sets_a_collectives_latency_and_link_bandwidth() -> None:
    """A tensor-parallel benchmark models HCCL's cost: latency plus bytes over the link."""
    from dataclasses import asdict

    from npusim import SimConfig

    sim = from_mapping({"sim": {"collective_us": 20, "collective_gb_s": 56}}).sim
    assert (sim.collective_us, sim.collective_gb_s) == (20.0, 56.0)
    assert SimConfig(**asdict(sim)).collective_gb_s == 56.0  # the worker's sim takes it
    assert from_mapping({}).sim.collective_gb_s == 0.0
    with pytest.raises(ConfigError, match="collective_gb_s"):
        from_mapping({"sim": {"collective_gb_s": "fast"}})


TINY_MODEL = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 4,
}  # fmt: skip


@pytest.mark.parametrize(
    "program",
    [
        {"name": "model", "random": TINY_MODEL, "dtype": "float32"},
        {"name": "attention", "dtype": "float32"},
        {"name": "paged_attention", "dtype": "float32"},
    ],
    ids=lambda p: p["name"],
)
def test_float32_fused_attention_is_refused_on_the_npu_backend_only(
    program: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from graphlane.cli import main
    from graphlane.cli_support import check_programs

    with pytest.raises(ConfigError) as err:
        check_programs(from_mapping({"backend": "npu", "programs": [program]}))
    assert err.value.key == f"programs.{program['name']}.dtype"
    check_programs(from_mapping({"backend": "sim", "programs": [program]}))  # the reference
    path = tmp_path / "f32.toml"
    random = ", ".join(f"{k} = {v!r}" for k, v in TINY_MODEL.items()).replace("'", '"')
    lines = ['backend = "npu"', "[[programs]]", f'name = "{program["name"]}"', 'dtype = "float32"']
    if program["name"] == "model":
        lines.append(f"random = {{ {random} }}")
    path.write_text("\n".join(lines) + "\n")
    assert main(["config", "check", str(path)]) != 0
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err_lines) == 1 and "dtype" in err_lines[0] and "bfloat16" in err_lines[0]


def test_a_model_is_bfloat16_unless_its_checkpoint_is_half_or_float32_is_asked_for() -> None:
    from graphlane.workers.programs import load_program

    def dtype(**over: object) -> str | None:
        p = load_program("model", {"name": "model", "random": TINY_MODEL, **over})
        return p.config.dtype  # type: ignore[attr-defined]

    assert dtype() == "bfloat16"
    assert dtype(random=TINY_MODEL | {"torch_dtype": "float32"}) == "bfloat16"
    assert dtype(random=TINY_MODEL | {"dtype": "float16"}) == "float16"
    assert dtype(dtype="float32") == "float32"


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).parents[2] / "deploy" / "examples").glob("*.toml")),
    ids=lambda p: p.name,
)  # fmt: skip
def test_every_example_config_checks_on_the_backend_it_names_and_on_npu(path: Path) -> None:
    import tomllib

    from graphlane.cli_support import check_programs

    raw = tomllib.loads(path.read_text())
    check_programs(from_mapping(raw))
    npu = {k: v for k, v in raw.items() if k != "sim"} | {"backend": "npu"}  # as its comments say
    check_programs(from_mapping(npu))
