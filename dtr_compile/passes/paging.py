"""The paging planner: the joint schedule replayed as offline DTR on the runtime's engine, for budgets the search
cannot reach.

The search of planner.py recomputes each dropped value at most once per split it chose, and its greedy
path can stop above budgets that a deeper schedule meets (an unrolled LSTM: 0.44 of the no-remat peak,
where recomputing chains again and again reaches 0.3). This planner is the fallback when the search
does not reach the budget.

Write the joint graph as one schedule: every forward node, then every backward node, in graph order, and run it
on `engine.Engine`, the same engine that holds the eager runtime's budget and replays the DTR authors' logs: each
op with fresh outputs is one engine operation over its inputs' storages, a storage's handle is dropped after its
last use, and before an op allocates, the engine evicts until it fits; an evicted value that is used again is
recomputed from its inputs just before that use (recursively), which the engine asks of this replay's executor. The
replay emits the ops the engine actually runs: that trace is the plan. A forward value evicted before the forward
ends is not saved; its backward uses read a recomputed copy placed right before them. Unlike the runtime, the
replay knows the whole future: each storage carries the schedule positions that read it (`NextUses`), and the
engine evicts by `h_future`, DTR's heuristic with the distance to the next read in place of staleness:

    score(storage) = (recompute cost + that of its evicted neighbourhood) / (bytes * steps until next read)

and the lowest score is evicted first: cheap, large values that are not needed for a long time.
Only values the cost pass marks recomputable are evicted; random ops are recomputed with their RNG
state replayed (see rewrite.py). The engine's accounting is not the compiled code's (it keeps dead values a
recompute may need, and counts no inlining), so the caller computes the exact peak again on the emitted graph
(`peak.schedule_peak`) and judges the plan by that.
"""

from __future__ import annotations

import time

from torch import fx

from ..engine import Engine
from ..engine.heuristics import NextUses, ScheduleClock
from ..engine.records import Operation, Storage
from ..errors import BudgetError
from .meta import cost_of
from .planner import Plan
from .schedule import Emitted, Version
from .storage import StorageKey, StorageMap

# A plan that runs more than this many times the ops of the original schedule is given up (thrashing).
_MAX_TRACE_FACTOR = 4


class _Infeasible(Exception):
    pass


class _Replay:
    """One replay of the schedule on the engine under a budget; the engine's executor (it emits each recompute the
    engine asks for, and forgets the values that lived in a storage it evicts)."""

    def __init__(
        self, gm: fx.GraphModule, budget: int | None, num_fwd_outputs: int, keep: frozenset[str] | None
    ) -> None:
        self.keep = keep
        graph = gm.graph
        self.nodes = list(graph.nodes)
        self.cost = {n: cost_of(n) for n in self.nodes}
        tangents = {n for n in self.nodes if self.cost[n].phase == "tangent"}
        self.storages = StorageMap(graph, counted_inputs=tangents)
        self.schedule = [n for n in self.nodes if self.cost[n].phase in ("forward", "backward")]
        self.position = {n: i for i, n in enumerate(self.schedule)}
        # Reads of each storage, as schedule positions: an op reads the storages of all its inputs.
        self.clock = ScheduleClock()
        reads: dict[StorageKey, list[float]] = {}
        for pos, node in enumerate(self.schedule):
            for key in dict.fromkeys(k for arg in node.all_input_nodes for k in self.storages.keys[arg]):
                reads.setdefault(key, []).append(float(pos))
        self.last_read = {key: times[-1] for key, times in reads.items()}
        self.reads = reads
        # Who lives in each storage (to forget views when it goes).
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
        # The replay's own thrash guard (trace length, below); the engine's compares costs, and the estimates of
        # tiny ops are noise next to that.
        self.engine = Engine(budget, heuristic="future", candidate_sampling="all", thrash_limit=None, executor=self)
        self.held: dict[StorageKey, Storage] = {}  # every storage of the replay, by key (the engine holds ops weakly)
        self.dropped: set[StorageKey] = set()  # handles given back (the storage is read no more)
        self.version: dict[fx.Node, Version | None] = {}
        self.next_version: dict[fx.Node, Version] = {}
        self.trace: list[Emitted] = []
        self.evictions: list[tuple[fx.Node, int]] = []
        self.recompute_s = 0.0
        for node in self.nodes:
            if node.op == "placeholder":
                self.version[node] = 0
                for key in self.storages.keys[node]:
                    if key not in self.held:  # inputs were live before the step: outside the budget
                        self._adopt(key, self.engine.constant(self.storages.info[key].nbytes))

    # ------------------------------------------------------------------------------------ helpers

    def _adopt(self, key: StorageKey, storage: Storage) -> None:
        self.held[key] = storage
        storage.payload = key  # what `evict` reads back
        times = self.reads.get(key)
        if times is not None:
            storage.meta = NextUses(times, self.clock)

    def _inputs(self, node: fx.Node) -> list[Storage]:
        return [self.held[k] for k in dict.fromkeys(k for a in node.all_input_nodes for k in self.storages.keys[a])]

    def _own(self, node: fx.Node) -> list[StorageKey]:
        return [k for k in self.storages.keys[node] if k[0] is node]

    # ------------------------------------------------------------------------------------ the executor

    def recompute(self, op: Operation) -> None:
        """The engine reruns `op` (its inputs are resident): emit its node again."""
        node = op.payload
        if not self.cost[node].recomputable:
            raise _Infeasible(
                f"value needed again after it was freed, and it cannot be recomputed: {node.format_node()}"
            )
        self._emit(node, recompute=True)

    def evict(self, storage: Storage) -> None:
        """The engine freed `storage`: the values living in it are gone until their producer runs again."""
        key: StorageKey | None = storage.payload
        if key is None:
            return
        for node in self.aliases.get(key, ()):
            # A multi-output op whose other outputs stay resident keeps its version: their `getitem`s read it still
            # (the engine reruns the op for the evicted one, and the readers of that one read the new version).
            if node is not key[0] or len(self._own(node)) == 1:
                self.version[node] = None
        if storage.handles > 0:  # evicted while still read later, not freed after its last read
            self.evictions.append((key[0], len(self.trace)))

    # ------------------------------------------------------------------------------------ replay

    def _emit(self, node: fx.Node, *, recompute: bool) -> None:
        """Append `node` to the trace, reading the current version of each input (re-emitting a view or `getitem`
        whose base storage came back since it was made)."""
        for arg in node.all_input_nodes:
            self._view_back(arg)
        version = self.next_version.get(node, 0)
        self.next_version[node] = version + 1
        self.version[node] = version
        self.trace.append(Emitted(node, version, tuple((a, self.version[a]) for a in node.all_input_nodes)))
        if recompute:
            self.recompute_s += self.cost[node].time_s
            # A budget the replay can only meet by recomputing the same values over and over (each recompute
            # evicting what the next one needs) is treated as infeasible: this bounds planning time, which
            # otherwise grows exponentially along chains, and no such plan would be worth running.
            if len(self.trace) > _MAX_TRACE_FACTOR * len(self.schedule) + 1000:
                raise _Infeasible(f"the replay thrashes under this budget (at {node.format_node()})")

    def _view_back(self, node: fx.Node) -> None:
        """A value with no storage of its own (a view, a `getitem`) whose base was evicted and recomputed since it was
        made: make it again from the base's current version."""
        if self.version.get(node) is not None:
            return
        if self._own(node):  # its own storage is resident (the engine made it so): its version is current
            raise AssertionError(f"{node.name}: resident, with no current version")
        self._emit(node, recompute=True)

    def _run(self, node: fx.Node) -> None:
        """Run one node of the schedule: as an engine operation if it makes storages, else (a view) on its inputs."""
        engine = self.engine
        inputs = self._inputs(node)
        own = self._own(node)
        if own:
            info = self.storages.info
            sizes = [info[k].nbytes if info[k].counted else 0 for k in own]
            cost = self.cost[node]
            engine.reserve(inputs, sum(sizes) + cost.workspace_bytes, node.name)
            try:
                self._emit(node, recompute=False)
            except BaseException:
                engine.abandon(inputs)
                raise
            op = engine.record(node.name, inputs, sizes, cost.time_s, payload=node, workspace=cost.workspace_bytes)
            for key, storage in zip(own, op.outputs, strict=True):
                self._adopt(key, storage)
                if key in self.pinned:
                    engine.pin(storage)
                elif not cost.recomputable:
                    engine.keep_resident(storage)
        else:
            engine.reserve(inputs, 0, node.name)  # brings the base back if it was evicted
            try:
                self._emit(node, recompute=False)
            finally:
                engine.abandon(inputs)
        # Give back the storages read for the last time here, and outputs nobody reads.
        now = float(self.position[node])
        for key in dict.fromkeys(k for a in (*node.all_input_nodes, node) for k in self.storages.keys[a]):
            if key in self.dropped or key in self.pinned or key[0].op == "placeholder":
                continue
            if self.last_read.get(key, -1.0) <= now:
                self.dropped.add(key)
                engine.drop_handle(self.held[key])

    def run(self) -> tuple[int, dict[fx.Node, Version]]:
        boundary = None
        fwd_versions: dict[fx.Node, Version] = {}
        for pos, node in enumerate(self.schedule):
            self.clock.now = float(pos)
            if boundary is None and self.cost[node].phase == "backward":
                boundary = len(self.trace)
                fwd_versions = self._snapshot(self.fwd_outputs)
                self._drop_unkept()
            self._run(node)
        if boundary is None:
            boundary = len(self.trace)
            fwd_versions = self._snapshot(self.fwd_outputs)
        return boundary, fwd_versions

    def _drop_unkept(self) -> None:
        """At the end of the forward, evict the recomputable values the starting partition does not save.

        With Inductor the starting partition is its own min-cut, which recomputes cheap pointwise ops
        inside the backward's fused kernels instead of saving them: saving them would cost memory
        traffic and time even with no budget.
        """
        if self.keep is None:
            return
        kept_keys = {k for n in self.nodes if n.name in self.keep for k in self.storages.keys[n]}
        for key, storage in sorted(self.held.items(), key=lambda item: item[1].sid):
            producer = key[0]
            if key in kept_keys or not storage.resident or storage.pinned or storage.locks or storage.kept_resident:
                continue
            if storage.producer is not None and self.cost[producer].phase == "forward":
                self.engine.evict(storage)

    def _snapshot(self, nodes: list[fx.Node]) -> dict[fx.Node, Version]:
        for node in nodes:
            inputs = [self.held[k] for k in self.storages.keys[node]]
            self.engine.reserve(inputs, 0, "output")
            try:
                self._view_back(node)
            finally:
                self.engine.abandon(inputs)
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
    fits = True
    try:
        boundary, fwd_versions = replay.run()
        final_versions = replay._snapshot(replay.bwd_outputs)
    except (_Infeasible, BudgetError):
        fits = False
        boundary, fwd_versions, final_versions = len(replay.trace), {}, {}
    compute_s = sum(replay.cost[n].time_s for n in replay.schedule)
    return Plan(
        budget_bytes=budget_bytes,
        trace=replay.trace,
        boundary=boundary,
        fwd_versions=fwd_versions,
        final_versions=final_versions,
        replay_peak_bytes=replay.engine.room_peak,
        fits=fits,
        recompute_s=replay.recompute_s,
        compute_s=compute_s,
        evictions=replay.evictions,
        planning_s=time.perf_counter() - start,
    )
