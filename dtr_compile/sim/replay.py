"""Replay a parsed operation log through the eviction engine, the same `Engine` the torch runtime uses.

Semantics (those of the DTR authors' simulator, see REFERENCES.md):
- a name is a handle on a storage; an alias result (ALIAS k) is a new handle on argument k's storage,
  and a view the storage's eviction discards: it is re-run (a recompute) when used again (views.py);
- CONSTANT storages are pinned and count against the budget;
- MUTATE is copy-on-write: each mutated argument gets a new version (a fresh storage of the argument's
  storage size, produced by the mutating op), and the handle moves from the old version to the new one;
- COPY adds a handle, COPY_FROM moves one, RELEASE drops one (at zero the storage is freed at once, unless
  the heuristic retains dead storages an evicted held one needs: Engine's `retain_needed_dead`);
- storages still referenced at the end are outputs: they are rematerialized if needed and pinned;
- every storage record lives until the end, so evicted dead storages stay in their neighbours' c(e*).
The baseline is the same replay with no budget: its peak M and total compute C. A run at ratio r has the
budget int(r * M); it fails with "thrash" when recompute exceeds C, and "oom" when nothing is evictable.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from ..engine import Engine, Storage
from ..errors import BudgetError, ThrashError
from ..oplog.format import Call, Constant, Copy, CopyFrom, Mutate, Release, Trace
from .bounds import lower_bound_bytes
from .future import FuturePlan
from .schedule import build_schedule
from .views import View, ViewTracker


@dataclass(frozen=True)
class Baseline:
    """What a trace needs with no budget, and the bound below which no policy can run it."""

    peak_bytes: int
    compute: float  # ns
    constant_bytes: int
    lower_bound_bytes: int


@dataclass(frozen=True)
class ReplayResult:
    log: str
    ratio: float
    heuristic: str
    status: str  # "ok", "oom" or "thrash"
    overhead: float | None  # (compute + recompute) / compute; None unless status == "ok"
    budget_bytes: int
    peak_bytes: int
    evictions: int  # chosen by the heuristic (eager frees of dead storages are counted apart)
    eager_evictions: int
    remats: int
    compute: float
    remat_compute: float
    baseline_peak_bytes: int
    baseline_compute: float
    lower_bound_bytes: int
    seconds: float  # wall time of this replay
    message: str = ""
    # Filled in by the command line from bounds.log_bounds (None when not computed):
    min_recompute: float | None = None  # ns no policy can beat at this budget (None below the memory bound)
    proven_infeasible: bool | None = None  # no policy can succeed at this budget
    infeasible_below: float | None = None  # every ratio below this fails for every policy

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ReplayOptions:
    """Engine settings for a replay. The defaults score every candidate, like the reference simulator."""

    heuristic: str = "dtr_eq"
    candidate_sampling: str | int = "all"
    min_evictable_fraction: float = 0.0
    thrash_limit: float | None = 1.0
    seed: int = 0
    charge_views: bool = True  # views are re-run after their storage's eviction, as the reference does (views.py)


# Heuristics that read future knowledge (NextUses in storage.meta); the replay annotates storages for them.
FUTURE_AWARE = frozenset({"future"})


def drive(trace: Trace, engine: Engine, plan: FuturePlan | None = None) -> None:
    """Run every instruction of `trace` through `engine`, then pin the outputs alive at the end.

    Raises whatever the engine raises (BudgetError, ThrashError). With a `plan`, each new storage gets its
    NextUses and the plan's clock follows the schedule. When the engine's executor is a ViewTracker, views are
    charged as the DTR simulator charges them (views.py); otherwise a view is only a handle on its storage.
    """
    tracker = engine.executor if isinstance(engine.executor, ViewTracker) else None
    # Every storage record stays alive until the replay ends, as in the DTR simulator. The engine holds the
    # records of dead storages only while an operation may need them; one that nothing can need any more then
    # drops out of its producer's outputs, and its class out of its parent's evicted neighbourhood (c(e*)).
    records: list[Storage] = []
    names: dict[str, Storage] = {}
    views: dict[str, View] = {}  # names that are views (only with a tracker)
    created = 0  # storages created so far, the key of the next one in the plan
    for index, ins in enumerate(trace.instructions):
        kind = type(ins)
        if kind is Call:
            if plan is not None:
                plan.clock.now = plan.op_start[index]
            inputs = [names[a] for a in ins.args]
            fresh = [size for size, alias in zip(ins.sizes, ins.aliases) if alias < 0]
            engine.reserve(inputs, sum(fresh), ins.op)
            reads = _valid_views(tracker, engine, views, ins.args, inputs)
            op = engine.record(ins.op, inputs, fresh, ins.time, payload=reads)
            records.extend(op.outputs)
            outputs = iter(op.outputs)
            made: dict[int, View] = {}  # argument position -> the view this op made of it
            for name, alias in zip(ins.results, ins.aliases):
                if alias < 0:
                    storage = next(outputs)
                    if plan is not None:
                        storage.meta = plan.uses[created]
                    created += 1
                else:
                    storage = inputs[alias]
                    engine.add_handle(storage)
                    if tracker is not None:
                        if alias not in made:
                            # An op that also makes fresh outputs is rerun for them: its views cost nothing more.
                            cost = ins.time if not fresh else 0.0
                            made[alias] = tracker.new_view(ins.op, cost, storage, views.get(ins.args[alias]))
                        views[name] = made[alias]
                names[name] = storage
        elif kind is Release:
            views.pop(ins.name, None)
            engine.drop_handle(names.pop(ins.name))
        elif kind is Copy:
            storage = names[ins.src]
            engine.add_handle(storage)
            names[ins.dst] = storage
            if ins.src in views:
                views[ins.dst] = views[ins.src]
        elif kind is Constant:
            engine.reserve([], ins.nbytes, "constant")  # a constant met mid-trace (recorded logs) needs room too
            storage = engine.constant(ins.nbytes, counted=True)
            records.append(storage)
            if plan is not None:
                storage.meta = plan.uses[created]
            created += 1
            names[ins.name] = storage
        elif kind is Mutate:
            if plan is not None:
                plan.clock.now = plan.op_start[index]
            inputs = [names[a] for a in ins.args]
            mutated = list(dict.fromkeys(ins.mutated))
            sizes = [inputs[i].nbytes for i in mutated]
            engine.reserve(inputs, sum(sizes), ins.op)
            reads = _valid_views(tracker, engine, views, ins.args, inputs)
            op = engine.record(ins.op, inputs, sizes, ins.time, payload=reads)
            records.extend(op.outputs)
            for i, storage in zip(mutated, op.outputs):
                if plan is not None:
                    storage.meta = plan.uses[created]
                created += 1
                names[ins.args[i]] = storage  # the new version is a storage of its own, not a view
                views.pop(ins.args[i], None)
                engine.drop_handle(inputs[i])
        elif kind is CopyFrom:
            storage = names[ins.src]
            engine.add_handle(storage)  # before dropping the old one: DST and SRC may share a storage
            old = names[ins.dst]
            names[ins.dst] = storage
            if ins.src in views:
                views[ins.dst] = views[ins.src]
            else:
                views.pop(ins.dst, None)
            engine.drop_handle(old)
    if plan is not None:
        plan.clock.now = plan.end
    for storage in dict.fromkeys(names.values()):
        if not storage.pinned:
            engine.pin(storage)
    if tracker is not None:
        for view in dict.fromkeys(views.values()):  # outputs that are views are made valid too
            tracker.make_valid(view)


def _valid_views(
    tracker: ViewTracker | None, engine: Engine, views: dict[str, View], args: tuple[str, ...], inputs: list[Storage]
) -> tuple[View, ...] | None:
    """After `reserve`: re-run the views among `args` that their storage's eviction discarded. Returns them
    (the op's payload, so that a recompute of the op re-runs them too), or None if the op reads no view."""
    if tracker is None:
        return None
    reads = tuple(dict.fromkeys(views[a] for a in args if a in views))
    try:
        for view in reads:
            tracker.make_valid(view)
    except BaseException:
        engine.abandon(inputs)
        raise
    return reads or None


def baseline(trace: Trace) -> Baseline:
    """Replay with no budget: the peak and the compute every ratio is measured against."""
    engine = Engine(None)
    drive(trace, engine)
    sched = build_schedule(trace)
    constant_bytes = sum(size for size, const in zip(sched.sizes, sched.constant) if const)
    return Baseline(engine.peak, engine.compute_cost, constant_bytes, lower_bound_bytes(sched))


def replay(
    trace: Trace, ratio: float, options: ReplayOptions = ReplayOptions(), base: Baseline | None = None
) -> ReplayResult:
    """Replay `trace` under the budget int(ratio * baseline peak)."""
    base = base if base is not None else baseline(trace)
    budget = int(base.peak_bytes * ratio)
    tracker = ViewTracker() if options.charge_views else None
    engine = Engine(
        budget,
        heuristic=options.heuristic,
        candidate_sampling=options.candidate_sampling,
        min_evictable_fraction=options.min_evictable_fraction,
        thrash_limit=options.thrash_limit,
        thrash_reference_cost=base.compute,
        seed=options.seed,
        keep_dead_intermediates=True,  # as the reference simulator: recomputed intermediates stay until evicted
        executor=tracker,
    )
    if tracker is not None:
        tracker.engine = engine
    plan = FuturePlan(build_schedule(trace)) if options.heuristic in FUTURE_AWARE else None
    status, message = "ok", ""
    start = time.perf_counter()
    try:
        drive(trace, engine, plan)
    except ThrashError as exc:
        status, message = "thrash", str(exc)
    except BudgetError as exc:
        status, message = "oom", str(exc)
    seconds = time.perf_counter() - start
    stats = engine.stats()
    return ReplayResult(
        log=trace.name,
        ratio=ratio,
        heuristic=options.heuristic,
        status=status,
        overhead=stats.overhead if status == "ok" else None,
        budget_bytes=budget,
        peak_bytes=stats.peak_bytes,
        evictions=stats.evictions,
        eager_evictions=stats.eager_evictions,
        remats=stats.remats,
        compute=stats.compute_cost,
        remat_compute=stats.remat_cost,
        baseline_peak_bytes=base.peak_bytes,
        baseline_compute=base.compute,
        lower_bound_bytes=base.lower_bound_bytes,
        seconds=seconds,
        message=message,
    )
