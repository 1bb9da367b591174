"""Dropout with a counter-based RNG, so that a recompute draws exactly the forward's mask.

aten's dropout draws from the device generator's stream; a kernel cannot reproduce that stream, so
when recompute kernels are on, every dropout of a compiled region (recomputed or not, so that the
budget never changes the random numbers) becomes:

    seed = draw_seed(x)               # forward: one 0-d int64 from torch's generator (8 bytes saved)
    out, mask = dropout_kernel(x, seed)  # forward and every recompute: keep = tl.rand(seed, i) > p

`tl.rand` is Philox keyed by the seed and counted by the element's flat index, so any kernel that
evaluates the same dropout (the forward's one-op kernel, or a fused recompute region) gets the same
mask, bit for bit. The seed comes from torch's generator, so `torch.manual_seed` still makes a step
reproducible.
"""

from __future__ import annotations

import torch

from .ir import InputSpec, Instr, Program, Ref, TensorType, contiguous_strides
from .launch import RecomputeKernel

SEED_HIGH = 2**62  # seeds are drawn in [0, SEED_HIGH): any 64-bit Philox key works, keep clear of sign issues


def draw_seed(like: torch.Tensor) -> torch.Tensor:
    """A fresh 0-d int64 seed on `like`'s device, drawn from that device's default generator."""
    return torch.randint(SEED_HIGH, (), dtype=torch.int64, device=like.device)


def seed_type() -> TensorType:
    return TensorType((), torch.int64)


def dropout_program(x: InputSpec, p: float) -> Program:
    """(out, mask) = dropout(x, p) keyed by input 1, the seed: the one-op program the forward runs."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout probability {p} must be in (0, 1) for a kernel (0 and 1 need no RNG)")
    seed = InputSpec(seed_type(), ())
    out = TensorType(x.type.shape, x.type.dtype)
    mask = TensorType(x.type.shape, torch.bool)
    instr = Instr("dropout", (Ref(0), Ref(1)), (("p", float(p)),), (2, 3))
    return Program(inputs=(x, seed), instrs=(instr,), types=(x.type, seed.type, out, mask), outputs=(2, 3))


def dropout_kernel(
    shape: tuple[int, ...], dtype: torch.dtype, p: float, stride: tuple[int, ...] | None = None
) -> RecomputeKernel:
    """The forward dropout kernel for an input of this shape, dtype and strides."""
    spec = InputSpec(
        TensorType(tuple(shape), dtype), tuple(stride) if stride is not None else contiguous_strides(shape)
    )
    return RecomputeKernel(dropout_program(spec, p), label="dropout_kernel")
