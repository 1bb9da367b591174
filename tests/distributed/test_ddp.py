"""`torch.compile(DDP(model), backend="dtr")` under a budget on 2 ranks (gloo, CPU): issue 19.

Oracles, on each rank: the gradients of the last step equal those of the same DDP wrapper compiled with no budget
(and agree across ranks, which trained on different batches: the allreduce ran); the measured peak of every
step after the fraction's calibration step is within 1.05x the fraction of the no-budget run's measured peak on
that rank (dtr_compile.measure, as DESIGN.md counts a step: gradients and DDP's bucket traffic included).

Budgets: 0.5, where GPT-2 under DDP raised before (two faults, see dtr_compile/distributed.py and
runtime/implicit.py `_tracing`), and 0.45, the lowest of 0.5, 0.45, 0.4, ... that the single-rank MLP reaches
(measured: 3677196 of 8915976 bytes; 0.4 raises BudgetError). Dynamo's DDPOptimizer splits the MLP's graph at
its 1 MB gradient buckets into 3 compiled regions; at 0.45 the split MLP needs 0.63 of the peak (each region
is planned against the room the step leaves when it is compiled, and the first takes the whole budget), so 0.45
is checked with the split turned off (`torch._dynamo.config.optimize_ddp = False`: one graph, DDP's reducer
allreduces after the compiled backward, without overlap), and the split case is a strict xfail (slow).

One 2-rank run per test module (spawned processes, codegen="fx"), about 60 s on 2 cores; GPT-2 and Inductor
variants are slow.
"""

from __future__ import annotations

import pytest
import torch

from .ranks import run_ranks
from .workers import Spec, measured_from, train_steps

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

TOLERANCE = 1.05


def _check(spec: Spec, results: list[dict], run) -> None:
    budget = run[0] if isinstance(run, tuple) else run
    first = measured_from(spec)
    for rank, runs in enumerate(results):
        reference = runs[None]["peaks"][-1]  # a steady step (after DDP's bucket rebuild)
        got = runs[run]
        assert got["missing_grads"] == 0, f"rank {rank}: parameters without gradients"
        scale = runs[None]["grad_scale"]
        assert got["grad_diff"] <= 1e-5 * max(scale, 1e-3), f"rank {rank} {run}: gradients differ: {got}"
        limit = TOLERANCE * budget * reference
        peaks = got["peaks"][first:]
        assert max(peaks) <= limit, (
            f"rank {rank} at {run}: measured peaks {peaks} above {TOLERANCE} x {budget} x {reference} = {limit:.0f} "
            f"(all steps {got['peaks']}, runtime budget {got['budget_bytes']})"
        )
    checksums = [runs[run]["grad_checksum"] for runs in results]
    assert abs(checksums[0] - checksums[1]) <= 1e-6 * max(1.0, abs(checksums[0])), f"ranks disagree: {checksums}"


@pytest.fixture(scope="module")
def mlp_runs() -> tuple[Spec, list[dict]]:
    spec = Spec(wrapper="ddp", model="mlp", budgets=(0.5, (0.45, False)))
    return spec, run_ranks(train_steps, spec)


def test_ddp_mlp_at_half_holds_the_budget_with_equal_gradients(mlp_runs) -> None:
    spec, results = mlp_runs
    _check(spec, results, 0.5)
    assert all(runs[0.5]["evictions"] > 0 for runs in results), "nothing was evicted at half the peak"


def test_ddp_mlp_at_the_single_rank_floor_unsplit(mlp_runs) -> None:
    spec, results = mlp_runs
    _check(spec, results, (0.45, False))


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=Exception, reason="DDPOptimizer's split: regions share the budget greedily")
def test_ddp_mlp_at_the_single_rank_floor_split() -> None:
    spec = Spec(wrapper="ddp", model="mlp", budgets=(0.45,))
    _check(spec, run_ranks(train_steps, spec), 0.45)


@pytest.mark.slow
def test_ddp_gpt2_at_half() -> None:
    """The issue's case: GPT-2 (transformers, 2 x 64, dropout 0.1) under DDP at 0.5 raised; the single-rank
    model reaches 0.5 and raises at 0.45 at this size."""
    pytest.importorskip("transformers")
    spec = Spec(wrapper="ddp", model="gpt2", budgets=(0.5,))
    _check(spec, run_ranks(train_steps, spec), 0.5)


@pytest.mark.slow
def test_ddp_mlp_inductor_at_half() -> None:
    spec = Spec(wrapper="ddp", model="mlp", budgets=(0.5,), codegen="inductor")
    _check(spec, run_ranks(train_steps, spec), 0.5)
