"""Recomputing one output of a compiled forward without rerunning the whole forward.

A compiled forward returns many tensors at once: the values the program receives and the activations
AOTAutograd saves for the backward. If the runtime could only bring one of them back by rerunning the
whole part, each recompute would allocate every output again (the peak of the whole region), and a tight
budget could not be met. So each output gets its own *slice*: the nodes of the forward graph it depends
on, cut at the region's inputs and at the part's other outputs. A slice is a small FX graph of aten ops;
the runtime registers each output as an operation whose inputs are the slice's boundary values, so DTR
sees the region at the granularity of its saved activations, and a recompute costs only its slice.

A slice that draws random numbers has no slice (None): its values can be reproduced only by rerunning
the whole part with the RNG state of the first run, which is what the part's own recipe does. Neither has
one whose slice would be long (a value at the end of a chain of intermediates no output cuts): its recompute
would cost nearly the part, and the slices of a long chain would hold the chain many times over.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_map

from ..roofline import estimate_call
from ..tensor_bytes import tensor_nbytes

# An output whose slice holds more nodes than this is recomputed with the whole part instead.
MAX_SLICE_NODES = 128

Boundary = tuple[str, int]  # ("input", position among the part's inputs) or ("output", position among its outputs)


@dataclass(frozen=True)
class OutputSlice:
    """The nodes of a forward that compute one output, as a module taking the boundary values in order."""

    module: fx.GraphModule
    boundaries: tuple[Boundary, ...]
    estimated_s: float
    workspace_bytes: int  # the most its intermediates hold at once, each freed after its last reader (_transient_peak)
    # One Triton kernel computing the output, when the slice is a fusible chain (slice_kernels.py), and the
    # positions among the boundary values of the kernel's inputs.
    kernel: Any = None
    kernel_inputs: tuple[int, ...] = ()


def output_slices(gm: fx.GraphModule) -> list[OutputSlice | None]:
    """One slice per output of `gm` (None for an output that is not a fresh tensor computed without RNG)."""
    graph = gm.graph
    placeholders = {node: i for i, node in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    out_position: dict[fx.Node, int] = {}
    for k, node in enumerate(outs):
        if isinstance(node, fx.Node):
            out_position.setdefault(node, k)
    order = {node: i for i, node in enumerate(graph.nodes)}
    return [
        _slice(gm, node, placeholders, out_position, order)
        if isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor) and node not in placeholders
        else None
        for node in outs
    ]


def _slice(
    gm: fx.GraphModule,
    target: fx.Node,
    placeholders: dict[fx.Node, int],
    out_position: dict[fx.Node, int],
    order: dict[fx.Node, int],
) -> OutputSlice | None:
    inside: set[fx.Node] = set()
    boundary: dict[fx.Node, Boundary] = {}
    stack = [target]
    while stack:
        node = stack.pop()
        if node in inside:
            continue
        if _draws_random_numbers(node) or len(inside) >= MAX_SLICE_NODES:
            return None
        inside.add(node)
        for arg in node.all_input_nodes:
            if arg in placeholders:
                boundary.setdefault(arg, ("input", placeholders[arg]))
            elif arg in out_position and arg is not target:
                boundary.setdefault(arg, ("output", out_position[arg]))
            elif arg not in inside:
                stack.append(arg)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    ordered_boundary = sorted(boundary, key=order.__getitem__)
    for node in ordered_boundary:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    estimated = 0.0
    ordered = sorted(inside, key=order.__getitem__)
    for node in ordered:
        env[node] = graph.node_copy(node, env.__getitem__)
        estimated += _estimate(node)
    graph.output(env[target])
    module = fx.GraphModule(gm, graph)
    workspace = _transient_peak(ordered, target)
    return OutputSlice(module, tuple(boundary[n] for n in ordered_boundary), estimated, workspace)


def _transient_peak(ordered: list[fx.Node], target: fx.Node) -> int:
    """The most a slice's intermediates hold at once, run in `ordered` (the forward's order), each freed after its
    last reader in the slice, as FX's generated code frees it; the target itself is not counted (the caller counts
    the output). The sum of every intermediate overstated a long slice: GPT-2's (4 x 128, batch 12, CPU stand-in)
    slice through an attention block summed to 33.1 MiB for a 0.75 MiB output, the runtime made room for it by
    evicting outputs only a whole rerun of the forward (33.8 MiB) brings back, and the first step overran its budget
    at batch 12 where 11 and 13 ran."""
    inside = set(ordered)
    fresh = {node: _fresh_bytes(node) for node in ordered}
    owner: dict[fx.Node, fx.Node | None] = {}  # the node whose storage a value lives in (None: outside the slice)
    for node in ordered:
        if fresh[node] or node.op != "call_function":
            owner[node] = node
        else:  # a view or a getitem: its base's storage
            base = next(iter(node.all_input_nodes), None)
            owner[node] = owner.get(base) if base in inside else None
    last_read: dict[fx.Node, int] = {}
    for position, node in enumerate(ordered):
        for arg in node.all_input_nodes:
            if owner.get(arg) is not None:
                last_read[owner[arg]] = position
    freed_after: dict[int, list[fx.Node]] = {}
    for storage, position in last_read.items():
        freed_after.setdefault(position, []).append(storage)
    live = peak = 0
    for position, node in enumerate(ordered):
        if owner[node] is node and node is not target:
            live += fresh[node]
        peak = max(peak, live)  # the node's inputs are still held while it runs
        live -= sum(fresh[storage] for storage in freed_after.get(position, ()))
    return peak


def _fresh_bytes(node: fx.Node) -> int:
    """Bytes a node allocates (0 for views and getitems, which share their input's storage)."""
    if node.op != "call_function" or node.target is operator.getitem:
        return 0
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and all(r.alias_info is not None for r in target._schema.returns):
        return 0
    leaves = node.meta.get("val")
    leaves = leaves if isinstance(leaves, (tuple, list)) else [leaves]
    return sum(tensor_nbytes(v) for v in leaves if isinstance(v, torch.Tensor))


def _draws_random_numbers(node: fx.Node) -> bool:
    target = node.target
    if target in (torch._prims.rng_prims.run_and_save_rng_state, torch._prims.rng_prims.run_with_rng_state):
        return True
    if "seed" in str(target):  # Inductor's seed lowering
        return True
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _estimate(node: fx.Node) -> float:
    if node.op != "call_function" or node.target is operator.getitem:
        return 0.0
    cost = node.meta.get("dtr")
    if cost is not None:
        return cost.time_s

    def value(a: object) -> object:
        return a.meta.get("val") if isinstance(a, fx.Node) else a

    return estimate_call(node.target, tree_map(value, node.args), tree_map(value, node.kwargs), node.meta.get("val"))
