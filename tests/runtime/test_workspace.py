"""The runtime's workspace estimates (runtime/workspace.py) against what the profiler measures for the same call:
never below it (the budget would be overshot), and no room where the kernel takes none (the runtime would evict
and recompute for nothing)."""

from __future__ import annotations

import pytest
import torch

from dtr_compile.measure import measure_peak
from dtr_compile.runtime.workspace import STRIDED_SCRATCH, workspace_bytes

_aten = torch.ops.aten
CPU = torch.device("cpu")


def _inputs() -> dict[str, torch.Tensor]:
    return {
        "contiguous": torch.randn(512, 1024),
        "transposed": torch.randn(1024, 512).t(),
        "strided": torch.randn(512, 2048)[:, ::2],
    }


@pytest.mark.parametrize("op", [_aten._softmax.default, _aten._log_softmax.default], ids=lambda op: op.__name__)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_softmax_workspace_is_the_copy_of_a_strided_input_alone(op, layout) -> None:
    torch.set_num_threads(1)
    x = _inputs()[layout]
    fresh = x.numel() * x.element_size()
    _, measured = measure_peak(lambda: op(x, -1, False))
    workspace = measured.peak_bytes - fresh
    estimate = workspace_bytes(op, (x, -1, False), fresh, CPU)
    assert estimate >= workspace, (estimate, workspace)
    if layout == "contiguous":
        assert estimate == 0 and workspace < 4096, (estimate, workspace)
    else:
        assert fresh <= estimate <= fresh + STRIDED_SCRATCH
