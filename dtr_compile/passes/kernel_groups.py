"""Which recomputed loop ops Inductor runs as one kernel, and what such a kernel holds while it runs.

Inductor fuses a producer loop (pointwise or reduction) with the loops that read it when they run over the same
elements, and the generated code allocates every buffer the fused kernel stores before it runs and frees what it
read only after it returns. Op by op, the memory model freed an input after its last reader inside the kernel
and allocated each output only where its op ran. A recomputed softmax shows the difference: the scores (a matmul's
output) are read by the max and by the stored `exp`, and the division's output is allocated while both are still
live. On HF BLOOM (2 layers x 64, batch 4 x 128, CPU) the plan that recomputes both attentions modelled 5.80 MB and
its Inductor code measured 6.77 MB: one (batch, heads, seq, seq) buffer more, held across the fused softmax.

The model groups consecutive recomputed loop ops (in the order the compiled code runs them) that read a value an
earlier one of the group stored and iterate over as many elements. Ops in between that own no storage (views,
pointwise ops computed inside their reader) do not break a group; anything else (a matmul, an op the backward runs
for itself) does. A group allocates all its stored outputs where it starts and frees its inputs where it ends.

What a fused kernel stores depends on the code generator. A Triton kernel (CUDA) is one function over the whole
group: a value read only inside it stays in registers (`remove_kernel_local_buffers`), so it is not allocated. Inductor's
C++ kernels are one loop nest per reduction, and a value one nest stores for the next is a buffer: on CPU every
stored value of the group is allocated (the `exp` above).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

import torch
from torch import fx

from ..tensor_bytes import size_hint
from .inlining import is_pointwise


@dataclass
class KernelSpans:
    """Groups of two or more run positions that run as one kernel."""

    spans: list[tuple[int, int]] = field(default_factory=list)  # (first, last) positions, inclusive

    def alloc_and_free(self) -> tuple[dict[int, range], dict[int, range], set[int]]:
        """(allocating, freeing, inside): at a span's first position the span's members allocate their storages,
        at its last position their inputs are freed; `inside`: every position in a span."""
        allocating, freeing, inside = {}, {}, set()
        for first, last in self.spans:
            members = range(first, last + 1)
            allocating[first] = members
            freeing[last] = members
            inside.update(members)
        return allocating, freeing, inside

    def local_storages(
        self, own: Callable[[int], Iterable[Hashable]], last_read: dict[Hashable, int], held: set[Hashable]
    ) -> set[Hashable]:
        """The storages a group makes and reads only inside itself (a Triton kernel keeps them in registers): `own`,
        what each position allocates; `last_read`, each storage's last reader's position; `held`, storages that
        outlive the step."""
        local: set[Hashable] = set()
        for first, last in self.spans:
            for i in range(first, last + 1):
                local.update(key for key in own(i) if key not in held and last_read.get(key, -1) <= last)
        return local


def kernel_spans(
    start: int,
    stop: int,
    own: Callable[[int], tuple[Hashable, ...]],
    fusable: Callable[[int], int | None],
    reads: Callable[[int], Iterable[Hashable]],
) -> KernelSpans:
    """The fused groups among run positions start..stop-1 (see the module doc). Per position: `own`, the storages
    the op allocates (none: a view or an op inlined into its reader); `fusable`, for a recomputed loop op that stores
    its value, how many elements its loop runs over, else None; `reads`, the storages it reads."""
    result = KernelSpans()
    first = last = -1  # the current group's first and last positions (-1: none open)
    stored: set[Hashable] = set()  # storages the group's ops allocate
    elements = None
    for i in range(start, stop):
        made = own(i)
        if not made:  # a view or an inlined op: part of whatever runs around it
            continue
        count = fusable(i)
        if first >= 0 and count is not None and count == elements and not stored.isdisjoint(reads(i)):
            last = i
            stored.update(made)
            continue
        if last > first:
            result.spans.append((first, last))
        first = last = -1
        if count is not None:
            first = last = i
            stored = set(made)
            elements = count
    if last > first:
        result.spans.append((first, last))
    return result


def loop_elements(node: fx.Node) -> int | None:
    """How many elements a loop op's kernel iterates over: its output's for a pointwise op, its input's for a
    reduction (whose output has fewer); None when not known."""
    source = node if is_pointwise(node) else next(iter(node.all_input_nodes), None)
    value = source.meta.get("val") if source is not None else None
    if not isinstance(value, torch.Tensor):
        return None
    count = 1
    for size in value.shape:
        count *= size_hint(size)
    return count


def keeps_local_values(nodes: Iterable[fx.Node]) -> bool:
    """Does the code generator keep a value read only inside its fused kernel out of memory? Triton (a graph on a
    CUDA device) does; Inductor's C++ kernels store it (see the module doc)."""
    for node in nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            return value.device.type == "cuda"
    return False
