"""What a user of `dtr_compile.runtime.enable` relies on beyond equal values: plain results, clear errors,
replayed randomness, fractional budgets, recorded logs, and memory returned when a step ends."""

from __future__ import annotations

import gzip
import io
import warnings

import pytest
import torch
from torch import nn

import dtr_compile
from dtr_compile.measure import measure_peak
from dtr_compile.oplog.format import parse_log
from dtr_compile.sim.replay import ReplayOptions, replay

from . import models
from .helpers import eager_reference, under_runtime


def test_results_leave_the_context_as_plain_tensors() -> None:
    model = models.mlp()
    with dtr_compile.runtime.enable(memory_budget="64MB"):
        loss = models.mlp_step(model)
        loss.backward()
    assert isinstance(loss.item(), float)
    assert all(type(p.grad) is torch.Tensor for p in model.parameters())
    # A handle used after the context runs its ops plainly and returns plain tensors.
    assert type(loss * 2) is torch.Tensor


def test_infeasible_budget_raises_with_the_op_the_budget_and_the_knob() -> None:
    model = models.mlp()
    with pytest.raises(dtr_compile.BudgetError) as info, dtr_compile.runtime.enable(memory_budget=100_000):
        models.mlp_step(model).backward()
    message = str(info.value)
    assert "aten." in message and "memory_budget" in message and "97.66 KiB" in message
    assert info.value.smallest_feasible_bytes > 100_000


@pytest.mark.compat
def test_dropout_recompute_replays_the_forward_mask() -> None:
    """Force the dropout mask to be evicted and recomputed; the gradient must equal eager's."""

    def make_model() -> nn.Module:
        return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.Dropout(0.5), nn.Tanh())])

    def step(model: nn.Module) -> torch.Tensor:
        return model(torch.randn(1024, 64)).square().mean()

    reference = eager_reference(make_model, step)
    recomputed: list[str] = []
    result, runtime = under_runtime(make_model, step, int(0.6 * reference.peak_bytes))
    original = runtime.executor.recompute

    torch.testing.assert_close(result.grads, reference.grads, rtol=1e-5, atol=1e-6)
    # Run once more, recording which ops were recomputed, to prove a random op was among them.
    def spy(op):
        recomputed.append(op.name)
        original(op)

    runtime.executor.recompute = spy
    model = make_model()
    torch.manual_seed(0)
    with runtime:
        step(model).backward()
    assert any("bernoulli" in name for name in recomputed), recomputed


def test_fraction_budget_calibrates_on_the_first_step() -> None:
    model = models.mlp()
    runtime = dtr_compile.runtime.enable(memory_budget=0.5)
    with pytest.warns(UserWarning, match="fraction"), runtime:
        models.mlp_step(model).backward()
    assert runtime.reference_peak_bytes is not None
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        def second_step() -> None:
            with runtime:
                models.mlp_step(model).backward()

        _, measured = measure_peak(second_step)
    budget = runtime.budget_bytes
    assert budget == int(0.5 * runtime.reference_peak_bytes)
    assert runtime.stats().evictions > 0
    assert measured.peak_bytes <= 1.05 * budget


def test_memory_is_returned_when_the_step_ends() -> None:
    model = models.mlp()
    runtime = dtr_compile.runtime.enable(memory_budget="4.5MB")

    def step() -> None:
        model.zero_grad(set_to_none=True)
        with runtime:
            models.mlp_step(model).backward()

    step()
    model.zero_grad(set_to_none=True)
    _, measured = measure_peak(step)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert measured.net_bytes <= gradient_bytes + 4096  # only the gradients outlive the step


def test_optimizer_step_inside_the_context_matches_eager() -> None:
    def train(runtime) -> list[torch.Tensor]:
        torch.manual_seed(3)
        model = models.cnn()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(2):
            torch.manual_seed(step)
            optimizer.zero_grad(set_to_none=True)
            if runtime is None:
                models.cnn_step(model).backward()
                optimizer.step()
            else:
                with runtime:
                    models.cnn_step(model).backward()
                    optimizer.step()
        return [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]

    expected = train(None)
    got = train(dtr_compile.runtime.enable(memory_budget="3.5MB"))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.compat
def test_recorded_log_replays_offline(tmp_path) -> None:
    path = tmp_path / "step.log.gz"
    model = models.TransformerWithDropout()
    runtime = dtr_compile.runtime.enable(memory_budget=None, log=path)
    with runtime:
        loss = models.transformer_step(model)
        loss.backward()
    del loss
    runtime.close()
    with gzip.open(path, "rt") as f:
        assert '"BACKWARD"' in f.read()
    trace = parse_log(path)
    full = replay(trace, 1.0, ReplayOptions(heuristic="dtr_eq"))
    tight = replay(trace, 0.6, ReplayOptions(heuristic="dtr_eq"))
    assert full.status == "ok" and full.evictions == 0
    assert tight.status == "ok" and tight.evictions > 0 and tight.peak_bytes <= tight.budget_bytes


def test_tensors_stay_plain_and_outlive_the_step_resident() -> None:
    """The program works on ordinary tensors; one the runtime freed is recomputed when the step ends."""
    torch.manual_seed(0)
    weights = [torch.randn(256, 256) / 16 for _ in range(8)]

    def forward(x: torch.Tensor) -> list[torch.Tensor]:
        activations = []
        for w in weights:
            x = torch.tanh(x @ w)
            activations.append(x)
        return activations

    x = torch.randn(512, 256)
    expected = forward(x)
    runtime = dtr_compile.runtime.enable(memory_budget=4 * 512 * 256 * 4)
    with runtime:
        activations = forward(x)
        assert all(type(a) is torch.Tensor for a in activations)
        assert runtime.stats().evictions > 0
        freed = [a for a in activations if a.untyped_storage().nbytes() == 0]
        assert freed, "the budget holds 4 of 8 activations: some must have been freed"
    for got, want in zip(activations, expected):
        assert got.untyped_storage().nbytes() > 0
        torch.testing.assert_close(got, want)


@pytest.mark.compat
def test_materialize_hands_a_freed_tensor_to_non_torch_code() -> None:
    torch.manual_seed(0)
    w = torch.randn(256, 256) / 16
    x = torch.randn(512, 256)
    runtime = dtr_compile.runtime.enable(memory_budget=3 * 512 * 256 * 4)
    with runtime:
        first = torch.tanh(x @ w)
        later = [torch.tanh(x @ w + i) for i in range(4)]
        assert first.untyped_storage().nbytes() == 0, "the oldest activation should have been evicted"
        array = runtime.materialize(first).numpy().copy()
        assert len(later) == 4
    assert (array == torch.tanh(x @ w).numpy()).all()
    buffer = io.BytesIO()
    torch.save(first, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer), torch.tanh(x @ w))


@pytest.mark.compat
def test_random_op_with_its_own_generator_replays_that_generator() -> None:
    """A tensor drawn inside the step from a `torch.Generator` (not the default one) is evicted and recomputed:
    the recompute must replay that generator, or the gradient is wrong."""
    torch.manual_seed(0)
    weights = [torch.randn(128, 128, requires_grad=True) for _ in range(6)]

    def step() -> list[torch.Tensor]:
        for w in weights:
            w.grad = None
        g = torch.Generator().manual_seed(7)
        x = torch.randn(512, 128, generator=g)  # made inside the step: a runtime tensor, evictable
        h = x
        for w in weights:
            h = torch.tanh(h @ w)
        (h * x).square().mean().backward()  # x, stale by now, is read again at the end
        return [w.grad.clone() for w in weights]

    expected = step()
    recomputed: list[str] = []
    runtime = dtr_compile.runtime.enable(memory_budget=6 * 512 * 128 * 4)
    original = runtime.executor.recompute

    def spy(op):
        recomputed.append(op.name)
        original(op)

    runtime.executor.recompute = spy
    with runtime:
        got = step()
    assert any("randn" in name for name in recomputed), recomputed
    torch.testing.assert_close(got, expected)


def test_garbage_collector_freeze_is_undone_and_a_programs_own_freeze_kept() -> None:
    import gc

    model = models.mlp()
    runtime = dtr_compile.runtime.enable(memory_budget="4.5MB")
    assert gc.get_freeze_count() == 0, "objects were left frozen before this test"
    with runtime:
        assert gc.get_freeze_count() > 0, "the step set older objects aside"
        models.mlp_step(model).backward()
    assert gc.get_freeze_count() == 0, "the step's end unfreezes them"

    gc.freeze()  # the program's own arrangement
    try:
        frozen = gc.get_freeze_count()
        with runtime:
            models.mlp_step(model).backward()
        # kept (an unfreeze would empty it); objects in it may still die by reference counting
        assert gc.get_freeze_count() > 0.9 * frozen, "the program's own freeze is kept"
    finally:
        gc.unfreeze()
