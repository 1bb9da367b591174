"""`explain` plans for one device: a model and inputs on different devices are refused before anything compiles."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dtr_compile import DeviceError
from dtr_compile.explain import explain


def test_explain_refuses_a_model_and_inputs_on_different_devices(monkeypatch) -> None:
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("explain compiled before checking devices"))
    model = nn.Linear(4, 4)
    x = torch.randn(2, 4, device="meta")
    with pytest.raises(DeviceError, match=r"span 2: parameter or buffer 'weight' on cpu, input 0 on meta\. Move"):
        explain(model, x, memory_budget=0.5)
