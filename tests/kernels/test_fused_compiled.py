"""backend="dtr" with codegen="fx" and recompute_kernels="triton" (Triton's interpreter on CPU tensors)."""

from __future__ import annotations

import pytest
import torch
from kernel_harness import assert_close_at_magnitude, compiled_step, gpt2_blocks, max_difference, mlp
from torch import fx

from dtr_compile.kernels import RecomputeKernel
from dtr_compile.passes.fuse_recompute import FUSED_META_KEY


@pytest.fixture(scope="module")
def gpt2_at_half_budget():
    """A 2-block GPT-2-style model with dropout 0.2 at budget 0.5: the no-budget run with kernels (the oracle
    with dropout: same counter-based masks), and the budgeted run with and without kernels."""
    model, x = gpt2_blocks(dropout=0.2)
    return {
        "x": x,
        "model": model,
        "reference": compiled_step(model, x, None, "triton"),
        "fused": compiled_step(model, x, 0.5, "triton"),
        "unfused": compiled_step(model, x, 0.5, "off"),
    }


def test_gradients_with_replayed_dropout_equal_the_unbudgeted_step(gpt2_at_half_budget) -> None:
    reference_grads, _, _ = gpt2_at_half_budget["reference"]
    grads, _, report = gpt2_at_half_budget["fused"]
    fusion = report.fusion
    assert fusion.enabled and fusion.dropouts == 6  # every dropout on the counter-based RNG, recomputed or not

    # The plan recomputes a dropout, its mask fused with the backward op that reads it, and layer norms and
    # softmax chains (mul, masked_fill, softmax) each as one kernel.
    def computes(region) -> list[str]:
        return [m for m in region.members if not m.startswith(("getitem", "view", "expand", "_unsafe_view"))]

    assert any(
        any(m.startswith("dropout_kernel") for m in computes(r)) and len(computes(r)) >= 2 for r in fusion.regions
    )
    assert any(any(m.startswith("native_layer_norm") for m in computes(r)) for r in fusion.regions)
    assert any(any(m.startswith("_softmax") for m in computes(r)) and len(computes(r)) >= 3 for r in fusion.regions)
    # A recomputed mask read only by its dropout's backward is never written: that backward joins the region.
    # (At 0.5 the plan recomputes such a dropout; the region then writes the backward's result, not the mask.)
    joined = [r for r in fusion.regions if any(m.startswith("native_dropout_backward") for m in r.members)]
    assert joined, [r.members for r in fusion.regions]
    for region in joined:
        backward = next(
            n for n in region.unfused.graph.nodes if str(n.target).startswith("aten.native_dropout_backward")
        )
        mask = backward.args[1]
        assert mask.name in region.members and mask.name not in region.outputs, (region.members, region.outputs)
        assert any(m.startswith("dropout_kernel") for m in region.members), region.members
    assert max_difference(grads, reference_grads) < 1e-5


def test_measured_peak_stays_within_budget_and_model(gpt2_at_half_budget) -> None:
    _, fused_peak, report = gpt2_at_half_budget["fused"]
    _, unfused_peak, unfused_report = gpt2_at_half_budget["unfused"]
    assert report.budget_bytes == unfused_report.budget_bytes
    assert report.fusion.peak.peak_bytes <= report.budget_bytes
    # Kernels write only what the backward reads: the step needs no more memory than the op-by-op recompute
    # (up to the inputs a kernel holds while it runs, where op by op they could be freed earlier).
    assert fused_peak <= 1.02 * unfused_peak, (fused_peak, unfused_peak)
    assert fused_peak <= 1.05 * report.budget_bytes
    assert 0.9 * report.fusion.peak.peak_bytes <= fused_peak <= 1.02 * report.fusion.peak.peak_bytes


def test_every_fused_kernel_equals_its_unfused_recompute(gpt2_at_half_budget) -> None:
    """Run the fused joint graph on fresh random values; at every kernel, run the members it replaced op by op."""
    _, _, report = gpt2_at_half_budget["fused"]
    graph_module = report.fusion.graph
    checked = []

    class CheckEveryRegion(fx.Interpreter):
        def run_node(self, node: fx.Node):
            result = super().run_node(node)
            region = node.meta.get(FUSED_META_KEY)
            if region is not None:
                args, _ = self.fetch_args_kwargs_from_env(node)
                reference = region.reference(*args)
                for position, want in zip(region.positions, reference, strict=True):
                    got = result[position].view(want.shape)
                    if want.dtype == torch.bool:
                        assert torch.equal(got, want), region.members  # dropout masks: bit for bit
                    else:
                        assert_close_at_magnitude(got, want, msg=str(region.members))
                checked.append(region)
            return result

    generator = torch.Generator().manual_seed(0)  # the same values each run: a failure reproduces
    values = []
    for node in graph_module.graph.nodes:
        if node.op == "placeholder":
            val = node.meta["val"]
            values.append(torch.randn(val.shape, generator=generator).to(val.dtype))
    CheckEveryRegion(graph_module).run(*values)
    assert len(checked) == len(report.fusion.regions) >= 8
    assert all(isinstance(region.kernel, RecomputeKernel) for region in checked)


def test_gradients_without_dropout_equal_eager() -> None:
    model, x = mlp()
    torch.manual_seed(0)
    model(x).sum().backward()
    eager = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    grads, _, report = compiled_step(model, x, 0.55, "triton")
    assert report.fusion.regions, "the plan should recompute fusible regions at this budget"
    assert max_difference(grads, eager) < 1e-5


def test_kernels_off_by_default_on_cpu() -> None:
    """recompute_kernels="auto" leaves CPU graphs as planned: the unfused recompute is the CPU path."""
    model, x = mlp()
    _, _, report = compiled_step(model, x, 0.55, "auto")
    assert not report.fusion.enabled and "cpu" in report.fusion.reason
    assert report.fusion.graph is report.planned
