"""The Triton recompute kernels compiled for the GPU (not Triton's interpreter), with the default
`recompute_kernels="auto"`: the fusion pass of `codegen="fx"` and the runtime's slice kernels turn on for CUDA
tensors, their results equal eager's, and dropout recomputed in a kernel draws the forward's mask.

tests/conftest.py sets TRITON_INTERPRET=1 only where CUDA is missing, so on a GPU machine every kernel here is
compiled for the device. The models come from tests/kernels/kernel_harness.py, shared with the CPU kernel tests.
"""

from __future__ import annotations

import copy
import os

import torch
from gpu_helpers import CUDA, GPU, SLACK, assert_grads_close, measured_step, warm_then_measure
from kernel_harness import gpt2_blocks, mlp  # the CPU kernel tests' models (gpu_helpers puts them on the path)

import dtr_compile
from dtr_compile.backend import make_backend
from dtr_compile.bench.dynamic_models import build_dynamic
from dtr_compile.kernels import draw_seed, dropout_kernel, launch
from dtr_compile.measure import move_to
from dtr_compile.runtime.implicit import implicit_runtime

pytestmark = GPU


def _fx_step(model: torch.nn.Module, x: torch.Tensor, budget, seed: int = 0):
    """(grads, measured CUDA peak, plan report) of a step through backend="dtr", codegen="fx", default kernels."""
    torch._dynamo.reset()
    backend = make_backend(budget, codegen="fx")
    with dtr_compile.config.patch(codegen="fx", recompute_kernels="auto"):
        compiled = torch.compile(model, backend=backend)
        grads, peak = warm_then_measure(model, lambda: compiled(x).sum().backward(), seed=seed)
    return grads, peak, backend.reports[-1]


def _compiled_for_the_gpu() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "Triton's interpreter is on: kernels would not compile"
    targets = {target for _, target in launch._CACHE}  # (program, target) -> kernel, for the process
    assert "gpu" in targets and "interpreter" not in targets, f"kernels built for {targets}"


def test_auto_fuses_recomputes_into_compiled_kernels_equal_to_eager() -> None:
    model, x = mlp()
    model, x = model.to(CUDA), x.to(CUDA)
    eager, _ = warm_then_measure(model, lambda: model(x).sum().backward())
    grads, peak, report = _fx_step(model, x, 0.55)
    assert report.fusion.enabled and "CUDA" in report.fusion.reason, report.fusion.reason
    assert report.fusion.regions, "the plan should recompute fusible regions at this budget"
    _compiled_for_the_gpu()
    assert_grads_close(grads, eager, rtol=1e-5)
    assert peak <= SLACK * report.budget_bytes, (peak, report.budget_bytes)


def test_dropout_recomputed_in_kernels_draws_the_forward_masks() -> None:
    """A GPT-2-style stack with dropout 0.2: at budget 0.5 the plan recomputes dropouts inside fused kernels, every
    one it recomputes (tests/kernels/test_cuda_plan.py makes the same plan on CPU); the oracle is the same backend
    with no budget (every dropout on the counter-based RNG in both)."""
    model, x = gpt2_blocks(dropout=0.2)
    model, x = model.to(CUDA), x.to(CUDA)
    reference, _, _ = _fx_step(model, x, None, seed=5)
    grads, _, report = _fx_step(model, x, 0.5, seed=5)
    assert report.fusion.dropouts == 6 and report.fusion.regions
    assert any(any(m.startswith("dropout_kernel") for m in region.members) for region in report.fusion.regions)
    left = [(name, why) for name, why in report.fusion.unfused if name.startswith("dropout_kernel")]
    assert not left, left
    _compiled_for_the_gpu()
    assert_grads_close(grads, reference, rtol=1e-5)


def test_dropout_kernel_mask_is_reproduced_from_its_seed() -> None:
    x = torch.randn(64, 1000, device=CUDA)
    kernel = dropout_kernel((64, 1000), torch.float32, 0.3)
    seed = draw_seed(x)
    assert seed.device.type == "cuda"  # drawn from the CUDA generator
    out, mask = kernel(x, seed)
    again_out, again_mask = kernel(x, seed)
    assert torch.equal(mask, again_mask) and torch.equal(out, again_out)
    assert torch.equal(out, torch.where(mask, x / 0.7, torch.zeros((), device=CUDA)))
    assert abs(mask.float().mean().item() - 0.7) < 0.01
    _compiled_for_the_gpu()


def test_runtime_slice_kernels_turn_on_for_cuda_under_auto() -> None:
    """Outputs of compiled regions that the runtime evicts come back through one compiled kernel per slice."""
    case = build_dynamic("transformer_branch", "test")
    case.model.to(CUDA)
    initial = copy.deepcopy(case.model.state_dict())
    batches = [move_to(case.batch(step), CUDA) for step in range(2)]

    def run(model) -> list[tuple[dict[str, torch.Tensor], int]]:
        return [
            measured_step(
                case.model, lambda inputs=inputs, target=target: case.loss_fn(model(*inputs), target).backward()
            )
            for inputs, target in batches
        ]

    eager = run(case.model)
    budget = int(0.3 * max(peak for _, peak in eager))
    case.model.load_state_dict(initial)
    torch._dynamo.reset()
    with dtr_compile.config.patch(memory_budget=budget, codegen="fx", recompute_kernels="auto"):
        got = run(torch.compile(case.model, backend="dtr"))
    assert implicit_runtime().stats().kernel_rematerializations > 0, implicit_runtime().stats()
    _compiled_for_the_gpu()
    for (grads, _), (reference, _) in zip(got, eager, strict=True):
        assert_grads_close(grads, reference, rtol=1e-4)
