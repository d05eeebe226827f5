"""Training under capture, from the call shapes of Ascend/pytorch's ``test/test_npu.py``
(``test_graph_make_graphed_callables``, ``test_graph_grad_scaling``,
``test_graph_scaling_fused_optimizers``) and the training loops that use
``torch.npu.amp``: autocast on the npu device with torch_npu's cast lists
(``torch_npu/csrc/aten/AutoCastOps.cpp``), torch_npu 2.14's ``GradScaler``
(``npu/amp/grad_scaler.py``), ``make_graphed_callables`` with inputs that require grad
(``npu/graphs.py``) and backward passes on the stream they were called on. Numbers are
checked against the same steps in plain CPU torch; each shape's fence, dropped, is
reported.
"""

from __future__ import annotations

import pytest
import torch
from npusim import HazardError, torch_npu

N, D_IN, H, D_OUT = 32, 24, 16, 8


def _mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, H), torch.nn.ReLU(), torch.nn.Linear(H, D_OUT))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.rand(N, D_IN, generator=g), torch.rand(N, D_OUT, generator=g)) for _ in range(n)]


def _train_eager_cpu(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    model = _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _graphed_mlp() -> tuple[torch.nn.Module, object, torch.optim.Optimizer]:
    """vllm/torch's shape: a Module and a loss function graphed together (one pool)."""
    model = _mlp(0).npu()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(N, D_IN, device="npu")
    y_pred = torch.randn(N, D_OUT, device="npu", requires_grad=True)
    y = torch.randn(N, D_OUT, device="npu")
    model, loss_fn = torch_npu.npu.make_graphed_callables(
        (model, torch.nn.functional.mse_loss), ((x,), (y_pred, y))
    )
    return model, loss_fn, opt


def test_make_graphed_callables_trains_an_mlp_as_eager_torch_does() -> None:
    batches = _batches(4)
    model, loss_fn, opt = _graphed_mlp()
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x.npu()), y.npu()).backward()  # forward and backward graphs replay
        opt.step()
    for got, want in zip(model.parameters(), _train_eager_cpu(batches), strict=True):
        torch.testing.assert_close(got.detach().cpu(), want)
    model.eval()  # graphed in training mode: eval runs the eager forward
    x = batches[0][0]
    torch.testing.assert_close(model(x.npu()).cpu(), model.forward(x.npu()).cpu())


def test_a_batch_loaded_on_a_side_stream_without_a_wait_is_a_race(watchdog_off: None) -> None:
    """The field's prefetch: the batch is copied on a side stream, and the step's stream
    waits for it before the graphed forward copies it into the static input."""
    model, loss_fn, _ = _graphed_mlp()
    ((x, y),) = _batches(1)
    loader = torch.npu.Stream()
    with torch.npu.stream(loader):
        xd = x.npu() * 2.0  # preprocessing on the loader stream
    # missing: torch.npu.current_stream().wait_stream(loader)
    with pytest.raises(HazardError) as err:  # the graphed forward's copy reads xd
        loss_fn(model(xd), y.npu()).backward()
        torch.npu.synchronize()
    assert err.value.kind == "race"


def test_make_graphed_callables_checks_as_torch_npu_does() -> None:
    model = _mlp(0).npu()
    x = torch.randn(N, D_IN, device="npu")
    with torch.npu.amp.autocast(cache_enabled=True), pytest.raises(RuntimeError, match="cache"):
        torch_npu.npu.make_graphed_callables(model, (x,))
    unused = torch.randn(N, D_IN, device="npu", requires_grad=True)
    with pytest.raises(RuntimeError):  # autograd: an input no output depends on
        torch_npu.npu.make_graphed_callables(lambda a, b: model(a), (x, unused))


def test_autocast_on_npu_casts_as_torch_npus_lists() -> None:
    """Lower precision for matmuls, float32 for losses and reductions, as CPU autocast does
    for these ops, with the same numbers."""
    model = _mlp(0)
    x, y = _batches(1)[0]
    with torch.autocast("cpu", dtype=torch.float16):
        want_out = model(x)
        want_loss = torch.nn.functional.mse_loss(want_out, y)
    dev = _mlp(0).npu()
    with torch_npu.npu.amp.autocast():
        assert torch.npu.is_autocast_enabled()
        out = dev(x.npu())
        loss = torch.nn.functional.mse_loss(out, y.npu())
        summed = out.sum()
        soft = torch.softmax(out, dim=-1)
        promoted = torch.addcmul(out, out.float(), out)
    assert (out.dtype, loss.dtype, summed.dtype, soft.dtype) == (
        torch.float16, torch.float32, torch.float32, torch.float32,
    )  # fmt: skip
    assert promoted.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), want_out)
    torch.testing.assert_close(loss.cpu(), want_loss)
    with torch_npu.npu.amp.autocast(), pytest.raises(RuntimeError, match="unsafe to autocast"):
        torch.nn.functional.binary_cross_entropy(torch.sigmoid(out), y.npu().half())
    assert torch.float16 in torch.npu.get_amp_supported_dtype()


def test_autocast_training_graphed_equals_eager_on_the_device() -> None:
    batches = _batches(3)
    results = []
    for graphed in (True, False):
        model = _mlp(0).npu()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if graphed:
            with torch.npu.amp.autocast(cache_enabled=False):
                model = torch_npu.npu.make_graphed_callables(
                    model, (torch.randn(N, D_IN, device="npu"),)
                )
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            with torch.npu.amp.autocast(cache_enabled=False):
                out = model(x.npu())
                assert out.dtype == torch.float16
                torch.nn.functional.mse_loss(out, y.npu()).backward()
            opt.step()
        results.append([p.detach().cpu() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def _grad_scaling_capture(fence: bool) -> tuple[object, torch.Tensor, torch.Tensor, object]:
    """test_graph_grad_scaling's shape: scale(loss).backward() captured, step and update
    eager."""
    scaler = torch_npu.npu.amp.GradScaler(init_scale=4.0)
    weight = torch.ones((100,), device="npu", requires_grad=True)
    static_input = torch.ones_like(weight)
    s = torch.npu.Stream()
    if fence:
        s.wait_stream(torch.npu.current_stream())
    with torch.npu.stream(s):  # warmup
        scaler.scale((weight.half() * static_input).sum()).backward()
    torch.npu.current_stream().wait_stream(s)
    weight.grad = None
    g = torch.npu.NPUGraph()
    with torch.npu.stream(s):
        g.capture_begin()
        scaler.scale((weight.half() * static_input).sum()).backward()
        g.capture_end()
    return scaler, weight, static_input, g


def test_grad_scaling_with_a_captured_backward(capsys: pytest.CaptureFixture[str]) -> None:
    scaler, weight, static_input, g = _grad_scaling_capture(fence=True)
    opt = torch.optim.SGD([weight], lr=0.1)
    ref = torch.ones(100)
    inf = float("inf")
    for data, scale, tracker, grad in zip(
        [5, 20000, 5, 40000], [4, 2, 2, 1], [1, 0, 1, 0], [5 * 4, inf, 5 * 2, inf], strict=True
    ):
        static_input.fill_(data)
        g.replay()
        assert torch.equal(weight.grad.cpu(), torch.full((100,), float(grad)))
        before = float(scaler._scale.item())
        scaler.step(opt)
        scaler.update()
        assert (scaler._scale.item(), scaler._growth_tracker.item()) == (scale, tracker)
        if grad != inf:  # torch_npu skips the step on an overflow
            ref -= 0.1 * (torch.full((100,), float(grad)) / before)
        torch.testing.assert_close(weight.detach().cpu(), ref)
    assert "Gradient overflow. Skipping step" in capsys.readouterr().out


def test_grad_scaling_warmup_without_the_side_streams_wait_is_a_race(watchdog_off: None) -> None:
    with pytest.raises(HazardError) as err:  # the side stream reads what the default one wrote
        _grad_scaling_capture(fence=False)
        torch.npu.synchronize()
    assert err.value.kind == "race"


def test_grad_scaler_step_reads_on_the_host_so_it_cannot_be_captured() -> None:
    """torch_npu's unscale_ reads found_inf with .item(): inside a capture that is a host
    read of a capturing stream, refused on the NPU and on the sim."""
    weight = torch.ones(4, device="npu", requires_grad=True)
    opt = torch.optim.SGD([weight], lr=0.1)
    scaler = torch_npu.npu.amp.GradScaler()
    scaler.scale(weight.sum()).backward()
    g = torch.npu.NPUGraph()
    with pytest.raises(RuntimeError), torch.npu.graph(g):
        scaler.step(opt)


def test_grad_scaler_hands_itself_to_a_fused_optimizer_as_torch_npu_does() -> None:
    """torch_npu 2.14 steps an optimizer with ``_step_supports_amp_scaling`` as
    ``step(grad_scaler=self)``; torch's fused Adam takes no such argument."""
    p = torch.ones(4, device="npu", requires_grad=True)
    opt = torch.optim.Adam([p], lr=0.1, fused=True)
    scaler = torch_npu.npu.amp.GradScaler(init_scale=128.0)
    scaler.scale(p.sum()).backward()
    with pytest.raises(TypeError, match="grad_scaler"):
        scaler.step(opt)
    assert scaler.state_dict()["dynamic"] is True


def test_backward_runs_on_the_stream_it_was_called_on_and_is_captured() -> None:
    w = torch.ones(5, device="npu", requires_grad=True)
    x = torch.full((5,), 3.0, device="npu")
    s = torch.npu.Stream()
    s.wait_stream(torch.npu.current_stream())
    with torch.npu.stream(s):
        (gw,) = torch.autograd.grad((w * x).sum(), (w,))
    torch.npu.current_stream().wait_stream(s)
    assert torch.equal(gw.cpu(), torch.full((5,), 3.0))
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        (gw,) = torch.autograd.grad((w * x).sum(), (w,))
    x.fill_(7.0)
    g.replay()  # the backward was captured: it reads the new x
    assert torch.equal(gw.cpu(), torch.full((5,), 7.0))
