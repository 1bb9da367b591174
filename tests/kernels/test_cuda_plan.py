"""The plans `backend="dtr"` makes for a CUDA graph, made on CPU: the GPU test's GPT-2-style stack with dropout 0.2
(tests/gpu/test_gpu_kernels.py), its values fake CUDA tensors, priced at H200-like rates as if measured.

On an H200 the plan at 0.5 fused no recomputed dropout into a kernel. Priced at CPU rates, as that run priced it,
the plan recomputes the two attention dropouts, and the fusion pass left both as they were: emit_plan put each mask's
getitem before the dropout's backward, several ops after the burst that recomputed the dropout's output for a
matmul, so the dropout's unit read outside its burst and joined no region. Only the *plan* is checked here (Triton
runs on CPU only through its interpreter); tests/gpu runs the kernels."""

from __future__ import annotations

import pytest
import torch
from kernel_harness import gpt2_blocks
from torch import fx

from dtr_compile import config, roofline
from dtr_compile.passes.partition import DTRPartitioner
from dtr_compile.passes.rewrite import RECOMPUTE_META_KEY

# About what an H200 measured (torch 2.11: 51 TFLOP/s fp32, 431 TF32, 860 bf16, 3.6-3.9 TB/s).
H200_LIKE = roofline.DeviceRates(
    fp32_flops_per_s=5.1e13,
    tf32_flops_per_s=4.3e14,
    half_flops_per_s=8.6e14,
    bytes_per_s=3.7e12,
    overhead_s=roofline.CUDA_OVERHEAD_S,
    fused_overhead_s=roofline.CUDA_FUSED_OVERHEAD_S,
)


def _joint(model: torch.nn.Module, x: torch.Tensor) -> tuple[fx.GraphModule, list, int, dict]:
    """The joint graph AOTAutograd hands `backend="dtr"`'s partitioner (FX code generator), and its arguments."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition

    captured = {}

    def partition(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
        captured.update(joint=joint, inputs=list(joint_inputs), n=num_fwd_outputs, kwargs=kwargs)
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    backend = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=partition, keep_inference_input_mutations=True)
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(x)
    return captured["joint"], captured["inputs"], captured["n"], captured["kwargs"]


def _on_fake_cuda(value, mode):
    """`value` (a fake CPU tensor, or a tuple of them) as fake tensors of the same layout on cuda:0."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(value, torch.Tensor):
        meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        return FakeTensor(mode, meta, torch.device("cuda", 0))
    if isinstance(value, (tuple, list)):
        return type(value)(_on_fake_cuda(v, mode) for v in value)
    return value


@pytest.fixture
def cuda_without_a_gpu(monkeypatch):
    """What planning a CUDA graph asks of the device, answered without one: the rates (H200-like, as if measured),
    the GPU's name (plan cache keys) and the size of its generator's state (16 bytes: Philox seed and offset)."""
    monkeypatch.setattr(roofline, "_cuda_rates", {0: H200_LIKE})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200 (stand-in)")
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.zeros(16, dtype=torch.uint8))


@pytest.fixture(scope="module")
def joint():
    """The GPU test's model (2 GPT-2-style blocks, dropout 0.2) as the partitioner receives it, traced on CPU."""
    return _joint(*gpt2_blocks(dropout=0.2))


def _plan_for_cuda(joint, budget: float):
    """The partitioner's report for `joint` on fake CUDA tensors under `budget`, with the FX code generator and the
    default recompute kernels (on for CUDA)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph, inputs, num_fwd_outputs, kwargs = joint
    copied = fx.Graph()
    copied.output(copied.graph_copy(graph.graph, {}))  # nodes and meta dicts of its own, the same values in them
    graph = fx.GraphModule(graph, copied)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    for node in graph.graph.nodes:
        if "val" in node.meta:
            node.meta["val"] = _on_fake_cuda(node.meta["val"], mode)
    partitioner = DTRPartitioner(budget, codegen="fx")
    with config.patch(codegen="fx", recompute_kernels="auto", plan_cache=False), mode:
        partitioner(graph, [_on_fake_cuda(v, mode) for v in inputs], num_fwd_outputs=num_fwd_outputs, **kwargs)
    return partitioner.reports[-1]


@pytest.mark.parametrize("rates", ["h200", "cpu"])
def test_cuda_plan_at_half_recomputes_every_dropout_it_drops_inside_kernels(
    joint, cuda_without_a_gpu, monkeypatch, rates
):
    """Priced at H200-like rates, and at CPU rates ("cpu") as the H200 run that found the bug priced it (then no
    dropout was fused at all)."""
    if rates == "cpu":
        monkeypatch.setattr(roofline, "_cuda_rates", {0: roofline.CPU_RATES})
    report = _plan_for_cuda(joint, 0.5)
    fusion = report.fusion
    assert fusion.enabled and "CUDA" in fusion.reason, fusion.reason
    assert report.planned_peak.peak_bytes <= report.budget_bytes < report.no_remat.peak_bytes
    assert fusion.dropouts == 6 and fusion.peak.peak_bytes <= report.budget_bytes

    in_kernels = [m for region in fusion.regions for m in region.members if m.startswith("dropout_kernel")]
    left = [(name, why) for name, why in fusion.unfused if name.startswith("dropout_kernel")]
    assert in_kernels and not left, left
    # Every dropout the plan recomputes runs inside a kernel; so does every recomputed layer norm (its mean and rstd,
    # like a dropout's mask, read by its backward further on): only ops without a lowering are left as they are.
    recomputed = {n.name for n in fusion.graph.graph.nodes if RECOMPUTE_META_KEY in n.meta}
    assert not [n for n in recomputed if n.startswith(("dropout_kernel", "native_layer_norm"))], recomputed
    assert all(why.startswith("no kernel lowering") for _, why in fusion.unfused), fusion.unfused
    # A recomputed softmax and the attention dropout that reads it are one kernel (which writes the mask).
    attention = [r for r in fusion.regions if any(m.startswith("_softmax") for m in r.members)]
    assert attention and all(any(m.startswith("dropout_kernel") for m in r.members) for r in attention)


def test_cuda_plan_recomputes_pointwise_chains_and_dropouts_before_any_matmul(joint, cuda_without_a_gpu) -> None:
    """Under a budget that needs recomputation, the first things a CUDA plan recomputes are the chains its kernels
    fuse: with the FX code generator a recomputed matmul is a launch of its own, a fused pointwise op or dropout is
    not (passes/costs.py). At 0.8 the plan once recomputed the MLP's up-projection (an addmm) for its bytes."""
    report = _plan_for_cuda(joint, 0.8)
    assert report.planned_peak.peak_bytes <= report.budget_bytes < report.no_remat.peak_bytes
    aten = torch.ops.aten
    recomputed = [n for n in report.planned.graph.nodes if RECOMPUTE_META_KEY in n.meta]
    matmuls = [n.name for n in recomputed if n.target in (aten.mm.default, aten.addmm.default, aten.bmm.default)]
    assert not matmuls, matmuls
    fusion = report.fusion
    assert any(m.startswith("dropout_kernel") for region in fusion.regions for m in region.members)
    assert all(why.startswith("no kernel lowering") for _, why in fusion.unfused), fusion.unfused
