"""Triton kernels for the slices the eager runtime recomputes (issue 7's kernels, used by the runtime).

When the runtime rematerializes an evicted output of a compiled forward, it reruns that output's slice
(slices.py): a small FX graph of aten ops. A slice made only of pointwise ops and row reductions (a layer
norm, a GELU, a bias-add, softmax pieces) is one kernel's work: `kernels.compile_chain` turns it into one
Triton kernel, so its intermediates never touch memory and the recompute is one launch. Inductor never sees
these recomputes (they happen between the compiled parts it generated), so this holds under either code
generator.

Used with `config.recompute_kernels`: "auto" on CUDA when triton is installed, "triton" everywhere (CPU tensors
need TRITON_INTERPRET=1: Triton's interpreter, for tests), "off" never. A slice that is not one kernel's work
(a matmul, a transpose of a computed value, symbolic sizes, a non-contiguous output, whose layout the kernel
would not reproduce) keeps its FX module.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from .. import config
from ..roofline import has_symbolic_sizes
from .slices import OutputSlice


def kernels_wanted(device: torch.device) -> bool:
    """Should the runtime recompute slices with Triton kernels on `device`? Raises for "triton" without it."""
    from ..kernels.launch import check_kernels_can_run, triton_available

    mode = config.recompute_kernels
    if mode == "off":
        return False
    if mode == "auto":
        return device.type == "cuda" and triton_available()
    check_kernels_can_run(device)
    return True


def with_kernels(slices: list[OutputSlice | None]) -> list[OutputSlice | None]:
    """`slices`, each with a kernel where it is one kernel's work."""
    return [None if s is None else _with_kernel(s) for s in slices]


def _with_kernel(output_slice: OutputSlice) -> OutputSlice:
    from ..kernels.chain import compile_chain
    from ..kernels.ir import UnsupportedRegion

    graph = output_slice.module.graph
    placeholders = {node: i for i, node in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    target = next(n for n in reversed(graph.nodes) if n.op == "output").args[0]
    value = target.meta.get("val") if isinstance(target, fx.Node) else None
    if not nodes or not isinstance(value, torch.Tensor) or not _plain_layout(value):
        return output_slice
    if any(has_symbolic_sizes(n.meta.get("val")) for n in nodes):
        return output_slice  # a kernel is generated for fixed sizes
    try:
        chain = compile_chain(nodes, [target])
    except UnsupportedRegion:
        return output_slice
    if any(node not in placeholders for node in chain.inputs):  # a constant of the graph, not a boundary
        return output_slice
    return dataclasses.replace(
        output_slice, kernel=chain, kernel_inputs=tuple(placeholders[node] for node in chain.inputs)
    )


def _plain_layout(value: torch.Tensor) -> bool:
    # The recomputed bytes replace the evicted ones in place: they must be laid out the same way.
    return value.is_contiguous() and value.storage_offset() == 0
