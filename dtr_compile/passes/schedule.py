"""The schedule a choice of saved values implies, and its memory, computed fast enough to search over.

Given the set of forward values that are *dropped* (not saved for the backward), the schedule is fixed:
the forward runs as traced and frees every value after its last forward use unless it is saved; the
backward runs in graph order, and right before a backward op needs a forward value that is not saved,
that value is recomputed from what is available (recursively: a recompute may need other values that
are not saved). Each recomputed value stays until its last use, in the backward or by a later
recompute; it is recomputed a second time only when the plan *splits* it (see `split`), after the
last use of its first copy. The result is a list of `Emitted` ops that `rewrite.emit_plan` turns into
a graph.

`simulate` replays that list with the accounting of `peak.schedule_peak` (which measures the emitted
graph) without building a graph, so the planner can evaluate many candidate plans: the two agree byte
for byte (tests/passes check it). `schedule_peak` counts its bytes on the eviction engine (engine/ledger.py);
this loop keeps plain sets, as the search's inner loop. Run on the engine too, it cost 3x its time on the CPU
stand-in's Llama `small` (0.35 s a plan where it took 0.11, 23 candidate plans), and up to 6x where the search
calls it deep in the stack (CPython 3.11 then maps and unmaps a frame chunk on every call the engine makes):
about 0.9 s more for each plan of a first call, for the same bytes.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import fx

from .inlining import FUSED_RECOMPUTE, InlineDecider, inline_kind, is_loop, is_pointwise, is_view, sunk_order
from .kernel_groups import KernelSpans, keeps_local_values, kernel_spans, loop_elements
from .layout_copies import layout_copied_inputs
from .meta import NodeCost, cost_of
from .storage import RNG_STATE_INDEX, StorageKey, StorageMap, assumed_tail, let_go_keys, rng_state_nbytes

Version = int  # 0 = the original computation of a node, k >= 1 = its k-th recomputation
SimKey = tuple[StorageKey, Version]  # one storage of one version of a value


@dataclass(frozen=True)
class Emitted:
    """One op the plan runs: `node` (of the joint graph) as its `version`, reading `arg_versions`."""

    node: fx.Node
    version: Version
    arg_versions: tuple[tuple[fx.Node, Version], ...]

    @property
    def is_recompute(self) -> bool:
        return self.version > 0


class JointFacts:
    """What the planner needs to know about a joint graph, computed once per graph."""

    def __init__(self, gm: fx.GraphModule, num_fwd_outputs: int) -> None:
        self.nodes = list(gm.graph.nodes)
        self.cost: dict[fx.Node, NodeCost] = {n: cost_of(n) for n in self.nodes}
        tangents = {n for n in self.nodes if self.cost[n].phase == "tangent"}
        self.tangents = [n for n in self.nodes if n in tangents]
        self.storages = StorageMap(gm.graph, counted_inputs=tangents)
        self.forward = [n for n in self.nodes if self.cost[n].phase == "forward"]
        self.backward = [n for n in self.nodes if self.cost[n].phase == "backward"]
        self.is_forward = set(self.forward)
        self.position = {n: i for i, n in enumerate(self.forward)}
        output = next(n for n in reversed(self.nodes) if n.op == "output")
        outs = list(output.args[0])
        self.output_args = outs  # the forward's outputs first (positions: storage.Tail.dropped_outputs)
        self.num_fwd_outputs = num_fwd_outputs
        self.fwd_outputs = [o for o in outs[:num_fwd_outputs] if isinstance(o, fx.Node)]
        self.bwd_outputs = [o for o in outs[num_fwd_outputs:] if isinstance(o, fx.Node)]
        self.keys = self.storages.keys
        self.own = {n: tuple(k for k in self.keys[n] if k[0] is n) for n in self.nodes}
        self.inputs = {n: tuple(n.all_input_nodes) for n in self.nodes}
        self.nbytes = {k: (i.nbytes if i.counted else 0) for k, i in self.storages.info.items()}
        # Random ops: bytes of the generator state a recompute replays (saved by the forward).
        self.rng_state_bytes = {n: rng_state_nbytes(n) for n in self.forward if self.cost[n].needs_rng_replay}
        self.nbytes.update({(n, RNG_STATE_INDEX): b for n, b in self.rng_state_bytes.items()})
        # Inputs Inductor's code copies to channels-last (layout_copies.py): the Inductor models allocate them at the
        # forward's start and count their bytes (`inductor_nbytes`); the FX model reads the inputs themselves.
        primal_and_forward = (n for n in self.nodes if self.cost[n].phase in ("primal", "forward"))
        self.layout_copies = [(k, 0) for n in layout_copied_inputs(primal_and_forward) for k in self.keys[n]]
        copy_bytes = {key: self.storages.info[key].nbytes for key, _ in self.layout_copies}
        self.inductor_nbytes = {**self.nbytes, **copy_bytes} if copy_bytes else self.nbytes
        self.pinned_forward = {k for o in self.fwd_outputs for k in self.keys[o]}
        self.backward_output_keys = {k for o in self.bwd_outputs for k in self.keys[o]}
        # Forward storages the backward reads: the ones a plan may save or drop (allow_saving adds more).
        self.read_by_backward = {k for b in self.backward for a in self.inputs[b] for k in self.keys[a]}
        self.savable_for_recompute: set[fx.Node] = set()  # nodes only allow_saving made savable
        # Per node, for the search's inner loops: the producers of its counted storages.
        self.producers = {n: frozenset(k[0] for k in self.keys[n] if self.nbytes.get(k, 0) > 0) for n in self.nodes}
        self._index_savable()
        self.input_keys = {n: tuple((k, 0) for k in self.keys[n]) for n in self.nodes if n.op == "placeholder"}
        self.pointwise = {n for n in self.nodes if is_pointwise(n)}
        self.movable = self.pointwise | {n for n in self.nodes if is_view(n)}
        self.loop = {n for n in self.nodes if is_loop(n)}
        self.forward_ops = [Emitted(n, 0, tuple((a, 0) for a in self.inputs[n])) for n in self.forward]
        # Each backward op as it runs when it reads no recomputed value: shared by every trace that runs it so
        # (Emitted is immutable), instead of made again per candidate plan.
        self.plain_backward_ops = [Emitted(n, 0, tuple((a, 0) for a in self.inputs[n])) for n in self.backward]
        self.backward_position = {n: i for i, n in enumerate(self.backward)}
        self.forward_inputs = {n: tuple(a for a in self.inputs[n] if a in self.is_forward) for n in self.nodes}
        self.backward_entries: list[tuple | None] = [None] * len(self.backward)  # schedule.storage_keys
        self.forward_index = {(op.node, 0): i for i, op in enumerate(self.forward_ops)}
        self.forward_readers: list[list[int]] = [[] for _ in self.forward_ops]
        for i, op in enumerate(self.forward_ops):
            for arg_version in op.arg_versions:
                j = self.forward_index.get(arg_version)
                if j is not None:
                    self.forward_readers[j].append(i)
        self.forward_keys_cache: tuple[list, list, dict] | None = None  # schedule._forward_keys
        self.forward_uses_cache: tuple[dict, dict] | None = None  # schedule._forward_uses
        self.workspace_bytes = {n: self.cost[n].workspace_bytes for n in self.nodes}
        self.loop_elements = {n: loop_elements(n) for n in self.loop}  # kernel_groups.py
        self.keeps_local_values = keeps_local_values(self.nodes)

    def _index_savable(self) -> None:
        """The candidates (forward values a plan may save or drop), and per node whether every storage it has
        may be saved (then the node is available in the backward unless one of its producers is dropped)."""
        savable, pinned = self.read_by_backward, self.pinned_forward
        self.candidates = [
            n
            for n in self.forward
            if self.cost[n].recomputable
            and any(self.nbytes[k] > 0 and k in savable and k not in pinned for k in self.own[n])
        ]
        self.readable = {n: all(k in savable for k in self.keys[n] if self.nbytes.get(k, 0) > 0) for n in self.nodes}

    def allow_saving(self, nodes: Iterable[fx.Node]) -> None:
        """Let a plan save `nodes` although no backward op reads them: values a recompute may start from.

        A chain's block boundaries are such values when the backward reads only what the block computes from
        them: with Inductor's decompositions a layer norm's backward reads its normalized input, not the residual
        stream it normalized. Without them, checkpointing a block recomputed every block before it, from the
        embedding (on the CPU stand-in GPT-2, the all-checkpoint plan modelled 241 MB, above saving everything).
        The matmuls a `sac` block keeps are others (blocks.sac_saves); `savable_for_recompute` lists what only this
        made savable, which the `save` option does not save."""
        nodes = frozenset(nodes)
        extra = {
            k
            for n in nodes
            if n in self.is_forward and self.cost[n].recomputable
            for k in self.own[n]
            if self.nbytes.get(k, 0) > 0 and k not in self.pinned_forward
        }
        if extra <= self.read_by_backward:
            return
        added = extra - self.read_by_backward
        self.savable_for_recompute |= {n for n in nodes if any(k in added for k in self.own.get(n, ()))}
        self.read_by_backward = self.read_by_backward | extra
        self._index_savable()


@dataclass
class Trace:
    ops: list[Emitted]
    boundary: int  # ops[:boundary] is the forward, ops[boundary:] the backward
    fwd_versions: dict[fx.Node, Version]  # versions the forward outputs read
    final_versions: dict[fx.Node, Version]  # versions the backward outputs read
    recomputed: dict[fx.Node, int]  # forward node -> how many times the backward recomputes it
    recompute_s: float
    owner: list[int]  # for each op of ops[boundary:]: the index of the backward op it runs for
    index: dict[tuple[fx.Node, Version], int]  # (node, version) -> position in ops
    forward_readers: list[list[int]]  # readers of the forward ops among themselves (JointFacts.forward_readers)
    _readers: list[list[int]] | None = None

    @property
    def readers(self) -> list[list[int]]:
        """For each op: the positions of the ops that read its value. Built on first use: only the Inductor models
        read it, and building it for every candidate plan cost a tenth of build_trace."""
        if self._readers is None:
            boundary = self.boundary
            readers = list(self.forward_readers)  # shared with every trace: copied before they grow
            readers.extend([] for _ in range(boundary, len(self.ops)))
            grown: set[int] = set()
            index = self.index
            for i in range(boundary, len(self.ops)):
                for arg_version in self.ops[i].arg_versions:
                    j = index.get(arg_version)
                    if j is not None:
                        if j < boundary and j not in grown:
                            readers[j] = list(readers[j])
                            grown.add(j)
                        readers[j].append(i)
            self._readers = readers
        return self._readers


class Infeasible(Exception):
    """The dropped set needs a value recomputed that cannot be (not recomputable)."""


def build_trace(
    facts: JointFacts,
    dropped: set[fx.Node],
    forget: frozenset[tuple[fx.Node, int]] = frozenset(),
    hoist: frozenset[tuple[fx.Node, int]] = frozenset(),
) -> Trace:
    """The schedule of the joint graph when the forward does not save `dropped`.

    `hoist`: (value, i) pairs: recompute `value` (if it is not available then) before the i-th backward op
    rather than right before its first use: earlier, where less memory is live.
    `forget`: (value, i) pairs: before the i-th backward op, the recomputed copy of `value` (and the
    recomputed copies it was made from) are given up, so that the next op that needs it recomputes it
    again (each copy is freed after its last use before that).
    """
    ops = list(facts.forward_ops)
    boundary = len(ops)
    available: dict[fx.Node, bool] = {}
    forget_before: dict[int, list[fx.Node]] = {}
    for node, index in sorted(forget, key=lambda item: (item[1], facts.position[item[0]])):
        forget_before.setdefault(index, []).append(node)
    hoist_before: dict[int, list[fx.Node]] = {}
    for node, index in sorted(hoist, key=lambda item: (item[1], facts.position[item[0]])):
        hoist_before.setdefault(index, []).append(node)

    def is_available(node: fx.Node) -> bool:
        """A forward value the backward can read as the forward left it."""
        known = available.get(node)
        if known is None:
            known = facts.readable[node] and facts.producers[node].isdisjoint(dropped)
            available[node] = known
        return known

    version: dict[fx.Node, Version] = {}  # forward node -> live recomputed version in the backward
    count: dict[fx.Node, int] = {}
    owner: list[int] = []  # for each op of the backward part: the backward op it runs for
    recompute_s = 0.0

    is_forward = facts.is_forward

    def ready(node: fx.Node) -> bool:
        if node not in is_forward or node in version:
            return True
        known = available.get(node)
        return is_available(node) if known is None else known

    inputs_of, cost_of_node = facts.inputs, facts.cost
    plain_backward_ops, forward_inputs = facts.plain_backward_ops, facts.forward_inputs

    def ensure(root: fx.Node, backward_index: int) -> None:
        nonlocal recompute_s
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if ready(node):
                continue
            if not expanded:
                if not cost_of_node[node].recomputable:
                    raise Infeasible(f"needs {node.format_node()}, which is not saved and cannot be recomputed")
                stack.append((node, True))
                # ready() inlined: only forward inputs may be unready (every other value is available).
                stack.extend(
                    [
                        (a, False)
                        for a in reversed(forward_inputs[node])
                        if a not in version and not (available[a] if a in available else is_available(a))
                    ]
                )
                continue
            times = count.get(node, 0) + 1
            count[node] = version[node] = times
            ops.append(Emitted(node, times, tuple([(a, version.get(a, 0)) for a in inputs_of[node]])))
            owner.append(backward_index)
            recompute_s += cost_of_node[node].time_s

    def give_up(node: fx.Node) -> None:
        """Forget a recomputed value and the recomputed values it was made from, so that its next
        recompute starts again from saved values instead of keeping its inputs alive until then."""
        stack = [node]
        while stack:
            current = stack.pop()
            if version.pop(current, None) is not None:
                stack.extend(a for a in facts.inputs[current] if a in version)

    for index, node in enumerate(facts.backward):
        for gone in forget_before.get(index, ()):
            give_up(gone)
        for early in hoist_before.get(index, ()):
            ensure(early, index)
        for arg in forward_inputs[node]:  # the others (gradients, graph inputs) are always ready
            if arg not in version and not (available[arg] if arg in available else is_available(arg)):
                ensure(arg, index)
        inputs = inputs_of[node]
        if version and not version.keys().isdisjoint(inputs):
            ops.append(Emitted(node, 0, tuple([(a, version.get(a, 0)) for a in inputs])))
        else:
            ops.append(plain_backward_ops[index])
        owner.append(index)
    for out in facts.bwd_outputs:
        ensure(out, len(facts.backward))
    final_versions = {o: version.get(o, 0) for o in facts.bwd_outputs}
    # Where each version runs: the forward part is the same in every plan, so only the backward part is indexed here.
    index = dict(facts.forward_index)
    for i in range(boundary, len(ops)):
        op = ops[i]
        index[(op.node, op.version)] = i
    fwd_versions = {o: 0 for o in facts.fwd_outputs}
    return Trace(ops, boundary, fwd_versions, final_versions, count, recompute_s, owner, index, facts.forward_readers)


@dataclass
class Simulation:
    """Memory of a trace, op by op, with the accounting of `peak.schedule_peak`."""

    timeline: list[int]  # bytes live while each op of the trace runs
    peak: int
    peak_index: int
    last_forward_use: dict[SimKey, int]
    saved: set[SimKey]  # forward storages the backward reads
    allocated: dict[SimKey, int]  # the op that allocates each storage
    order: list[int]  # run position -> trace position
    complete: bool = True  # False: stopped at the first op above `simulate`'s limit (peak is that op's memory)
    entries: list = field(default_factory=list, repr=False)  # storage_keys' entries in run order
    boundary: int = 0  # run positions from here on are the backward part
    forward_end_peak: int = 0  # bytes live where the forward has returned, with the assumed tail (the loss) on top
    _reads: dict[SimKey, list[int]] | None = field(default=None, repr=False)
    _first_read: dict[SimKey, int] | None = field(default=None, repr=False)

    @property
    def reads(self) -> dict[SimKey, list[int]]:
        """The ops of the backward part that read each storage, in order. Built on first use: only the search's
        candidates read it, and most simulated plans are rejected (fill's) before any candidate is listed."""
        if self._reads is None:
            reads: dict[SimKey, list[int]] = {}
            for i in range(self.boundary, len(self.entries)):
                for keys in self.entries[i][1]:
                    for key in keys:
                        reads.setdefault(key, []).append(i)
            self._reads = reads
        return self._reads

    @property
    def first_read(self) -> dict[SimKey, int]:
        """The first op of the backward part that reads each storage."""
        if self._first_read is None:
            self._first_read = {key: positions[0] for key, positions in self.reads.items()}
        return self._first_read

    @property
    def run_position(self) -> list[int]:
        """Trace position -> run position."""
        inverse = [0] * len(self.order)
        for run, traced in enumerate(self.order):
            inverse[traced] = run
        return inverse


def storage_keys(
    facts: JointFacts, trace: Trace, *, inductor: bool | str = False
) -> tuple[list, dict[fx.Node, Version], InlineDecider | None]:
    """For every op of the trace: (its own storages, the storages of each of its inputs, the storages
    its value occupies), versioned; the version of every node at the end of the trace; and, with
    `inductor`, which ops Inductor computes inside their readers (those own nothing, and reading one
    reads their inputs, inlining.py).

    A random op the backward recomputes also allocates, in the forward, the generator state its
    recomputes replay (see rewrite.py); each recompute reads it."""
    ops = trace.ops
    index = trace.index
    recomputes_only = inductor == FUSED_RECOMPUTE
    inline = InlineDecider(_inline_candidates(facts, trace, recomputes_only)) if inductor else None
    replayed = {n for n, times in trace.recomputed.items() if n in facts.rng_state_bytes and times > 0}
    entry_keys: list[tuple[SimKey, ...]] = []
    result = []
    current: dict[fx.Node, Version] = {}
    start = 0
    # The forward's entries are the same in every plan under the FX model, and under FUSED_RECOMPUTE, which inlines
    # recomputes only: cached.
    if (inline is None or recomputes_only) and trace.boundary < len(ops):
        cached = _forward_keys(facts)
        entry_keys = list(cached[0])
        result = list(cached[1])
        current = dict(cached[2])
        start = trace.boundary
        for node in replayed:  # its forward op allocates the generator state its recomputes replay
            j = facts.forward_index[(node, 0)]
            own, inputs, keys = result[j]
            result[j] = ((*own, ((node, RNG_STATE_INDEX), 0)), inputs, keys)

    def keys_of(arg: fx.Node, version: Version) -> tuple[SimKey, ...]:
        j = index.get((arg, version))
        if j is None:  # a graph input
            return facts.input_keys[arg]
        return entry_keys[j]

    def entry_of(i: int, op: Emitted) -> tuple[tuple[SimKey, ...], tuple[tuple[SimKey, ...], ...], tuple[SimKey, ...]]:
        node = op.node
        inputs = tuple([keys_of(a, v) for a, v in op.arg_versions])
        own: tuple[SimKey, ...] = ()
        if inline is not None and inline.may_inline(i) and _inlines(inline, i, op, inputs, index):
            keys = _union(inputs)
        elif facts.own[node] or not facts.keys[node]:
            own = tuple([(k, op.version) for k in facts.own[node]])
            keys = own
        else:  # a view or a getitem: the storages of its base (one element of it, for a getitem)
            base, base_version = op.arg_versions[0] if op.arg_versions else (None, 0)
            base_keys = keys_of(base, base_version) if base is not None else ()
            wanted = set(facts.keys[node])
            selected = tuple(k for k in base_keys if k[0] in wanted)
            keys = selected if node.target is operator.getitem and selected else base_keys
        if node in replayed:
            state = ((node, RNG_STATE_INDEX), 0)
            if op.version == 0:
                own = (*own, state)
            else:
                inputs = (*inputs, (state,))
        return own, inputs, keys

    # A backward op that reads no recomputed value, directly or through a view, has the same entry in every plan
    # (these models inline recomputes only): cached on `facts` once computed (`JointFacts.backward_entries`).
    fixed = facts.backward_entries if start else None
    varied: set[fx.Node] = set()  # backward views whose storages in this trace may be recomputed ones
    for i in range(start, len(ops)):
        op = ops[i]
        node = op.node
        entry = None
        if fixed is not None and op.version == 0:
            b = facts.backward_position[node]
            if op is facts.plain_backward_ops[b] and varied.isdisjoint(facts.inputs[node]):
                entry = fixed[b]
                if entry is None:
                    entry = fixed[b] = entry_of(i, op)
            elif not facts.own[node] and facts.keys[node]:  # a view or a getitem: its base's storages
                varied.add(node)
        if entry is None:
            entry = entry_of(i, op)
        entry_keys.append(entry[2])
        current[node] = op.version
        result.append(entry)
    return result, current, inline


def _forward_keys(facts: JointFacts) -> tuple[list, list, dict[fx.Node, Version]]:
    """`storage_keys`' entries of the forward ops under the FX model, without generator states (the same in
    every plan, cached on `facts`: recomputing them per candidate plan was about a sixth of planning time)."""
    cached = facts.forward_keys_cache
    if cached is None:
        forward = Trace(
            list(facts.forward_ops),
            len(facts.forward_ops),
            {},
            {},
            {},
            0.0,
            [],
            dict(facts.forward_index),
            facts.forward_readers,
        )
        result, current, _ = storage_keys(facts, forward)
        cached = ([keys for _, _, keys in result], result, current)
        facts.forward_keys_cache = cached
    return cached


def _forward_uses(facts: JointFacts, trace: Trace) -> tuple[dict[SimKey, int], dict[SimKey, int]]:
    """`simulate`'s last forward use and allocating op of the storages of the forward ops, from `_forward_keys`'
    entries (the same in every plan, cached on `facts`), with the generator states `trace` replays added."""
    cached = facts.forward_uses_cache
    if cached is None:
        last: dict[SimKey, int] = {}
        allocated: dict[SimKey, int] = {}
        for i, (own, inputs, _) in enumerate(_forward_keys(facts)[1]):
            for key in own:
                allocated.setdefault(key, i)
            for keys in inputs:
                for key in keys:
                    last[key] = i
        cached = facts.forward_uses_cache = (last, allocated)
    last, allocated = dict(cached[0]), dict(cached[1])
    for node, times in trace.recomputed.items():
        if node in facts.rng_state_bytes and times > 0:
            allocated.setdefault(((node, RNG_STATE_INDEX), 0), facts.forward_index[(node, 0)])
    return last, allocated


def _union(groups: tuple[tuple[SimKey, ...], ...]) -> tuple[SimKey, ...]:
    if len(groups) == 1:
        return groups[0]
    union: dict[SimKey, None] = {}
    for group in groups:
        union.update(dict.fromkeys(group))
    return tuple(union)


def _inlines(inline: InlineDecider, i: int, op: Emitted, inputs: tuple, index: dict) -> bool:
    positions = [index[a] for a in op.arg_versions if a in index]
    return inline.inlines(i, len(_union(inputs)), node=op.node, inputs=positions)


def _inline_candidates(facts: JointFacts, trace: Trace, recomputes_only: bool = False) -> dict[int, str]:
    """Trace positions of the pointwise ops Inductor may compute inside their readers, with their kind
    (`recomputes_only`: of the backward's recomputes only, the FUSED_RECOMPUTE model)."""
    readers = trace.readers
    index = trace.index
    outputs = {index.get((o, v)) for o, v in trace.fwd_versions.items()}
    outputs |= {index.get((o, v)) for o, v in trace.final_versions.items()}
    boundary = trace.boundary
    ops = trace.ops
    kinds = {}
    start = boundary if recomputes_only else 0  # the forward recomputes nothing
    for i in range(start, len(ops)):
        op = ops[i]
        if recomputes_only and not op.version or op.node not in facts.pointwise or i in outputs:
            continue
        effective: list[int] = []
        stack = list(readers[i])
        while stack:  # look through views of it
            j = stack.pop()
            if ops[j].node in facts.movable and ops[j].node not in facts.pointwise:  # a view
                if j in outputs:
                    effective.append(-1)
                stack.extend(readers[j])
            else:
                effective.append(j)
        phase = i < boundary
        kind = inline_kind(
            effective, lambda j: j >= 0 and ops[j].node in facts.loop, lambda j, phase=phase: (j < boundary) == phase
        )
        if kind is not None:
            kinds[i] = kind
    return kinds


def run_order(
    facts: JointFacts, trace: Trace, inline: InlineDecider | None, recomputes_only: bool = False
) -> list[int]:
    """Trace positions in the order the compiled code runs them: as planned for plain FX execution; for
    Inductor (`inline` given), with pointwise ops (`recomputes_only`: recomputed ones) run where their first
    reader needs them, except the values it stores on reuse (inlining.sunk_order)."""
    count = len(trace.ops)
    if inline is None:
        return list(range(count))
    boundary, ops = trace.boundary, trace.ops
    first = boundary if recomputes_only else 0  # recomputes only: nothing moves in the forward, which recomputes none
    movable = [False] * first + [
        ops[i].node in facts.movable
        and not (ops[i].node in facts.pointwise and inline.stored_on_reuse(i))
        and (ops[i].is_recompute or not recomputes_only)
        for i in range(first, count)
    ]
    forward = list(range(boundary)) if recomputes_only else sunk_order(0, boundary, trace.readers, movable)
    return forward + sunk_order(boundary, count, trace.readers, movable)


def backward_kernel_spans(facts: JointFacts, ops: list[Emitted], keyed: list, boundary: int) -> KernelSpans:
    """The backward's fused groups of recomputed loop ops, in run positions (kernel_groups.py)."""
    loop, elements = facts.loop, facts.loop_elements

    def fusable(i: int) -> int | None:
        op = ops[i]
        return elements.get(op.node) if op.version and op.node in loop else None

    return kernel_spans(
        boundary,
        len(ops),
        lambda i: keyed[i][0],
        fusable,
        lambda i: [key for group in keyed[i][1] for key in group],
    )


class _OverLimit(Exception):
    """Raised inside `simulate` at the first op above its limit, to stop the replay there."""


def simulate(facts: JointFacts, trace: Trace, *, inductor: bool | str = False, limit: int | None = None) -> Simulation:
    """Bytes live at every op of `trace` (inputs and outputs of the running op, plus its workspace).

    `limit`: stop at the first op whose memory is above it (the result is then not `complete`): enough to reject
    a candidate plan that must fit a budget.

    Positions in the result (timeline, peak_index, reads, ...) are run positions: `order[p]` is the
    trace position of the op that runs p-th (see `run_order`)."""
    keyed_by_trace, _, inline = storage_keys(facts, trace, inductor=inductor)
    recomputes_only = inductor == FUSED_RECOMPUTE
    order = run_order(facts, trace, inline, recomputes_only=recomputes_only)
    if inline is None:  # runs as traced
        keyed, ops = keyed_by_trace, trace.ops
    else:
        keyed = [keyed_by_trace[i] for i in order]
        ops = [trace.ops[i] for i in order]
    boundary = trace.boundary
    nbytes = facts.inductor_nbytes if inline is not None else facts.nbytes
    # Storages that live to the end of the step: the forward outputs (held by the user) and the gradients.
    forever: set[SimKey] = set()
    for out, version in (*trace.fwd_versions.items(), *trace.final_versions.items()):
        j = trace.index.get((out, version))
        forever.update(keyed_by_trace[j][2] if j is not None else ((k, 0) for k in facts.keys[out]))
    last_bwd: dict[SimKey, int] = {}
    if (inline is None or recomputes_only) and boundary < len(ops):  # storage_keys' cached forward, run as traced
        last_fwd, allocated = _forward_uses(facts, trace)
        start = boundary
    else:
        last_fwd, allocated = {}, {}
        start = 0
    for i in range(start, len(keyed)):
        own, inputs, _ = keyed[i]
        for key in own:
            allocated.setdefault(key, i)
        table = last_fwd if i < boundary else last_bwd
        for keys in inputs:
            for key in keys:
                table[key] = i
    saved = {key for key in last_bwd if key[0][0] in facts.is_forward and key[1] == 0}
    copies = facts.layout_copies if inline is not None else []
    saved.update(key for key in copies if key in last_bwd)

    stop_above = float("inf") if limit is None else limit
    forward_end_peak = 0
    live: set[SimKey] = set()
    memory = peak = 0
    peak_index = 0
    timeline: list[int] = []

    workspace = facts.workspace_bytes
    # Recomputed loop ops Inductor runs as one kernel (kernel_groups.py): allocated together, freed together.
    spans = backward_kernel_spans(facts, ops, keyed, boundary) if inline is not None else KernelSpans()
    allocating, freeing, inside = spans.alloc_and_free()
    local = spans.local_storages(lambda i: keyed[i][0], last_bwd, forever) if facts.keeps_local_values else set()

    def run(start: int, stop: int, last: dict[SimKey, int], keep: set[SimKey]) -> None:
        nonlocal memory, peak, peak_index
        held = forever | keep  # never freed in this part
        for i in range(start, stop):
            own = keyed[i][0]
            for j in allocating.get(i, ()) if i in inside else (i,):
                for key in keyed[j][0]:
                    if key not in live and key not in local:
                        live.add(key)
                        memory += nbytes[key[0]]
            running = memory + workspace[ops[i].node] if own else memory
            timeline.append(running)
            if running > peak:
                peak, peak_index = running, i
                if running > stop_above:
                    raise _OverLimit
            for j in freeing.get(i, ()) if i in inside else (i,):
                _, inputs, keys = keyed[j]
                for group in (*inputs, keys):
                    for key in group:
                        if key in live and key not in held and last.get(key, -1) <= i:
                            live.discard(key)
                            memory -= nbytes[key[0]]

    for key in copies:  # allocated before the forward's first op
        live.add(key)
        memory += nbytes[key[0]]
    try:
        run(0, boundary, last_fwd, saved)
        for key in list(live):  # saved values the backward never reads are dropped when the forward returns
            if key not in forever and key not in last_bwd:
                live.discard(key)
                memory -= nbytes[key[0]]
        forward_end = memory
        tangent_bytes = 0
        for tangent in facts.tangents:
            for k in facts.keys[tangent]:
                if (k, 0) not in live:
                    live.add((k, 0))
                    memory += nbytes[k]
                    tangent_bytes += nbytes[k]
        # The code between forward and backward (a loss), its tangents included (storage.Tail).
        tail = assumed_tail(facts.tangents, tangent_bytes)
        forward_end_peak = forward_end + tail.peak_bytes
        if forward_end_peak > peak:
            peak, peak_index = forward_end_peak, max(boundary - 1, 0)
            if peak > stop_above:
                raise _OverLimit
        memory += tail.at_backward_bytes - tangent_bytes
        # Outputs the program let go before the backward, where this plan does not save them for it.
        for key in let_go_keys(tail, facts.output_args, facts.num_fwd_outputs, facts.keys):
            if (key, 0) in live and (key, 0) not in last_bwd:
                live.discard((key, 0))
                memory -= nbytes[key]
        run(boundary, len(keyed), last_bwd, set())
    except _OverLimit:
        complete = False
    else:
        complete = True
    return Simulation(
        timeline, peak, peak_index, last_fwd, saved, allocated, order, complete, keyed, boundary, forward_end_peak
    )
