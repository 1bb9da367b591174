"""Triton recompute kernels: one generated kernel per region of recomputed ops.

Recomputation is cheap only when it does not pay a kernel launch and a round trip to memory for every
recomputed op. This package turns a region of pointwise ops, row reductions (layer norm, softmax,
sum/mean/amax over the last dim) and dropout into one Triton kernel that writes only the values its
consumers read; the intermediates stay in registers.

Who uses it
- The compiled path with `codegen="fx"`: `dtr_compile.passes.fuse_recompute` replaces each region of
  the plan's recomputes with one kernel (`dtr_compile.config.recompute_kernels`). Under Inductor the pass
  steps aside: Inductor's scheduler already fuses recomputed pointwise/reduction chains into its own
  Triton kernels (see BENCHMARKS.md, "Recompute kernels").
- The eager runtime, when it rematerializes a chain of evicted tensors that came out of a compiled
  region:

      from dtr_compile.kernels import compile_chain, UnsupportedRegion
      try:
          chain = compile_chain(nodes)          # FX nodes of the region's graph, in graph order
      except UnsupportedRegion:
          chain = None                          # run the nodes one by one, as before
      outs = chain(*[tensor_of(n) for n in chain.inputs])   # one tensor per node in chain.outputs

  Compile a chain once and keep it: kernels are cached per structure and shapes for the process.

Devices: CUDA tensors run compiled kernels; CPU tensors run them in Triton's interpreter, only with
TRITON_INTERPRET=1 in the environment (slow: for correctness tests). Without triton or a GPU, nothing
here is needed: the unfused recompute is the default CPU path.

Dropout: aten's mask cannot be reproduced by a kernel, so with kernels on, dropouts draw from a
counter-based RNG (`rng.py`): the forward and every recompute compute the same mask from a saved seed.

Without a GPU, `python -m dtr_compile.kernels.aot` compiles generated kernels for a GPU architecture down to a
cubin (Triton's compiler and ptxas run on the CPU): the GPU code path is checked in CI, its speed is not.

Layers: `ir` (the hashable program), `lower_fx` (FX nodes -> program), `layout` (iteration space and
indexing), `codegen` (program -> Triton source), `launch` (cache, loading, calling), `rng`, `chain`, `aot`.
Importing this package does not import triton; the first kernel call does.
"""

from .chain import Chain, compile_chain, unsupported_reason
from .ir import Program, UnsupportedRegion
from .launch import RecomputeKernel, cache_size, import_triton, triton_available
from .rng import draw_seed, dropout_kernel

__all__ = [
    "Chain",
    "Program",
    "RecomputeKernel",
    "UnsupportedRegion",
    "cache_size",
    "compile_chain",
    "draw_seed",
    "dropout_kernel",
    "import_triton",
    "triton_available",
    "unsupported_reason",
]
