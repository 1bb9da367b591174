"""Plans over a chain of blocks: one option per block, chosen together by dynamic programming (issue 17).

This is how the best tools plan a chain (rotor's optimal chain checkpointing, Rockmate's per-block options):
for each block of the chain (blocks.py) a few options - keep, selective checkpointing (save matmuls and
attention), full checkpointing - each priced by the cost pass's time of what it recomputes, and the options
chosen together so that the step's peak meets the budget at the least total recompute time.

The memory model of the dynamic program is additive and read off exact simulations (schedule.simulate) of
the uniform plans (every block on the same option). The backward visits the blocks last to first, and
while it runs block k's backward, what blocks 0..k-1 saved is still live and what blocks k+1.. saved is
gone; so the step's peak is modelled as

    max( max_k  P_k + T_k(option_k),   max_L  P_L + G_L ),     P_k = sum over j < k of S_j(option_j)

where S_j(o) is the bytes block j saves under option o, T_k(o) the memory of block k's backward (its saved
values, its recompute burst, gradients) above what the earlier blocks saved, and G_L the memory of the ops
outside every block (the forward, the loss, the embedding's backward) above what the blocks before level L
saved (the most any option gives). The program keeps, block by block, the Pareto front of (P, recompute time).

The model is then checked against the exact simulation of the chosen plan and its target moved by the
miss (tightened when the plan is above the budget, loosened when it leaves room), a handful of rounds; the
cheapest plan that fits is taken. The planner's `fill` then spends what is left of the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import fx

from .blocks import OPTIONS, Block, option_drops
from .plan_state import PlanState
from .schedule import JointFacts

__all__ = ["ChainResult", "ChainSearch", "plan_chain"]

ROUNDS = 6  # exact checks of the dynamic program's choice


@dataclass
class _Profile:
    """The additive model of one option, read off the uniform plan's simulation."""

    saved: list[int]  # S_k: bytes block k saves
    transient: list[int | None]  # T_k: block k's backward above what blocks < k saved (None: no backward ops)
    gaps: dict[int, int]  # level L -> G_L from this plan
    recompute: list[float]  # C_k: modelled time of recomputing block k's values


class ChainSearch(Protocol):
    """What the chain planner uses of the planner's search (planner.py, which calls it: the search is handed in
    rather than imported, so that the two modules do not import each other)."""

    facts: JointFacts
    state: PlanState  # the plan the search stands at (the chain's plans keep what it drops outside the blocks)

    def evaluate(self, dropped: frozenset[fx.Node], forget: frozenset[tuple[fx.Node, int]]) -> PlanState | None:
        """The plan that does not save `dropped` (and gives up `forget`); None when it cannot be scheduled."""
        ...


@dataclass
class ChainResult:
    blocks: list[Block]
    options: tuple[str, ...] | None  # the chosen option per block (None: no combination met the budget)
    state: PlanState | None  # the chosen plan (before fill)
    floor: PlanState | None  # every block checkpointed: the lowest peak the chain's options reach
    rounds: int = 0


def plan_chain(search: ChainSearch, blocks: list[Block], budget: int) -> ChainResult:
    """The cheapest combination of block options whose exact peak is within `budget` (see the module doc)."""
    facts = search.facts
    start = search.state.dropped
    inside = set().union(*(b.forward for b in blocks))
    other = frozenset(n for n in start if n not in inside)
    drops = [{o: option_drops(facts, b, o, start) for o in OPTIONS} for b in blocks]

    def dropped_of(choice: tuple[str, ...]) -> frozenset[fx.Node]:
        return other.union(*(drops[k][o] for k, o in enumerate(choice)))

    def evaluate_choice(choice: tuple[str, ...]) -> PlanState | None:
        if choice not in evaluated:
            evaluated[choice] = search.evaluate(dropped_of(choice), frozenset())
        return evaluated[choice]

    block_of_backward = {n: k for k, b in enumerate(blocks) for n in b.backward}
    block_of_forward = {n: k for k, b in enumerate(blocks) for n in b.forward}
    profiles: dict[str, _Profile] = {}
    evaluated: dict[tuple[str, ...], PlanState | None] = {}
    for option in OPTIONS:
        choice = (option,) * len(blocks)
        state = search.evaluate(dropped_of(choice), frozenset())
        evaluated[choice] = state
        if state is not None:
            profiles[option] = _profile(facts, state, len(blocks), block_of_forward, block_of_backward)
    floor = evaluated.get(("checkpoint",) * len(blocks))
    if not profiles:
        return ChainResult(blocks, None, None, floor)
    gaps: dict[int, int] = {}
    for profile in profiles.values():
        for level, value in profile.gaps.items():
            gaps[level] = max(gaps.get(level, value), value)

    best: PlanState | None = None
    best_choice: tuple[str, ...] | None = None
    for choice, state in evaluated.items():
        if (
            state is not None
            and state.peak <= budget
            and (best is None or state.trace.recompute_s < best.trace.recompute_s)
        ):
            best, best_choice = state, choice
    target = budget
    rounds = 0
    for rounds in range(1, ROUNDS + 1):
        choice = _cheapest(profiles, gaps, len(blocks), target)
        if choice is None:
            break
        state = evaluate_choice(choice)
        if state is None:
            break
        if state.peak <= budget and (best is None or state.trace.recompute_s < best.trace.recompute_s):
            best, best_choice = state, choice
        if state.peak == budget:
            break
        # A choice seen before moves the target again by its miss rather than ending the search: the additive
        # model can underrate one plan by more than one miss (GPT-2 at 96 MiB chose `sac` x8, 4 MiB over, at
        # two targets), and ending there fell back to the all-checkpoint plan at 2.4x the recompute of the
        # plans chosen 1 MiB above and below it.
        target += budget - state.peak
    local = _LocalSearch(profiles, evaluated, evaluate_choice, budget)
    best_choice = local.settle(best_choice)
    best = evaluated[best_choice] if best_choice is not None else None
    return ChainResult(blocks, best_choice, best, floor, rounds)


def _profile(
    facts: JointFacts,
    state: PlanState,
    count: int,
    block_of_forward: dict[fx.Node, int],
    block_of_backward: dict[fx.Node, int],
) -> _Profile:
    sim, trace = state.sim, state.trace
    saved = [0] * count
    for key in sim.saved:
        (producer, _), _version = key
        k = block_of_forward.get(producer)
        if k is not None:
            saved[k] += facts.nbytes.get(key[0], 0)
    before = [0] * (count + 1)  # before[L]: bytes saved by blocks < L
    for k in range(count):
        before[k + 1] = before[k] + saved[k]
    recompute = [0.0] * count
    for node, times in trace.recomputed.items():
        k = block_of_forward.get(node)
        if k is not None:
            recompute[k] += times * facts.cost[node].time_s
    transient: list[int | None] = [None] * count
    gaps: dict[int, int] = {}
    level = count  # the forward, and the backward before the first block's: every block's saved values live
    backward = facts.backward
    for run, traced in enumerate(sim.order):
        memory = sim.timeline[run]
        k = None
        if traced >= trace.boundary:
            index = trace.owner[traced - trace.boundary]
            k = block_of_backward.get(backward[index]) if index < len(backward) else None
        if k is None:
            gaps[level] = max(gaps.get(level, memory - before[level]), memory - before[level])
            continue
        level = k
        value = memory - before[k]
        transient[k] = value if transient[k] is None else max(transient[k], value)
    return _Profile(saved, transient, gaps, recompute)


class _LocalSearch:
    """Exact moves of one block by one option, after the dynamic program's rounds. The additive model can be off by
    more than the gap between two neighbouring plans, and then the rounds end on a plan far from the best: GPT-2 at
    99 MiB ended on the all-checkpoint plan (89.5 ms of recompute) where moving one block of the `sac` x8 plan, 1 MiB
    over, to `checkpoint` fits at 38.0 ms. So the cheapest plan over the budget is lowered block by block until it
    fits, and the best plan that fits is raised block by block while it still fits, each move ranked by the
    additive model's recompute per byte and checked by the exact simulation; at most MOVES x blocks simulations."""

    MOVES = 2

    def __init__(
        self,
        profiles: dict[str, _Profile],
        evaluated: dict[tuple[str, ...], PlanState | None],
        evaluate: Callable[[tuple[str, ...]], PlanState | None],
        budget: int,
    ) -> None:
        self.profiles, self.evaluated, self.evaluate, self.budget = profiles, evaluated, evaluate, budget
        self.order = [o for o in OPTIONS if o in profiles]  # most memory first
        self.left = self.MOVES * len(next(iter(profiles.values())).saved)

    def settle(self, best: tuple[str, ...] | None) -> tuple[str, ...] | None:
        over = [
            c for c, s in self.evaluated.items() if s is not None and s.peak > self.budget and self._cheaper(c, best)
        ]
        if over:
            best = self._lower(min(over, key=lambda c: self.evaluated[c].peak), best)
        return self._raise(best) if best is not None else None

    def _cheaper(self, choice: tuple[str, ...], than: tuple[str, ...] | None) -> bool:
        return than is None or self.evaluated[choice].trace.recompute_s < self.evaluated[than].trace.recompute_s

    def _lower(self, choice: tuple[str, ...], best: tuple[str, ...] | None) -> tuple[str, ...] | None:
        """Move the blocks of `choice` toward less memory, cheapest first, until it fits (or costs more than best)."""
        while self.left > 0:
            moves = self._moves(choice, step=1)
            if not moves:
                return best
            choice = moves[0]
            state = self._spend(choice)
            if state is None or not self._cheaper(choice, best):
                return best
            if state.peak <= self.budget:
                return choice
        return best

    def _raise(self, best: tuple[str, ...]) -> tuple[str, ...]:
        """Move blocks of the best plan toward less recompute while the plan still fits."""
        improved = True
        while improved and self.left > 0:
            improved = False
            for choice in self._moves(best, step=-1):
                if self.left <= 0:
                    break
                state = self._spend(choice)
                if state is not None and state.peak <= self.budget and self._cheaper(choice, best):
                    best, improved = choice, True
                    break
        return best

    def _spend(self, choice: tuple[str, ...]) -> PlanState | None:
        if choice not in self.evaluated:
            self.left -= 1
        return self.evaluate(choice)

    def _moves(self, choice: tuple[str, ...], step: int) -> list[tuple[str, ...]]:
        """The choices one block away (step 1: the next option with less memory; -1: with more), not yet seen, best
        first by the additive model: the least recompute added per byte freed, or the most saved per byte added."""
        ranked = []
        for k, option in enumerate(choice):
            i = self.order.index(option) + step
            if not 0 <= i < len(self.order):
                continue
            moved = (*choice[:k], self.order[i], *choice[k + 1 :])
            if moved in self.evaluated:
                continue
            was, now = self.profiles[option], self.profiles[self.order[i]]
            freed = (was.saved[k] - now.saved[k]) * step
            added = (now.recompute[k] - was.recompute[k]) * step
            ranked.append((step * added / max(freed, 1), moved))
        ranked.sort(key=lambda row: row[0])
        return [moved for _, moved in ranked]


def _cheapest(profiles: dict[str, _Profile], gaps: dict[int, int], count: int, target: int) -> tuple[str, ...] | None:
    """The least recompute time under the additive model with the peak within `target`: a dynamic program
    over the blocks in forward order whose states are the Pareto front of (bytes saved so far, time)."""
    front: list[tuple[int, float, tuple[str, ...]]] = [(0, 0.0, ())]
    for k in range(count):
        gap = gaps.get(k)
        grown = []
        for prefix, cost, choice in front:
            if gap is not None and prefix + gap > target:
                continue
            for option, profile in profiles.items():
                transient = profile.transient[k]
                if transient is not None and prefix + transient > target:
                    continue
                grown.append((prefix + profile.saved[k], cost + profile.recompute[k], (*choice, option)))
        front = _pareto(grown)
        if not front:
            return None
    gap = gaps.get(count, 0)
    feasible = [row for row in front if row[0] + gap <= target]
    if not feasible:
        return None
    return min(feasible, key=lambda row: (row[1], row[0]))[2]


def _pareto(rows: list[tuple[int, float, tuple[str, ...]]]) -> list[tuple[int, float, tuple[str, ...]]]:
    """The rows no other row beats in both bytes saved and time."""
    rows.sort(key=lambda row: (row[0], row[1]))
    kept = []
    for row in rows:
        if not kept or row[1] < kept[-1][1]:
            kept.append(row)
    return kept
