"""`compile_chain`: one kernel for a chain of FX nodes, for whoever recomputes them outside a graph.

The eager runtime rematerializes evicted tensors that came out of a compiled region by running the
region's nodes again; when they form a supported chain, one kernel does it and the chain's
intermediates never touch memory:

    chain = compile_chain(nodes)                 # nodes of a compiled region's graph, in graph order
    outs = chain(*[value_of(n) for n in chain.inputs])   # one tensor per node of chain.outputs
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx

from .codegen import generate
from .ir import UnsupportedRegion
from .launch import RecomputeKernel
from .lower_fx import lower_nodes


@dataclass(frozen=True)
class Chain:
    """A compiled chain: call it with one tensor per node of `inputs`; returns one per node of `outputs`."""

    kernel: RecomputeKernel
    inputs: tuple[fx.Node, ...]
    outputs: tuple[fx.Node, ...]
    positions: tuple[int, ...]  # per output: which kernel output holds its elements
    shapes: tuple[tuple[int, ...], ...]  # per output: its shape (kernel outputs are re-viewed to it)

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        produced = self.kernel(*tensors)
        return tuple(produced[p].view(shape) for p, shape in zip(self.positions, self.shapes, strict=True))


def compile_chain(nodes: Sequence[fx.Node], outputs: Sequence[fx.Node] | None = None) -> Chain:
    """One kernel computing `outputs` (default: the members read outside `nodes`, and the last node).

    Raises UnsupportedRegion, naming the node and the reason, when the chain is not one kernel's work
    (an op without a lowering, a matmul, reductions of different row lengths, aten's own dropout...).
    """
    nodes = list(nodes)
    if not nodes:
        raise UnsupportedRegion("empty chain")
    members = set(nodes)
    if outputs is None:
        outputs = [n for n in nodes if any(u not in members for u in n.users)]
        if nodes[-1] not in outputs:
            outputs.append(nodes[-1])
    program, inputs, positions = lower_nodes(nodes, outputs)
    generate(program)  # fails here, not at the first call, when the program has no kernel
    shapes = tuple(tuple(int(s) for s in node.meta["val"].shape) for node in outputs)
    return Chain(RecomputeKernel(program), tuple(inputs), tuple(outputs), tuple(positions), shapes)


def unsupported_reason(nodes: Sequence[fx.Node], outputs: Sequence[fx.Node] | None = None) -> str | None:
    """Why `nodes` cannot be one kernel, or None when they can."""
    try:
        compile_chain(nodes, outputs)
    except UnsupportedRegion as error:
        return str(error)
    return None
