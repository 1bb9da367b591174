"""An exact oracle for small joint graphs: the least recompute time under a memory budget, by integer programming.

    optimum = solve_ilp(joint, budget_bytes, num_fwd_outputs=n)      # None when no plan fits
    peak = plan_peak(joint, plan, num_fwd_outputs=n)                 # a planner's plan, in the ILP's model

Why: the planner (planner.py, paging.py) is a greedy search; this says how far from the best plan it lands.
It is Checkmate's formulation (Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
Rematerialization", MLSys 2020) with the schedule fixed as the planner fixes it: the forward runs as traced
and computes every value once, the backward runs its ops in graph order, and before backward op t (stage t)
any recomputable forward value may be computed again. Solved by HiGHS (`scipy.optimize.milp`); meant for
graphs of tens of nodes (tests), not for compiling.

Variables (k: a counted storage of a forward op, j: a recomputable forward op, s: a slot of stage t, i.e. the
recomputable forward ops in forward order, then the backward op):
    keep[k]        binary: the forward keeps k alive into the backward
    R[t, j]        binary: stage t recomputes j (at j's slot)
    S[t, k]        in [0, 1]: k is alive when stage t begins (S[0] = keep)
    L[t, k, s]     in [0, 1]: k is alive at slot s of stage t
Constraints: a value read at a slot is alive there (the backward op's forward inputs, a recompute's inputs);
alive only if alive at the previous slot (or the stage's start) or produced at this slot; alive at the next
stage's start only if alive at the end of this one. The liveness variables need not be integral: given the
binaries, every read forces its value's liveness to 1 back to where it was produced.
Memory, with the accounting of `peak.schedule_peak` (exact model: every value allocated where its op runs,
inputs and outputs of the running op live together, its workspace while it runs, forward outputs and
gradients to the end of the step, tangents from the backward's start to their last use):
    forward op i:  fixed memory of the traced forward at i + sum of kept k whose forward life ended before i
    slot s of t:   fixed memory of the backward's own values and tangents + sum of alive k (+ workspace)
    the boundary:  the forward outputs and the loss's tail, tangents included (storage.Tail) + sum of kept k
each <= the budget. Objective: the sum of R[t, j] x the modelled time of j.

This space contains every plan the planner can make (it saves, drops, recomputes before a backward op and
frees at last use), and more: it may keep a forward value the backward does not read, to recompute others
from it (as PyTorch's min-cut partition does). So its optimum is a lower bound on the planner's recompute time.
Random ops (whose recompute replays a saved generator state) are not modelled: a graph with a recomputable
random op is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import fx

from .schedule import JointFacts
from .storage import StorageKey, assumed_tail, let_go_keys

__all__ = ["IlpSolution", "plan_peak", "solve_ilp"]


@dataclass(frozen=True)
class IlpSolution:
    recompute_s: float  # the optimum: modelled time of all recomputations
    peak_bytes: int  # the peak of the optimal plan in the ILP's memory model
    kept: frozenset[str]  # names of the forward ops whose storages the forward keeps for the backward
    recomputes: tuple[tuple[int, str], ...]  # (backward op index, forward op name) of each recompute


class _Model:
    """Variables and constraint rows of the ILP for one joint graph, before a budget is chosen."""

    def __init__(self, facts: JointFacts) -> None:
        self.facts = facts
        forward = [n for n in facts.forward if n.op == "call_function"]
        self.fpos = {n: i for i, n in enumerate(forward)}
        self.backward = list(facts.backward)
        nbytes = facts.nbytes
        pinned = facts.pinned_forward
        for node in forward:
            if facts.cost[node].recomputable and facts.cost[node].needs_rng_replay:
                raise ValueError(f"the ILP does not model random ops: {node.format_node()}")
        # Counted storages of forward ops that are not forward outputs: the ones a plan keeps or frees.
        self.keys: list[StorageKey] = [k for n in forward for k in facts.own[n] if nbytes[k] > 0 and k not in pinned]
        self.kindex = {k: i for i, k in enumerate(self.keys)}
        self.rc = [n for n in forward if facts.cost[n].recomputable and any(k in self.kindex for k in facts.own[n])]
        self.rindex = {n: i for i, n in enumerate(self.rc)}
        T, K, J = len(self.backward), len(self.keys), len(self.rc)
        self.T, self.K, self.J, self.slots = T, K, J, J + 1
        # Variable layout: keep[K] | R[T*J] | S[T*K] (S[0] unused: keep) | L[T*K*slots]
        self.o_keep, self.o_r = 0, K
        self.o_s = self.o_r + T * J
        self.o_l = self.o_s + T * K
        self.nvars = self.o_l + T * K * self.slots
        self._fixed_memory(forward)

    def r(self, t: int, j: int) -> int:
        return self.o_r + t * self.J + j

    def s(self, t: int, k: int) -> int:
        return self.o_keep + k if t == 0 else self.o_s + t * self.K + k

    def l(self, t: int, k: int, slot: int) -> int:
        return self.o_l + (t * self.K + k) * self.slots + slot

    def read_keys(self, node: fx.Node) -> list[int]:
        """The planned storages `node` reads (through views)."""
        found = {self.kindex[k] for a in self.facts.inputs[node] for k in self.facts.keys[a] if k in self.kindex}
        return sorted(found)

    def _fixed_memory(self, forward: list[fx.Node]) -> None:
        """Bytes every plan holds at each forward op and each backward slot, and the forward lives of the keys."""
        facts, nbytes = self.facts, self.facts.nbytes
        pinned = facts.pinned_forward
        produced: dict[StorageKey, int] = {}
        last: dict[StorageKey, int] = {}
        for i, node in enumerate(forward):
            for k in facts.own[node]:
                produced[k] = i
                last[k] = i
            for a in facts.inputs[node]:
                for k in facts.keys[a]:
                    if k in produced:
                        last[k] = i
        self.forward_end = {k: last[k] for k in self.keys}  # after this forward op, an unkept key is freed
        fixed_fwd = []
        for i, node in enumerate(forward):
            live = sum(nbytes[k] for k in produced if nbytes[k] and produced[k] <= i and (k in pinned or i <= last[k]))
            own = any(k[0] is node for k in facts.own[node])
            fixed_fwd.append(live + (facts.cost[node].workspace_bytes if own else 0))
        self.fixed_fwd = fixed_fwd
        self.forward_nodes = forward
        # Backward: forward outputs (forever), tangents (to their last read, or forever if unread), and the
        # backward's own storages (from their op to their last read; gradients forever).
        T = self.T
        forever = {k for o in facts.bwd_outputs for k in facts.keys[o]}
        pinned_bytes = sum(nbytes[k] for k in pinned)
        last_read: dict[StorageKey, int] = {}
        for t, node in enumerate(self.backward):
            for a in facts.inputs[node]:
                for k in facts.keys[a]:
                    last_read[k] = t
        start: dict[StorageKey, int] = {}
        end: dict[StorageKey, int] = {}
        for tangent in facts.tangents:
            for k in facts.keys[tangent]:
                start[k], end[k] = -1, last_read.get(k, T)
        for t, node in enumerate(self.backward):
            for k in facts.own[node]:
                start[k], end[k] = t, T if k in forever else max(t, last_read.get(k, t))
        tangent_keys = {k for tangent in facts.tangents for k in facts.keys[tangent]}
        tangent_bytes = sum(nbytes[k] for k in tangent_keys)
        # Between forward and backward: the outputs and the code there, its tangents included (storage.Tail);
        # from the backward's start, what that code still holds beyond the tangents (outputs let go: negative).
        tail = assumed_tail(facts.tangents, tangent_bytes)
        self.fixed_boundary = pinned_bytes + tail.peak_bytes
        held = pinned_bytes + tail.at_backward_bytes - tangent_bytes
        # Outputs the program let go before the backward, where the backward does not read them.
        for k in let_go_keys(tail, facts.output_args, facts.num_fwd_outputs, facts.keys):
            if k in pinned and k not in last_read:
                held -= nbytes[k]
        self.fixed_rc = [held] * T  # at the recompute slots of stage t
        self.fixed_b = [held] * T  # at backward op t
        for k, s in start.items():
            for t in range(max(s, 0), T):
                if t > end[k]:
                    break
                if s < t or s < 0:
                    self.fixed_rc[t] += nbytes[k]
                self.fixed_b[t] += nbytes[k]
        self.workspace_b = [
            facts.cost[n].workspace_bytes if any(k[0] is n for k in facts.own[n]) else 0 for n in self.backward
        ]

    def rows(self) -> tuple[list[tuple[dict[int, float], float]], list[tuple[dict[int, float], float]]]:
        """(liveness rows: coefficients <= rhs, memory rows: coefficients <= budget - rhs)."""
        facts, T, J = self.facts, self.T, self.J
        live: list[tuple[dict[int, float], float]] = []
        memory: list[tuple[dict[int, float], float]] = []
        nbytes = [facts.nbytes[k] for k in self.keys]
        owner_slot = [self.rindex.get(k[0]) for k in self.keys]
        for i, fixed in enumerate(self.fixed_fwd):  # forward op i: kept keys whose forward life ended
            coefficients = {self.s(0, k): float(nbytes[k]) for k in range(self.K) if self.forward_end[self.keys[k]] < i}
            memory.append((coefficients, fixed))
        # The boundary between forward and backward: every kept key, the outputs, tangents and the loss's tail.
        memory.append(({self.s(0, k): float(nbytes[k]) for k in range(self.K)}, self.fixed_boundary))
        reads = [self.read_keys(n) for n in self.rc]
        for t in range(T):
            for k in range(self.K):
                own = owner_slot[k]
                for slot in range(self.slots):
                    row = {self.l(t, k, slot): 1.0}
                    if slot == 0:
                        row[self.s(t, k)] = -1.0
                    else:
                        row[self.l(t, k, slot - 1)] = -1.0
                    if own == slot:
                        row[self.r(t, own)] = -1.0
                    live.append((row, 0.0))
                if own is not None:
                    live.append(({self.r(t, own): 1.0, self.l(t, k, own): -1.0}, 0.0))
                if t + 1 < T:
                    live.append(({self.s(t + 1, k): 1.0, self.l(t, k, J): -1.0}, 0.0))
            for j, keys in enumerate(reads):
                for k in keys:
                    live.append(({self.r(t, j): 1.0, self.l(t, k, j): -1.0}, 0.0))
            for slot in range(self.slots):
                row = {self.l(t, k, slot): float(nbytes[k]) for k in range(self.K)}
                if slot < J:
                    row[self.r(t, slot)] = float(facts.cost[self.rc[slot]].workspace_bytes)
                    memory.append((row, self.fixed_rc[t]))
                else:
                    memory.append((row, self.fixed_b[t] + self.workspace_b[t]))
        return live, memory

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Variable bounds: the forward storages each backward op reads are alive at its slot."""
        lower, upper = np.zeros(self.nvars), np.ones(self.nvars)
        for t, node in enumerate(self.backward):
            for k in self.read_keys(node):
                lower[self.l(t, k, self.J)] = 1.0
        return lower, upper


def _solve(
    model: _Model,
    budget_bytes: int | None,
    fixed: dict[int, float] | None = None,
    time_limit_s: float = 120.0,
) -> tuple[np.ndarray, float] | None:
    """Solve the ILP (budget given: least recompute time) or the LP of the least peak with the binaries in
    `fixed` (budget None: minimize the peak). Returns (solution, objective) or None when infeasible."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    live, memory = model.rows()
    peak_var = model.nvars if budget_bytes is None else None
    nvars = model.nvars + (1 if peak_var is not None else 0)
    data, rows, cols, upper_rhs = [], [], [], []
    for index, (row, rhs) in enumerate(live):
        for col, value in row.items():
            rows.append(index), cols.append(col), data.append(value)
        upper_rhs.append(rhs)
    for offset, (row, fixed_bytes) in enumerate(memory):
        index = len(live) + offset
        for col, value in row.items():
            rows.append(index), cols.append(col), data.append(value)
        if peak_var is None:
            upper_rhs.append(float(budget_bytes - fixed_bytes))
        else:
            rows.append(index), cols.append(peak_var), data.append(-1.0)
            upper_rhs.append(float(-fixed_bytes))
    matrix = coo_matrix((data, (rows, cols)), shape=(len(upper_rhs), nvars)).tocsr()
    lower, upper = model.bounds()
    cost = np.zeros(nvars)
    integrality = np.zeros(nvars)
    integrality[: model.o_s] = 1  # keep and R
    if peak_var is None:
        for t in range(model.T):
            for j, node in enumerate(model.rc):
                cost[model.r(t, j)] = model.facts.cost[node].time_s
    else:
        lower, upper = np.append(lower, 0.0), np.append(upper, np.inf)
        cost[peak_var] = 1.0
    for col, value in (fixed or {}).items():
        lower[col] = upper[col] = value
    if peak_var is not None:
        integrality[:] = 0  # the binaries are fixed: an LP
    result = milp(
        cost,
        integrality=integrality,
        bounds=Bounds(lower, upper),
        constraints=LinearConstraint(matrix, -np.inf, np.array(upper_rhs)),
        options={"time_limit": time_limit_s, "mip_rel_gap": 1e-9},
    )
    if result.x is None:
        return None
    if result.status not in (0,):
        raise RuntimeError(f"HiGHS did not prove optimality: {result.message}")
    return result.x, float(result.fun)


def _peak_of(model: _Model, binaries: dict[int, float]) -> int:
    solved = _solve(model, None, binaries)
    if solved is None:
        raise ValueError("the plan reads a value it neither keeps nor recomputes")
    return round(solved[1])


def solve_ilp(
    joint: fx.GraphModule, budget_bytes: int, *, num_fwd_outputs: int, time_limit_s: float = 120.0
) -> IlpSolution | None:
    """The least modelled recompute time of a plan whose modelled peak is within `budget_bytes` (None: none is).

    `joint` carries the cost pass's records (`annotate_costs`, as `plan_joint` leaves it)."""
    model = _Model(JointFacts(joint, num_fwd_outputs))
    solved = _solve(model, budget_bytes, time_limit_s=time_limit_s)
    if solved is None:
        return None
    x, objective = solved
    binaries = {i: float(round(x[i])) for i in range(model.o_s)}
    kept = frozenset(model.keys[k][0].name for k in range(model.K) if binaries[model.s(0, k)] > 0.5)
    recomputes = tuple(
        (t, model.rc[j].name) for t in range(model.T) for j in range(model.J) if binaries[model.r(t, j)] > 0.5
    )
    return IlpSolution(objective, _peak_of(model, binaries), kept, recomputes)


def plan_peak(joint: fx.GraphModule, trace: list, boundary: int, *, num_fwd_outputs: int) -> int:
    """The peak of a planner's schedule (`Plan.trace`, `Plan.boundary`) in the ILP's memory model: the same
    keep and recompute decisions, every storage freed after its last use."""
    model = _Model(JointFacts(joint, num_fwd_outputs))
    facts = model.facts
    binaries = {i: 0.0 for i in range(model.o_s)}
    stage_of_op = {}
    t = len(model.backward)
    for position in range(len(trace) - 1, boundary - 1, -1):  # a recompute belongs to the next backward op
        op = trace[position]
        if op.version == 0:
            t = model.backward.index(op.node)
        elif t >= len(model.backward):
            raise ValueError("the ILP does not model recomputes after the last backward op")
        stage_of_op[position] = t
    for position in range(boundary, len(trace)):
        op = trace[position]
        if op.version > 0 and op.node in model.rindex:
            binaries[model.r(stage_of_op[position], model.rindex[op.node])] = 1.0
        for arg, version in op.arg_versions:
            if version == 0 and arg in facts.is_forward:
                for k in facts.keys[arg]:
                    if k in model.kindex:
                        binaries[model.s(0, model.kindex[k])] = 1.0
    return _peak_of(model, binaries)
