"""Dropout on the counter-based RNG: the recomputed mask is the forward's, bit for bit."""

from __future__ import annotations

import operator

import kernel_harness  # noqa: F401  (skips this module, saying why, when triton cannot be imported)
import pytest
import torch
from torch import fx

from dtr_compile.kernels import compile_chain, draw_seed, dropout_kernel

aten = torch.ops.aten


def _softmax_dropout_chain(scores: torch.Tensor, seed: torch.Tensor, p: float):
    """A recompute region as the fusion pass sees it: softmax, then the forward's dropout kernel on the saved
    seed, then both of its outputs. Node values are real tensors of the right shapes (what meta["val"] holds)."""
    graph = fx.Graph()
    x = graph.placeholder("scores")
    x.meta["val"] = scores
    s = graph.placeholder("seed")
    s.meta["val"] = seed
    probs = graph.call_function(aten._softmax.default, (x, -1, False))
    probs.meta["val"] = torch.empty_like(scores)
    kernel = dropout_kernel(tuple(scores.shape), scores.dtype, p)
    dropped = graph.call_function(kernel, (probs, s))
    dropped.meta["val"] = (torch.empty_like(scores), torch.empty_like(scores, dtype=torch.bool))
    out = graph.call_function(operator.getitem, (dropped, 0))
    out.meta["val"] = dropped.meta["val"][0]
    mask = graph.call_function(operator.getitem, (dropped, 1))
    mask.meta["val"] = dropped.meta["val"][1]
    graph.output((out, mask))
    return compile_chain([probs, dropped, out, mask], [out, mask])


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_recomputed_mask_is_the_forward_mask(p: float) -> None:
    scores = torch.randn(6, 4, 16, 24)
    seed = draw_seed(scores)
    probs = torch.softmax(scores, -1)
    forward_out, forward_mask = dropout_kernel(tuple(probs.shape), probs.dtype, p)(probs, seed)  # flat kernel
    chain = _softmax_dropout_chain(scores, seed, p)  # a row kernel: other tiles, same flat index per element
    assert chain.kernel.program.instrs[0].op == "softmax" and len(chain.kernel.program.instrs) == 2
    recomputed_out, recomputed_mask = chain(scores, seed)
    assert torch.equal(recomputed_mask, forward_mask)
    torch.testing.assert_close(recomputed_out, forward_out)


def test_a_region_that_needs_only_the_mask_reads_only_the_seed() -> None:
    scores = torch.randn(4, 8, 8)
    seed = draw_seed(scores)
    chain = _softmax_dropout_chain(scores, seed, 0.5)
    mask_node = chain.outputs[1]
    mask_only = compile_chain([n for n in mask_node.graph.nodes if n.op == "call_function"], [mask_node])
    assert [n.name for n in mask_only.inputs] == ["seed"]  # no softmax, no scores: the mask is Philox(seed, i)
    (mask,) = mask_only(seed)
    assert torch.equal(mask, chain(scores, seed)[1])


def test_dropout_kernel_matches_its_definition() -> None:
    x = torch.randn(64, 1000)
    p = 0.3
    out, mask = dropout_kernel((64, 1000), torch.float32, p)(x, draw_seed(x))
    assert mask.dtype == torch.bool
    assert torch.equal(out, torch.where(mask, x * (1 / (1 - p)), torch.zeros(())))
    kept = mask.float().mean().item()
    assert abs(kept - (1 - p)) < 0.01, kept  # 64k draws: 1 - p to within 5 sigma


def test_seeds_come_from_torch_generator() -> None:
    x = torch.randn(32, 32)
    kernel = dropout_kernel((32, 32), torch.float32, 0.5)
    torch.manual_seed(123)
    first = kernel(x, draw_seed(x))[1]
    second = kernel(x, draw_seed(x))[1]
    torch.manual_seed(123)
    again = kernel(x, draw_seed(x))[1]
    assert torch.equal(first, again)  # manual_seed makes a step reproducible
    assert not torch.equal(first, second)  # and every draw is a fresh mask


def test_mask_depends_on_the_element_index_only() -> None:
    """Same seed and element count, any shape or tiling: the same mask (that is what lets any kernel recompute it)."""
    x = torch.randn(4, 3000)
    seed = draw_seed(x)
    wide = dropout_kernel((4, 3000), torch.float32, 0.5)(x, seed)[1]
    tall = dropout_kernel((3000, 4), torch.float32, 0.5)(x.view(3000, 4), seed)[1]
    assert torch.equal(wide.view(-1), tall.view(-1))
