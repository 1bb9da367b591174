"""300 steps per mode (the eager runtime, backend="dtr" with the FX code generator): live tensors and
gc-tracked objects stay flat, as they do in plain eager. A leak of a few objects a step (once: dead entries
of a parameter's value cache, runtime/constants.py) shows here as hundreds."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import dtr_compile

STEPS = 300


def _counts() -> tuple[int, int]:
    gc.collect()
    objects = gc.get_objects()
    return len(objects), sum(1 for o in objects if isinstance(o, torch.Tensor))


def _no_remat_peak(model: nn.Module, x: torch.Tensor) -> int:
    rt = dtr_compile.runtime.enable(memory_budget=None)
    with rt:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return rt.stats().peak_bytes


@pytest.mark.parametrize("mode", ["eager", "runtime", "fx"])
def test_300_steps_leave_nothing_behind(mode: str) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    layers = [nn.Linear(32, 128), nn.ReLU()] + [m for _ in range(6) for m in (nn.Linear(128, 128), nn.ReLU())]
    model = nn.Sequential(*layers, nn.Linear(128, 1))
    x = torch.randn(512, 32)
    rt = dtr_compile.runtime.enable(memory_budget=0.6, reference_peak_bytes=_no_remat_peak(model, x))
    with dtr_compile.config.patch(memory_budget="3MB", codegen="fx"):
        run = torch.compile(model, backend="dtr") if mode == "fx" else model

        def step() -> None:
            model.zero_grad(set_to_none=True)
            if mode == "runtime":
                with rt:
                    run(x).sum().backward()
            else:
                run(x).sum().backward()

        for _ in range(20):  # warm caches
            step()
        objects, tensors = _counts()
        for _ in range(STEPS):
            step()
        objects_after, tensors_after = _counts()
    if mode == "runtime":
        assert rt.stats().evictions > 0, rt.stats()  # the budget binds: the runtime's bookkeeping is exercised
    assert tensors_after <= tensors, (mode, tensors, tensors_after)
    assert objects_after - objects <= 0.2 * STEPS, (mode, objects, objects_after)
