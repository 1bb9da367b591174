"""Temporary memory that some aten kernels allocate and free inside one call ("workspace").

The runtime sees an op's outputs, not the buffers its kernel uses while running; a budget that counts
only outputs is overshot by the largest workspace. The measured peak is what counts (DESIGN.md), so
room is made for the workspace too, before the op runs and before each recompute of it.

The multipliers were measured on CPU with torch 2.13 by running each op alone under the profiler and
subtracting its fresh output bytes from its allocation peak (GPT-2, BERT, a CNN with BatchNorm, an LSTM
and a transformer layer). They are upper bounds over the shapes tried, relative to a named reference
tensor of the call. Ops not listed showed no workspace, except 16-bit matrix multiplies, whose scratch depends on
the CPU's instruction set: it is measured per call shape (matmul_scratch.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..matmul_scratch import scratch_bytes
from .rng_memory import rng_workspace_bytes

_aten = torch.ops.aten


def _bytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _flash_splits(q_len: int, kv_len: int) -> tuple[int, int]:
    """Block sizes of the CPU flash-attention kernels (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp)."""
    q_split = 256 if q_len >= 768 else (64 if q_len >= 192 else 32)
    return min(q_split, q_len), min(512, kv_len)


def _flash_forward(args: tuple, fresh: int) -> int:
    """One buffer per thread: a (q block x kv block) score tile, the block's max and sum, and its output rows.
    Checked against the profiler for sequence lengths 16 to 1024, 1 and 2 threads (exact for float32)."""
    q, k = args[0], args[1]
    q_split, kv_split = _flash_splits(q.shape[-2], k.shape[-2])
    per_thread = q_split * kv_split + 2 * q_split + q_split * q.shape[-1]
    reduced = q.element_size() < 4  # bf16/fp16 keep a second, reduced-precision tile
    return torch.get_num_threads() * per_thread * (4 + (q.element_size() if reduced else 0))


def _flash_backward(args: tuple, fresh: int) -> int:
    """Two score tiles per thread, a row of the block, and a contiguous copy of one (batch, seq, head) input
    when the layout asks for one (counted always: the profiler saw it on every multi-head shape)."""
    q, k = args[1], args[2]
    q_split, kv_split = _flash_splits(q.shape[-2], k.shape[-2])
    reduced = q.element_size() < 4
    tiles = torch.get_num_threads() * 2 * q_split * kv_split * (4 + (q.element_size() if reduced else 0))
    return tiles + 4 * q_split + _bytes(args[0])


STRIDED_SCRATCH = 16 << 10  # beside that copy, a small buffer: 14,400 bytes for every shape tried, fp32


def _contiguous_copy(t: Any) -> int:
    """The copy a kernel makes of a strided input (softmax and log-softmax over any dim, on CPU). A contiguous input
    is read in place: the profiler saw no workspace for it (reserving one output's worth for every loss's
    log-softmax made the runtime evict 7.5 MiB of saved activations per step in bf16 GPT-2's loss, CPU stand-in)."""
    return _bytes(t) + STRIDED_SCRATCH if isinstance(t, torch.Tensor) and not t.is_contiguous() else 0


# op -> function(args, fresh_output_bytes) -> workspace bytes
_CPU_WORKSPACE: dict[Any, Callable[[tuple, int], int]] = {
    # mkldnn reorders the larger of output and input (a strided convolution: its input)
    _aten.convolution.default: lambda args, fresh: max(fresh, _bytes(args[0])),
    # two buffers the size of the larger of grad_output and input (a strided convolution: its input)
    _aten.convolution_backward.default: lambda args, fresh: 2 * max(_bytes(args[0]), _bytes(args[1])),
    _aten.native_batch_norm_backward.default: lambda args, fresh: _bytes(args[1]),  # 1 x input
    _aten.native_layer_norm_backward.default: lambda args, fresh: _bytes(args[1]),  # 1 x input
    _aten._safe_softmax.default: lambda args, fresh: 4 * fresh,  # max, exp and mask temporaries
    _aten._softmax.default: lambda args, fresh: _contiguous_copy(args[0]),
    _aten._log_softmax.default: lambda args, fresh: _contiguous_copy(args[0]),
}
# Collectives of the gloo backend (CPU) stage their tensors through a flat buffer the size of the gathered output
# or of the reduced input (measured for both on 2 ranks; FSDP2 issues these two: its all-gather and its gradient
# reduce-scatter, distributed.py).
_c10d = torch.ops.c10d
_CPU_WORKSPACE[_c10d._allgather_base_.default] = lambda args, fresh: _bytes(args[0])
_CPU_WORKSPACE[_c10d._reduce_scatter_base_.default] = lambda args, fresh: _bytes(args[1])
if hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu"):
    _CPU_WORKSPACE[_aten._scaled_dot_product_flash_attention_for_cpu.default] = _flash_forward
    _CPU_WORKSPACE[_aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _flash_backward


def workspace_bytes(func: Any, args: tuple, fresh_bytes: int, device: torch.device) -> int:
    """Estimated temporary bytes of one call (0 for ops with no known workspace), with the RNG states a random
    op saves and a recompute of it replays (rng_memory.py)."""
    if device.type != "cpu":
        return 0  # not modeled on CUDA yet (cuDNN/cuBLAS workspaces): measured peaks there will show it
    rng = rng_workspace_bytes(device) if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()) else 0
    estimate = _CPU_WORKSPACE.get(func)
    return rng + (estimate(args, fresh_bytes) if estimate is not None else 0) + scratch_bytes(func, args)
