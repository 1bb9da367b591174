"""Refilling an evicted storage on both paths compat.py offers: the storage swap (torch 2.13+) and the
in-place path (torch 2.11, forced elsewhere with `storage_swap(False)`).

What must hold on each path: the tensors the program holds read the recomputed values (they view the same
torch storage before and after), and the refill's measured peak (DESIGN.md: the profiler's allocation events)
is the value itself, no extra copy, for ops that can write their result in place; an op that cannot is
copied in, and its operation's workspace reserves that copy so that the budget still holds.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import dtr_compile
from dtr_compile import compat
from dtr_compile.measure import measure_peak
from dtr_compile.runtime.refill import storage_swap

from ..runtime import models
from ..runtime.helpers import check_budgets

pytestmark = pytest.mark.compat

# Every path this torch has: the fallback always, the swap where torch offers it.
PATHS = [False, True] if compat.HAS_STORAGE_SWAP else [False]
ROWS, COLS = 512, 256
NBYTES = ROWS * COLS * 4


def _path(swap: bool):
    return storage_swap(swap) if swap != compat.uses_storage_swap() else contextlib.nullcontext()


def _evicted_then_refilled(make, swap: bool):
    """`first = make(x)` is evicted by four younger values under a budget of three; then it is refilled
    (`materialize`), under the profiler. Returns (first's storage identity before and after, its value, the
    refill's measured peak, what eager computes)."""
    torch.manual_seed(0)
    x = torch.randn(ROWS, COLS)
    with _path(swap):
        runtime = dtr_compile.runtime.enable(memory_budget=3 * NBYTES)
        with runtime:
            first = make(x)
            before = first.untyped_storage()._cdata
            later = [x * (i + 2) for i in range(4)]
            assert first.untyped_storage().nbytes() == 0, "the oldest value should have been evicted"
            refilled, measurement = measure_peak(lambda: runtime.materialize(first))
            after = first.untyped_storage()._cdata
            value = first.clone()
            assert refilled.untyped_storage()._cdata == after and len(later) == 4
    return before, after, value, measurement.peak_bytes, make(x)


@pytest.mark.parametrize("swap", PATHS)
def test_refill_writes_the_value_into_the_same_storage_at_its_own_size(swap: bool) -> None:
    """`exp` has an out= kernel: without the swap it writes into the evicted storage resized back."""
    before, after, value, peak, want = _evicted_then_refilled(torch.exp, swap)
    assert before == after, "the program's tensor must view the same torch storage after the refill"
    torch.testing.assert_close(value, want, rtol=0, atol=0)
    assert peak == NBYTES, f"refill peak {peak} B: the value is {NBYTES} B (swap={swap})"


@pytest.mark.parametrize("swap", PATHS)
def test_refill_of_an_op_without_an_out_kernel_is_correct_and_reserved(swap: bool) -> None:
    """`relu` has no out= kernel of its own: without the swap its result is copied in (one extra value at most)."""
    before, after, value, peak, want = _evicted_then_refilled(torch.relu, swap)
    assert before == after
    torch.testing.assert_close(value, want, rtol=0, atol=0)
    assert peak <= (1 if swap else 2) * NBYTES, f"refill peak {peak} B for a {NBYTES} B value (swap={swap})"


@pytest.mark.parametrize("swap", PATHS)
def test_in_place_write_recomputed_into_the_programs_storage(swap: bool) -> None:
    """An in-place op's new version is rebuilt on the evicted storage itself (no clone without the swap)."""

    def make(x: torch.Tensor) -> torch.Tensor:
        y = x.exp()
        y.mul_(3)
        return y

    before, after, value, peak, want = _evicted_then_refilled(make, swap)
    assert before == after
    torch.testing.assert_close(value, want, rtol=0, atol=0)
    # The old version (exp) is recomputed into a storage of its own and the new one built from it: 2 values
    # (and the few bytes of the scalar operand).
    assert peak <= 2 * NBYTES + 1024, f"refill peak {peak} B for a {NBYTES} B value (swap={swap})"


@pytest.mark.parametrize("case", ["transformer_dropout", "cnn_batchnorm"])
def test_training_without_the_swap_matches_eager_within_budget(case: str) -> None:
    """The whole runtime on the in-place path: dropout (replayed mask, copied refill), BatchNorm (running
    statistics: an in-place write), convolutions and matmuls under budgets, gradients equal to eager's and
    the measured peak within 1.05 x the budget."""
    cases = {
        "transformer_dropout": (models.TransformerWithDropout, models.transformer_step, (0.7, 0.5)),
        "cnn_batchnorm": (models.cnn, models.cnn_step, (0.7, 0.55)),
    }
    make_model, step, fractions = cases[case]
    with _path(False):
        check_budgets(make_model, step, fractions)


def test_forcing_the_swap_where_torch_lacks_it_is_refused() -> None:
    if compat.HAS_STORAGE_SWAP:
        with storage_swap(False):
            assert not compat.uses_storage_swap()
        assert compat.uses_storage_swap()
    else:
        with pytest.raises(dtr_compile.ConfigError, match="_swap_data_ptr_"), storage_swap(True):
            pass
