"""The modelled peak of a partitioned joint graph: forward, backward, recomputes and gradients.

The model is the memory of executing the graph node by node and freeing every storage right after its
last use (exactly what the FX code generator does):
- graph inputs are free (live before the step); tangents are allocated when the backward starts;
- forward values saved for the backward live until their last backward use;
- forward outputs live to the end of the step (the user holds them), and so do gradients;
- between forward and backward, the code there (a loss) holds more: storage.Tail, assumed or measured;
- while an op runs, its inputs, its outputs and its kernel's workspace are live together.
For Inductor (`inductor=True`) the pointwise ops it inlines into their reader allocate nothing, and
pointwise ops run where their first reader needs them (inlining.py); this is close to, not exactly,
Inductor's memory (passes/verify.py measures the compiled code and corrects). It is the number
`explain` prints and the number the planner holds to the budget; planner.py's fast simulation of a
plan agrees with it byte for byte.

The bytes are counted by the eviction engine (engine/ledger.py), as the runtime's live step and the log
replay are: this module decides when each storage is allocated and freed, the engine counts what that holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import fx

from ..engine.ledger import ScheduleLedger
from .inlining import FUSED_RECOMPUTE, InlineDecider, inductor_inlined, is_loop, is_pointwise, is_view, sunk_order
from .kernel_groups import KernelSpans, keeps_local_values, kernel_spans, loop_elements
from .layout_copies import layout_copied_inputs
from .meta import DTR_META_KEY
from .rewrite import RECOMPUTE_META_KEY
from .storage import StorageKey, StorageMap, assumed_tail, let_go_keys, tangent_placeholders


@dataclass(frozen=True)
class MemoryPoint:
    node: fx.Node
    phase: str  # "forward" | "backward"
    bytes_live: int  # bytes allocated above the start of the step while this node runs


@dataclass(frozen=True)
class PeakModel:
    peak_bytes: int
    peak_node: fx.Node | None
    timeline: tuple[MemoryPoint, ...]
    saved_bytes: int  # bytes the forward leaves alive for the backward (saved values and outputs)
    backward_start_bytes: int  # bytes live when the backward begins: those, the tail's (its tangents), less drops
    # (node name, bytes) of each storage counted at the peak, largest first; kept only when asked (`record_live`)
    live_at_peak: tuple[tuple[str, int], ...] = ()


def schedule_peak(
    gm: fx.GraphModule, *, num_fwd_outputs: int, inductor: bool | str = False, record_live: bool = False
) -> PeakModel:
    """Peak of a joint graph whose nodes carry `partitioner_tag` is_forward / is_backward.

    `inductor`: model the graphs as Inductor compiles them, with the pointwise ops it inlines into
    their reader's kernel allocating nothing (inlining.py). `record_live`: keep what is live at the peak
    (`PeakModel.live_at_peak`: what tools/inductor_live.py lines up against the compiled code's buffers)."""
    return graph_peak(gm.graph, num_fwd_outputs=num_fwd_outputs, inductor=inductor, record_live=record_live)


def graph_peak(
    graph: fx.Graph, *, num_fwd_outputs: int, inductor: bool | str = False, record_live: bool = False
) -> PeakModel:
    """`schedule_peak` of a joint graph not wrapped in a GraphModule (rewrite.emit_graph)."""
    nodes = list(graph.nodes)
    tangents = set(tangent_placeholders(graph))
    inline = None
    recomputes_only = inductor == FUSED_RECOMPUTE
    if inductor:
        inlined = inductor_inlined(nodes, _same_graph)
        if recomputes_only:
            inlined = {n: kind for n, kind in inlined.items() if RECOMPUTE_META_KEY in n.meta}
        inline = InlineDecider(inlined)
    ops = [n for n in nodes if n.op == "call_function"]
    backward = {n for n in ops if n.meta.get("partitioner_tag") == "is_backward"}
    forward_ops = [n for n in ops if n not in backward]
    # Inputs Inductor's code copies to channels-last: allocated at the forward's start (layout_copies.py).
    # The forward graph's nodes without the output, as schedule.JointFacts passes them: Inductor's decision counts nodes.
    forward_graph = (n for n in nodes if n.op != "output" and n not in backward and n not in tangents)
    copies = layout_copied_inputs(forward_graph) if inductor else []
    storages = StorageMap(graph, counted_inputs=tangents | set(copies), inline=inline)
    output = next(n for n in reversed(nodes) if n.op == "output")
    outs = [o for o in output.args[0] if isinstance(o, fx.Node)]
    fwd_outs = [o for o in list(output.args[0])[:num_fwd_outputs] if isinstance(o, fx.Node)]

    backward_ops = [n for n in ops if n in backward]
    if inductor:  # pointwise ops run where their first reader needs them
        forward_ops = _sunk(forward_ops, inline, recomputes_only)
        backward_ops = _sunk(backward_ops, inline, recomputes_only)

    def counted(key: StorageKey) -> int:
        info = storages.info[key]
        return info.nbytes if info.counted else 0

    # Last use of every storage, per phase; None = lives to the end of the step.
    forever = {k for o in outs for k in storages.keys[o]}
    last_fwd: dict[StorageKey, int] = {}
    last_bwd: dict[StorageKey, int] = {}
    for i, node in enumerate(forward_ops):
        for arg in node.all_input_nodes:
            for key in storages.keys[arg]:
                last_fwd[key] = i
    for i, node in enumerate(backward_ops):
        for arg in node.all_input_nodes:
            for key in storages.keys[arg]:
                last_bwd[key] = i
    saved = {k for k in last_bwd if k[0] not in backward}  # forward storages the backward reads
    del fwd_outs

    timeline: list[MemoryPoint] = []
    ledger = ScheduleLedger()  # the engine counts the bytes (engine/ledger.py)
    peak, peak_node = 0, None
    live_at_peak: list[tuple[str, int]] = []

    def own_keys(node: fx.Node) -> list[StorageKey]:
        return [key for key in storages.keys[node] if key[0] is node]

    def counted_live() -> list[tuple[str, int]]:
        return [(key[0].name, counted(key)) for key in ledger if counted(key)]

    # Recomputed loop ops Inductor runs as one kernel (kernel_groups.py): allocated together, freed together.
    spans = _backward_spans(backward_ops, storages, own_keys) if inductor else KernelSpans()
    allocating, freeing, inside = spans.alloc_and_free()
    local: set[StorageKey] = set()
    if keeps_local_values(nodes):
        local = spans.local_storages(lambda i: own_keys(backward_ops[i]), last_bwd, forever)

    def run(sequence: list[fx.Node], last: dict[StorageKey, int], phase: str, keep: set[StorageKey]) -> None:
        nonlocal peak, peak_node
        grouped = phase == "backward"
        for i, node in enumerate(sequence):
            made = [
                (key, counted(key))
                for member in (_members(sequence, i, allocating, inside) if grouped else (node,))
                for key in own_keys(member)
                if key not in local
            ]
            # A kernel's own temporaries (dropout's float mask) are live only while it runs.
            cost = node.meta.get(DTR_META_KEY)
            own = own_keys(node)
            running = ledger.allocate(node.name, made, cost.workspace_bytes if cost is not None and own else 0)
            timeline.append(MemoryPoint(node, phase, running))
            if running > peak:
                peak, peak_node = running, node
                if record_live:
                    live_at_peak[:] = counted_live()
            for member in _members(sequence, i, freeing, inside) if grouped else (node,):
                for arg in (*member.all_input_nodes, member):
                    for key in storages.keys[arg]:
                        if key not in forever and key not in keep and last.get(key, -1) <= i:
                            ledger.free(key)

    ledger.allocate("layout copies", [(key, counted(key)) for copy in copies for key in storages.keys[copy]])
    run(forward_ops, last_fwd, "forward", saved)
    saved_bytes = ledger.memory
    # Saved values the backward never reads are dropped when the forward returns.
    for key in list(ledger):
        if key not in forever and key not in last_bwd:
            ledger.free(key)
    forward_end = ledger.memory
    ledger.allocate("tangents", [(key, counted(key)) for tangent in tangents for key in storages.keys[tangent]])
    tangent_bytes = ledger.memory - forward_end
    # The code between forward and backward (a loss), its tangents included (storage.Tail).
    tail = assumed_tail(tangents, tangent_bytes)
    if forward_end + tail.peak_bytes > peak:
        peak, peak_node = forward_end + tail.peak_bytes, forward_ops[-1] if forward_ops else peak_node
        if record_live:
            held = [(key[0].name, counted(key)) for key in ledger if counted(key) and key[0] not in tangents]
            live_at_peak[:] = [*held, ("(the tail, its tangents included)", tail.peak_bytes)]
    # What the tail holds into the backward beyond its tangents is not a storage of this graph.
    ledger.outside += tail.at_backward_bytes - tangent_bytes
    # Outputs the program let go before the backward, where this plan does not save them for it.
    for key in let_go_keys(tail, output.args[0], num_fwd_outputs, storages.keys):
        if key not in last_bwd:
            ledger.free(key)
    backward_start = ledger.memory
    run(backward_ops, last_bwd, "backward", set())
    live_at_peak.sort(key=lambda entry: -entry[1])
    return PeakModel(peak, peak_node, tuple(timeline), saved_bytes, backward_start, tuple(live_at_peak))


def _backward_spans(
    backward_ops: list[fx.Node], storages: StorageMap, own_keys: Callable[[fx.Node], list[StorageKey]]
) -> KernelSpans:
    """The backward's fused groups of recomputed loop ops, in positions of `backward_ops` (kernel_groups.py)."""

    def fusable(i: int) -> int | None:
        node = backward_ops[i]
        return loop_elements(node) if RECOMPUTE_META_KEY in node.meta and is_loop(node) else None

    def reads(i: int) -> list[StorageKey]:
        return [key for arg in backward_ops[i].all_input_nodes for key in storages.keys[arg]]

    return kernel_spans(0, len(backward_ops), lambda i: own_keys(backward_ops[i]), fusable, reads)


def _members(sequence: list[fx.Node], i: int, at: dict[int, range], inside: set[int]) -> list[fx.Node]:
    """The ops whose storages are allocated (or freed) at position i: its own, or a fused group's (`at`)."""
    if i not in inside:
        return [sequence[i]]
    return [sequence[j] for j in at.get(i, ())]


def _same_graph(a: fx.Node, b: fx.Node) -> bool:
    return a.meta.get("partitioner_tag") == b.meta.get("partitioner_tag")


def _sunk(sequence: list[fx.Node], inline: InlineDecider, recomputes_only: bool = False) -> list[fx.Node]:
    position = {n: i for i, n in enumerate(sequence)}
    readers = [[position[u] for u in n.users if u in position] for n in sequence]
    movable = [
        (is_view(n) or is_pointwise(n) and not inline.stored_on_reuse(n))
        and (not recomputes_only or RECOMPUTE_META_KEY in n.meta)
        for n in sequence
    ]
    return [sequence[i] for i in sunk_order(0, len(sequence), readers, movable)]
