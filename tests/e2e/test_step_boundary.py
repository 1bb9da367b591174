"""A compiled step ends by itself: on graph-break models, a plain loop of `loss.backward()` (no optimizer, no
`finish_steps()`) holds the budget, and when `backward()` returns the process is as it was before the step.

The TreeLSTM (recursion over a random tree), the transformer with a data-dependent branch per block and the
mixture of experts (data-dependent routing), at 0.5 and 0.3 of plain eager's measured peak: every step after
the first (which compiles, and begins inside TorchDynamo's frame) measures at most the budget, gradients
equal eager's, and after every step no dispatch mode, saved-tensor hook, gc freeze or open step is left.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dtr_compile
from dtr_compile.bench.dynamic_models import build_dynamic
from dtr_compile.measure import measure_peak
from tests.runtime.process_state import assert_restored, snapshot

# Steps per model: three trees (16, 17 and 18 leaves), three batches. The TreeLSTM's third tree raised a BudgetError
# at 0.3 (1.33 MiB needed, 1.05 MiB of it gradients the autograd engine holds) until the backward's sums of
# gradients ran in place under the runtime as they do in plain eager (runtime/accumulate.py).
STEPS = {"treelstm": 3, "transformer_branch": 3, "moe": 3}


def _run(case, model, *, check_state: bool):
    results = []
    for step in range(STEPS[case.name]):
        case.model.zero_grad(set_to_none=True)
        inputs, target = case.batch(step)
        before = snapshot()

        def body(inputs=inputs, target=target) -> float:
            loss = case.loss_fn(model(*inputs), target)
            loss.backward()
            return loss.item()

        loss, measured = measure_peak(body)
        if check_state:
            assert_restored(before, f"after step {step} of {case.name}")
        grads = [None if p.grad is None else p.grad.clone() for p in case.model.parameters()]
        results.append((loss, grads, measured.peak_bytes))
    return results


# ~3 min on 2 cores: out of CI, where tests/e2e/test_handoff.py runs the same models and budgets with a plain
# backward loop, and tests/runtime/test_fault_matrix.py checks the state a plain loop leaves on a graph-break model.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["treelstm", "transformer_branch", "moe"])
def test_a_plain_backward_loop_holds_the_budget_and_leaves_nothing(name: str) -> None:
    case = build_dynamic(name, "test")
    initial = copy.deepcopy(case.model.state_dict())
    eager = _run(case, case.model, check_state=False)
    no_remat = max(peak for _, _, peak in eager)
    for fraction in (0.5, 0.3):
        budget = int(fraction * no_remat)
        case.model.load_state_dict(initial)
        torch._dynamo.reset()
        with dtr_compile.config.patch(memory_budget=budget, codegen="fx"):
            results = _run(case, torch.compile(case.model, backend="dtr"), check_state=True)
        for step, ((loss, grads, peak), (ref_loss, ref_grads, _)) in enumerate(zip(results, eager)):
            what = f"{name} at {fraction}, step {step}"
            assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss)), (what, loss, ref_loss)
            for got, want in zip(grads, ref_grads):
                assert (got is None) == (want is None), what
                if got is not None:
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=what)
            assert step == 0 or peak <= budget, f"{what}: measured {peak} > budget {budget}"
