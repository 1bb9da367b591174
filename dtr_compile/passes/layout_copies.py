"""The graph inputs Inductor copies to channels-last inside the step: memory no other model of a plan sees.

With layout optimization (Inductor decides it per graph: `GraphLowering.decide_layout_opt`, always on for CPU
convolutions under mkldnn, by heuristics on CUDA), Inductor runs every 2-D convolution on channels-last tensors.
What the graph computes it lays out so from the start, at no cost; a graph input it cannot lay out, so the batch and
each convolution's weight are copied, once, and every reader uses the copy. The forward saves the copy for the
backward in the input's place (its return statement names `buf0` where the graph names `primals_1`), so the copy lives
from the forward's start (Inductor's CPU code makes all of them in its first kernel) to the input's last read in the
backward. Those bytes are allocated inside the step, above what was live at its start: the budget counts them.
Uncounted, the CPU stand-in's ResNet `quick` planned at 0.62 of torch.compile's peak measured 1.107x its model (0.84
MiB of copies in a 10 MiB plan), and verify.py compiled it a second time (backend/region.py).

The rule read off Inductor (kernel/conv.py: `require_channels_last` on `x` and `weight` when `layout_opt` and the
convolution is 2-D): a forward placeholder read as a 2-D convolution's input or weight, dense, and not channels-last
already. An input read through a view is not counted (no model here sees one; a copy of the view would be made).
The backward's placeholders are the forward's saved values, channels-last already.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

import torch
from torch import fx

_CONVOLUTION = torch.ops.aten.convolution.default
_SPATIAL_2D = 4  # (N, C, H, W): Inductor lays out only 2-D convolutions channels-last


def layout_copied_inputs(forward: Iterable[fx.Node]) -> list[fx.Node]:
    """The placeholders among the forward graph's nodes (`forward`: its placeholders and ops) that Inductor's code
    copies to channels-last, in graph order; empty where it does not optimize the forward's layout."""
    forward = list(forward)
    convolutions = [n for n in forward if n.target is _CONVOLUTION and _is_2d(n)]
    if not convolutions or not _layout_optimized(forward):
        return []
    copied: dict[fx.Node, None] = {}
    for conv in convolutions:
        for arg in conv.args[:2]:
            if isinstance(arg, fx.Node) and arg.op == "placeholder" and _needs_copy(arg.meta.get("val")):
                copied[arg] = None
    return [n for n in forward if n in copied]


def _is_2d(conv: fx.Node) -> bool:
    weight = conv.args[1]
    value = weight.meta.get("val") if isinstance(weight, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() == _SPATIAL_2D


def _needs_copy(value: object) -> bool:
    if not isinstance(value, torch.Tensor) or value.dim() != _SPATIAL_2D:
        return False
    dense = torch._prims_common.is_non_overlapping_and_dense_or_false(value)
    return dense and not value.is_contiguous(memory_format=torch.channels_last)


def _layout_optimized(forward: list[fx.Node]) -> bool:
    """Inductor's own decision for a graph of these nodes (a training graph: `is_inference=False`)."""
    from torch._inductor.graph import GraphLowering

    stand_in = SimpleNamespace(graph=SimpleNamespace(nodes=forward))  # it reads only `gm.graph.nodes`
    return bool(GraphLowering.decide_layout_opt(stand_in, is_inference=False))
