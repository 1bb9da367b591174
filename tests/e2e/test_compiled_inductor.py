"""The compiled path with Inductor (C++ on CPU) and the entry point. Each compile costs 15-30 s here."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import compiled_models as models
import pytest
import torch


def test_backend_found_through_entry_point_in_fresh_process() -> None:
    code = textwrap.dedent(
        """
        import sys, torch
        assert "dtr" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
        assert "dtr_compile" not in sys.modules
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        x = torch.randn(4, 8)
        torch.compile(model, backend="dtr")(x).sum().backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).sum().backward()
        assert all(torch.allclose(g, p.grad, atol=1e-5) for g, p in zip(got, model.parameters()))
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_inductor_gradients_equal_eager_under_budget() -> None:
    model, inputs = models.mlp()
    expected = models.eager_grads(model, inputs)
    grads, measured, reports = models.run_step(model, inputs, 0.6, codegen="inductor")
    assert max((grads[k] - expected[k]).abs().max().item() for k in grads) < 1e-4
    report = reports[-1]
    assert report.planned_peak.peak_bytes <= report.budget_bytes
    assert measured <= 1.05 * report.no_remat.peak_bytes * 0.6 or measured <= report.no_remat.peak_bytes


@pytest.mark.slow  # two Inductor compiles of a transformer: ~2 min on 2 cores
def test_inductor_dropout_matches_same_backend_without_budget() -> None:
    model, inputs = models.transformer(dropout=0.2)
    with torch._inductor.config.patch(fallback_random=True):
        reference, _, _ = models.run_step(model, inputs, None, codegen="inductor", steps=1)
        grads, _, _ = models.run_step(model, inputs, 0.5, codegen="inductor", steps=1)
    assert max((grads[k] - reference[k]).abs().max().item() for k in grads) < 1e-4
