"""Keep Inductor from computing a value later than the plan put it, past a recompute.

Inductor lowers a pointwise op lazily: it becomes a buffer only where a consumer needs one (an extern kernel
such as a convolution's backward, a reduction, several readers), and is computed there, at its consumer's
place. In a planned backward that place can lie after a recompute chain: on a BatchNorm CNN, the gradient of
one block (the BatchNorm backward's elementwise pass) was planned before the recompute of the previous
block's convolution and read only by the convolution backward after it. Inductor computed it after the
recompute, so everything it reads (the incoming gradient, the saved convolution output, the ReLU output)
stayed alive across the recompute: 14.36 MiB measured for a plan whose exact model was 12.38.

`pin_values_before_recomputes` marks every tensor an op makes before a recompute and reads after it with
Inductor's own per-node flag `inductor_realize_to_strides`, which makes Inductor realize the value where the
graph computes it. "Reads after it" includes a value also read before: read by a reduction before the recompute
and by a pointwise op after it, Inductor computes it inside both kernels, and what it reads stays alive across the
recompute (on the CPU stand-in's ResNet at 0.6 of torch.compile's peak, a block's masked gradient kept the ReLU
output and both residual gradients, 3 MiB where the plan held 1 MiB: the first plan measured 1.058x its model and
was compiled four times). It is applied to plans held by the exact memory model, which counts every value as
allocated where the plan computes it; the Inductor memory model (inlining.py) instead predicts Inductor's
inlining, and pinning would break its predictions (measured: 15.44 MiB instead of 14.74 on the same CNN).
"""

from __future__ import annotations

import bisect

import torch
from torch import fx

from .rewrite import RECOMPUTE_META_KEY

REALIZE_META_KEY = "inductor_realize_to_strides"  # read by Inductor's GraphLowering.run_node


def pin_values_before_recomputes(gm: fx.GraphModule) -> int:
    """Mark the values made before a recompute and read after it; returns how many were marked."""
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    recomputes = [i for i, node in enumerate(nodes) if RECOMPUTE_META_KEY in node.meta]
    marked = 0
    for node in nodes:
        if node.op != "call_function" or RECOMPUTE_META_KEY in node.meta:
            continue
        if not isinstance(node.target, torch._ops.OpOverload) or node.target.is_view:
            continue  # a view has no buffer of its own; realizing it would copy
        if not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        readers = [position[user] for user in node.users if user.op != "output"]
        if not readers:
            continue  # unread, or only a graph output (realized anyway)
        next_recompute = bisect.bisect_right(recomputes, position[node])
        if next_recompute < len(recomputes) and recomputes[next_recompute] < max(readers):
            node.meta[REALIZE_META_KEY] = True
            marked += 1
    return marked
