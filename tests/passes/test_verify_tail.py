"""verify.py measures a compiled region in the training loop its plan was made for (storage.Tail): with the
outputs let go before the backward where the tail says the loop lets them go (`loss_fn(model(x)).backward()`),
else held. Measured always held, a region whose outputs are large (a language model's logits) was charged them
through its whole backward, and its named floor stood above what the step itself needs."""

from __future__ import annotations

import torch

from dtr_compile.passes.verify import measure_region

N = 256 * 1024  # floats: 1 MiB


def _region(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0  # saves nothing for its backward: the output lives only as long as the loop holds it


def test_a_region_measured_with_its_outputs_let_go_is_charged_one_output_less() -> None:
    x = torch.randn(N, requires_grad=True)
    held = measure_region(_region, [x])
    dropped = measure_region(_region, [x], outputs_dropped=True)
    assert held is not None and dropped is not None
    assert held.peak_bytes - dropped.peak_bytes == N * 4, (held, dropped)


def test_the_backward_room_is_its_peak_above_its_start_with_the_incoming_gradient_held() -> None:
    """The room the runtime makes for a region's backward is measured from where the backward begins, its incoming
    gradient counted as already held there (in a step the loss made it; here a sum's backward hands in an expanded
    scalar that the region's code copies out whole). For `x * 2` that leaves room for x's gradient alone."""
    from functorch.compile import aot_function, nop

    region = aot_function(_region_tuple, fw_compiler=nop, bw_compiler=nop)  # a CompiledFunction autograd node
    x = torch.randn(N, requires_grad=True)
    measured = measure_region(region, [x])
    assert measured is not None and measured.backward_room_bytes is not None
    assert N * 4 <= measured.backward_room_bytes < N * 4 + 4096, measured


def test_a_region_with_no_compiled_backward_node_has_no_measured_room() -> None:
    """A plain function has no compiled backward to mark: its room is left to the model (None), not guessed."""
    x = torch.randn(N, requires_grad=True)
    measured = measure_region(_region, [x])
    assert measured is not None and measured.backward_room_bytes is None


def _region_tuple(x: torch.Tensor) -> tuple[torch.Tensor]:
    return (x * 2.0,)


def _two_step_backward(x: torch.Tensor) -> torch.Tensor:
    return (x * 2.0).exp()  # its backward reads the incoming gradient once, then allocates x's gradient


def test_gradients_held_through_the_backward_are_measured_held() -> None:
    """torch 2.11's engine holds a cross-entropy's gradient through the compiled backward (storage.HELD_META_KEY): the
    region measured for such a step holds a dense gradient until its backward returns, one incoming gradient above
    a measurement whose gradient is freed after its last read (here: while x's gradient is made)."""
    x = torch.randn(N, requires_grad=True)
    freed = measure_region(_two_step_backward, [x])
    held = measure_region(_two_step_backward, [x], gradients_held=True)
    assert freed is not None and held is not None
    assert N * 4 <= held.peak_bytes - freed.peak_bytes < N * 4 + 4096, (held, freed)


def test_a_strided_input_is_measured_with_its_own_strides() -> None:
    """A micro-batch sliced out of a batch (`x[::2]`) is a strided view; Inductor's code is compiled for the strides
    traced and asserts them. Cloned, the stand-in was contiguous, and the plan made at a step's end raised an
    AssertionError from Inductor's code."""
    batch = torch.randn(64, 32)
    x = batch[::2]
    weight = torch.nn.Parameter(torch.randn(32, 32))

    def region(inputs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        assert inputs.stride() == x.stride(), inputs.stride()  # as Inductor's assert_size_stride does
        return inputs @ w

    assert measure_region(region, [x, weight]) is not None
