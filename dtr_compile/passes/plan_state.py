"""`PlanState`: one plan of the planner's search with the schedule it implies and that schedule's simulation.

Its own module because two planners build and compare them: the greedy search (planner.py) and the chain
planner (chain_plan.py), which the greedy search starts from. Both import it from here, so that neither has to
import the other's internals (issue 18: no import circles).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from .schedule import Simulation, Trace


@dataclass
class PlanState:
    dropped: frozenset[fx.Node]  # forward values the forward does not save
    forget: frozenset[tuple[fx.Node, int]]  # (value, i): its recomputed copy is given up before backward op i
    trace: Trace  # the schedule the plan implies
    sim: Simulation  # its exact memory simulation
    hoist: frozenset[tuple[fx.Node, int]] = frozenset()  # (value, i): recomputed before backward op i, earlier

    @property
    def peak(self) -> int:
        return self.sim.peak

    def area_above(self, level: float) -> int:
        return sum(m - level for m in self.sim.timeline if m > level)
