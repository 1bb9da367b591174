"""FSDP2 (`fully_shard` on each block, then the root, then `torch.compile(..., backend="dtr")`) under a budget on
2 gloo ranks (CPU): issue 19.

FSDP2 frees each block's gathered parameters after its forward by resizing their storages to 0 bytes, behind the
runtime's back. What is held (dtr_compile/distributed.py has the mechanism and the figures):
  - gradients equal the same FSDP2 wrapper compiled with no budget, on every rank, and agree across ranks;
  - the runtime evicts and recomputes block outputs, and those recomputes read resharded parameters: they are
    brought back (a prefetched all-gather copied out early, or an all-gather the runtime runs itself, the same
    on every rank), never read as freed memory (which gave NaN gradients at 0.6 before);
  - each rank's measured peak (dtr_compile.measure: gathered parameters and gloo's buffers included) stays within
    1.05x the fraction of the no-budget run's measured peak, as issue 19 asks (0.92-1.00x measured; it was
    1.067-1.113x while the runtime held the bytes of outside tensors that died in the step: runtime/constants.py);
  - 0.5 raises BudgetError naming the step's floor (0.54 of the reference here; the single-rank MLP reaches 0.45),
    and leaves the rank able to train: a strict xfail records that 0.5 does not run yet.

One 2-rank run in CI (spawned processes, codegen="fx", 3 steps: compile, calibrate, one step held to the budget):
the no-budget reference and 0.6. The 0.5 run is slow-marked (another 2-rank run).
"""

from __future__ import annotations

import pytest
import torch

from .ranks import run_ranks
from .workers import Spec, measured_from, train_steps

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

TOLERANCE = 1.05  # what issue 19 asks
SPEC = Spec(wrapper="fsdp2", model="mlp", budgets=(0.6,), steps=3)
HALF = Spec(wrapper="fsdp2", model="mlp", budgets=(0.5,), steps=3, infeasible_ok=True)


@pytest.fixture(scope="module")
def fsdp2_runs() -> list[dict]:
    return run_ranks(train_steps, SPEC)


@pytest.fixture(scope="module")
def half_runs() -> list[dict]:
    return run_ranks(train_steps, HALF)


def _peaks_within(results: list[dict], budget: float, tolerance: float) -> None:
    for rank, runs in enumerate(results):
        reference = runs[None]["peaks"][-1]
        got = runs[budget]
        assert "error" not in got, f"rank {rank} at {budget}: {got['error']}"
        peaks = got["peaks"][measured_from(SPEC):]
        limit = tolerance * budget * reference
        assert max(peaks) <= limit, (
            f"rank {rank} at {budget}: measured peaks {peaks} above {tolerance} x {budget} x {reference} = "
            f"{limit:.0f} (runtime budget {got['budget_bytes']}, runtime peak {got['runtime_peak']})"
        )


def test_fsdp2_at_0_6_gives_equal_gradients_and_recomputes_from_regathered_parameters(fsdp2_runs) -> None:
    for rank, runs in enumerate(fsdp2_runs):
        got = runs[0.6]
        assert "error" not in got, f"rank {rank}: {got['error']}"
        assert got["missing_grads"] == 0, f"rank {rank}: parameters without gradients"
        assert got["grad_diff"] <= 1e-5 * max(runs[None]["grad_scale"], 1e-3), f"rank {rank}: {got}"
        assert got["evictions"] > 0 and got["rematerializations"] > 0, f"rank {rank}: nothing recomputed: {got}"
        # Recomputes of evicted block outputs needed resharded parameters, and got them back.
        assert got["early_copy_outs"] + got["gathers"] > 0, f"rank {rank}: no parameters were regathered: {got}"
    checksums = [runs[0.6]["grad_checksum"] for runs in fsdp2_runs]
    assert abs(checksums[0] - checksums[1]) <= 1e-6 * max(1.0, abs(checksums[0])), f"ranks disagree: {checksums}"
    assert fsdp2_runs[0][0.6]["gathers"] == fsdp2_runs[1][0.6]["gathers"], "ranks gathered differently"


def test_fsdp2_at_0_6_holds_the_budget_within_1_05(fsdp2_runs) -> None:
    _peaks_within(fsdp2_runs, 0.6, TOLERANCE)


@pytest.mark.slow
def test_fsdp2_at_half_raises_naming_the_floor(half_runs) -> None:
    for rank, runs in enumerate(half_runs):
        got = runs[0.5]
        assert "error" in got, f"rank {rank}: 0.5 ran; make it a tested budget (and drop the xfail): {got}"
        assert got["floor"] is not None and got["floor"] > got["budget_bytes"], (rank, got)
        assert "Set memory_budget to at least" in got["error"], (rank, got["error"])


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="FSDP2's floor is 0.54 of the reference here (the single-rank MLP: 0.45)")
def test_fsdp2_at_half_runs(half_runs) -> None:
    _peaks_within(half_runs, 0.5, TOLERANCE)
