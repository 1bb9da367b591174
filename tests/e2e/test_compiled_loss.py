"""A loss compiled in its own graph (as transformers computes a causal LM's, after a graph break) runs under a budget
in the memory Inductor's code takes, from its first step.

Inductor fuses a cross-entropy's backward (`nll_loss_backward` into `_log_softmax_backward_data`) into one kernel:
one logits-sized buffer, the gradient. Two things charged it three: the FX code of a region's first step, which runs
each op on its own, and the plans' memory model, which counts each link of a backward chain as a buffer because a
pinned plan stores it (partition.baseline_runs_unpinned). A budget of twice the logits then raised a BudgetError naming
three. Inductor compiles of a few seconds each (small logits)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dtr_compile
from dtr_compile.measure import measure_peak
from dtr_compile.passes import running_plans

TOKENS, VOCAB = 1024, 1024
LOGITS_BYTES = TOKENS * VOCAB * 4  # 4 MiB


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels, ignore_index=-100)


def _steps(budget: int | None, steps: int = 3) -> tuple[torch.Tensor, int, list]:
    """`steps` steps of the loss compiled with backend="dtr" (Inductor) at `budget` bytes: the last step's gradient
    of the logits, its measured peak and the region's plans."""
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(TOKENS, VOCAB, generator=generator, requires_grad=True)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    labels[::7] = -100
    with dtr_compile.config.patch(memory_budget=budget, codegen="inductor"):
        loss_fn = torch.compile(_cross_entropy, backend="dtr")
        for _ in range(steps - 1):
            logits.grad = None
            loss_fn(logits, labels).backward()
        logits.grad = None
        _, peak = measure_peak(lambda: loss_fn(logits, labels).backward())
    return logits.grad.clone(), peak.peak_bytes, list(running_plans.running().values())


def _eager_grad() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(TOKENS, VOCAB, generator=generator, requires_grad=True)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    labels[::7] = -100
    _cross_entropy(logits, labels).backward()
    return logits.grad


@pytest.mark.compat
def test_a_compiled_loss_runs_in_the_memory_of_inductors_code_from_its_first_step() -> None:
    budget = 2 * LOGITS_BYTES  # the fused backward needs one logits' worth; op by op it needs three
    grad, peak, reports = _steps(budget)
    torch.testing.assert_close(grad, _eager_grad(), rtol=1e-5, atol=1e-7)
    assert peak <= budget, (peak, budget)
    assert peak < 1.5 * LOGITS_BYTES, peak  # Inductor's fused backward, not the op-by-op one
    report = reports[-1]
    assert report.partition == "min_cut" and report.unpinned_baseline  # torch.compile's own partition, as it runs
    # modelled as Inductor runs it: within 5% of the measured peak (the pinned model counts three logits)
    assert abs(report.no_remat.peak_bytes - peak) <= 0.05 * peak, (report.no_remat.peak_bytes, peak)
    assert report.pinned_no_remat_bytes > 2.5 * LOGITS_BYTES
    assert report.times.compiles == 1  # the first step ran Inductor's code: no FX plan to replace at its end
