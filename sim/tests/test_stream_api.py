"""``torch.npu.Stream`` wherever torch takes a stream (issue 18, item 7).

torch_npu's Stream is a ``torch.Stream`` (``_NPUStreamBase`` derives from torch's
stream type), so ``Tensor.record_stream`` accepts it, it compares and hashes by device
and stream id, and ``torch.npu.stream``/``set_stream`` accept the ``torch.Stream`` torch
hands back for it. Field code: vllm-ascend and sglang's NPU runner switch streams with
``torch.npu.stream(s)``, keep buffers alive across streams with ``record_stream`` and
compare ``current_stream()`` with their own streams.
"""

from __future__ import annotations

import pytest
import torch
from npusim import SimUsageError
from npusim.streams import Stream
from npusim.streamuse import stream_uses

_NPU = int(torch._C._autograd.DeviceType.PrivateUse1)


def test_npu_stream_is_a_torch_stream_with_npu_device() -> None:
    s = torch.npu.Stream()
    assert isinstance(s, torch.Stream)
    assert s.device == torch.device("npu", 0)
    assert s.device_type == _NPU
    assert s.stream_id != torch.npu.default_stream().stream_id
    assert s.native_handle == s.npu_stream != 0


def test_streams_compare_and_hash_by_device_and_id() -> None:
    a, b = torch.npu.Stream(), torch.npu.Stream()
    same_as_a = torch.Stream(a.stream_id, a.device_index, _NPU)  # what torch hands back
    assert a == same_as_a and hash(a) == hash(same_as_a)
    assert a != b
    assert {a: 1}[same_as_a] == 1
    assert torch.npu.current_stream() == torch.npu.default_stream()


def test_record_stream_records_the_use_on_the_allocation() -> None:
    side = torch.npu.Stream()
    x = torch.ones(8).npu()
    with torch.npu.stream(side):
        y = x * 2
    x[2:].record_stream(side)  # a view records on its allocation
    y.record_stream(torch.npu.current_stream())
    assert stream_uses(x) == {side}
    assert stream_uses(y) == {torch.npu.default_stream()}
    torch.npu.synchronize()
    assert y.cpu().tolist() == [2.0] * 8


def test_record_stream_refuses_a_stream_of_another_device_type() -> None:
    x = torch.ones(2).npu()
    with pytest.raises(SimUsageError, match="npu stream"):
        x.record_stream(torch.Stream(0, 0, int(torch._C._autograd.DeviceType.CPU)))
    assert stream_uses(x) == frozenset()


def test_torch_stream_of_an_npu_stream_selects_it() -> None:
    s = torch.npu.Stream()
    handed_back = torch.Stream(s.stream_id, s.device_index, _NPU)
    with torch.npu.stream(handed_back):
        assert torch.npu.current_stream() is s
        x = torch.ones(3).npu() + 1  # queued on s
    assert torch.npu.current_stream() is torch.npu.default_stream()
    torch.npu.set_stream(handed_back)
    try:
        assert torch.npu.current_stream() is s
    finally:
        torch.npu.set_stream(torch.npu.default_stream())
    s.synchronize()
    assert x.cpu().tolist() == [2.0] * 3


def test_with_stream_makes_it_current_and_restores() -> None:
    s, t = torch.npu.Stream(), torch.npu.Stream()
    with s:
        assert torch.npu.current_stream() is s
        with t:
            assert torch.npu.current_stream() is t
        assert torch.npu.current_stream() is s
    assert torch.npu.current_stream() is torch.npu.default_stream()


def test_a_stream_that_is_not_an_npu_stream_is_refused() -> None:
    with pytest.raises(TypeError, match="npu stream"):
        torch.npu.set_stream(torch.Stream(5, 0, int(torch._C._autograd.DeviceType.CPU)))
    with pytest.raises(TypeError, match="npu stream"):
        torch.npu.stream(torch.Stream(99999, 0, _NPU)).__enter__()  # no such npu stream


def test_is_capturing_and_device_module() -> None:
    s = torch.npu.Stream()
    g = torch.npu.NPUGraph()
    with pytest.warns(UserWarning, match="empty"), torch.npu.graph(g, stream=s):
        assert s.is_capturing()  # nothing captured: torch_npu warns at capture_end
    assert not s.is_capturing()
    assert torch.get_device_module("npu") is torch.npu
    module = torch.get_device_module(torch.device("npu", 0))
    assert module.current_stream() is torch.npu.default_stream()
    assert isinstance(module.Stream(), Stream)
