"""16-bit CPU matmuls' scratch (dtr_compile/matmul_scratch.py): measured per call shape, the same for real and fake
tensors, a bound while another profiler runs, and counted by the planner's cost pass.

Oracle: the step meter itself (`measure_peak`) around the plain call, less its output's bytes."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from dtr_compile import matmul_scratch
from dtr_compile.measure import measure_peak
from dtr_compile.passes.costs import annotate_costs
from dtr_compile.passes.meta import DTR_META_KEY

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _forget_measured(monkeypatch):
    monkeypatch.setattr(matmul_scratch, "_measured", {})


def _metered_scratch(func, args) -> int:
    out, measured = measure_peak(lambda: func(*args))
    return measured.peak_bytes - out.numel() * out.element_size()


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


CALLS = {
    "mm": (aten.mm.default, lambda: (_bf16(256, 128), _bf16(128, 96))),
    "mm-transposed-first": (aten.mm.default, lambda: (_bf16(128, 256).t(), _bf16(128, 32))),
    "addmm": (aten.addmm.default, lambda: (_bf16(96), _bf16(64, 128), _bf16(96, 128).t())),
    "bmm": (aten.bmm.default, lambda: (_bf16(4, 64, 32), _bf16(4, 32, 64))),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_the_scratch_is_what_the_meter_measures_around_the_call(name) -> None:
    func, make = CALLS[name]
    args = make()
    expected = _metered_scratch(func, args)
    assert matmul_scratch.scratch_bytes(func, args) == expected
    # Measured once: a second ask is the remembered figure, and fake tensors of the same layout get it too.
    assert len(matmul_scratch._measured) == 1
    with FakeTensorMode() as mode:
        fakes = tuple(mode.from_tensor(a) for a in args)
        assert matmul_scratch.scratch_bytes(func, fakes) == expected
    assert len(matmul_scratch._measured) == 1


def test_float32_and_other_ops_have_none() -> None:
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    assert matmul_scratch.scratch_bytes(aten.mm.default, (a, b)) == 0
    assert matmul_scratch.scratch_bytes(aten.add.Tensor, (a.bfloat16(), b.bfloat16())) == 0
    assert not matmul_scratch._measured


def test_inside_another_profiler_a_bound_stands_in_and_is_not_remembered() -> None:
    func, make = CALLS["mm-transposed-first"]
    args = make()
    measured = _metered_scratch(func, args)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True):
        inside = matmul_scratch.scratch_bytes(func, args)
    assert inside >= measured and inside == matmul_scratch._fallback(args)
    assert not matmul_scratch._measured
    assert matmul_scratch.scratch_bytes(func, args) == measured


def test_the_cost_pass_counts_it_as_the_matmuls_workspace() -> None:
    """A bf16 linear's matmul in an aten graph carries its measured scratch as its workspace."""
    x, w = _bf16(512, 128), _bf16(256, 128)
    graph = fx.Graph()
    xn, wn = graph.placeholder("x"), graph.placeholder("w")
    xn.meta["val"], wn.meta["val"] = x, w
    t = graph.call_function(aten.t.default, (wn,))
    t.meta["val"] = w.t()
    mm = graph.call_function(aten.mm.default, (xn, t))
    mm.meta["val"] = torch.mm(x, w.t())
    graph.output((mm,))
    annotate_costs(fx.GraphModule(torch.nn.Module(), graph))
    assert mm.meta[DTR_META_KEY].workspace_bytes == _metered_scratch(aten.mm.default, (x, w.t())) > 0
