"""The planner: what the forward saves, what the backward recomputes, and where each recompute runs.

Reformulation. A plan is (1) the set of forward values the forward does *not* save (dropped) and (2) the
recomputed values the backward gives up between two uses (split). The schedule follows from them
(schedule.py): a dropped value is freed after its last forward use and recomputed in the backward right
before the first op that needs it, from saved values, then freed after its last use, or after its last
use before a split, to be recomputed again for the next one. So the planner searches over plans, and
each candidate is judged by the exact peak of the schedule it implies (`schedule.simulate`, which
agrees byte for byte with the model of the emitted graph in peak.py), not by a proxy such as saved
bytes. This is offline DTR: every recomputation is known in advance and placed where it is needed.

When the graph is a chain of repeated blocks (blocks.py: transformer layers, ResNet blocks, found from Dynamo's
module paths), the plan starts from the chain planner (chain_plan.py): per block one of a few options (save,
min-cut's, selective checkpointing, full checkpointing), chosen together by dynamic programming at the least
recompute time and checked by the exact simulation. The greedy search below runs only when no combination of
block options meets the budget (then from the all-checkpoint plan, whose peak is the smallest budget the block
options meet), or alongside on small graphs, where it is cheap and may beat coarse block options.

The search is greedy and follows the peak down:

    simulate the current plan; while its peak is above the budget:
        at the op where the peak occurs, list the decisions that lower memory there:
          drop a saved value that is live there only because it is saved (its last forward use is
          behind, its first backward use ahead), or
          split a recomputed value that is live there between two uses;
        rank them by recompute cost / bytes freed, where the cost counts every value that would have to
        be recomputed with them (values already recomputed for another reason are free);
        apply the cheapest ones until about 1% of the peak is freed, and keep the change if the peak (or,
        at equal peak, the memory above 97% of it) went down; otherwise try the cheapest one alone, and
        if that does not help either, never try it again.

When no single move lowers the peak any more, a second phase goes on with compound moves: a drop together
with giving up, right after its recompute, the dropped ancestors it pulls back (`_compound_drop`), optionally
with its burst run a few backward ops earlier, where less is live; and, when nothing else is left, the burst
at the peak run earlier (`_hoisted`). On a chain of Linear+ReLU layers single moves stopped at 0.81 of
no-remat and the second phase reaches the exact ILP optimum's 0.63 (tests/passes/test_ilp_oracle.py).

Once the budget is met, `fill` spends what is left of it: dropped values are saved again, dearest recompute per
byte first, while the plan still fits and recomputes less (the search starts from PyTorch's min-cut partition,
whose recomputes of cheap values are not needed under a loose budget; tests/passes/test_ilp_oracle.py compares
the result with an exact ILP).

The search's steps do not depend on the budget, only on the plan so far: a tighter budget continues the
same path further, and the lowest peak on the path is the smallest budget this planner can meet (named by
the BudgetError for a budget below it). (`fill` depends on the budget: it only keeps the peak within it.)
Values the cost pass marks non-recomputable are always saved; random ops are recomputed with their RNG
state replayed (rewrite.py).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import fx

from .blocks import Block, boundaries, find_chain, sac_saves
from .chain_plan import plan_chain
from .plan_state import PlanState
from .schedule import Emitted, Infeasible, JointFacts, Simulation, Trace, Version, build_trace, simulate

__all__ = ["Emitted", "Plan", "Version", "plan_schedule"]

STEP_FRACTION = 0.02  # each step of the search frees about this fraction of the current peak
AREA_FRACTION = 0.97  # at equal peak, a step must lower the memory above this fraction of the peak
GREEDY_ALONGSIDE = 100  # with a chain, the greedy search also runs on graphs with at most this many candidates
FILL_PATIENCE = 32  # fill stops after this many rejections in a row (see _fill_pass)
HOIST_REACH = 4  # a recompute burst may move up to this many allocating backward ops earlier


@dataclass
class Plan:
    budget_bytes: int | None
    trace: list[Emitted]
    boundary: int  # trace[:boundary] is the forward, trace[boundary:] the backward
    fwd_versions: dict[fx.Node, Version]  # versions read by the forward outputs
    final_versions: dict[fx.Node, Version]  # versions read by the backward outputs
    replay_peak_bytes: int  # the planner's simulated peak (equal to peak.schedule_peak of the emitted graph)
    fits: bool  # the plan's peak is within the budget
    recompute_s: float  # modelled time of all recomputations
    compute_s: float  # modelled time of the original schedule
    evictions: list[tuple[fx.Node, int]] = field(default_factory=list)  # (dropped value, its forward position)
    planning_s: float = 0.0
    smallest_peak_bytes: int = 0  # the lowest peak the search reached (the smallest feasible budget)
    dropped: frozenset[fx.Node] = frozenset()
    block_options: tuple[str, ...] | None = None  # the chain planner's option per block (None: not used)


Decision = tuple[str, fx.Node, int]  # ("drop", value, 0) or ("split", value, backward op index)


class _Search:
    def __init__(self, facts: JointFacts, initial: frozenset[fx.Node], inductor: bool | str) -> None:
        self.facts = facts
        self.inductor = inductor
        self.position = facts.position
        self.banned: set[Decision] = set()
        self.compound = False  # second phase of the search: compound drops and earlier bursts (see run)
        self._suffix_cache: tuple[Simulation, list[int]] | None = None  # see _forward_suffix_max
        state = self.evaluate(initial, frozenset())
        if state is None:
            raise ValueError("the starting partition needs a value that cannot be recomputed")
        self.state = self.best = state

    def evaluate(
        self,
        dropped: frozenset[fx.Node],
        forget: frozenset[tuple[fx.Node, int]],
        hoist: frozenset[tuple[fx.Node, int]] = frozenset(),
        *,
        fitting: tuple[int, float] | None = None,
    ) -> PlanState | None:
        """The state of a plan; None when it is infeasible or, with `fitting` = (budget, recompute time), when
        it recomputes no less or its peak is above the budget (judged without simulating past the first op
        above it: fill rejects most of its candidates, 97% on the LSTM graphs of tests/e2e/test_handoff.py)."""
        try:
            trace = build_trace(self.facts, set(dropped), forget, hoist)
        except Infeasible:
            return None
        if fitting is None:
            return PlanState(dropped, forget, trace, simulate(self.facts, trace, inductor=self.inductor), hoist)
        budget, recompute_s = fitting
        if trace.recompute_s >= recompute_s:
            return None
        sim = simulate(self.facts, trace, inductor=self.inductor, limit=budget)
        return PlanState(dropped, forget, trace, sim, hoist) if sim.complete and sim.peak <= budget else None

    def _apply(self, state: PlanState, decisions: list[Decision]) -> PlanState | None:
        dropped = set(state.dropped)
        forget = set(state.forget)
        hoist = set(state.hoist)
        for kind, node, index in decisions:
            if kind == "drop":
                dropped.add(node)
            elif kind == "hoist":
                hoist.add((node, index))
            else:
                forget.add((node, index))
        return self.evaluate(frozenset(dropped), frozenset(forget), frozenset(hoist))

    def _better(self, new: PlanState | None, old: PlanState) -> bool:
        if new is None:
            return False
        if new.peak != old.peak:
            return new.peak < old.peak
        level = AREA_FRACTION * old.peak
        return new.area_above(level) < old.area_above(level)

    def _candidates(self, state: PlanState) -> list[tuple[float, int, Decision, int]]:
        """(cost per byte, -bytes, decision, bytes) of the decisions that lower memory at the peak."""
        rows = self._drop_candidates(state) + self._split_candidates(state)
        rows.sort(key=lambda row: (row[0], row[1], self.position[row[2][1]], row[2][0], row[2][2]))
        return rows

    def _drop_candidates(self, state: PlanState) -> list[tuple[float, int, Decision, int]]:
        """Saved values live at the peak only because they are saved."""
        facts, sim, at = self.facts, state.sim, state.sim.peak_index
        run_position = sim.run_position
        rows = []
        for node in facts.candidates:
            decision = ("drop", node, 0)
            if node in state.dropped or decision in self.banned:
                continue
            produced = run_position[self.position[node]]
            if produced >= at:
                continue
            freed = 0
            for key in facts.own[node]:
                sim_key = (key, 0)
                if sim_key not in sim.saved or facts.nbytes[key] == 0:
                    continue
                if sim.last_forward_use.get(sim_key, produced) < at < sim.first_read.get(sim_key, at):
                    freed += facts.nbytes[key]
            if freed == 0:
                continue
            cost = self._recompute_cost(node, state.dropped, state.trace)
            if cost is None:
                self.banned.add(decision)
                continue
            rows.append((cost / freed, -freed, decision, freed))
        return rows

    def _split_candidates(self, state: PlanState) -> list[tuple[float, int, Decision, int]]:
        """Recomputed values live at the peak between two uses: recompute them again for the later one."""
        facts, sim, trace, at = self.facts, state.sim, state.trace, state.sim.peak_index
        if at < trace.boundary:
            return []
        freed: dict[Decision, int] = {}
        for key, reads in sim.reads.items():
            (producer, _), version = key
            if version == 0 or sim.allocated.get(key, at) >= at or facts.nbytes[key[0]] == 0:
                continue
            later = bisect.bisect_right(reads, at)
            if later == 0 or later == len(reads) or reads[later - 1] == at:
                continue  # not read before the peak, not read after it, or read by the op at the peak
            index = trace.owner[sim.order[reads[later]] - trace.boundary]
            if index <= trace.owner[sim.order[at] - trace.boundary]:
                continue  # the next read belongs to the same backward op: nothing to split
            decision = ("split", producer, index)
            if decision not in self.banned:
                freed[decision] = freed.get(decision, 0) + facts.nbytes[key[0]]
        rows = []
        for decision, nbytes in freed.items():
            cost = self._recompute_cost(decision[1], state.dropped, trace, fresh=True)
            if cost is None:
                self.banned.add(decision)
                continue
            rows.append((cost / nbytes, -nbytes, decision, nbytes))
        return rows

    def _recompute_cost(
        self, node: fx.Node, dropped: frozenset[fx.Node], trace: Trace, *, fresh: bool = False
    ) -> float | None:
        """Modelled time added by recomputing `node` once more: it and every value it needs that is
        neither saved nor already recomputed (`fresh`: recomputed values are gone too, except `node`'s
        inputs' saved copies). None when one of them cannot be recomputed."""
        facts = self.facts
        cost = 0.0
        seen = {node}
        stack = [node]
        while stack:
            current = stack.pop()
            if not facts.cost[current].recomputable:
                return None
            cost += facts.cost[current].time_s
            for arg in facts.inputs[current]:
                if arg in seen or arg not in facts.is_forward:
                    continue
                if arg in trace.recomputed and not fresh:
                    continue
                if arg not in dropped and _is_saved(facts, arg, dropped):
                    continue
                seen.add(arg)
                stack.append(arg)
        return cost

    def run(self, budget: int) -> PlanState:
        """Apply decisions until the peak is within `budget` or nothing more helps; returns the final state."""
        while self.state.peak > budget:
            rows = self._candidates(self.state)
            if not rows and not self.compound:
                # Single moves are exhausted: go on with compound drops and earlier bursts (a second phase, so
                # that every budget single moves can meet is planned as they plan it).
                self.compound = True
                self.banned.clear()
                continue
            if not rows:
                hoisted = self._hoisted(self.state)
                if hoisted is None:
                    return self.state
                self.state = hoisted
                if hoisted.peak < self.best.peak:
                    self.best = hoisted
                # The schedule moved: decisions that did not help before may help now.
                self.banned = {d for d in self.banned if d[0] == "hoist"}
                continue
            target = max(1, int(STEP_FRACTION * self.state.peak))
            batch, freed = [], 0
            for _, _, decision, nbytes in rows:
                batch.append(decision)
                freed += nbytes
                if freed >= target:
                    break
            new = self._apply(self.state, batch)
            if not self._better(new, self.state) and len(batch) > 1:
                batch = batch[:1]
                new = self._apply(self.state, batch)
            if self.compound and not self._better(new, self.state) and new is not None and batch[0][0] == "drop":
                new = self._compound_drop(batch[0], new)
            if self._better(new, self.state):
                self.state = new
                if new.peak < self.best.peak:
                    self.best = new
            else:
                self.banned.add(batch[0])
        return self.state

    def _compound_drop(self, drop: Decision, dropped: PlanState) -> PlanState | None:
        """A drop that did not lower the peak alone (`dropped`: the plan with it), tried with the moves that
        make it pay: the dropped ancestors its recompute pulls back are given up right after it (their copies
        would otherwise stay alive until their own later uses), and the burst also runs before one of the
        previous backward ops, where less is live. On a Linear+ReLU chain this is what an exact ILP does to
        reach 0.63 of no-remat, where single moves stopped at 0.81. Returns the first that lowers the peak
        (else the last tried)."""
        node, trace = drop[1], dropped.trace
        burst = [
            i for i in range(trace.boundary, len(trace.ops)) if trace.ops[i].node is node and trace.ops[i].is_recompute
        ]
        if not burst:
            return None
        owner = trace.owner[burst[0] - trace.boundary]
        helpers = {
            op.node
            for i, op in enumerate(trace.ops[trace.boundary :], trace.boundary)
            if op.is_recompute and op.node is not node and trace.owner[i - trace.boundary] == owner
        }
        facts = self.facts
        new = None
        for index in [owner] + [i for i in range(owner - 1, -1, -1) if facts.own[facts.backward[i]]][:HOIST_REACH]:
            moves = [drop, *(("split", helper, index + 1) for helper in helpers)]
            if index != owner:
                moves.append(("hoist", node, index))
            new = self._apply(self.state, moves)
            if self._better(new, self.state):
                return new
        return new

    def _hoisted(self, state: PlanState) -> PlanState | None:
        """When no drop or split lowers the peak any more: if the peak is in a backward op's recompute burst,
        or at the op itself, run that burst earlier, before one of the previous backward ops, where less is
        live. (On a Linear+ReLU chain the search stopped at 0.81 of no-remat with the first layer recomputed
        right after a gradient matmul; an exact ILP recomputed it before that matmul.) The first move that
        lowers the peak is taken; None if none does."""
        sim, trace, facts = state.sim, state.trace, self.facts
        at = sim.order[sim.peak_index]
        if at < trace.boundary:
            return None
        owner = trace.owner[at - trace.boundary]
        roots = [
            op.node
            for i, op in enumerate(trace.ops[trace.boundary :], trace.boundary)
            if op.is_recompute and trace.owner[i - trace.boundary] == owner
        ]
        if not roots:
            return None
        earlier = [i for i in range(owner - 1, -1, -1) if facts.own[facts.backward[i]]][:HOIST_REACH]
        for index in earlier:
            decisions = [("hoist", node, index) for node in roots]
            if any(d in self.banned for d in decisions):
                continue
            new = self._apply(state, decisions)
            if self._better(new, state):
                return new
            self.banned.update(decisions)
        return None

    def fill(self, budget: int) -> PlanState:
        """Spend the memory left under `budget` on saving again what is dearest to recompute.

        The search only ever drops values, and it starts from the min-cut partition, which recomputes cheap
        values whatever the budget. Once the budget is met, each split recompute, fewest recomputes first, is
        merged back when the plan then still fits and recomputes less; then each dropped value, dearest recompute
        per byte first, is saved again the same way (an exact ILP found the search recomputing 1.94x the
        optimum's time on a residual block, from min-cut's recomputes alone). Splits first: a split recomputes a
        value once more for each later use, and merging them back is where most of the recompute goes (an
        unrolled LSTM of 3,252 nodes: 586 ms of modelled recompute to 17.9 in 43 tries; saving values again
        first took 207 tries to reach 583, and the splits after it 67 more to reach 21.1)."""
        state = self.state
        splits = sorted(state.forget, key=lambda item: (item[1], self.position[item[0]]))
        state = self._fill_pass(state, splits, budget, lambda s, group: (s.dropped, s.forget - set(group), s.hoist))
        rows = []
        for node in state.dropped:
            freed = sum(self.facts.nbytes[k] for k in self.facts.own[node])
            cost = self._recompute_cost(node, state.dropped, state.trace, fresh=True) or 0.0
            rows.append((-cost / max(freed, 1), self.position[node], node))
        rows.sort(key=lambda row: row[:2])
        state = self._fill_pass(
            state,
            [node for _, _, node in rows],
            budget,
            lambda s, group: (s.dropped - set(group), s.forget, s.hoist),
            self._saved_again_lower_bound,
        )
        self.state = state
        return state

    def _fill_pass(
        self,
        state: PlanState,
        items: list[Any],
        budget: int,
        undo: Callable,
        lower_bound: Callable[[PlanState, list[Any]], int | None] | None = None,
    ) -> PlanState:
        """Undo `items` in order while the plan fits `budget` and recomputes less.

        Each evaluation simulates the whole schedule, so undoing items one by one cost one simulation per
        dropped value: quadratic in the graph, 37 of a 58 s compile on an unrolled LSTM of 1,780 nodes (and
        minutes at 3x the length). Runs of accepted items are undone in growing groups (a prefix of the
        dearest values usually fits together); a rejected group is halved until the item that does not fit is
        found, which is skipped, and the pass goes on at the pace it had (an unrolled LSTM's 351 splits: 86 tries
        where restarting at one item each time took 129). The pass stops after FILL_PATIENCE rejections in a
        row: past that point the budget is spent (on that LSTM, 3 of 77 acceptances came later).
        `lower_bound` (state, group): a peak the plan with `group` undone cannot go below, read off the current
        simulation; a group it puts above the budget is rejected as the simulation would reject it, without
        simulating (a transformer's fill, whose peak is where the loss runs, rejects most groups so)."""
        i, group_size, misses = 0, 1, 0
        pace = 1  # the largest group undone since the last item that did not fit
        bad_end: int | None = None  # a rejected group ended here: the item that does not fit is before it
        while i < len(items) and misses < FILL_PATIENCE:
            group = items[i : i + group_size]
            bound = lower_bound(state, group) if lower_bound is not None else None
            if bound is not None and bound > budget:
                new = None
            else:
                new = self.evaluate(*undo(state, group), fitting=(budget, state.trace.recompute_s))
            if new is not None:
                state, i, misses = new, i + len(group), 0
                pace = max(pace, len(group))
                if bad_end is not None and i < bad_end:
                    group_size = max(1, (bad_end - i) // 2)  # bisect what is left before the rejected group's end
                else:
                    bad_end = None
                    group_size = 2 * len(group)
            elif len(group) > 1:
                bad_end = i + len(group)
                group_size = len(group) // 2
            else:  # this item does not fit: past it, at the pace before it
                i, misses, bad_end = i + 1, misses + 1, None
                group_size, pace = pace, 1
        return state

    def _saved_again_lower_bound(self, state: PlanState, nodes: list[fx.Node]) -> int | None:
        """A peak that `state` with `nodes` saved again cannot go below, from its simulation alone.

        Saving a dropped value again changes nothing in the forward but its lifetime: it stays live from where the
        plan freed it (after its last forward read) to the forward's end, on top of what was live there. So at
        each forward op, and where the forward has returned (the loss's tail, where a transformer's peak
        usually is), the new plan holds at least the old memory plus the bytes of the values saved again that
        are freed before it. None where that does not hold: a value the plan never allocates (Inductor's model
        inlines it into its readers; realized, it may let its own inputs go earlier)."""
        sim = state.sim
        if not sim.complete or sim.boundary == 0:
            return None
        facts = self.facts
        starts: list[tuple[int, int]] = []  # (first forward op that holds it only in the new plan, bytes)
        for node in nodes:
            for key in facts.own[node]:
                nbytes = facts.nbytes.get(key, 0)
                if nbytes == 0 or key in facts.pinned_forward or key in facts.backward_output_keys:
                    continue
                sim_key = (key, 0)
                if sim_key in sim.saved:
                    continue
                allocated = sim.allocated.get(sim_key)
                if allocated is None or allocated >= sim.boundary:
                    return None
                starts.append((max(allocated, sim.last_forward_use.get(sim_key, allocated)) + 1, nbytes))
        if not starts:
            return None
        suffix = self._forward_suffix_max(sim)
        starts.sort()
        # Where the forward has returned, every value saved again is live, the loss's tail on top.
        bound = sim.forward_end_peak + sum(nbytes for _, nbytes in starts)
        added = 0
        for start, nbytes in starts:
            added += nbytes
            if start < sim.boundary:
                bound = max(bound, suffix[start] + added)
        return bound

    def _forward_suffix_max(self, sim: Simulation) -> list[int]:
        """max(sim.timeline[p : sim.boundary]) for every forward position p, for the last simulation asked."""
        cached = self._suffix_cache
        if cached is not None and cached[0] is sim:
            return cached[1]
        boundary = sim.boundary
        suffix = [0] * boundary
        running = 0
        for p in range(boundary - 1, -1, -1):
            running = max(running, sim.timeline[p])
            suffix[p] = running
        self._suffix_cache = (sim, suffix)
        return suffix


def _is_saved(facts: JointFacts, node: fx.Node, dropped: frozenset[fx.Node]) -> bool:
    """True when the backward can read `node` as the forward left it."""
    for key in facts.keys[node]:
        if facts.nbytes.get(key, 0) == 0:
            continue
        if key not in facts.read_by_backward or key[0] in dropped:
            return False
    return True


def plan_schedule(
    gm: fx.GraphModule,
    budget_bytes: int | None,
    *,
    num_fwd_outputs: int,
    keep: frozenset[str] | None = None,
    inductor: bool | str = False,
    fill: bool = True,
) -> Plan:
    """Plan the joint graph `gm` under `budget_bytes` (None: no limit).

    `inductor`: hold the budget with the model of Inductor's memory (pointwise ops inlined into their
    reader allocate nothing, inlining.py) instead of the node-by-node model of plain FX execution.

    `keep`: names of the forward values a starting partition saves; the others start out dropped
    (None: the forward starts out saving everything the backward reads).
    `fill`: spend what the plan leaves of the budget on saving again what is dearest to recompute (`_Search.fill`).
    False for a plan that runs once (the first step's FX code, backend/region.py): its recompute hardly matters,
    and the fill is most of the planning time (on the H100's GPT-2 at checkpointing's peak, 11.3 of 18.8 s).
    The plan may not fit (`plan.fits` is False) when the budget is below what the search can reach;
    `plan.smallest_peak_bytes` then says how low it got.
    """
    start = time.perf_counter()
    with paused_gc():
        return _plan(gm, budget_bytes, num_fwd_outputs, keep, inductor, start, fill)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector. Planning allocates many small objects and frees them by
    reference counting; the collector would walk the whole heap (the graphs, torch) every few hundred
    allocations, which made planning 8x slower."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _plan(
    gm: fx.GraphModule,
    budget_bytes: int | None,
    num_fwd_outputs: int,
    keep: frozenset[str] | None,
    inductor: bool | str,
    start: float,
    fill: bool = True,
) -> Plan:
    facts = JointFacts(gm, num_fwd_outputs)
    blocks = find_chain(facts) if budget_bytes is not None else None
    if blocks is not None:
        facts.allow_saving(boundaries(facts, blocks) | sac_saves(blocks))  # before the start is read off `keep`
    initial = frozenset()
    if keep is not None:  # a value is kept when the partition saves it or a view of it
        kept = {k[0] for n in facts.nodes if n.name in keep for k in facts.keys[n]}
        initial = frozenset(n for n in facts.candidates if n not in kept)
    search = _Search(facts, initial, inductor)
    options = None
    if budget_bytes is None or search.state.peak <= budget_bytes:
        state = search.state
    else:
        state, options = _plan_blocks(search, blocks, budget_bytes)
        if state is not None and fill:
            state = search.fill(budget_bytes)
        small = len(facts.candidates) <= GREEDY_ALONGSIDE
        if state is None or small:
            # No chain, or no combination of block options meets the budget: the greedy search (on a large graph
            # from the all-checkpoint plan, see _plan_blocks). On a small graph it costs milliseconds, starts
            # from the min-cut partition and may beat the block options, which are coarse when a block is one
            # layer (Linear + GELU: its output is the value worth dropping, and every option keeps it;
            # tests/passes/test_ilp_oracle.py): the cheaper plan wins.
            floor = search.best
            greedy = _Search(facts, initial, inductor) if small else search
            other = greedy.run(budget_bytes)
            if other.peak <= budget_bytes and fill:
                other = greedy.fill(budget_bytes)
            if state is None or (other.peak <= budget_bytes and other.trace.recompute_s < state.trace.recompute_s):
                greedy.best = min(greedy.best, floor, key=lambda s: s.peak)
                search, state, options = greedy, other, None
    trace = state.trace
    compute_s = sum(facts.cost[n].time_s for n in facts.forward + facts.backward)
    return Plan(
        budget_bytes=budget_bytes,
        trace=trace.ops,
        boundary=trace.boundary,
        fwd_versions=trace.fwd_versions,
        final_versions=trace.final_versions,
        replay_peak_bytes=state.peak,
        fits=budget_bytes is None or state.peak <= budget_bytes,
        recompute_s=trace.recompute_s,
        compute_s=compute_s,
        evictions=sorted(((n, facts.position[n]) for n in state.dropped), key=lambda e: e[1]),
        planning_s=time.perf_counter() - start,
        smallest_peak_bytes=search.best.peak,
        dropped=state.dropped,
        block_options=options,
    )


def _plan_blocks(
    search: _Search, blocks: list[Block] | None, budget: int
) -> tuple[PlanState | None, tuple[str, ...] | None]:
    """The chain planner's plan (chain_plan.py) when the graph is a chain of blocks and some combination of
    block options meets `budget`; else (None, None), with the search moved to the all-checkpoint plan when
    that lowers its peak, so that the greedy search goes on below checkpointing's floor from there."""
    if blocks is None:
        return None, None
    result = plan_chain(search, blocks, budget)
    floor = result.floor
    if floor is not None and floor.peak < search.best.peak:
        search.best = floor
    if result.state is None:
        if floor is not None and floor.peak < search.state.peak:
            search.state = floor
        return None, None
    search.state = result.state
    return result.state, result.options
