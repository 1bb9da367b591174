"""The first step's FX plan runs once (backend/region.py), so it is planned without the fill (planner._Search.fill),
which is most of the planning time of a large graph: on the H100's GPT-2 at checkpointing's peak, 11.3 of the 18.8 s
its two plans took. Such a plan still meets its budget; it recomputes what the fill would have saved again, and it
is kept in the plan cache apart from the plans that run every step."""

from __future__ import annotations

import torch
from tiny_models import Residual

from dtr_compile import config
from dtr_compile.backend.aot import compile_region
from dtr_compile.passes import planner
from dtr_compile.passes.partition import DTRPartitioner


def _report(budget: int | None, runs_once: bool) -> DTRPartitioner:
    torch._dynamo.reset()
    partitioner = DTRPartitioner(budget, codegen="fx", runs_once=runs_once)
    with config.patch(plan_cache=False):
        compiled = torch.compile(
            Residual(), backend=lambda gm, inputs: compile_region(gm, inputs, partitioner, codegen="fx")
        )
        compiled(torch.randn(512, 32)).sum().backward()
    return partitioner


def test_a_plan_that_runs_once_meets_its_budget_without_the_fill(monkeypatch) -> None:
    no_remat = _report(None, False).reports[-1].no_remat.peak_bytes
    budget = int(0.9 * no_remat)
    fills = []
    real_fill = planner._Search.fill
    monkeypatch.setattr(planner._Search, "fill", lambda self, b: fills.append(b) or real_fill(self, b))
    every_step = _report(budget, False)
    assert fills, "the plan that runs every step is filled"
    fills.clear()
    once = _report(budget, True)
    assert not fills
    planned, filled = once.reports[-1], every_step.reports[-1]
    assert planned.planned_peak.peak_bytes <= budget and filled.planned_peak.peak_bytes <= budget
    # What the fill saves again, the plan that runs once recomputes: min-cut's tanh and sigmoid.
    assert planned.plan.recompute_s > filled.plan.recompute_s
    assert once.key_for(budget) != every_step.key_for(budget)
