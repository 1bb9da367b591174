"""Fuzz: random small models with dropout x budgets under the eager runtime, against plain eager.

Issue 16, class 3: the runtime held its own accounting under the budget while the measured peak was
1.05-1.41 x the budget on such models (the CPU generator's 5 KiB state saved per random op was not counted;
CPU flash attention's per-thread buffers were not either). The rule is "hold the budget or raise": every case
either raises a DTRError, or has a measured peak <= the budget and the values and gradients of eager.
The models are tiny (activations of tens of KiB), so the fixed costs the runtime adds are a large share.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import dtr_compile

from .helpers import assert_same, eager_reference, under_runtime


class Block(nn.Module):
    """A residual block: optional self-attention (SDPA, with attention dropout), then a GELU MLP with dropout."""

    def __init__(self, dim: int, dropout: float, attention: bool) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(dropout)
        self.attn = nn.MultiheadAttention(dim, 2, dropout=dropout, batch_first=True) if attention else None
        self.norm = nn.LayerNorm(dim) if attention else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.attn is not None:
            x = self.norm(x + self.drop(self.attn(x, x, x, need_weights=False)[0]))
        return x + self.drop(self.down(self.drop(nn.functional.gelu(self.up(x)))))


def random_case(seed: int):
    """A model and step drawn from `seed`: width, depth, dropout, attention or not, batch and sequence."""
    draw = random.Random(seed)
    dim, depth = draw.choice([16, 32, 48]), draw.randint(2, 5)
    dropout, attention = draw.choice([0.0, 0.1, 0.3]), draw.random() < 0.6
    batch, seq = draw.choice([4, 8]), draw.choice([16, 32])

    def make_model() -> nn.Module:
        return nn.Sequential(*[Block(dim, dropout, attention) for _ in range(depth)])

    def step(model: nn.Module) -> torch.Tensor:
        return model(torch.randn(batch, seq, dim)).square().mean()

    return make_model, step


@pytest.mark.parametrize("seed", range(8))
def test_random_models_hold_the_budget_or_raise(seed: int) -> None:
    make_model, step = random_case(seed)
    reference = eager_reference(make_model, step)
    held = 0
    for fraction in (0.7, 0.5, 0.35):
        budget = int(fraction * reference.peak_bytes)
        try:
            result, runtime = under_runtime(make_model, step, budget)
        except dtr_compile.DTRError:
            continue
        assert_same(result, reference)
        assert result.peak_bytes <= budget, (
            f"seed {seed} at {fraction}: measured {result.peak_bytes} B > budget {budget} B ({runtime.stats()})"
        )
        held += 1
    assert held, f"seed {seed}: no budget ran at all, the fuzz case checks nothing"


def test_random_ops_state_counts_against_the_budget() -> None:
    """Every dropout saves the generator state for its replay: the runtime's own peak includes those bytes."""
    from dtr_compile.runtime.rng_memory import cpu_state_bytes

    def make_model() -> nn.Module:
        return nn.Sequential(*[nn.Dropout(0.5) for _ in range(6)])

    def step(model: nn.Module) -> torch.Tensor:
        return model(torch.randn(4, 4, requires_grad=True)).sum()

    result, runtime = under_runtime(make_model, step, None)
    assert runtime.stats().peak_bytes >= 6 * cpu_state_bytes()
    assert result.peak_bytes <= runtime.stats().peak_bytes + 4096  # the measurement sees what the runtime counted


class BranchyModel(nn.Module):
    """Blocks with attention and dropout, and a data-dependent branch after each: a graph break per block, so
    `backend="dtr"` runs compiled regions (with random ops) and eager code in one runtime step."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(32, 0.2, attention=True) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            if x.sum() > 0:
                x = x * 1.0
        return x


def _compiled_steps(model: nn.Module, budget, steps: int = 2) -> list:
    """`steps` measured steps of `torch.compile(model, backend="dtr")` (codegen="fx") after one unmeasured
    step (the compile's own allocations, such as the RNG states Dynamo saves while tracing, are not a step's)."""
    from dtr_compile.measure import measure_peak

    torch._dynamo.reset()
    results = []
    with dtr_compile.config.patch(memory_budget=budget, codegen="fx"):
        compiled = torch.compile(model, backend="dtr")
        for i in range(steps + 1):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            x = torch.randn(8, 32, 32)

            def body(x: torch.Tensor = x) -> float:
                loss = compiled(x).square().mean()
                loss.backward()
                return loss.item()

            loss, measurement = measure_peak(body)
            dtr_compile.runtime.finish_steps()
            if i:
                grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
                results.append((loss, grads, measurement.peak_bytes))
    return results


def test_compiled_regions_with_dropout_hold_the_budget_under_fx(monkeypatch: pytest.MonkeyPatch) -> None:
    """codegen="fx" measured 1.05 x its budget: a compiled part's saved RNG state was not counted either.
    Then each region is planned again after the first step with a tail equal to the assumed one (the same plan,
    compiled again outside Dynamo's trace): its backward recomputed a GELU and a dropout only to drop them, a
    transient no Footprint held, and the step measured 1.058 x its budget (passes/partition.py)."""
    import copy

    torch.manual_seed(0)
    base = BranchyModel()
    reference = _compiled_steps(copy.deepcopy(base), None)  # the oracle with random ops: no budget, same backend
    budget = int(0.7 * reference[-1][2])
    for replan in (False, True):
        if replan:
            _plan_again_with_the_assumed_tail(monkeypatch)
        try:
            results = _compiled_steps(copy.deepcopy(base), budget)
        except dtr_compile.DTRError:
            pytest.fail("0.7 of the no-budget peak ran before; it should still")
        for (loss, grads, peak), (ref_loss, ref_grads, _) in zip(results, reference):
            assert peak <= budget, (replan, peak, budget)
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            for got, want in zip(grads, ref_grads):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _plan_again_with_the_assumed_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a step has shown a region's tail, plan the region with one equal to the tail it assumed: a new key, so
    the region is compiled again (at its next call), with the same plan."""
    from dtr_compile.backend import region

    def measured_tail(self: region.Region, runtime, step_budget: int, compiling: bool = False):
        if not self._tail_decided and self.reports and runtime.tails.decided(self.name):
            self._tail_decided = True
            self._tail = self.reports[-1].tail
        return self._tail

    monkeypatch.setattr(region.Region, "_measured_tail", measured_tail)
