"""The paging planner: the joint schedule replayed as offline DTR, for budgets the search cannot reach.

The search of planner.py recomputes each dropped value at most once per split it chose, and its greedy
path can stop above budgets that a deeper schedule meets (an unrolled LSTM: 0.44 of the no-remat peak,
where recomputing chains again and again reaches 0.3). This planner is the fallback when the search
does not reach the budget.

Write the joint graph as one schedule: every forward node, then every backward node, in graph order.
Replaying that schedule with the whole future known is an offline paging problem: memory holds
storages; a storage is freed right after its last use; before an op allocates, if the resident bytes
would pass the budget, some resident storages are *evicted*; an evicted value that is used again is
*recomputed* from its inputs just before that use (recursively, if an input is gone too) and freed
again after its last use. The replay emits the ops it actually runs: that trace is the plan. A forward
value evicted before the forward ends is not saved; its backward uses read a recomputed copy placed
right before them. This is DTR run offline, with Belady's knowledge of the next use in place of DTR's
staleness:

    score(storage) = recompute cost (own + evicted inputs it would need) / (bytes * steps until next use)

and the lowest score is evicted first: cheap, large values that are not needed for a long time.
Only values the cost pass marks recomputable are evicted; random ops are recomputed with their RNG
state replayed (see rewrite.py). The replay's accounting is an upper bound of the real schedule's
memory (a value may be evicted later than its real last use), so the caller computes the exact peak
again on the emitted graph (`peak.schedule_peak`) and judges the plan by that.
"""

from __future__ import annotations

import bisect
import time

from torch import fx

from .meta import cost_of
from .planner import Plan
from .schedule import Emitted, Version
from .storage import StorageKey, StorageMap

# A plan that runs more than this many times the ops of the original schedule is given up (thrashing).
_MAX_TRACE_FACTOR = 4
# Values smaller than 1/_TINY of the room an op needs are not evicted to make it (see _Replay._make_room).
_TINY = 64


class _Infeasible(Exception):
    pass


class _Replay:
    """State of one replay of the schedule under a budget."""

    def __init__(
        self, gm: fx.GraphModule, budget: int | None, num_fwd_outputs: int, keep: frozenset[str] | None
    ) -> None:
        self.budget = budget
        self.keep = keep
        graph = gm.graph
        self.nodes = list(graph.nodes)
        self.cost = {n: cost_of(n) for n in self.nodes}
        tangents = {n for n in self.nodes if self.cost[n].phase == "tangent"}
        self.storages = StorageMap(graph, counted_inputs=tangents)
        self.schedule = [n for n in self.nodes if self.cost[n].phase in ("forward", "backward")]
        self.position = {n: i for i, n in enumerate(self.schedule)}
        # Uses of each storage, as schedule positions: an op uses the storages of all its inputs.
        self.uses: dict[StorageKey, list[int]] = {}
        for pos, node in enumerate(self.schedule):
            for arg in node.all_input_nodes:
                for key in self.storages.keys[arg]:
                    self.uses.setdefault(key, []).append(pos)
        # Who lives in each storage (to invalidate views when it goes), and who produced it.
        self.aliases: dict[StorageKey, list[fx.Node]] = {}
        for node in self.nodes:
            for key in self.storages.keys[node]:
                self.aliases.setdefault(key, []).append(node)
        output = next(n for n in reversed(self.nodes) if n.op == "output")
        outs = list(output.args[0])
        self.fwd_outputs = [o for o in outs[:num_fwd_outputs] if isinstance(o, fx.Node)]
        self.bwd_outputs = [o for o in outs[num_fwd_outputs:] if isinstance(o, fx.Node)]
        # Outputs stay until the end of the step: the user holds the forward's, autograd the gradients.
        self.pinned = {k for o in self.fwd_outputs + self.bwd_outputs for k in self.storages.keys[o]}
        self.version: dict[fx.Node, Version | None] = {}
        self.next_version: dict[fx.Node, Version] = {}
        self.resident: set[StorageKey] = set()
        self.locks: dict[StorageKey, int] = {}
        self.memory = 0
        self.peak = 0
        self.fits = True
        self.now = 0
        self.trace: list[Emitted] = []
        self.evictions: list[tuple[fx.Node, int]] = []
        self.recompute_s = 0.0
        for node in self.nodes:
            if node.op == "placeholder":
                self.version[node] = 0
                for key in self.storages.keys[node]:
                    if self.cost[node].phase == "primal":
                        self.resident.add(key)

    # ------------------------------------------------------------------------------------ helpers

    def _counted(self, key: StorageKey) -> int:
        info = self.storages.info[key]
        return info.nbytes if info.counted else 0

    def _next_use(self, key: StorageKey) -> int | None:
        uses = self.uses.get(key, ())
        i = bisect.bisect_right(uses, self.now)
        return uses[i] if i < len(uses) else None

    def _lock(self, node: fx.Node, delta: int) -> None:
        for key in self.storages.keys[node]:
            self.locks[key] = self.locks.get(key, 0) + delta

    def _drop(self, key: StorageKey) -> None:
        """Free a storage and invalidate every value that lives in it."""
        if key not in self.resident:
            return
        self.resident.discard(key)
        self.memory -= self._counted(key)
        for node in self.aliases.get(key, ()):
            self.version[node] = None

    # ---------------------------------------------------------------------------------- eviction

    def _victim_score(self, producer: fx.Node, nbytes: int, next_use: int) -> float:
        cost = self.cost[producer].time_s
        for arg in producer.all_input_nodes:  # evicted inputs would have to be recomputed too
            if self.version.get(arg) is None and self.cost[arg].recomputable:
                cost += self.cost[arg].time_s
        return (cost + 1e-9) / (max(nbytes, 1) * max(next_use - self.now, 1))

    def _make_room(self, need: int) -> None:
        if self.budget is None or self.memory + need <= self.budget:
            return
        groups: dict[fx.Node, list[StorageKey]] = {}
        for key in self.resident:
            producer = key[0]
            if self.locks.get(key, 0) or key in self.pinned or not self.storages.info[key].counted:
                continue
            if not self.cost[producer].recomputable:
                continue
            groups.setdefault(producer, []).append(key)
        scored = []
        for producer, keys in groups.items():
            all_keys = [k for k in self.storages.keys[producer] if k[0] is producer]
            if any(k in self.pinned or self.locks.get(k, 0) for k in all_keys):
                continue  # a multi-output op is evicted and recomputed as a whole
            nbytes = sum(self._counted(k) for k in keys)
            uses = [u for u in (self._next_use(k) for k in keys) if u is not None]
            if not uses or nbytes == 0 or nbytes * _TINY < need:
                # Evicting a value this much smaller than the room needed frees nothing that matters, and its
                # recompute can cost a chain: a BatchNorm's running-statistics update (256 bytes), read again
                # by the buffer copy at the end of the forward, pulled a chain of convolutions back, all locked.
                continue
            scored.append((self._victim_score(producer, nbytes, min(uses)), self.position.get(producer, -1), keys))
        scored.sort(key=lambda item: (item[0], item[1]))
        for _, _, keys in scored:
            if self.memory + need <= self.budget:
                return
            for key in keys:
                self._drop(key)
            self.evictions.append((keys[0][0], len(self.trace)))
        if self.memory + need > self.budget:
            self.fits = False

    # ------------------------------------------------------------------------------------- replay

    def _ensure(self, node: fx.Node, depth: int = 0) -> None:
        """Make `node`'s value available, recomputing it (and what it needs) if it was freed."""
        if self.version.get(node) is not None:
            return
        if not self.cost[node].recomputable:
            raise _Infeasible(
                f"value needed again after it was freed, and it cannot be recomputed: {node.format_node()}"
            )
        if depth > 10_000:
            raise _Infeasible(f"recompute chain too deep at {node.format_node()}")
        self._run(node, recompute=True, depth=depth + 1)

    def _run(self, node: fx.Node, *, recompute: bool, depth: int = 0) -> None:
        args = node.all_input_nodes
        for arg in args:  # lock first, so that recomputing one input cannot evict another
            self._lock(arg, +1)
        for arg in args:
            self._ensure(arg, depth)
        own = [k for k in self.storages.keys[node] if k[0] is node]
        need = sum(self._counted(k) for k in own)
        workspace = self.cost[node].workspace_bytes
        self._make_room(need + workspace)
        for key in own:
            self.resident.add(key)
        self.memory += need
        self.peak = max(self.peak, self.memory + workspace)
        version = self.next_version.get(node, 0)
        self.next_version[node] = version + 1
        self.version[node] = version
        self.trace.append(Emitted(node, version, tuple((a, self.version[a]) for a in args)))
        if recompute:
            self.recompute_s += self.cost[node].time_s
            # A budget the replay can only meet by recomputing the same values over and over (each recompute
            # evicting what the next one needs) is treated as infeasible: this bounds planning time, which
            # otherwise grows exponentially along chains, and no such plan would be worth running.
            if len(self.trace) > _MAX_TRACE_FACTOR * len(self.schedule) + 1000:
                raise _Infeasible(f"the replay thrashes under this budget (at {node.format_node()})")
        for arg in args:
            self._lock(arg, -1)
        # Free what nobody needs any more: the inputs after their last use, and outputs nobody reads.
        for arg in (*args, node):
            for key in self.storages.keys[arg]:
                free = key in self.resident and key not in self.pinned and not self.locks.get(key, 0)
                if free and self._next_use(key) is None and self.storages.info[key].counted:
                    self._drop(key)

    def run(self) -> tuple[int, dict[fx.Node, Version]]:
        boundary = None
        fwd_versions: dict[fx.Node, Version] = {}
        for pos, node in enumerate(self.schedule):
            self.now = pos
            if boundary is None and self.cost[node].phase == "backward":
                boundary = len(self.trace)
                fwd_versions = self._snapshot(self.fwd_outputs)
                self._drop_unkept()
            self._run(node, recompute=False)
        if boundary is None:
            boundary = len(self.trace)
            fwd_versions = self._snapshot(self.fwd_outputs)
        return boundary, fwd_versions

    def _drop_unkept(self) -> None:
        """At the end of the forward, drop the recomputable values the starting partition does not save.

        With Inductor the starting partition is its own min-cut, which recomputes cheap pointwise ops
        inside the backward's fused kernels instead of saving them: saving them would cost memory
        traffic and time even with no budget.
        """
        if self.keep is None:
            return
        kept_keys = {k for n in self.nodes if n.name in self.keep for k in self.storages.keys[n]}
        for key in sorted(self.resident, key=lambda k: (self.position.get(k[0], -1), k[1])):
            producer = key[0]
            if key in kept_keys or key in self.pinned or not self.cost[producer].recomputable:
                continue
            if self.cost[producer].phase == "forward" and not self.locks.get(key, 0):
                self._drop(key)

    def _snapshot(self, nodes: list[fx.Node]) -> dict[fx.Node, Version]:
        for node in nodes:
            self._ensure(node)
        return {n: self.version[n] for n in nodes}


def page_schedule(
    gm: fx.GraphModule, budget_bytes: int | None, *, num_fwd_outputs: int, keep: frozenset[str] | None = None
) -> Plan:
    """Replay the joint schedule under `budget_bytes` (None: no limit) and return the plan.

    `keep`: names of the forward values a starting partition saves; the others are dropped when the
    forward ends (None: the forward saves everything the backward reads, until the budget says otherwise).
    The plan may not fit (`plan.fits` is False) when the budget is too small; the caller decides.
    """
    start = time.perf_counter()
    replay = _Replay(gm, budget_bytes, num_fwd_outputs, keep)
    try:
        boundary, fwd_versions = replay.run()
        final_versions = replay._snapshot(replay.bwd_outputs)
    except _Infeasible:
        replay.fits = False
        boundary, fwd_versions, final_versions = len(replay.trace), {}, {}
    compute_s = sum(replay.cost[n].time_s for n in replay.schedule)
    return Plan(
        budget_bytes=budget_bytes,
        trace=replay.trace,
        boundary=boundary,
        fwd_versions=fwd_versions,
        final_versions=final_versions,
        replay_peak_bytes=replay.peak,
        fits=replay.fits,
        recompute_s=replay.recompute_s,
        compute_s=compute_s,
        evictions=replay.evictions,
        planning_s=time.perf_counter() - start,
    )
