"""Tensor-parallel groups at the edge (issue 44): a program's ``tensor_parallel = N`` makes
groups of N consecutive devices; ``graphlane config check`` (and serve, which loads the
same way) refuses in one line a device count that is not a multiple of N, a group larger
than the host's NPUs and devices the host does not have."""

from __future__ import annotations

from pathlib import Path

import pytest

from graphlane.orchestrator.config import ConfigError, from_mapping
from graphlane.orchestrator.groups import (
    SIM_DEVICES,
    DeviceGroups,
    GroupError,
    host_npus,
    plan_groups,
    tensor_parallel,
)

WORKERS_TESTS = str(Path(__file__).parents[1] / "workers")  # allreduce_program
TP = {"name": "allreduce_program:AllReduceAttention", "layers": 1, "dtype": "float32"}
TP_KEY = f"programs.{TP['name']}.tensor_parallel"  # the key in the table of that name


@pytest.fixture(autouse=True)
def _programs_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(WORKERS_TESTS)


def test_groups_are_consecutive_devices_led_by_the_first() -> None:
    cfg = from_mapping({"devices": 4, "programs": [{**TP, "tensor_parallel": 2}]})
    assert cfg.tensor_parallel == 2
    groups = plan_groups(cfg.devices, cfg.tensor_parallel, cfg.backend)
    assert groups == DeviceGroups(2, ((0, 1), (2, 3)))
    assert groups.leaders() == [0, 2] and groups.of(3) == (1, (2, 3))
    listed = from_mapping({"devices": [4, 5, 6, 7], "programs": [{**TP, "tensor_parallel": 4}]})
    assert plan_groups(listed.devices, 4, "sim").groups == ((4, 5, 6, 7),)
    assert from_mapping({"programs": [TP]}).tensor_parallel == 1  # no key: each device alone


def test_a_device_count_that_is_not_a_multiple_of_the_group_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        from_mapping({"devices": 3, "programs": [{**TP, "tensor_parallel": 2}]})
    assert err.value.key == "devices" and "multiple of 2" in str(err.value)


def test_a_group_larger_than_the_hosts_npus_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:  # the sim has 8
        from_mapping({"devices": 16, "programs": [{**TP, "tensor_parallel": 16}]})
    assert err.value.key == TP_KEY and "8 NPU(s)" in str(err.value)
    with pytest.raises(ConfigError) as err:  # no count of devices would do: say the group's
        from_mapping({"devices": 4, "programs": [{**TP, "tensor_parallel": 16}]})
    assert err.value.key == TP_KEY and "at most 8" in str(err.value)
    with pytest.raises(ConfigError) as err:  # devices 8, 9 do not exist on the sim
        from_mapping({"devices": [6, 7, 8, 9], "programs": [{**TP, "tensor_parallel": 2}]})
    assert err.value.key == "devices" and "[8, 9]" in str(err.value)
    # An Ascend host: one /dev/davinciN per NPU (davinci_manager is the driver's own)
    for name in ("davinci0", "davinci1", "davinci_manager", "davinci_manager_docker"):
        (tmp_path / name).touch()
    assert host_npus("npu", tmp_path) == 2
    assert plan_groups((0, 1), 2, "npu", tmp_path).groups == ((0, 1),)
    with pytest.raises(GroupError) as err:
        plan_groups((0, 1, 2, 3), 4, "npu", tmp_path)
    assert "larger than the 2 NPU(s) this host has" in str(err.value)
    assert host_npus("npu", tmp_path / "absent") == 0
    with pytest.raises(GroupError) as err:  # no NPU here: say so, not "at most 0"
        plan_groups((0, 1), 2, "npu", tmp_path / "absent")
    assert err.value.key == "tensor_parallel" and "has no NPU" in str(err.value)


def test_programs_must_agree_and_the_null_backend_has_no_collectives() -> None:
    with pytest.raises(GroupError) as err:
        tensor_parallel([{"tensor_parallel": 2}, {}, {"tensor_parallel": 4}])
    assert "disagree" in str(err.value) and err.value.key == "programs[0].tensor_parallel"
    with pytest.raises(GroupError) as err:
        tensor_parallel([{"tensor_parallel": 0}])
    assert err.value.key == "programs[0].tensor_parallel"
    with pytest.raises(GroupError) as err:
        plan_groups((0, 1), 2, "null")
    assert "no collectives" in str(err.value)


@pytest.mark.parametrize(
    ("n", "devices", "says"),
    [
        (0, 2, "integer >= 1"),  # the daemon refuses it
        (16, 4, "at most 8"),  # the daemon: no group of 16 on the sim's 8 NPUs
        (3, 3, "divide num_attention_heads 8"),  # the daemon takes it, the worker does not
    ],
)
def test_the_daemon_and_the_worker_name_a_programs_tensor_parallel_alike(
    n: int, devices: int, says: str
) -> None:
    """Whichever process refuses a program's ``tensor_parallel``, the line names it as the
    worker does, ``programs.NAME.tensor_parallel``: the key in the [[programs]] table
    named NAME (the daemon said ``programs[0].tensor_parallel`` or a bare
    ``tensor_parallel``, a top-level key the file refuses)."""
    from graphlane.cli_support import check_programs

    model = {"name": "model", "block_size": 128, "tensor_parallel": n, "random": {
        "model_type": "llama", "vocab_size": 200, "hidden_size": 128,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 8,
        "num_key_value_heads": 2}}  # fmt: skip
    with pytest.raises(ConfigError) as err:
        check_programs(from_mapping({"devices": devices, "programs": [model]}))
    assert err.value.key == "programs.model.tensor_parallel" and says in str(err.value)


def test_the_sims_device_count_is_npusims() -> None:
    from npusim.runtime import RUNTIME

    assert RUNTIME.device_count == SIM_DEVICES


def test_config_check_refuses_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from graphlane.cli import main

    path = tmp_path / "tp.toml"
    path.write_text(
        "devices = 3\n[[programs]]\n"
        f'name = "{TP["name"]}"\nlayers = 1\ndtype = "float32"\ntensor_parallel = 2\n'
    )
    assert main(["config", "check", str(path)]) == 2
    err_lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err_lines) == 1 and "devices" in err_lines[0], err_lines
    assert "tensor_parallel = 2" in err_lines[0]
    path.write_text(path.read_text().replace("devices = 3", "devices = 4"))
    assert main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tensor_parallel 2: groups [[0, 1], [2, 3]], clients reach devices [0, 2]" in out


def test_a_daemon_gives_each_rank_its_group_and_an_npu_rank_its_groups_npus() -> None:
    """On backend npu each rank sees its group's NPUs, numbered from 0 in rank order, and
    takes its own (rank r: device r), as vLLM's ranks do; hello lists the leaders only."""
    from graphlane.orchestrator.config import ServeConfig
    from graphlane.orchestrator.daemon import Daemon
    from graphlane.workers.process_group import GroupSpec

    conf = ServeConfig(backend="npu", devices=(0, 1, 2, 3), tensor_parallel=2)
    d = Daemon(conf)
    specs = {h.device: h.spec for h in d.supervisor.workers.values()}
    assert specs[3].group == GroupSpec(1, 1, (2, 3)) and specs[0].group == GroupSpec(0, 0, (0, 1))
    assert d._env_for(3) == {"ASCEND_RT_VISIBLE_DEVICES": "2,3"}
    assert [specs[dev].runtime_index for dev in range(4)] == [0, 1, 0, 1]
    assert [w["device"] for w in d.hello()["workers"]] == [0, 2]
    assert [w["group"]["rank"] for w in d.status()["workers"]] == [0, 1, 0, 1]
    alone = Daemon(ServeConfig(backend="npu", devices=(0, 1)))
    assert alone._env_for(1) == {"ASCEND_RT_VISIBLE_DEVICES": "1"}
    assert all(h.spec.group is None for h in alone.supervisor.workers.values())


def test_a_rank_whose_npu_its_process_cannot_see_is_refused_before_joining() -> None:
    from types import SimpleNamespace

    from graphlane.workers.process_group import GroupSpec, join

    seen = SimpleNamespace(device_count=lambda: 1, set_device=lambda i: None)
    backend = SimpleNamespace(name="npu", npu=seen, device=SimpleNamespace(index=1))
    with pytest.raises(RuntimeError, match="ASCEND_RT_VISIBLE_DEVICES"):
        join(GroupSpec(0, 1, (4, 5), "tcp://127.0.0.1:1"), backend)
    with pytest.raises(RuntimeError, match="no collectives"):
        join(GroupSpec(0, 1, (4, 5)), SimpleNamespace(name="null"))


def test_a_rendezvous_that_fails_is_a_transient_start_failure() -> None:
    """A rank whose group never meets (the others gone, the port taken meanwhile) fails its
    start as transient: the group is restarted, not failed for good."""
    from graphlane.orchestrator.ports import free_loopback_ports
    from graphlane.workers.backends import create_backend
    from graphlane.workers.process_group import GroupSpec, GroupUnavailable, join
    from graphlane.workers.worker import start_failure

    (port,) = free_loopback_ports(1)  # nothing listens there: rank 0 never comes
    group = GroupSpec(0, 1, (0, 1), f"tcp://127.0.0.1:{port}", timeout_s=1.0)
    with pytest.raises(GroupUnavailable) as err:
        join(group, create_backend("sim", 1))
    assert "rendezvous" in str(err.value)
    assert start_failure(err.value).permanent is False
