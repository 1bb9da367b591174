"""`_Search.fill`, which spends what a plan leaves of its budget: the lower bound that lets it reject a value saved
again without simulating, and how it finds the items that do not fit (planner.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from tiny_models import decomposed_joint
from torch import nn

from dtr_compile.passes.costs import annotate_costs
from dtr_compile.passes.inlining import FUSED_RECOMPUTE
from dtr_compile.passes.planner import _Search
from dtr_compile.passes.schedule import Infeasible, JointFacts, build_trace, simulate
from tests.passes.test_schedule_model import _model


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
                                    for _ in range(4))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()


@pytest.mark.parametrize("inductor", [False, True, FUSED_RECOMPUTE])
@pytest.mark.parametrize("model", ["sequential", "residual"])
def test_the_lower_bound_never_exceeds_the_simulated_peak(inductor: bool | str, model: str) -> None:
    """For random plans and random groups of their dropped values, the peak with the group saved again is never
    below the bound read off the plan's own simulation: the bound may reject only what the simulation would."""
    module, x = _model() if model == "sequential" else (_Residual(), torch.randn(32, 64))
    joint, n_out = decomposed_joint(module, x)
    annotate_costs(joint, codegen="inductor" if inductor else "fx")
    facts = JointFacts(joint, n_out)
    search = _Search(facts, frozenset(), inductor)
    rng = random.Random(0)
    checked = 0
    for trial in range(12):
        dropped = frozenset(n for n in facts.candidates if rng.random() < (trial + 1) / 13)
        state = search.evaluate(dropped, frozenset())
        if state is None or not dropped:
            continue
        for _ in range(6):
            group = rng.sample(sorted(dropped, key=facts.position.get), rng.randint(1, min(4, len(dropped))))
            bound = search._saved_again_lower_bound(state, group)
            if bound is None:
                continue
            try:
                trace = build_trace(facts, set(dropped - set(group)))
            except Infeasible:
                continue
            assert simulate(facts, trace, inductor=inductor).peak >= bound
            checked += 1
    assert checked >= 20


def test_fill_bisects_to_the_one_item_that_does_not_fit() -> None:
    """Runs of items that fit, each ended by one that does not (the splits of an unrolled LSTM planned tight):
    the pass finds each such item by halving the rejected group, skips it, and goes on at the pace it had, in
    far fewer tries than items; every other item is undone."""
    bad = set(range(40, 400, 41))

    def evaluate(items: list[int], *, fitting: tuple[int, float]) -> SimpleNamespace | None:
        tries.append(items)
        if bad & set(items):
            return None
        return SimpleNamespace(trace=SimpleNamespace(recompute_s=fitting[1] * 0.9))

    tries: list[list[int]] = []
    search = SimpleNamespace(evaluate=evaluate)
    start = SimpleNamespace(trace=SimpleNamespace(recompute_s=1.0))
    undone: list[int] = []

    def undo(state: SimpleNamespace, group: list[int]) -> tuple[list[int]]:
        return (group,)

    _Search._fill_pass(search, start, list(range(400)), 10**9, undo)  # type: ignore[arg-type]
    for group in tries:
        if not bad & set(group):
            undone.extend(group)
    assert sorted(undone) == [i for i in range(400) if i not in bad]
    assert len(tries) < 400 / 3
