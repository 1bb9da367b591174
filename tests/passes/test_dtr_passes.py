"""Cost pass, planner, rewrite and peak model on joint graphs captured from small models."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from dtr_compile.backend import make_backend
from dtr_compile.errors import BudgetError
from dtr_compile.passes import DTR_META_KEY, NodeCost, plan_joint, plan_schedule
from dtr_compile.passes.rewrite import RECOMPUTE_META_KEY


def _joint(model: nn.Module, *inputs: torch.Tensor):
    """The joint graph AOTAutograd hands the partitioner (captured through the FX backend)."""
    torch._dynamo.reset()
    backend = make_backend(None, codegen="fx")
    torch.compile(model, backend=backend)(*inputs)
    report = backend.reports[-1]
    return report.joint, report.num_fwd_outputs


def _mlp(depth: int = 4, width: int = 64, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(dropout)) for _ in range(depth)]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def test_every_node_has_one_frozen_cost_record() -> None:
    joint, _ = _joint(_mlp(dropout=0.1), torch.randn(32, 64))
    for node in joint.graph.nodes:
        cost = node.meta[DTR_META_KEY]
        assert isinstance(cost, NodeCost)
        with pytest.raises(dataclasses.FrozenInstanceError):
            cost.out_bytes = 0  # frozen
    by_target = {}
    for node in joint.graph.nodes:
        by_target.setdefault(str(node.target), []).append(node.meta[DTR_META_KEY])
    addmm = by_target["aten.addmm.default"][0]
    assert addmm.flops == 2 * 32 * 64 * 64 and addmm.out_bytes == 32 * 64 * 4 and addmm.recomputable
    assert all(c.out_bytes == 0 for c in by_target["aten.t.default"])  # views allocate nothing
    dropout = by_target["aten.native_dropout.default"][0]
    assert dropout.recomputable and dropout.needs_rng_replay
    backward = [c for costs in by_target.values() for c in costs if c.phase == "backward"]
    assert backward and all(not c.recomputable and "backward" in c.why_not for c in backward)


def test_attention_is_costed_by_flops() -> None:
    class Attention(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    q = torch.randn(2, 4, 64, 16, requires_grad=True)
    joint, _ = _joint(Attention(), q)
    costs = [n.meta[DTR_META_KEY] for n in joint.graph.nodes if "scaled_dot_product" in str(n.target)]
    forward = [c for c in costs if c.phase == "forward"]
    backward = [c for c in costs if c.phase == "backward"]
    assert forward and forward[0].flops == 4 * 2 * 4 * 64 * 64 * 16  # QK^T and PV, two flops per multiply-add
    assert backward and backward[0].flops > forward[0].flops


def test_no_budget_plan_is_the_original_schedule() -> None:
    joint, n_out = _joint(_mlp(), torch.randn(32, 64))
    plan = plan_schedule(joint, None, num_fwd_outputs=n_out)
    assert not any(e.is_recompute for e in plan.trace) and plan.fits
    assert [e.node for e in plan.trace] == [n for n in joint.graph.nodes if n.op == "call_function"]


def test_recomputes_run_in_the_backward_right_before_first_use() -> None:
    joint, n_out = _joint(_mlp(depth=6), torch.randn(64, 64))
    report = plan_joint(joint, 0.7, num_fwd_outputs=n_out)
    assert report.planned_peak.peak_bytes <= report.budget_bytes < report.no_remat.peak_bytes
    nodes = list(report.planned.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    recomputes = [n for n in nodes if RECOMPUTE_META_KEY in n.meta]
    assert recomputes
    for node in recomputes:
        assert node.meta["partitioner_tag"] == "is_backward"
        first_use = min(position[u] for u in node.users)
        # Only other recomputes (the rest of its chain) may sit between a recompute and its first use.
        between = nodes[position[node] + 1 : first_use]
        assert all(RECOMPUTE_META_KEY in n.meta or n.op == "call_function" and not n.users for n in between) or (
            first_use - position[node] <= 8
        )


@pytest.mark.parametrize("codegen", ["fx", "inductor"])
def test_planned_peak_decreases_with_budget_and_stays_within_it(codegen: str) -> None:
    joint, n_out = _joint(_mlp(depth=8), torch.randn(256, 64))
    peaks, costs = [], []
    for fraction in (1.0, 0.8, 0.65, 0.5):
        report = plan_joint(joint, fraction, num_fwd_outputs=n_out, codegen=codegen)
        assert report.planned_peak.peak_bytes <= report.budget_bytes
        peaks.append(report.planned_peak.peak_bytes)
        costs.append(report.plan.recompute_s)
    assert peaks == sorted(peaks, reverse=True)
    assert costs == sorted(costs) and costs[0] == 0 < costs[-1]  # tighter budgets cost more recomputation


def test_infeasible_budget_raises_with_smallest_feasible() -> None:
    joint, n_out = _joint(_mlp(), torch.randn(32, 64))
    with pytest.raises(BudgetError) as info:
        plan_joint(joint, 1000, num_fwd_outputs=n_out)
    smallest = info.value.smallest_feasible_bytes
    assert smallest > 1000 and str(smallest) in str(info.value)
    report = plan_joint(joint, smallest, num_fwd_outputs=n_out)
    assert report.planned_peak.peak_bytes <= smallest


def test_plans_a_2000_node_graph() -> None:
    # How long this takes is a benchmark figure (benchmarks/compiled_bench.py --planning), not a test.
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU()) for _ in range(90)]
    joint, n_out = _joint(nn.Sequential(*blocks), torch.randn(64, 32))
    assert len(joint.graph.nodes) >= 2000
    report = plan_joint(joint, 0.6, num_fwd_outputs=n_out)
    assert report.planned_peak.peak_bytes <= report.budget_bytes < report.no_remat.peak_bytes
    assert any(e.is_recompute for e in report.plan.trace)


class _UnrolledRecurrence(nn.Module):
    """h <- tanh(W h) for a number of steps: one long chain, where only recomputing segments again and again
    reaches low budgets (the recursive checkpointing of Chen et al. and of DTR)."""

    def __init__(self, steps: int = 32, width: int = 64) -> None:
        super().__init__()
        self.cell = nn.Linear(width, width)
        self.steps = steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(self.steps):
            h = torch.tanh(self.cell(h))
        return h.sum()


def test_paging_planner_takes_over_below_the_searchs_reach() -> None:
    torch.manual_seed(0)
    joint, n_out = _joint(_UnrolledRecurrence(), torch.randn(128, 64))
    report = plan_joint(joint, 0.15, num_fwd_outputs=n_out)
    search = plan_schedule(joint, report.budget_bytes, num_fwd_outputs=n_out)
    assert not search.fits  # the search stops above this budget ...
    assert report.planned_peak.peak_bytes <= report.budget_bytes  # ... the paging planner meets it
    assert report.plan.smallest_peak_bytes <= report.planned_peak.peak_bytes
    versions = [e.version for e in report.plan.trace if e.node.name.startswith("tanh")]
    assert max(versions) >= 2  # some values are recomputed more than once


def test_paging_planner_runs_the_schedule_on_the_engine() -> None:
    """The paging replay is the engine's run of the schedule: every recompute in its trace of an op with storages of
    its own is one the engine asked for, and every op reads versions of its inputs emitted before it."""
    from dtr_compile.passes import paging

    torch.manual_seed(0)
    joint, n_out = _joint(_UnrolledRecurrence(), torch.randn(128, 64))
    no_remat = plan_joint(joint, None, num_fwd_outputs=n_out).planned_peak.peak_bytes
    replay = paging._Replay(joint, int(0.15 * no_remat), n_out, None)
    replay.run()
    replay._snapshot(replay.bwd_outputs)
    recomputed = [e for e in replay.trace if e.version > 0 and replay._own(e.node)]
    assert recomputed and len(recomputed) == replay.engine.stats().remats
    emitted: set[tuple[str, int]] = set()
    for e in replay.trace:
        for arg, version in e.arg_versions:
            assert arg.op == "placeholder" or (arg.name, version) in emitted, (e.node.name, arg.name, version)
        emitted.add((e.node.name, e.version))


def test_paging_plan_gives_eager_gradients() -> None:
    torch.manual_seed(0)
    model, x = _UnrolledRecurrence(), torch.randn(128, 64)
    model(x).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    backend = make_backend(0.15, codegen="fx")
    torch.compile(model, backend=backend)(x).backward()
    assert max(e.version for e in backend.reports[-1].plan.trace) >= 2
    for got, want in zip((p.grad for p in model.parameters()), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
