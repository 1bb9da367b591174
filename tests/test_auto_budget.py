"""`memory_budget="auto"` (dtr_compile/auto_budget.py): what the CUDA device can give a step, less a margin.

On this CPU machine the CUDA path runs against a fake device: `torch.cuda.is_available`, `mem_get_info`,
`memory_reserved`, `memory_allocated` and `current_device` are monkeypatched, and the steps themselves run on CPU
tensors (the runtime takes the budget in bytes; where the bytes come from is what is tested). The real device is
tests/gpu/test_gpu_auto_budget.py.
"""

from __future__ import annotations

import pytest
import torch

import dtr_compile
from dtr_compile import auto_budget, config
from dtr_compile.errors import DeviceError

MiB = 2**20


class FakeDevice:
    """A CUDA device as torch.cuda reports it: `free` bytes free, `reserved - allocated` cached by the allocator."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, free: int, reserved: int = 0, allocated: int = 0) -> None:
        self.free, self.reserved, self.allocated = free, reserved, allocated
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.free, 80 * 2**30))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)


def test_auto_is_a_budget_value() -> None:
    for spelling in ("auto", "AUTO", " Auto "):
        assert config.parse_budget(spelling) == "auto"
    with config.patch(memory_budget="auto"):
        assert config.memory_budget == "auto"


def test_auto_on_cpu_asks_for_a_number(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match=r"no CUDA device.*give a number.*'2GB'.*0\.5"):
        dtr_compile.runtime.enable(memory_budget="auto")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    x = torch.randn(4, 8, requires_grad=True)
    torch._dynamo.reset()
    with config.patch(memory_budget="auto", codegen="fx"), pytest.raises(DeviceError, match="give a number"):
        torch.compile(model, backend="dtr")(x).sum().backward()
    torch._dynamo.reset()


def test_auto_resolves_free_plus_cached_less_the_margin(monkeypatch) -> None:
    device = FakeDevice(monkeypatch, free=10_000 * MiB, reserved=1_500 * MiB, allocated=500 * MiB)
    available = 11_000 * MiB  # free + (reserved - allocated)
    expected = available - int(0.10 * available)
    expected -= expected % auto_budget.AUTO_STEP_BYTES
    assert auto_budget.resolve() == expected
    device.free = 1_000 * MiB
    device.reserved = device.allocated = 0
    small = 1_000 * MiB - auto_budget.AUTO_MARGIN_MIN_BYTES  # the floor of the margin on a small free amount
    assert auto_budget.resolve() == small - small % auto_budget.AUTO_STEP_BYTES
    device.free = 200 * MiB
    with pytest.raises(dtr_compile.BudgetError, match="give memory_budget in bytes"):
        auto_budget.resolve()


def test_auto_follows_the_device_from_step_to_step(monkeypatch) -> None:
    """Re-resolved at each step's start: it shrinks with the free memory, ignores noise, and the runtime's stats()
    and explain() show the bytes it resolved to."""
    device = FakeDevice(monkeypatch, free=4_000 * MiB)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x = torch.randn(8, 16)
    rt = dtr_compile.runtime.enable(memory_budget="auto")
    seen = []
    for free in (4_000 * MiB, 4_000 * MiB - 12345, 3_000 * MiB, 3_100 * MiB, 3_500 * MiB):
        device.free = free
        with rt:
            model(x).sum().backward()
        seen.append(rt.stats().budget_bytes)
    assert seen[0] == seen[1], f"a few bytes less free memory changed the budget: {seen}"
    assert seen[2] < seen[1], f"the budget did not shrink with the free memory: {seen}"
    assert seen[3] == seen[2], f"100 MiB more free memory (under 2 x {auto_budget.AUTO_STEP_BYTES}) moved it: {seen}"
    assert seen[4] > seen[3], f"500 MiB more free memory did not raise it: {seen}"
    assert all(b % auto_budget.AUTO_STEP_BYTES == 0 for b in seen), seen
    device.free = 2_000 * MiB
    # Dynamo and Inductor probe a device that says it is there: for the compile, CUDA is absent again, and only
    # auto_budget is told it is present.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(auto_budget, "check_available", lambda: None)
    report = dtr_compile.explain(model, x.requires_grad_(), memory_budget="auto")
    available = 2_000 * MiB
    expected = available - max(auto_budget.AUTO_MARGIN_MIN_BYTES, int(0.1 * available))
    expected -= expected % auto_budget.AUTO_STEP_BYTES
    assert report.reports[0].budget_bytes == expected, report
