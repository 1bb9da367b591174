"""The eager runtime rematerializes outputs of compiled regions with Triton kernels (Triton's interpreter on CPU)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from kernel_harness import assert_close_at_magnitude, trace

import dtr_compile
from dtr_compile.bench.dynamic_models import build_dynamic
from dtr_compile.measure import measure_peak
from dtr_compile.runtime.implicit import implicit_runtime
from dtr_compile.runtime.slice_kernels import with_kernels
from dtr_compile.runtime.slices import output_slices


def _forward(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, y: torch.Tensor):
    normed = F.layer_norm(x, (x.shape[-1],), w, b)
    activated = F.gelu(normed)
    return normed, activated, activated @ y, torch.softmax(x * 0.5, dim=-1)


def test_every_slice_kernel_equals_its_slice_on_fresh_values() -> None:
    torch.manual_seed(0)  # the same values each run: a failure reproduces
    examples = (torch.randn(6, 32), torch.randn(32), torch.randn(32), torch.randn(32, 8))
    slices = with_kernels(output_slices(trace(_forward, *examples)))
    fused = [s for s in slices if s is not None and s.kernel is not None]
    # layer norm, GELU and softmax are one kernel each; the matmul's slice is not one kernel's work
    assert len(fused) == 3 and slices[2] is not None and slices[2].kernel is None
    for output_slice in fused:
        placeholders = [n for n in output_slice.module.graph.nodes if n.op == "placeholder"]
        values = [torch.randn(tuple(n.meta["val"].shape)) for n in placeholders]
        got = output_slice.kernel(*(values[i] for i in output_slice.kernel_inputs))[0]
        assert_close_at_magnitude(got, output_slice.module(*values))


def test_runtime_rematerializes_region_outputs_with_kernels_and_matches_eager() -> None:
    case = build_dynamic("transformer_branch", "test")
    model = case.model
    initial = copy.deepcopy(model.state_dict())

    def step(forward, i: int):
        model.zero_grad(set_to_none=True)
        inputs, target = case.batch(i)
        loss = case.loss_fn(forward(*inputs), target)
        loss.backward()
        return loss.item(), [None if p.grad is None else p.grad.clone() for p in model.parameters()]

    measured = [measure_peak(lambda i=i: step(model, i)) for i in range(2)]
    expected = [result for result, _ in measured]
    budget = int(0.3 * max(m.peak_bytes for _, m in measured))  # rematerializes region outputs (by slices)
    model.load_state_dict(initial)
    torch._dynamo.reset()
    dtr_compile.runtime.finish_steps()
    with dtr_compile.config.patch(memory_budget=budget, codegen="fx", recompute_kernels="triton"):
        compiled = torch.compile(model, backend="dtr")
        got = [step(compiled, i) for i in range(2)]
    stats = implicit_runtime().stats()
    assert stats.kernel_rematerializations > 0, stats
    for (loss, grads), (want_loss, want_grads) in zip(got, expected, strict=True):
        assert abs(loss - want_loss) < 1e-5
        for g, w in zip(grads, want_grads, strict=True):
            assert (g is None) == (w is None)
            if g is not None:
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
