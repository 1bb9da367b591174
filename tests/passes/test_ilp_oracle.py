"""The planner against an exact oracle (passes/ilp.py: Checkmate's ILP with the schedule fixed, HiGHS).

On tiny joint graphs (55-64 nodes): the ILP's memory model of the planner's own plan gives the planner's
modelled peak, byte for byte; the ILP's optimum is a lower bound on the planner's recompute time; and the
planner's recompute time is within 5% of it at the same budget. Budgets are fractions of the no-remat peak
of torch.compile's own (min-cut) partition, as `backend="dtr"` resolves them.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import Residual
from torch import nn

from dtr_compile.backend import make_backend
from dtr_compile.errors import BudgetError
from dtr_compile.passes.ilp import plan_peak, solve_ilp

pytest.importorskip("scipy")


def _chain() -> nn.Module:
    """Linear + ReLU, three times."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3)], nn.Linear(32, 1))


def _gelu_chain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(3)], nn.Linear(32, 1))


MODELS = {"chain": _chain, "gelu_chain": _gelu_chain, "residual": Residual}
FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6)


def _plan(name: str, budget: int | None, *, start_from_min_cut: bool = True):
    """The planner's report for the model at `budget` bytes (None: no budget); None if it raises BudgetError."""
    torch._dynamo.reset()
    backend = make_backend(budget, codegen="fx", start_from_min_cut=start_from_min_cut)
    try:
        torch.compile(MODELS[name](), backend=backend)(torch.randn(512, 32)).sum().backward()
    except torch._dynamo.exc.BackendCompilerFailed as error:
        if isinstance(error.inner_exception, BudgetError):
            return None
        raise
    return backend.reports[-1]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_ilps_memory_model_of_the_plan_is_the_planners(name: str) -> None:
    no_remat = _plan(name, None).no_remat.peak_bytes
    checked = 0
    for fraction in FRACTIONS:
        report = _plan(name, int(fraction * no_remat))
        if report is None:
            continue
        peak = plan_peak(report.joint, report.plan.trace, report.plan.boundary, num_fwd_outputs=report.num_fwd_outputs)
        assert peak == report.planned_peak.peak_bytes, (name, fraction)
        checked += 1
    assert checked >= 2  # the no-remat plan and at least one that recomputes


_SAVED_THEN_RECOMPUTED = pytest.mark.xfail(
    strict=True,
    reason="a known gap, measured: from the save-all start the planner meets 0.8 on the residual blocks at 1.51x "
    "the optimum's recompute time. The optimum keeps tanh for the early backward and recomputes it later; the "
    "planner can give up only recomputed copies between uses, not saved values, so it drops tanh and recomputes "
    "it twice. (The default min-cut start names its floor above 0.8 there.)",
)


@pytest.mark.parametrize(
    ("name", "start_from_min_cut"),
    [
        pytest.param(name, start, marks=_SAVED_THEN_RECOMPUTED if (name, start) == ("residual", False) else ())
        for name in sorted(MODELS)
        for start in (False, True)
    ],
)
def test_planner_recompute_time_is_within_5_percent_of_the_optimum(name: str, start_from_min_cut: bool) -> None:
    """Where the planner meets a budget, its recompute time is at most 1.05x the ILP's optimum (which bounds
    it from below), and the ILP's optimal plan meets the budget. Where the planner runs torch.compile's own
    partition (no budget to meet), its recomputes are PyTorch's choice, not a plan: not judged here.
    (Before `_Search.fill`, the min-cut start kept min-cut's recomputes of tanh/sigmoid on the residual blocks:
    1.94x the optimum's time at 0.9, where the optimum saves them.)"""
    base = _plan(name, None)
    no_remat = base.no_remat.peak_bytes
    compared = 0
    for fraction in FRACTIONS[1:]:
        budget = int(fraction * no_remat)
        optimum = solve_ilp(base.joint, budget, num_fwd_outputs=base.num_fwd_outputs)
        report = _plan(name, budget, start_from_min_cut=start_from_min_cut)
        if report is None:
            continue
        assert optimum is not None, (name, fraction)  # the planner's plan is a solution of the ILP
        assert optimum.peak_bytes <= budget
        planner = report.plan.recompute_s
        assert optimum.recompute_s <= planner * (1 + 1e-9) + 1e-15, (name, fraction, optimum, planner)
        if report.partition == "planned":
            assert planner <= 1.05 * optimum.recompute_s + 1e-15, (name, fraction, planner, optimum.recompute_s)
            compared += 1
    assert compared >= 1


def test_the_optimums_floor_on_a_chain() -> None:
    """Three Linear+ReLU layers: the ILP meets 0.7 of no-remat (0.63 by recomputing two layers from the
    input in the backward) and nothing meets 0.6."""
    base = _plan("chain", None)
    no_remat = base.no_remat.peak_bytes
    optimum = solve_ilp(base.joint, int(0.7 * no_remat), num_fwd_outputs=base.num_fwd_outputs)
    assert optimum is not None and optimum.peak_bytes <= 0.7 * no_remat
    assert solve_ilp(base.joint, int(0.6 * no_remat), num_fwd_outputs=base.num_fwd_outputs) is None


def test_planner_reaches_the_optimums_floor_on_a_chain() -> None:
    """Single moves stopped at 0.81 of no-remat here; a drop that gives up the ancestors it pulls back and
    runs its burst earlier (planner.py: `_compound_drop`, `_hoisted`) reaches the optimum's 0.63, at the
    optimum's recompute time."""
    base = _plan("chain", None)
    no_remat = base.no_remat.peak_bytes
    budget = int(0.7 * no_remat)
    report = _plan("chain", budget)
    optimum = solve_ilp(base.joint, budget, num_fwd_outputs=base.num_fwd_outputs)
    assert report is not None and optimum is not None
    assert report.planned_peak.peak_bytes == optimum.peak_bytes
    assert report.plan.recompute_s <= 1.05 * optimum.recompute_s
