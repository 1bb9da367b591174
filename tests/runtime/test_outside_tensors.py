"""Outside tensors born inside a step (runtime/constants.py): made where the runtime's mode does not see them (a
collective's kernel, code run with the mode off), read by recorded ops, then dropped by the program.

One first seen in a backward pass is read by ops that are never rerun: its bytes go when the program's last
reference does. One first seen in the forward stays held for the recomputes that may read it.
Before, the record of such a tensor held its bytes until the step ended: with FSDP2 on 2 gloo ranks, one
reduce-scatter buffer per block, 1.067-1.113x the budget at 0.6 (tests/distributed/test_fsdp2.py).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch.utils._python_dispatch import _disable_current_modes

import dtr_compile
from dtr_compile.measure import measure_peak
from tests.runtime.models import mlp, mlp_step

N = 64 * 1024  # floats: 256 KiB, above the engine's smallest evictable size


def _unseen(values: torch.Tensor) -> torch.Tensor:
    """A copy of `values` made with the runtime's mode off: an outside tensor born in the step."""
    with _disable_current_modes():
        return values.clone()


def _alive(weak: int) -> bool:
    storage = torch.UntypedStorage._new_with_weak_ptr(weak)
    return storage is not None and storage.nbytes() > 0


class ScaleByUnseen(torch.autograd.Function):
    """Backward multiplies the gradient by a tensor it makes unseen, then drops it (what FSDP2's post-backward
    does with gloo's reduce-scatter buffer). Records whether its bytes were gone once the backward's op ran."""

    freed_in_backward: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 3.0

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        scale = _unseen(torch.full_like(grad, 3.0))
        weak = scale.untyped_storage()._weak_ref()
        out = grad * scale
        del scale
        ScaleByUnseen.freed_in_backward.append(not _alive(weak))
        torch.UntypedStorage._free_weak_ref(weak)
        return out


def test_an_outside_tensor_a_backward_op_read_is_freed_when_the_program_drops_it() -> None:
    ScaleByUnseen.freed_in_backward.clear()
    x = torch.randn(N, requires_grad=True)
    runtime = dtr_compile.runtime.enable(memory_budget=64 * N * 4)
    with runtime:
        ScaleByUnseen.apply(x).sum().backward()
    assert ScaleByUnseen.freed_in_backward == [True], "the runtime kept a dropped outside tensor's bytes"
    torch.testing.assert_close(x.grad, torch.full_like(x, 3.0))


def test_an_outside_tensor_a_held_value_needs_is_kept_for_its_recompute() -> None:
    """The forward's op may be rerun (its output is held and evictable): the dropped tensor's bytes stay, and the
    rerun after an eviction reads them."""
    x = torch.randn(N)
    runtime = dtr_compile.runtime.enable(memory_budget=64 * N * 4)
    with runtime:
        scale = _unseen(torch.linspace(0, 1, N))
        weak = scale.untyped_storage()._weak_ref()
        y = x * scale
        del scale
        kept = _alive(weak)
        runtime.engine.evict(runtime.index.lookup(y))  # as the heuristic may
        assert y.untyped_storage().nbytes() == 0
        total = (y + 1).sum()
    torch.UntypedStorage._free_weak_ref(weak)
    assert kept, "an outside tensor a recompute needs lost its bytes"
    torch.testing.assert_close(total, (x * torch.linspace(0, 1, N) + 1).sum())
    assert runtime.stats().rematerializations >= 1


def test_the_snapshot_taken_before_an_outside_tensor_is_mutated_counts_in_the_step() -> None:
    """`y = x * 2` is held (its op may be rerun) when `x`, an outside tensor, is written in place: the runtime
    keeps x's old value for that rerun in a snapshot it makes itself, outside any aten call it sees. The step's
    count includes it (it did not: a budget could be overrun by every snapshot's bytes)."""
    x = torch.randn(N)
    expected = x * 2
    runtime = dtr_compile.runtime.enable(memory_budget=64 * N * 4)
    with runtime:
        y = x * 2
        x.add_(1.0)
        held = runtime.step_bytes
        runtime.engine.evict(runtime.index.lookup(y))
        total = y.sum()
    assert runtime.constants.snapshot_bytes == N * 4
    assert held >= 2 * N * 4, f"the step counts {held} B: y ({N * 4} B) and the snapshot ({N * 4} B) at least"
    torch.testing.assert_close(total, expected.sum())


class _Tanh(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w)


def test_a_compiled_output_evicted_after_its_input_was_written_in_place_comes_back_from_the_old_value() -> None:
    """A compiled region reads `w`; the program then writes `w` in place and the runtime evicts the output. The
    recompute must read w's old value (a snapshot). Compiled parts were not noted as readers of the outside tensors
    they take, and AOTAutograd hands them aliases that die at once, so the mutation found no reader to keep the old
    value for: the output came back computed from the new `w`, 2.0 off, silently."""
    from dtr_compile.runtime.runtime import current_step

    torch.manual_seed(0)
    x, w = torch.randn(256, 256, requires_grad=True), torch.randn(256, 256)
    torch._dynamo.reset()
    with dtr_compile.config.patch(memory_budget=64 << 20, codegen="fx"):
        compiled = torch.compile(_Tanh(), backend="dtr")
        for step in range(3):  # code after the call is under the runtime from the second step on (README)
            old = w.clone()
            y = compiled(x, w)
            w.add_(1.0)
            if step > 0:
                runtime = current_step()
                runtime.engine.evict(runtime.index.lookup(y))  # as the heuristic may
                assert y.untyped_storage().nbytes() == 0
                torch.testing.assert_close(y.detach().clone(), torch.tanh(x @ old).detach())
            y.sum().backward()


def test_gradients_accumulated_into_existing_grads_across_steps_match_eager_within_the_budget() -> None:
    """A second step without `zero_grad`: the backward adds each parameter's gradient into its `.grad`, an outside
    tensor, in place. The runtime keeps no record of such a write (nothing can need it rerun), and the step still
    evicts and recomputes its activations around it: gradients equal eager's, peak within the budget."""
    torch.manual_seed(0)
    reference = mlp()
    model = mlp()
    model.load_state_dict(reference.state_dict())
    for seed in (1, 2):
        torch.manual_seed(seed)
        mlp_step(reference).backward()
    budget = 8 * 2048 * 64 * 4  # 8 activations of 512 KiB: the step must evict
    runtime = dtr_compile.runtime.enable(memory_budget=budget)
    for seed in (1, 2):
        torch.manual_seed(seed)

        def step() -> None:
            with runtime:
                mlp_step(model).backward()

        _, measurement = measure_peak(step)
        assert measurement.peak_bytes <= 1.05 * budget
    assert runtime.stats().evictions > 0
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)


def test_summing_into_existing_grads_takes_the_short_path_and_counts_nothing(monkeypatch) -> None:
    """Each parameter's `.grad += gradient` of a step without `zero_grad` runs with no engine bookkeeping (it
    allocates nothing and writes only an outside tensor no recorded op reads): the generic path is never entered
    for it, and nothing of either step stays counted in the engine."""
    from dtr_compile.runtime import dispatch

    model = mlp()
    runtime = dtr_compile.runtime.enable(memory_budget=8 * 2048 * 64 * 4)
    generic_adds = []
    run_call = dispatch.run_call

    def counting(rt, func, args, kwargs):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.add_.Tensor:
            generic_adds.append(func)
        return run_call(rt, func, args, kwargs)

    monkeypatch.setattr(dispatch, "run_call", counting)
    for seed in (1, 2):
        torch.manual_seed(seed)
        with runtime:
            mlp_step(model).backward()
    assert generic_adds == []
    assert runtime.engine.memory == 0  # nothing of either step is left counted


def test_a_grad_a_recorded_forward_op_read_is_not_written_on_the_short_path() -> None:
    """The short path's guard: an outside tensor that a recorded op of the forward read (and may rerun) needs its
    old value kept before an in-place write, so its sum goes the generic way (which keeps a snapshot)."""
    from dtr_compile.runtime.runtime import current_step
    from dtr_compile.runtime.values import storage_key

    read = torch.randn(N)
    unread = torch.randn(N)
    x = torch.randn(N, requires_grad=True)
    runtime = dtr_compile.runtime.enable(memory_budget=64 * N * 4)
    with runtime:
        y = (x * read).tanh()
        constants = current_step().constants
        assert not constants.mutation_needs_no_record(storage_key(read))
        assert constants.mutation_needs_no_record(storage_key(unread))
        y.sum().backward()
