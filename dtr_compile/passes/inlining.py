"""Which nodes Inductor computes inside the kernel of their reader instead of storing them.

Inductor lowers pointwise ops to loop bodies and, when such an op has a single reader that is itself
lowered to a loop (a pointwise op or a reduction) in the same graph, inlines it there: no buffer is
allocated, and the reader reads the op's inputs instead. Everything else gets a buffer: outputs of
extern kernels (matmul, convolution, attention), inputs of extern kernels, values read by several
ops (Inductor inlines some of those too, but not always, so they are counted), graph outputs, and
values the forward saves for the backward.

The planner's model of Inductor's memory treats these inlined nodes as allocating nothing
(`StorageMap(inlined=...)` for a graph, `schedule.storage_keys(inductor=True)` for a plan). The rule
is narrower than Inductor's own heuristics so that the model stays an upper bound: where Inductor
inlines or fuses more, it uses less memory than modelled.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable

import torch
from torch import fx

from .storage import is_mutating, returns_alias

# Inductor stops inlining (stores the value) once an inlined chain reads more than this many buffers
# (`realize_acc_reads_threshold`, 8; 12 on CPU); the model uses the smaller one.
MAX_INLINED_READS = 8

# Loop-lowered ops without the pointwise tag that Inductor inlines like pointwise ones.
_POINTWISE_EXTRA = {
    torch.ops.aten.full.default,
    torch.ops.aten.scalar_tensor.default,
    torch.ops.prims.iota.default,
}


def is_pointwise(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or is_mutating(node):
        return False
    return torch.Tag.pointwise in target.tags or target in _POINTWISE_EXTRA


def is_loop(node: fx.Node) -> bool:
    """Lowered by Inductor to a loop that a producer can be inlined into (pointwise or reduction)."""
    if is_pointwise(node):
        return True
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.reduction in target.tags


def is_view(node: fx.Node) -> bool:
    """An op whose output aliases its input (no allocation, no kernel)."""
    return node.op == "call_function" and node.target is not operator.getitem and returns_alias(node)


def _readers(node: fx.Node) -> list[fx.Node]:
    """The nodes that read `node`'s data, looking through views of it."""
    readers = []
    stack = list(node.users)
    while stack:
        user = stack.pop()
        if is_view(user):
            stack.extend(user.users)
        else:
            readers.append(user)
    return readers


def inductor_inlined(nodes: Iterable[fx.Node], same_graph: Callable[[fx.Node, fx.Node], bool]) -> set[fx.Node]:
    """The pointwise nodes among `nodes` that Inductor inlines into their only reader.

    `same_graph(a, b)`: a and b end up in the same compiled graph (both forward or both backward); a
    value read across graphs is saved, hence stored.
    """
    inlined = set()
    for node in nodes:
        if not is_pointwise(node):
            continue
        readers = _readers(node)
        if len(readers) == 1 and is_loop(readers[0]) and same_graph(node, readers[0]):
            inlined.add(node)
    return inlined


def sunk_order(start: int, stop: int, readers: list[list[int]], movable: list[bool]) -> list[int]:
    """The order Inductor runs a graph's ops in: pointwise ops (and views of them) where their first
    reader needs them, not where the graph lists them.

    Inductor does not store a pointwise op's result when it lowers the op; the buffer is created when a
    reader first needs it stored (an extern kernel such as a matmul or a convolution, or the graph's
    output), so the op's inputs stay alive until then. The graph is positions start..stop-1 of a longer
    sequence; `readers[i]`: positions of the ops that read op i (those outside the graph are ignored);
    `movable[i]`: op i is pointwise or a view. Returns the graph's positions in run order; a movable op
    nothing in the graph reads runs at the end (as a graph output)."""
    keys: dict[int, tuple[int, int, int]] = {}
    for i in range(stop - 1, start - 1, -1):
        if movable[i]:
            first = (stop, 1, i)
            for j in readers[i]:
                if j < stop and keys[j] < first:
                    first = keys[j]
            keys[i] = (first[0], first[1] - 1, i)
        else:
            keys[i] = (i, 0, i)
    return sorted(range(start, stop), key=keys.__getitem__)
