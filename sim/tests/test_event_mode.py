"""``event_mode = "enpu"`` (issue 18, item 5): on ENPU an ExternalEvent must be
recorded before it is waited on, or the wait hangs (vllm-ascend #8636, #8317,
#8354). In that mode the sim reports a wait issued before its record; current
CANN's flag (the default) allows it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from npusim import HazardError, SimConfig, configure
from test_host_ordering import LAYERS, Stack, lengths_for


@pytest.fixture
def enpu() -> Iterator[None]:
    old = configure()
    configure(event_mode="enpu", watchdog_s=600)
    yield
    configure(event_mode=old.event_mode, watchdog_s=old.watchdog_s)


def test_update_then_replay_runs_clean_on_enpu(enpu: None) -> None:
    """torch_npu's own order: records first, then the replay that waits on them."""
    stack = Stack(31)
    for step in range(4):
        lengths = lengths_for(step)
        stack.patch_all(lengths)
        stack.replay()
        stack.check(lengths)


def test_replay_then_update_is_reported_on_enpu(enpu: None) -> None:
    """The field's other order (vllm-ascend, torchair, xLLM): the replay's waits are
    issued before the update's records: fine on current CANN, a hang on ENPU."""
    stack = Stack(32)
    stack.replay()
    stack.patch_all(lengths_for(0))
    with pytest.raises(HazardError) as err:
        torch.npu.synchronize()
    assert err.value.kind == "wait-before-record"
    assert stack.events[0].name in str(err.value) and stack.graph.name in str(err.value)


def test_eager_wait_before_record_is_reported_on_enpu(enpu: None) -> None:
    ev = torch.npu.ExternalEvent()
    s, u = torch.npu.Stream(), torch.npu.Stream()
    ev.wait(s)
    ev.record(u)
    with pytest.raises(HazardError) as err:
        torch.npu.synchronize()
    assert err.value.kind == "wait-before-record"


def test_replay_then_update_runs_clean_on_cann() -> None:
    assert configure().event_mode == "cann"
    stack = Stack(33)
    for step in range(3):
        lengths = lengths_for(step)
        stack.replay()
        stack.patch_all(lengths)
        stack.check(lengths)
    assert LAYERS >= 2


def test_event_mode_from_configure_env_and_config_file(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="event_mode"):
        configure(event_mode="npu")
    assert configure().event_mode == "cann"
    monkeypatch.setenv("NPUSIM_EVENT_MODE", "enpu")
    assert SimConfig.from_env().event_mode == "enpu"
    monkeypatch.setenv("NPUSIM_EVENT_MODE", "bogus")
    with pytest.raises(ValueError, match="NPUSIM_EVENT_MODE"):
        SimConfig.from_env()
