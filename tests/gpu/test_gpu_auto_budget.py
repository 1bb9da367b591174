"""`memory_budget="auto"` on a real CUDA device: the budget is the device's free memory (plus the allocator's
cached bytes) less the margin (dtr_compile/auto_budget.py), the runtime's stats() show it, and a step under it runs
with its measured peak within it."""

from __future__ import annotations

import torch
from gpu_helpers import GPU

import dtr_compile
from dtr_compile import auto_budget
from dtr_compile.measure import measure_peak

pytestmark = GPU


def test_auto_budget_on_the_device() -> None:
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU()) for _ in range(4)])
    model = model.cuda()
    x = torch.randn(256, 512, device="cuda")
    free, _ = torch.cuda.mem_get_info()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    resolved = auto_budget.resolve()
    assert 0 < resolved <= free + cached - auto_budget.AUTO_MARGIN_MIN_BYTES
    rt = dtr_compile.runtime.enable(memory_budget="auto")
    with rt:
        model(x).sum().backward()  # warm-up: cuBLAS workspaces
    model.zero_grad(set_to_none=True)

    def step() -> None:
        with rt:
            model(x).sum().backward()

    _, measured = measure_peak(step, "cuda")
    budget = rt.stats().budget_bytes
    assert budget is not None and budget % auto_budget.AUTO_STEP_BYTES == 0
    assert measured.peak_bytes <= budget, (measured.peak_bytes, budget)
