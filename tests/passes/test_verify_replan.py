"""The compile-time measurement's last resort (passes/verify.py `_lowest_plan`), with a stand-in planner and
measurement: the lowest *modelled* plan is not always the lowest *measured* one (under Inductor, the deepest
plans stray furthest above the model), so plans held a little above the modelled floor are measured too."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dtr_compile.errors import BudgetError
from dtr_compile.passes import verify

FLOOR = 1000  # the planner's lowest modelled peak
EXACT_FLOOR = 700  # the exact memory model's


class StandInPlanner:
    """Plans to `budget x model_scale` (never below FLOOR with its own memory model; the exact model's plans
    are marked by a negative target); the measured peak of each plan comes from `measured_at(target)`.
    Records the targets it was asked for."""

    def __init__(self, measured_at) -> None:
        self.model_scale = 1.0
        self.memory_model = None
        self.reports: list = []
        self.targets: list[int] = []
        self.measured_at = measured_at

    def compile_once(self, budget: int):
        target = round(budget * self.model_scale)
        if self.memory_model == "exact":
            if target < EXACT_FLOOR:
                error = BudgetError("too low for the exact model", budget_bytes=budget)
                error.modelled_floor_bytes = EXACT_FLOOR
                raise error
            self.targets.append(-target)
            report = SimpleNamespace(planned_peak=SimpleNamespace(peak_bytes=target), measured_peak_bytes=None)
            self.reports.append(report)
            return SimpleNamespace(target=-target)
        if target < FLOOR:
            error = BudgetError("too low", budget_bytes=budget)
            error.modelled_floor_bytes = FLOOR
            raise error
        self.targets.append(target)
        report = SimpleNamespace(planned_peak=SimpleNamespace(peak_bytes=target), measured_peak_bytes=None)
        self.reports.append(report)
        return SimpleNamespace(target=target)


def _run(monkeypatch, budget: int, measured_at):
    planner = StandInPlanner(measured_at)
    monkeypatch.setattr(verify, "measure_region", lambda compiled, inputs: planner.measured_at(compiled.target))
    compiled, report, smallest = verify._lowest_plan(lambda: planner.compile_once(budget), [], planner, None, budget)
    return planner, compiled, report, smallest


def test_a_plan_above_the_modelled_floor_that_measures_within_the_budget_is_taken(monkeypatch) -> None:
    # Deep plans measure far above their model, shallower ones close to it: 1.15 x the floor measures 1100.
    measured = {1150: 1100, 1100: 1120, 1050: 1180, 1000: 1300}
    planner, compiled, report, smallest = _run(monkeypatch, 1150, measured.get)
    assert planner.targets == [1150] and compiled.target == 1150 and report.measured_peak_bytes == 1100
    assert smallest == 1150  # max(measured, modelled)


def test_when_none_fits_the_smallest_feasible_budget_is_the_best_plan_measured(monkeypatch) -> None:
    measured = {1150: 1400, 1100: 1120, 1050: 1180, 1000: 1300, -1050: 1200, -945: 1150, -840: 1130, -735: 1140}
    planner, compiled, _, smallest = _run(monkeypatch, 1050, measured.get)
    # every candidate tried: the planner's own model from the highest down, then the exact model
    assert planner.targets == [1150, 1100, 1050, 1000, -1050, -945, -840, -735]
    assert compiled.target == 1100 and smallest == 1120  # not the lowest modelled plan's 1300
    assert planner.memory_model is None  # the best plan came from the planner's own model


def test_an_exact_model_plan_that_measures_within_the_budget_is_taken(monkeypatch) -> None:
    # The planner's own model cannot go below FLOOR, and its plans measure above the budget; a plan held by the
    # exact model to the budget measures within it.
    measured = {1150: 1400, 1100: 1300, 1050: 1250, 1000: 1200, -950: 940}
    planner, compiled, report, smallest = _run(monkeypatch, 950, measured.get)
    assert compiled.target == -950 and report.measured_peak_bytes == 940 and smallest == 950
    assert planner.memory_model == "exact"  # compiling again plans the same way


def test_without_a_measurement_only_the_lowest_modelled_plan_is_tried_and_the_planner_error_stands(monkeypatch) -> None:
    with pytest.raises(BudgetError, match="too low"):
        _run(monkeypatch, 900, lambda target: None)


def test_below_the_exact_models_floor_its_floor_plan_is_measured(monkeypatch) -> None:
    # A budget far below every floor: the exact model's targets (a fraction of the budget) are all below its
    # floor, so the plan at that floor is tried, and it names the smallest feasible budget.
    measured = {1150: 1400, 1100: 1300, 1050: 1250, 1000: 1200, -700: 900}
    planner, compiled, _, smallest = _run(monkeypatch, 300, measured.get)
    assert planner.targets[-1] == -700 and compiled.target == -700 and smallest == 900
