"""Which nodes Inductor computes inside the kernel of their reader instead of storing them.

Inductor lowers pointwise ops to loop bodies and, when such an op has a single reader that is itself
lowered to a loop (a pointwise op or a reduction) in the same graph, inlines it there: no buffer is
allocated, and the reader reads the op's inputs instead. Everything else gets a buffer: outputs of
extern kernels (matmul, convolution, attention), inputs of extern kernels, values read by several
ops (Inductor inlines some of those too, but not always, so they are counted), graph outputs, and
values the forward saves for the backward.

A value read by several loops is computed inside each of them too, unless its expression reads more
than a few buffers or contains an expensive op (Inductor then stores it where it is computed).

The planner's model of Inductor's memory treats inlined nodes as allocating nothing, their inputs
living until their last reader (`StorageMap(inlined=...)` for a graph, `schedule.storage_keys(
inductor=True)` for a plan), and runs every other pointwise op where its first reader needs it
(`sunk_order`), except the values stored on reuse, which run where the graph lists them. It is a model
of Inductor's lowering, not Inductor itself: of kernel fusion it models the recomputes' (a fused kernel allocates
its outputs at once and frees its inputs after it, kernel_groups.py), in-place kernels not at all, so the compiled
code is measured once (verify.py). Inductor's reuse of dead
buffers, which would keep them allocated past their last reader, is turned off for planned parts
(PLANNED_PART_SETTINGS).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import fx

from .storage import is_mutating, returns_alias

# A memory model between the exact one and Inductor's (partition.plan_model): every value is allocated where the
# plan computes it, except the recomputed pointwise ops Inductor computes inside their readers. Passed as the
# `inductor` argument where the other two pass False / True (partition.model_flag: one flag, three models). A checkpointed block's recompute (a GELU's chain of pointwise
# ops) is fused by Inductor into the backward's kernels: the exact model counted each link as a buffer.
FUSED_RECOMPUTE = "fused_recompute"

# Inductor settings a planned part is compiled with (backend/aot.py), so that its code frees what the model frees:
# - no peak-memory reordering: Inductor's own pass does not know the plan (on a CNN it moved three recomputes planned
#   just before their convolutions' backwards to the start of the backward, 1.21x the planned peak);
# - no buffer reuse: Inductor's wrapper keeps a dead buffer allocated until a later buffer of the same size takes it
#   over, however far away. In a plan that recomputes blocks, a block's MLP buffers in the backward then stayed
#   allocated through the next block's attention backward until its own recompute: on the CPU stand-in Llama
#   (8 x 256) six 4 MiB buffers, 76.8 MiB measured for 62.0 modelled; 66.1 without reuse, at the same step time.
#   The memory model frees each value after its last reader, as the code then does; on a GPU the caching allocator
#   reuses the freed blocks;
# - no in-place buffers (a kernel writing its output over an input it reads last): with them, Inductor's C++ code of
#   HF T5's plan at 0.6 (4 x 128, CPU, torch 2.13) returned a wrong gradient for the first encoder and decoder blocks'
#   `DenseReluDense.wo.weight` (relative error 1.0, every step), where the same planned graphs run as FX code, or
#   compiled without in-place buffers or without fusion, gave eager's. The memory model never counted that reuse.
PLANNED_PART_SETTINGS = {"reorder_for_peak_memory": False, "allow_buffer_reuse": False, "inplace_buffers": False}

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


SINGLE, MULTI = "single", "multi"  # an op read by one loop, or by several loops, of its own graph

# Inductor stores a value read by several kernels, instead of computing it in each, when its expression
# (with what is inlined into it) reads more than this many buffers (`realize_reads_threshold`) or, on
# CPU, contains one of these ops (`should_realize_on_reuse`).
MAX_SHARED_READS = 4
HEAVY = {"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"}


def is_heavy(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target.overloadpacket.__name__ in HEAVY


def inline_kind(
    readers: list[fx.Node] | list[int], loop: Callable[[Any], bool], same: Callable[[Any], bool]
) -> str | None:
    """SINGLE or MULTI when every reader is a loop in the same graph, else None (the value is stored)."""
    if not readers or not all(loop(r) and same(r) for r in readers):
        return None
    return SINGLE if len(readers) == 1 else MULTI


def keeps_inlined(kind: str | None, reads: int, heavy: bool) -> bool:
    """Does Inductor compute the value inside its readers, given the buffers its expression reads?"""
    if kind == SINGLE:
        return reads <= MAX_INLINED_READS
    if kind == MULTI:
        return reads <= MAX_SHARED_READS and not heavy
    return False


class InlineDecider:
    """Decides, in graph order, which candidates (`inductor_inlined`) Inductor does compute inside their
    readers: that depends on the buffers their expression reads and on the expensive ops inlined into it."""

    def __init__(self, kinds: dict[Any, str]) -> None:
        self.kinds = kinds
        self.inlined: set[Any] = set()
        self._heavy: set[Any] = set()

    def may_inline(self, item: Any) -> bool:
        return item in self.kinds

    def inlines(self, item: Any, reads: int, node: fx.Node | None = None, inputs: Iterable[Any] = ()) -> bool:
        """`item`: a node, or an op's position in a plan (then `node` is its node and `inputs` the
        positions of the ops it reads)."""
        node = item if node is None else node
        inputs = node.all_input_nodes if not inputs and isinstance(item, fx.Node) else inputs
        heavy = is_heavy(node) or any(a in self._heavy for a in inputs)
        if not keeps_inlined(self.kinds[item], reads, heavy):
            return False
        self.inlined.add(item)
        if heavy:
            self._heavy.add(item)
        return True

    def stored_on_reuse(self, item: Any) -> bool:
        """A value several loops read that Inductor stores where it is computed (not where it is needed)."""
        return self.kinds.get(item) == MULTI and item not in self.inlined


def inductor_inlined(nodes: Iterable[fx.Node], same_graph: Callable[[fx.Node, fx.Node], bool]) -> dict[fx.Node, str]:
    """The pointwise nodes among `nodes` that Inductor may compute inside their readers, with their kind
    (whether it does depends on what its expression reads, see `keeps_inlined`).

    `same_graph(a, b)`: a and b end up in the same compiled graph (both forward or both backward); a
    value read across graphs is saved, hence stored.
    """
    kinds = {}
    for node in nodes:
        if not is_pointwise(node):
            continue
        kind = inline_kind(_readers(node), is_loop, lambda reader, node=node: same_graph(node, reader))
        if kind is not None:
            kinds[node] = kind
    return kinds


def sunk_order(start: int, stop: int, readers: list[list[int]], movable: list[bool]) -> list[int]:
    """The order Inductor runs a graph's ops in: pointwise ops (and views of them) where their first
    reader needs them, not where the graph lists them.

    Inductor does not store a pointwise op's result when it lowers the op; the buffer is created when a
    reader first needs it stored (an extern kernel such as a matmul or a convolution, or the graph's
    output), so the op's inputs stay alive until then. The graph is positions start..stop-1 of a longer
    sequence; `readers[i]`: positions of the ops that read op i (those outside the graph are ignored);
    `movable[i]`: op i is pointwise or a view. Returns the graph's positions in run order; a movable op
    nothing in the graph reads runs at the end (as a graph output)."""
    anchor = [0] * (stop - start)  # position of the op an op runs right before (itself if it does not move)
    depth = [0] * (stop - start)  # how many movable ops lie between it and its anchor, on the way there
    for i in range(stop - 1, start - 1, -1):
        local = i - start
        if movable[i]:
            best = (stop, 1)
            for j in readers[i]:
                if j < stop and (anchor[j - start], depth[j - start]) < best:
                    best = (anchor[j - start], depth[j - start])
            anchor[local], depth[local] = best[0], best[1] - 1
        else:
            anchor[local], depth[local] = i, 0
    return sorted(range(start, stop), key=lambda i: (anchor[i - start], depth[i - start], i))
