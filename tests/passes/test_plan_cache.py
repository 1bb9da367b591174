"""The plan cache (passes/plan_cache.py): a second compile of the same graph under the same budget, with the in-memory
state cleared as a fresh process has it, reads the plan from disk instead of planning (and, under Inductor, instead
of measuring), and runs the same plan: the same values and gradients as plain eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtr_compile import config
from dtr_compile.backend import make_backend
from dtr_compile.measure import measure_peak
from dtr_compile.passes import plan_cache


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)]
    return nn.Sequential(*layers, nn.Linear(64, 1))


def _step(model: nn.Module, backend, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    loss = torch.compile(model, backend=backend)(x).sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(plan_cache.ENV_DIR, str(tmp_path))
    return tmp_path


def test_a_second_process_reads_the_plan_instead_of_planning(cache_dir) -> None:
    model, x = _mlp(), torch.randn(256, 64)
    first = make_backend(0.7, codegen="fx")
    _step(model, first, x)
    assert first.reports[-1].plan.recompute_s > 0  # the budget makes it recompute
    assert list(cache_dir.glob("*.json")), "the plan was not written to disk"

    plan_cache.clear_memory()  # what a fresh process starts with
    plans = plan_cache.COUNTS["plans"]
    second = make_backend(0.7, codegen="fx")
    loss, grads = _step(model, second, x)
    assert plan_cache.COUNTS["plans"] == plans, "the second compile planned again"
    report = second.reports[-1]
    assert report.from_cache and report.times.cached == 1
    ops = [(e.node.name, e.version) for e in report.plan.trace]
    assert ops == [(e.node.name, e.version) for e in first.reports[-1].plan.trace]
    assert report.planned_peak.peak_bytes == first.reports[-1].planned_peak.peak_bytes

    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    eager = model(x).sum()
    eager.backward()
    torch.testing.assert_close(loss, eager.detach())
    for got, want in zip(grads, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(got, want)


def test_another_budget_or_the_flag_off_plans_again(cache_dir) -> None:
    model, x = _mlp(), torch.randn(256, 64)
    _step(model, make_backend(0.7, codegen="fx"), x)
    plan_cache.clear_memory()
    plans = plan_cache.COUNTS["plans"]
    _step(model, make_backend(0.8, codegen="fx"), x)  # another budget: another key
    assert plan_cache.COUNTS["plans"] == plans + 1
    with config.patch(plan_cache=False):
        for path in cache_dir.glob("*.json"):
            path.unlink()
        _step(model, make_backend(0.9, codegen="fx"), x)
        assert not list(cache_dir.glob("*.json"))  # kept in memory only
        plan_cache.clear_memory()
        backend = make_backend(0.9, codegen="fx")
        _step(model, backend, x)
        assert not backend.reports[-1].from_cache


@pytest.mark.slow
def test_under_inductor_the_second_compile_neither_plans_nor_measures(cache_dir) -> None:
    """Inductor: the first compile measures the region (verify.py) and keeps the plan with its measured peak; the
    second, from the cache, runs the same plan without measuring it again, and still holds the budget."""
    model, x = _mlp(), torch.randn(512, 64)
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, backend=make_backend(None, codegen="inductor"))
    compiled(x).sum().backward()
    _, plain = measure_peak(lambda: compiled(x).sum().backward())
    budget = int(0.6 * plain.peak_bytes)

    with config.patch(compiled_steps="plan_only"):
        first = make_backend(budget, codegen="inductor")
        _step(model, first, x)
        assert first.reports[-1].measured_peak_bytes is not None and first.reports[-1].times.measures >= 1
        plan_cache.clear_memory()
        plans = plan_cache.COUNTS["plans"]
        second = make_backend(budget, codegen="inductor")
        _step(model, second, x)
    report = second.reports[-1]
    assert plan_cache.COUNTS["plans"] == plans and report.from_cache
    assert report.times.measures == 0 and report.times.compiles == 1
    assert report.measured_peak_bytes == first.reports[-1].measured_peak_bytes <= budget


def test_a_plan_priced_for_one_gpu_is_not_reused_on_another(monkeypatch) -> None:
    """Plans are priced with the device's measured rates (roofline.rates_for): the cache key names the GPU model
    and the TF32 setting, so a plan made on one GPU, or with TF32 off, is a miss on another or with it on."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dtr_compile.passes.partition import _device_key

    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    graph.output(node)
    gm = torch.fx.GraphModule(nn.Module(), graph)
    assert _device_key(gm) == "cpu"  # no tensor value: nothing device-specific
    with FakeTensorMode(allow_non_fake_inputs=True):
        node.meta["val"] = torch.empty(4, device="cuda")
    names = iter(["NVIDIA H100", "NVIDIA H200"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: next(names))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    on_h100, on_h200 = _device_key(gm), _device_key(gm)
    assert on_h100 != on_h200 and "H100" in on_h100 and "tf32=" in on_h100


def test_a_ratio_that_says_the_model_did_not_describe_the_plan_is_not_kept(cache_dir) -> None:
    """A plan far below a graph's floor once measured 7.2x its model; kept as the graph's calibration, it held every
    later plan of the graph, in every process, to 0.136 of its budget (plan_cache.CALIBRATION_RANGE)."""
    key = "calibration-of-some-graph"
    assert plan_cache.calibrate(key, 1.04)
    assert not plan_cache.calibrate(key, 7.2) and not plan_cache.calibrate(key, 0.3)
    plan_cache.clear_memory()  # a fresh process reads it from disk
    assert plan_cache.calibration(key) == pytest.approx(1.04)


def test_a_measured_tail_is_read_back_by_a_fresh_process_at_the_same_sizes_only(cache_dir, monkeypatch) -> None:
    """The loss tail a step measured is kept per graph and sizes (backend/region.py recalls it for a later process's
    first plan), or that the assumed one was kept; an entry that is not a tail reads as none."""
    from dtr_compile.passes.storage import Tail

    at_128, at_96 = plan_cache.tail_key("graph", "[('s0', 128)]"), plan_cache.tail_key("graph", "[('s0', 96)]")
    plan_cache.remember_tail(at_128, Tail(1 << 20, 1 << 19, frozenset({0, 2})))
    plan_cache.clear_memory()  # a fresh process reads it from disk
    assert plan_cache.remembered_tail(at_128) == (Tail(1 << 20, 1 << 19, frozenset({0, 2})), False)
    plan_cache.remember_tail(at_128, Tail(1 << 20, 1 << 19), tangents_held=True)  # torch 2.11's engine held them
    plan_cache.clear_memory()
    assert plan_cache.remembered_tail(at_128) == (Tail(1 << 20, 1 << 19), True)
    # A step that measured the assumed tail closely enough to keep it: a later process plans with the assumed one too
    # (with the measured one, a few bytes off, its plan missed the code Inductor cached for the same plan)
    at_64 = plan_cache.tail_key("graph", "[('s0', 64)]")
    plan_cache.remember_tail(at_64, None)
    plan_cache.clear_memory()
    assert plan_cache.remembered_tail(at_64) == (None, False)
    assert plan_cache.remembered_tail(at_96) is None
    plan_cache.calibrate(at_96, 1.0)  # some other entry under the key
    assert plan_cache.remembered_tail(at_96) is None
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    plan_cache.clear_memory()  # caches off: nothing from disk
    assert plan_cache.remembered_tail(at_128) is None
