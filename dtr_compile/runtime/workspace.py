"""Temporary memory that some aten kernels allocate and free inside one call ("workspace").

The runtime sees an op's outputs, not the buffers its kernel uses while running; a budget that counts
only outputs is overshot by the largest workspace. The measured peak is what counts (DESIGN.md), so
room is made for the workspace too, before the op runs and before each recompute of it.

The multipliers were measured on CPU with torch 2.13 by running each op alone under the profiler and
subtracting its fresh output bytes from its allocation peak (GPT-2, BERT, a CNN with BatchNorm, an LSTM
and a transformer layer). They are upper bounds over the shapes tried, relative to a named reference
tensor of the call. Ops not listed showed no workspace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_aten = torch.ops.aten


def _bytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


# op -> function(args, fresh_output_bytes) -> workspace bytes
_CPU_WORKSPACE: dict[Any, Callable[[tuple, int], int]] = {
    # mkldnn reorders the larger of output and input (a strided convolution: its input)
    _aten.convolution.default: lambda args, fresh: max(fresh, _bytes(args[0])),
    # two buffers the size of the larger of grad_output and input (a strided convolution: its input)
    _aten.convolution_backward.default: lambda args, fresh: 2 * max(_bytes(args[0]), _bytes(args[1])),
    _aten.native_batch_norm_backward.default: lambda args, fresh: _bytes(args[1]),  # 1 x input
    _aten.native_layer_norm_backward.default: lambda args, fresh: _bytes(args[1]),  # 1 x input
    _aten._safe_softmax.default: lambda args, fresh: 4 * fresh,  # max, exp and mask temporaries
    _aten._softmax.default: lambda args, fresh: fresh,
    _aten._log_softmax.default: lambda args, fresh: fresh,
}


def workspace_bytes(func: Any, args: tuple, fresh_bytes: int, device: torch.device) -> int:
    """Estimated temporary bytes of one call (0 for ops with no known workspace)."""
    if device.type != "cpu":
        return 0  # not modeled on CUDA yet (cuDNN/cuBLAS workspaces): measured peaks there will show it
    estimate = _CPU_WORKSPACE.get(func)
    return estimate(args, fresh_bytes) if estimate is not None else 0
