"""A lower bound on the recompute that any eviction policy needs to replay a trace under a budget.

The replay fails as "thrash" when its recompute exceeds the thrash limit (1 x the original compute C), so a
budget whose least possible recompute exceeds that limit fails for every policy, online or planned.

Proof sketch (why `RecomputeBound.min_recompute` is a lower bound)
-------------------------------------------------------------------
Positions: the trace's operations in order, 0..n-1, then END (n), where the outputs still alive are pinned.
Take any policy that replays the trace under the budget B, and one non-constant storage u (a view shares its
storage's key, so it is not a storage of its own). Its producer p made it at position a_0; the program reads it
at a_1 < a_2 < ... (and at END if it is alive at the end). Each gap (a_k, a_k+1) with at least one position
strictly inside is an *interval* i of u, of s_i = bytes of u.

(1) Restores. If u is not resident at some moment inside interval i (after op a_k ends, before op a_k+1
    starts), it must be resident again when op a_k+1 reads it, and the only way back is to rerun p: at
    least one rerun of p happens inside interval i. Let x_i = 1 then, else 0. The intervals of u are disjoint
    in time, so p is rerun at least sum_{i of u} x_i times, for each output u of p (one rerun of a
    multi-output op restores all its outputs, hence "for each output", not a sum over outputs). A rerun of
    p costs p's logged time c_p (the engine charges exactly that; the views it re-runs and the reruns of p's
    own evicted inputs only add more). So the recompute R of the policy satisfies
        R >= sum_p c_p r_p,  for r_p = the reruns of p >= sum_{i of u} x_i, for every output u of p.
(2) Memory. While op t runs, the resident storages include: the constants created so far (pinned), the
    distinct inputs of t and its outputs (together F_t bytes: the engine makes them resident at once), and
    every u with an interval i strictly around t and x_i = 0 (resident throughout i). These sets are
    disjoint (an input of t ends its intervals at t, an output of t starts them at t), so
        sum_{i around t} s_i (1 - x_i) + F_t <= B,  i.e.  sum_{i around t} s_i x_i >= L_t + F_t - B =: b_t,
    with L_t = sum_{i around t} s_i. (b_t > L_t means F_t > B: the memory bound of bounds.py.)
So the policy's (x, r) is feasible for the LP
    min sum_p c_p r_p  s.t.  (2) at every t,  r_p >= sum_{i of u} x_i for every output u of p,  0 <= x <= 1,
and its recompute is at least the LP optimum. The LP leaves out what makes real schedules costlier (a rerun
needs its own inputs resident, which may take more reruns and memory; x_i = 1 frees u's bytes over the whole
interval), so it can be far below the best policy, but never above it.

Certificate. The solver's optimum is not taken on trust: from its dual values we take lambda_t >= 0 (for (2))
and mu_u >= 0 (for (1)), scale the mu of each op down until sum_{u out of p} mu_u <= c_p, and set
z_i = max(0, s_i Lambda_i - mu_u), Lambda_i = sum_{t around i} lambda_t. Then for every feasible (x, r):
    sum_t lambda_t b_t - sum_i z_i <= sum_i x_i s_i Lambda_i - sum_i z_i  <= sum_i x_i mu_u(i)
                                   <= sum_p r_p sum_{u out of p} mu_u     <= sum_p c_p r_p
(using x <= 1, mu >= 0), so that value, computed here from the trace's own numbers, is the bound whatever the
solver's accuracy (a relative 1e-9 is taken off for floating-point rounding).

Solving: (2) is written as a running sum y_t = y_t-1 + (bytes of intervals that start covering t) - (those
that stop), y_t >= max(0, b_t), so the LP has O(intervals + n) nonzeros; HiGHS (through scipy) solves the
logs of shared/dtr-logs in 0.01-0.2 s each.
"""

from __future__ import annotations

import math
from itertools import accumulate, pairwise

import numpy as np

from .schedule import Schedule

# Taken off the certified value, relative to its size, for floating-point rounding in the certificate.
_ROUNDING_MARGIN = 1e-9


class RecomputeBound:
    """The LP above for one trace; `min_recompute(budget)` solves it for one budget."""

    def __init__(self, sched: Schedule) -> None:
        n = len(sched.ops)
        self.positions = n
        producer: dict[int, int] = {}
        for t, op in enumerate(sched.ops):
            for key in op.outputs:
                producer[key] = t
        reads: dict[int, list[int]] = {key: [t] for key, t in producer.items()}  # creation, then reads
        for t, op in enumerate(sched.ops):
            for key in dict.fromkeys(op.inputs):
                if not sched.constant[key]:
                    reads[key].append(t)
        for key in sched.final_live:
            if not sched.constant[key]:
                reads[key].append(n)

        # Intervals: (storage, a, b) for consecutive positions a < b with something strictly between.
        keys, starts, ends = [], [], []
        for key, pos in reads.items():
            for a, b in pairwise(pos):
                if b > a + 1:
                    keys.append(key)
                    starts.append(a)
                    ends.append(b)
        self.interval_key = np.array(keys, dtype=np.int64)
        self.interval_start = np.array(starts, dtype=np.int64)
        self.interval_end = np.array(ends, dtype=np.int64)
        self.interval_bytes = np.array([sched.sizes[k] for k in keys], dtype=np.int64)

        # F_t: constants created so far + the op's distinct non-constant inputs + its outputs (as bounds.py).
        constant_prefix = [0, *accumulate(size if const else 0 for size, const in zip(sched.sizes, sched.constant))]
        self.required = np.array(
            [
                constant_prefix[op.created_before]
                + sum(sched.sizes[k] for k in set(op.inputs) if not sched.constant[k])
                + sum(sched.sizes[k] for k in op.outputs)
                for op in sched.ops
            ],
            dtype=np.int64,
        )
        end_bytes = constant_prefix[-1] + sum(sched.sizes[k] for k in sched.final_live if not sched.constant[k])
        self.memory_floor = max(int(self.required.max(initial=0)), end_bytes)

        # L_t: bytes of the intervals strictly around t.
        diff = np.zeros(n + 1, dtype=np.int64)
        np.add.at(diff, self.interval_start + 1, self.interval_bytes)
        np.add.at(diff, self.interval_end, -self.interval_bytes)
        self.around = np.cumsum(diff)[:n]

        # Restore rows: one per storage with intervals, and one r column per op producing such a storage.
        row_keys = sorted(set(keys))
        self.interval_row = np.searchsorted(np.array(row_keys, dtype=np.int64), self.interval_key)
        ops = sorted({producer[k] for k in row_keys})
        op_column = {t: j for j, t in enumerate(ops)}
        self.row_op = np.array([op_column[producer[k]] for k in row_keys], dtype=np.int64)
        self.op_cost = np.array([sched.ops[t].time for t in ops], dtype=float)
        self._lp = None

    def min_recompute(self, budget_bytes: int) -> float:
        """A lower bound (ns) on the recompute any policy needs under `budget_bytes`; math.inf below the memory
        floor (no policy fits at all), 0.0 when nothing has to be evicted."""
        if budget_bytes < self.memory_floor:
            return math.inf
        need = self.around + self.required - budget_bytes  # b_t
        if self.positions == 0 or need.max() <= 0 or not self.op_cost.any():
            return 0.0
        return self._certified(np.maximum(need, 0))

    # ---------------------------------------------------------------------------------------- the LP

    def _build(self):
        from scipy import sparse

        m, n, rows, ops = len(self.interval_key), self.positions, len(self.row_op), len(self.op_cost)
        self.size_scale = float(max(1, self.interval_bytes.max(initial=1)))
        self.time_scale = float(max(1.0, self.op_cost.max(initial=1.0)))
        sizes = self.interval_bytes / self.size_scale
        x_cols, r_cols, y_cols = np.arange(m), m + np.arange(ops), m + ops + np.arange(n)
        # Running sum: y_t - y_t-1 - (intervals starting to cover t) + (intervals ending at t) = 0.
        ends_inside = self.interval_end < n
        eq_rows = np.concatenate(
            [np.arange(n), np.arange(1, n), self.interval_start + 1, self.interval_end[ends_inside]]
        )
        eq_cols = np.concatenate([y_cols, y_cols[:-1], x_cols, x_cols[ends_inside]])
        eq_vals = np.concatenate([np.ones(n), -np.ones(n - 1), -sizes, sizes[ends_inside]])
        a_eq = sparse.csr_matrix((eq_vals, (eq_rows, eq_cols)), shape=(n, m + ops + n))
        # Restores: sum_{i of u} x_i - r_p <= 0.
        ub_rows = np.concatenate([self.interval_row, np.arange(rows)])
        ub_cols = np.concatenate([x_cols, r_cols[self.row_op]])
        ub_vals = np.concatenate([np.ones(m), -np.ones(rows)])
        a_ub = sparse.csr_matrix((ub_vals, (ub_rows, ub_cols)), shape=(rows, m + ops + n))
        cost = np.concatenate([np.zeros(m), self.op_cost / self.time_scale, np.zeros(n)])
        self._lp = (cost, a_ub, a_eq, sizes, y_cols)
        return self._lp

    def _certified(self, need: np.ndarray) -> float:
        from scipy.optimize import linprog

        cost, a_ub, a_eq, sizes, y_cols = self._lp or self._build()
        m, ops, n = len(sizes), len(self.op_cost), self.positions
        b = need / self.size_scale
        lower = np.concatenate([np.zeros(m + ops), b])
        upper = np.concatenate([np.ones(m), np.full(ops + n, np.inf)])
        res = linprog(
            cost,
            A_ub=a_ub,
            b_ub=np.zeros(a_ub.shape[0]),
            A_eq=a_eq,
            b_eq=np.zeros(n),
            bounds=np.stack([lower, upper], axis=1),
            method="highs",
        )
        if res.status != 0:
            raise RuntimeError(f"the recompute lower bound's LP was not solved ({res.message}); this is a bug")
        lam = np.maximum(res.lower.marginals[y_cols], 0.0)
        mu = np.maximum(-res.ineqlin.marginals, 0.0)
        # Each op's mu may not exceed its cost: scale down where the solver's rounding makes them do so.
        per_op = np.zeros(ops)
        np.add.at(per_op, self.row_op, mu)
        limit = self.op_cost / self.time_scale
        factor = np.where(per_op > limit, limit / np.where(per_op > 0, per_op, 1.0), 1.0)
        mu = mu * factor[self.row_op]
        prefix = np.concatenate([[0.0], np.cumsum(lam)])
        around = prefix[self.interval_end] - prefix[self.interval_start + 1]  # Lambda_i
        z = np.maximum(sizes * around - mu[self.interval_row], 0.0)
        gain = float(lam @ b)
        value = gain - float(z.sum()) - _ROUNDING_MARGIN * (gain + float(z.sum()))
        return max(0.0, value) * self.time_scale
