"""`torch.compile(DDP(model), backend="dtr")` under a budget on 2 ranks (gloo, CPU): issue 19.

Oracles, on each rank: the gradients of the last step equal those of the same DDP wrapper compiled with no budget
(and agree across ranks, which trained on different batches: the allreduce ran); the measured peak of every
step after the fraction's calibration step is within 1.05x the fraction of the no-budget run's measured peak on
that rank (dtr_compile.measure, as DESIGN.md counts a step: gradients and DDP's bucket traffic included).

Budgets: 0.5, where GPT-2 under DDP raised before (two faults, see dtr_compile/distributed.py and
runtime/implicit.py `_tracing`), and 0.45, the lowest of 0.5, 0.45, 0.4, ... that the single-rank MLP reaches
(measured: 3677196 of 8915976 bytes; 0.4 raises BudgetError). Dynamo's DDPOptimizer splits the MLP's graph at
its 1 MB gradient buckets into 3 compiled regions; 0.45 is checked both split and with the split turned off
(`torch._dynamo.config.optimize_ddp = False`: one graph, DDP's reducer allreduces after the compiled backward,
without overlap). (The split once needed 0.63 of the peak, each region planned against the room the step left
when it was compiled, and was a strict xfail; rerun in November 2026 it held 0.45. The change that made it hold
was not bisected: the regions now plan again for the tails and held gradients steps measure.)
GPT-2 and the MLP under Inductor have higher single-rank floors (0.6 and 0.57 of their references; their tests
give the figures): 0.5 raises BudgetError on one rank without DDP too, so each is checked at its own floor.

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
    spec = Spec(wrapper="ddp", model="mlp", budgets=(0.5, (0.45, False), 0.45))
    return spec, run_ranks(train_steps, spec)


def test_ddp_mlp_at_half_holds_the_budget_with_equal_gradients(mlp_runs) -> None:
    spec, results = mlp_runs
    _check(spec, results, 0.5)
    assert all(runs[0.5]["evictions"] > 0 for runs in results), "nothing was evicted at half the peak"


def test_ddp_mlp_at_the_single_rank_floor_unsplit(mlp_runs) -> None:
    spec, results = mlp_runs
    _check(spec, results, (0.45, False))


def test_ddp_mlp_at_the_single_rank_floor_split(mlp_runs) -> None:
    spec, results = mlp_runs
    _check(spec, results, 0.45)


@pytest.mark.slow
def test_ddp_gpt2_at_the_single_rank_floor() -> None:
    """The issue's case: GPT-2 (transformers, 2 x 64, dropout 0.1) under DDP. At this size 0.5 is below the
    single-rank model's own floor: the fraction's calibration step measures 4097480 bytes (the same before and
    after the in-place gradient sums of runtime/accumulate.py, and with them turned off), and the planner names
    2455936 bytes (0.599 of it) for one region alone, on one rank without DDP as under DDP, so 0.5 (2048740
    bytes) raises BudgetError on both, and 0.55 (2253614) is below that floor too. 0.6 (2458488 bytes) is the
    lowest of 0.5, 0.55, 0.6 the single-rank model reaches (measured 2002772 bytes, 0.442 of the no-budget
    step's 4531464); DDP split at its buckets measures the same, with no eviction. (A bisect that pointed at the
    in-place sums was misled: at their commit, fb1498e, every backward op under the runtime raised
    AttributeError, Runtime.backward_began coming only with 8d1533e; the commit before it raises at 0.5 too.)"""
    pytest.importorskip("transformers")
    spec = Spec(wrapper="ddp", model="gpt2", budgets=(0.6,))
    _check(spec, run_ranks(train_steps, spec), 0.6)


@pytest.mark.slow
def test_ddp_mlp_inductor_at_the_single_rank_floor() -> None:
    """Under Inductor the planner's floor for the MLP's graph is 4699630 bytes, 0.560 of the 8390664-byte
    reference (under the FX code generator the single-rank MLP reaches 0.45), on one rank without DDP and under
    DDP unsplit alike: at 0.5 both raise BudgetError naming it, and 0.56 is 859 bytes short of it. So 0.57 is the
    lowest of 0.5, 0.51, ... the single-rank model reaches (measured 3677196 bytes, 0.438 of the no-budget step,
    no eviction), checked unsplit. Split at DDP's buckets, the regions share the budget greedily (module
    docstring), and a compiled Inductor part is rerun whole: at 0.57 and 0.6 the step raises BudgetError naming
    6035468 bytes (0.72), at 0.5 one naming 8922124 (1.064x the reference: a saved tensor's recompute reran a
    forward part with every other tensor evicted). (So it did; rerun in November 2026 the split held 0.57 as well, and is
    checked the same way.)"""
    spec = Spec(wrapper="ddp", model="mlp", budgets=((0.57, False), 0.57), codegen="inductor")
    results = run_ranks(train_steps, spec)
    _check(spec, results, (0.57, False))
    _check(spec, results, 0.57)
