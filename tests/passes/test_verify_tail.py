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
    assert held - dropped == N * 4, (held, dropped)
