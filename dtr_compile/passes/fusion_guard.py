"""Keep Inductor's kernel fusion from undoing the plan's memory schedule.

The plan places every recompute right before its first use and frees it after its last; its peak
model assumes each value is allocated where the plan put the node that makes it. Inductor's scheduler
may fuse two nodes that lie far apart in that order (horizontal fusion of nodes that read the same
inputs, or a producer with a distant consumer), and the fused kernel runs at the position of the
earlier one: the later node's outputs are then allocated early and live across everything between.
With recomputation this happens often, because a recompute reads the same saved values as the
forward-time nodes and as other recomputes of the same value (measured on a 4-block GPT at budget
0.45: 1.20x the planned peak with Inductor's defaults, 0.98x with this guard).

`PlanOrderChoices` is an Inductor choices handler that refuses any fusion of two scheduler nodes more
than `max_gap` nodes apart in the scheduler's original order (Inductor itself refuses horizontal
fusions more than 64 apart, for the same reason). Fusions of nearby nodes, which make up the usual
pointwise chains and epilogues, are untouched. The gap was 1 until the CPU stand-in GPT-2 (8 layers x 256)
showed its cost: the plans at 0.73 and 0.5 of torch.compile's peak ran 1.08 s and 1.18 s a step with it, 0.89 s
and 1.00 s at 64 (torch.compile: 0.97 s), with the same measured peaks (107.2 and 73.1 MB).

A horizontal fusion (two nodes that share inputs, neither reading the other) may join nodes only `max_horizontal_gap`
apart. Such a fusion saves a second read of the shared input, and it is the one that joins two blocks' recomputes:
in a plan that recomputes attention, the softmax of one layer and that of the layer before both read the causal
mask, so they fused into one kernel at the later layer's place, which pulled the earlier layer's whole recompute
(its projections, rotary embedding and scores) forward across the later layer's backward. On the CPU stand-in Llama
(4 layers x 128, batch 4 x 128) a plan modelled at 13.6 MB measured 16.7 MB with gap 64, and its second plan,
modelled lower, 19.5 MB (so 13.2 MiB raised BudgetError naming 16.0 MiB); with this, 13.4 MB, and it ran.

A producer may not fuse with a consumer across an extern kernel (a matmul, attention) that lies between them: the
fused kernel runs after that kernel, and what the producer reads stays allocated across it. In a plan that recomputes
attention written out (HF BLOOM's eager attention), the softmax's division fused with the softmax's backward, which
reads the gradient the next matmul makes, so the exponentials the division reads stayed allocated across that matmul
and the probabilities were allocated there too: four (batch, heads, seq, seq) buffers at once where the plan has
three (that attention on the CPU stand-in, 2 layers x 64, batch 4 x 128: 1.16x the plan's model at its floor, 0.98x
with this). Epilogues and the usual pointwise chains have no matmul inside them; on the CPU stand-in GPT-2 the plan
at 0.5 of torch.compile's peak ran 1.150x torch.compile's step with this rule and 1.155x with it applied to recomputes
only (the same peak, one process, interleaved steps).

The producer-consumer limit is on the span of the fused kernel (from its first member to its last), not on the gap
between the two nodes: fused one step at a time, a chain grew past any gap. HF T5's layers share one position bias,
whose gradient sums each layer's softmax gradient reduced over the batch; Inductor fused those reductions into one
kernel at the backward's end, so every layer's probabilities and their gradient (two (batch, heads, seq, seq)
buffers a layer) stayed allocated to there (CPU stand-in T5, 4 + 4 layers x 64, batch 4 x 128, at 15.43 MiB: plans
measured 1.35x and 1.83x their model, and the region ran at 0.60 of the budget after three compiles). With the span
limit the first plan measured 1.032x; with the extern rule above too, 1.000x, one compile, 0.985 of the budget.

Before scheduling, Inductor's post-grad pattern passes move a matmul in one case: `add(mm(a, b), c)` becomes
`addmm(c, a, b)` (and `add(mm, mm)` one fused kernel), computed where the add is. When the add lies far from the
matmul, everything the matmul reads lives until the add. On a model with tied embeddings (GPT-2's lm_head and
wte) the gradient of the shared weight is such a sum, and the add is the last op of the backward: the logits'
gradient (8 MB on the CPU stand-in GPT-2) stayed alive through the whole backward, 1.18x the plan's model.
`keep_distant_matmuls_in_place` writes such an add `c + m` as `sub(c, m, alpha=-1)`, `c - (-1 * m)`, which is the
same sum bit for bit (negation is exact in IEEE arithmetic) and which no pattern matches (they ignore an add's
extra keyword arguments, so `alpha=1` would not do); an add right after its matmul still fuses.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch._inductor.choices import InductorChoices

# How far apart (in Inductor scheduler nodes, original order) two nodes may be and still fuse (see the module doc):
# a producer and its consumer, and two nodes that only share inputs.
DEFAULT_MAX_GAP = 64
MAX_HORIZONTAL_GAP = 1


def fusion_gap(node1: Any, node2: Any) -> int:
    """Scheduler nodes strictly between the two (fused groups count by their first and last member)."""
    if node1.max_order < node2.min_order:
        return node2.min_order - node1.max_order - 1
    if node2.max_order < node1.min_order:
        return node1.min_order - node2.max_order - 1
    return 0  # the groups interleave


def fusion_span(node1: Any, node2: Any) -> int:
    """Scheduler nodes strictly between the first and the last member the two would have fused: wherever the fused
    kernel runs, it moves one of its ends that far from its place."""
    return max(node1.max_order, node2.max_order) - min(node1.min_order, node2.min_order) - 1


class PlanOrderChoices(InductorChoices):
    """Inductor's default heuristics, except that fusions may not move a node far from its planned place."""

    def __init__(self, max_gap: int | None = None, max_horizontal_gap: int | None = None) -> None:
        super().__init__()
        self.max_gap = DEFAULT_MAX_GAP if max_gap is None else max_gap
        self.max_horizontal_gap = MAX_HORIZONTAL_GAP if max_horizontal_gap is None else max_horizontal_gap
        self._externs: tuple[Any, list[int]] | None = None  # (scheduler, its extern kernels' orders, sorted)

    def can_fuse_vertical(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        if fusion_span(node1, node2) > self.max_gap:
            return False
        if self._extern_between(scheduler, node1, node2):
            return False
        return super().can_fuse_vertical(scheduler, node1, node2, shared_data_score)

    def _extern_between(self, scheduler: Any, node1: Any, node2: Any) -> bool:
        """Does an extern kernel (a matmul, attention) lie strictly between the two in the scheduler's order?"""
        if self._externs is None or self._externs[0] is not scheduler:
            orders = sorted(node.min_order for node in scheduler.nodes if node.is_extern())
            self._externs = (scheduler, orders)
        orders = self._externs[1]
        low, high = min(node1.max_order, node2.max_order), max(node1.min_order, node2.min_order)
        at = bisect.bisect_right(orders, low)
        return at < len(orders) and orders[at] < high

    def can_fuse_horizontal(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        if fusion_gap(node1, node2) > self.max_horizontal_gap:
            return False
        return super().can_fuse_horizontal(scheduler, node1, node2, shared_data_score)


def guarded_inner_compile(inner_compile: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap Inductor's `compile_fx_inner` so that each graph it compiles (forward, and the backward,
    which AOTAutograd may compile later) is scheduled with `PlanOrderChoices`."""
    from torch._inductor.virtualized import V

    def inner(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        with V.set_choices_handler(PlanOrderChoices()):
            return inner_compile(gm, example_inputs, **kwargs)

    return inner


_MATMULS = (torch.ops.aten.mm.default,)


def keep_distant_matmuls_in_place(gm: fx.GraphModule) -> int:
    """Write `add(mm, c)` as `sub(c, mm, alpha=-1)` where an op runs between the mm and the add, so that Inductor's
    addmm patterns do not move the mm to the add (see the module doc); returns how many adds were changed."""
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    changed = 0
    for node in gm.graph.nodes:
        if node.target is not torch.ops.aten.add.Tensor or node.kwargs:
            continue
        for k, arg in enumerate(node.args):
            if isinstance(arg, fx.Node) and arg.target in _MATMULS and position[node] - position[arg] > 1:
                other = node.args[1 - k]
                node.target = torch.ops.aten.sub.Tensor
                node.args = (other, arg)
                node.kwargs = {"alpha": -1}
                changed += 1
                break
    if changed:
        gm.recompile()
    return changed
