"""The eager DTR runtime on CUDA: measured peak (the allocator's) within the budget, gradients equal eager's.

The transformer has dropout in attention and after every sublayer: with the generators seeded alike, eager and
the runtime draw the same masks only if every recompute of a random op replays the CUDA generator's (Philox)
state the op first ran from; so equal gradients are also the check that dropout recompute replays its mask.
"""

from __future__ import annotations

import copy

import pytest
import torch
from gpu_helpers import CUDA, GPU, SLACK, assert_grads_close, warm_then_measure
from torch import nn

import dtr_compile
from dtr_compile.runtime.recipe import RngState

pytestmark = GPU


def _transformer(dropout: float) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers = [
        nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, dropout=dropout, batch_first=True)
        for _ in range(4)
    ]
    model = nn.Sequential(*layers, nn.Linear(256, 1)).to(CUDA).train()
    x = torch.randn(16, 128, 256, generator=torch.Generator().manual_seed(1)).to(CUDA)
    return model, x


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_runtime_holds_the_budget_with_eager_gradients(dropout: float) -> None:
    fraction = 0.5
    model, x = _transformer(dropout)
    initial = copy.deepcopy(model)

    def step() -> None:
        model(x).square().mean().backward()

    eager, eager_peak = warm_then_measure(model, step)
    budget = int(fraction * eager_peak)
    model.load_state_dict(initial.state_dict())
    rt = dtr_compile.runtime.enable(memory_budget=budget)

    def step_under_runtime() -> None:
        with rt:
            model(x).square().mean().backward()

    grads, peak = warm_then_measure(model, step_under_runtime)
    stats = rt.stats()
    # Not bitwise: the memory-efficient attention's backward accumulates in a nondeterministic order on CUDA.
    assert_grads_close(grads, eager, rtol=1e-4)
    assert peak <= SLACK * budget, f"measured {peak} B > {SLACK} x budget {budget} B at {fraction}: {stats}"
    assert stats.evictions > 0 and stats.rematerializations > 0, stats


def test_rng_state_replay_on_cuda_redraws_the_same_dropout_mask() -> None:
    x = torch.ones(4096, device=CUDA)
    state = RngState.capture(CUDA)
    first = torch.nn.functional.dropout(x, 0.5)
    assert state.state.device.type == "cpu" and state.device.type == "cuda"  # the CUDA generator's seed and offset
    previous = state.replay()
    again = torch.nn.functional.dropout(x, 0.5)
    previous.replay()
    later = torch.nn.functional.dropout(x, 0.5)
    assert torch.equal(first, again)
    assert not torch.equal(first, later)  # the generator went on from where it was, not from the replayed state
