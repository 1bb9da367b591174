"""`backend="dtr"` with Inductor on a small transformer under a budget: the path through AOTAutograd, the
partitioner, the planner and Inductor's scheduler that the compatibility stages of .ci/run must see compile
and train on every supported torch (one block and no dropout, so that plain eager is the oracle and the
compiles stay few)."""

from __future__ import annotations

import pytest
import torch

from dtr_compile.passes.partition import MAX_SCALE

from ..e2e import compiled_models as models

pytestmark = pytest.mark.compat


def test_inductor_trains_a_small_transformer_under_a_budget() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(models.Block(64, 4, 0.0), torch.nn.Linear(64, 1))
    inputs = (torch.randn(8, 32, 64),)
    expected = models.eager_grads(model, inputs)
    grads, measured, reports = models.run_step(model, inputs, 0.75, codegen="inductor", steps=1)
    for name, want in expected.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-5, msg=name)
    report = reports[-1]
    # The model is held to its target; a target above the budget is a model shown (measured) to overestimate
    # Inductor's memory, trusted at most MAX_SCALE x the budget. The measured peak is what must hold (below).
    assert report.planned_peak.peak_bytes <= report.target_bytes <= MAX_SCALE * report.budget_bytes
    # The budget binds: something is recomputed, and the plan models below the no-remat schedule by the plans' own
    # (pinned) model. `no_remat` models torch.compile's partition as Inductor runs it, unpinned (partition.baseline_runs_unpinned).
    assert report.plan.recompute_s > 0
    assert report.planned_peak.peak_bytes < (report.pinned_no_remat_bytes or report.no_remat.peak_bytes)
    assert measured <= 1.05 * report.budget_bytes, (measured, report.budget_bytes)
