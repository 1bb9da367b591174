"""The DTR paper's theorem on a uniform linear chain, and recompute counts on chains of multi-output ops.

Kirisame et al. (ICLR 2021), Theorem: an n-layer linear feed-forward network trains under a budget of
O(sqrt(n)) tensors with O(n) tensor operations when the heuristic accounts for the evicted neighbourhood
(h_DTR; h_DTR_eq is its union-find approximation). The authors' simulator recomputes 0.77n-0.96n ops for
n = 64..1024 with h_DTR, while LRU, which ignores the cost of long evicted chains, recomputes far more.

The scenario (see `linear_chain_remats`): forward f_1..f_n, every activation saved; backward b_n..b_1,
b_k reading g_k and a_{k-1} and writing g_{k-1}, the handles of g_k and a_{k-1} dying after it. The budget
is ceil(2 sqrt(n)) tensors. We assert remats <= C * n with C = 1.25: the theorem promises a constant, the
authors measured at most 0.96 for these n, and 1.25 leaves room for candidate sampling (sqrt measures up to
1.03 here) while a superlinear policy (LRU: 1.75n at n=64, 7.75n at n=1024) fails it.
"""

from __future__ import annotations

import pytest
from engine_harness import linear_chain_remats

from dtr_compile import config
from dtr_compile.engine import Engine

LINEAR_CONSTANT = 1.25
SIZES = [64, 256, 1024]


@pytest.mark.parametrize("n", SIZES)
def test_default_heuristic_scoring_every_candidate_recomputes_linearly(n: int) -> None:
    engine = linear_chain_remats(n, config.heuristic, "all")
    assert engine.peak <= engine.budget_bytes
    assert engine.remats <= LINEAR_CONSTANT * n, f"{config.heuristic}: {engine.remats / n:.2f} n recomputes"
    assert engine.remats >= 0.5 * n, "a budget of 2 sqrt(n) tensors cannot avoid recomputing most layers"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_default_heuristic_sampling_sqrt_candidates_recomputes_linearly(n: int, seed: int) -> None:
    engine = linear_chain_remats(n, config.heuristic, "sqrt", seed=seed)
    assert engine.peak <= engine.budget_bytes
    assert engine.remats <= LINEAR_CONSTANT * n, f"{config.heuristic}: {engine.remats / n:.2f} n recomputes"


@pytest.mark.parametrize("n", [64, 256])
def test_exact_dtr_matches_the_authors_simulator(n: int) -> None:
    """h_DTR with every candidate scored: within the 0.77n-0.96n the authors report (1024 is slow here)."""
    assert 0.7 * n <= linear_chain_remats(n, "dtr", "all").remats <= 0.96 * n


def test_dtr_eq_matches_exact_dtr_on_the_chain() -> None:
    for n in (64, 256):
        assert linear_chain_remats(n, "dtr_eq", "all").remats == linear_chain_remats(n, "dtr", "all").remats


def test_lru_recomputes_much_more_than_dtr_and_superlinearly() -> None:
    lru = {n: linear_chain_remats(n, "lru", "all").remats / n for n in (256, 1024)}
    dtr_eq = {n: linear_chain_remats(n, "dtr_eq", "all").remats / n for n in (256, 1024)}
    assert lru[1024] >= 4 * dtr_eq[1024], (lru, dtr_eq)
    assert lru[1024] > LINEAR_CONSTANT * 4, "LRU's recompute per layer grows with the depth"
    assert lru[1024] / lru[256] >= 1.5 and dtr_eq[1024] / dtr_eq[256] <= 1.2, (lru, dtr_eq)


@pytest.mark.parametrize("depth", [4, 12])
def test_chains_of_multi_output_ops_recompute_each_op_once(depth: int) -> None:
    """s_k reads both outputs of s_{k-1}, all dead but the last: bringing the last back reruns each op once.

    Regression: a frame locked only the first missing input, so the dead sibling from the same producer was
    freed again after the rerun and recomputed once more: 2^depth - 1 reruns instead of depth.
    """
    engine = Engine(None, thrash_limit=None)
    x = engine.constant(10)
    previous = [x]
    for k in range(depth):
        engine.reserve(previous, 20, f"s{k}")
        outputs = engine.record(f"s{k}", previous, [10, 10], 1.0).outputs
        for storage in previous:
            if storage is not x:
                engine.drop_handle(storage)
        previous = outputs
    engine.evict(previous[0])
    engine.materialize(previous[0])
    assert engine.remats == depth
    assert engine.memory == 20, "the two last outputs (x is not counted): dead by-products are freed again"
