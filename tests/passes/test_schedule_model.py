"""The planner's fast simulation against the model of the emitted graph (counted by the engine: engine/ledger.py),
and the Inductor memory model."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from tiny_models import decomposed_joint, trace_as_plan
from torch import fx, nn

from dtr_compile.passes import emit_plan, schedule_peak
from dtr_compile.passes.costs import annotate_costs
from dtr_compile.passes.fusion_guard import fusion_gap
from dtr_compile.passes.inlining import FUSED_RECOMPUTE, MULTI, SINGLE, InlineDecider, inductor_inlined, sunk_order
from dtr_compile.passes.schedule import JointFacts, build_trace, simulate
from dtr_compile.passes.storage import StorageMap


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 64), nn.LayerNorm(64)]
    return nn.Sequential(*layers, nn.Linear(64, 1)), torch.randn(32, 64)


@pytest.mark.parametrize("inductor", [False, True, FUSED_RECOMPUTE])
def test_simulation_equals_model_of_emitted_graph(inductor: bool | str) -> None:
    joint, n_out = decomposed_joint(*_model())
    annotate_costs(joint, codegen="inductor" if inductor else "fx")
    facts = JointFacts(joint, n_out)
    rng = random.Random(0)
    backward_ops = len(facts.backward)
    for trial in range(6):
        dropped = {n for n in facts.candidates if rng.random() < trial / 6}
        trace = build_trace(facts, dropped)
        recomputed = list(trace.recomputed)
        forget = frozenset((n, rng.randrange(backward_ops)) for n in recomputed if rng.random() < 0.3)
        trace = build_trace(facts, dropped, forget)
        planned = emit_plan(joint, trace_as_plan(trace), num_fwd_outputs=n_out)
        modelled = schedule_peak(planned, num_fwd_outputs=n_out, inductor=inductor)
        simulated = simulate(facts, trace, inductor=inductor)
        assert simulated.peak == modelled.peak_bytes, (trial, inductor)
        # With a limit (the planner's fill): the same result when the plan fits it, stopped above it otherwise.
        within = simulate(facts, trace, inductor=inductor, limit=simulated.peak)
        assert within.complete and within.peak == simulated.peak and within.timeline == simulated.timeline
        above = simulate(facts, trace, inductor=inductor, limit=simulated.peak - 1)
        assert not above.complete and above.peak == simulated.peak and len(above.timeline) <= len(simulated.timeline)


@pytest.mark.parametrize("inductor", [False, FUSED_RECOMPUTE])
def test_what_is_live_at_the_peak_adds_up_to_it(inductor: bool | str) -> None:
    """`record_live` lists the storages counted at the peak (tools/inductor_live.py sets them beside the compiled
    code's buffers): their bytes, with the peak op's workspace, are the peak, the op's own output among them; the
    peak itself is the same as without the record."""
    joint, n_out = decomposed_joint(*_model())
    annotate_costs(joint, codegen="inductor" if inductor else "fx")
    facts = JointFacts(joint, n_out)
    planned = emit_plan(joint, trace_as_plan(build_trace(facts, set(facts.candidates))), num_fwd_outputs=n_out)
    recorded = schedule_peak(planned, num_fwd_outputs=n_out, inductor=inductor, record_live=True)
    assert recorded.peak_bytes == schedule_peak(planned, num_fwd_outputs=n_out, inductor=inductor).peak_bytes
    assert recorded.peak_node is not None and recorded.live_at_peak
    workspace = recorded.peak_node.meta["dtr"].workspace_bytes
    assert sum(nbytes for _, nbytes in recorded.live_at_peak) + workspace == recorded.peak_bytes
    assert recorded.peak_node.name in {name for name, _ in recorded.live_at_peak}
    assert [nbytes for _, nbytes in recorded.live_at_peak] == sorted(
        (b for _, b in recorded.live_at_peak), reverse=True
    )


def test_fused_recompute_model_inlines_only_recomputes() -> None:
    """FUSED_RECOMPUTE is the exact model except inside recompute bursts (the recomputed pointwise ops live in
    Inductor's kernels, not in buffers): equal to it with nothing dropped and in the forward, apart from it in the
    backward once everything is recomputed, its peak between the Inductor model's and the exact one's."""
    joint, n_out = decomposed_joint(*_model())
    annotate_costs(joint, codegen="inductor")
    facts = JointFacts(joint, n_out)
    nothing = build_trace(facts, set())
    assert simulate(facts, nothing, inductor=FUSED_RECOMPUTE).peak == simulate(facts, nothing, inductor=False).peak
    everything = build_trace(facts, set(facts.candidates))
    exact, fused, inductor = (simulate(facts, everything, inductor=flag) for flag in (False, FUSED_RECOMPUTE, True))
    assert inductor.peak <= fused.peak <= exact.peak
    forward = slice(None, everything.boundary)  # no recompute there: the same in both
    assert fused.timeline[forward] == exact.timeline[forward]
    assert fused.timeline != exact.timeline  # the recompute bursts are counted apart


def test_forgotten_values_are_recomputed_again() -> None:
    joint, n_out = decomposed_joint(*_model())
    annotate_costs(joint)
    facts = JointFacts(joint, n_out)
    dropped = set(facts.candidates)
    once = build_trace(facts, dropped)
    value = next(n for n, times in once.recomputed.items() if times == 1 and facts.cost[n].flops > 0)
    readers = [b for b in facts.backward if value in facts.inputs[b]]
    assert readers, "the value should be read by the backward"
    later = facts.backward.index(readers[-1])
    twice = build_trace(facts, dropped, frozenset({(value, later)}))
    versions = [op.version for op in twice.ops if op.node is value and op.is_recompute]
    assert len(versions) >= 2 and versions == sorted(versions)
    assert twice.recompute_s > once.recompute_s


def test_inductor_inlines_pointwise_read_only_by_loops() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    w = graph.placeholder("w")
    a = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))  # read once, by a pointwise op: inlined
    b = graph.call_function(torch.ops.aten.exp.default, (a,))  # read by a matmul: stored
    c = graph.call_function(torch.ops.aten.mm.default, (b, w))
    d = graph.call_function(torch.ops.aten.relu.default, (c,))  # read by two loops: computed in each
    e = graph.call_function(torch.ops.aten.add.Tensor, (d, 1.0))
    f = graph.call_function(torch.ops.aten.sum.default, (d,))
    g = graph.call_function(torch.ops.aten.exp.default, (c,))  # read by two loops, but expensive: stored
    h = graph.call_function(torch.ops.aten.add.Tensor, (g, 1.0))
    k = graph.call_function(torch.ops.aten.sum.default, (g,))
    graph.output((e, f, h, k))
    for node in graph.nodes:  # shapes, for the bytes
        node.meta["val"] = torch.empty(()) if node in (f, k) else torch.empty(8, 8)
    kinds = inductor_inlined(graph.nodes, lambda _a, _b: True)
    assert kinds == {a: SINGLE, d: MULTI, g: MULTI}
    storages = StorageMap(graph, inline=InlineDecider(kinds))
    assert storages.allocated_bytes(a) == storages.allocated_bytes(d) == 0
    assert storages.keys[d] == storages.keys[c]  # reading d reads c
    assert storages.allocated_bytes(b) == storages.allocated_bytes(g) == 8 * 8 * 4  # stored
    assert inductor_inlined(graph.nodes, lambda _a, _b: False) == {}  # across graphs: saved, stored


def test_an_unsafe_view_shares_its_input_storage() -> None:
    """`aten._unsafe_view` declares no alias in its schema, yet returns a view: a 3-D Linear's output under torch 2.15.
    Counted as a buffer of its own, the model held a Linear's result twice."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    w = graph.placeholder("w")
    product = graph.call_function(torch.ops.aten.mm.default, (x, w))
    batched = graph.call_function(torch.ops.aten._unsafe_view.default, (product, [2, 4, 8]))
    graph.output((batched,))
    for node, shape in ((x, (8, 8)), (w, (8, 8)), (product, (8, 8)), (batched, (2, 4, 8))):
        node.meta["val"] = torch.empty(shape)
    storages = StorageMap(graph)
    assert storages.keys[batched] == storages.keys[product]
    assert storages.allocated_bytes(batched) == 0 and storages.allocated_bytes(product) == 8 * 8 * 4


def test_sunk_order_runs_pointwise_where_first_needed() -> None:
    # 0: extern, 1: pointwise read by 3, 2: extern, 3: extern reading 1, 4: pointwise read by nothing
    readers = [[1], [3], [3], [], []]
    movable = [False, True, False, False, True]
    assert sunk_order(0, 5, readers, movable) == [0, 2, 1, 3, 4]
    # a chain of pointwise ops moves as a whole, in order
    readers = [[1], [2], [4], [], []]
    movable = [True, True, True, False, False]
    assert sunk_order(0, 5, readers, movable) == [3, 0, 1, 2, 4]


def test_fusion_gap_counts_nodes_between() -> None:
    def node(first: int, last: int) -> SimpleNamespace:
        return SimpleNamespace(min_order=first, max_order=last)

    assert fusion_gap(node(3, 3), node(4, 4)) == 0
    assert fusion_gap(node(4, 6), node(1, 2)) == 1
    assert fusion_gap(node(0, 1), node(10, 12)) == 8
    assert fusion_gap(node(0, 5), node(3, 9)) == 0


def test_distant_nodes_fuse_only_as_producer_and_consumer(monkeypatch) -> None:
    """A horizontal fusion (shared inputs only) of nodes more than MAX_HORIZONTAL_GAP apart is refused: two layers'
    recomputed softmaxes both read the causal mask, and fused, the earlier layer's whole recompute ran at the later
    one's place (CPU stand-in Llama: 1.23x the plan's model). A producer and its consumer still fuse up to max_gap."""
    from torch._inductor.choices import InductorChoices

    from dtr_compile.passes import fusion_guard

    monkeypatch.setattr(InductorChoices, "can_fuse_vertical", lambda *args: True)
    monkeypatch.setattr(InductorChoices, "can_fuse_horizontal", lambda *args: True)

    def node(first: int, last: int) -> SimpleNamespace:
        return SimpleNamespace(min_order=first, max_order=last)

    choices = fusion_guard.PlanOrderChoices()
    no_matmuls = SimpleNamespace(nodes=[])
    near, apart = fusion_guard.MAX_HORIZONTAL_GAP + 1, fusion_guard.MAX_HORIZONTAL_GAP + 2
    assert choices.can_fuse_horizontal(None, node(0, 0), node(near, near), 1)
    assert not choices.can_fuse_horizontal(None, node(0, 0), node(apart, apart), 1)
    assert choices.can_fuse_vertical(no_matmuls, node(0, 0), node(apart, apart), 1)
    # A chain fused one link at a time may not reach further back than max_gap from its last member: HF T5's layers'
    # position-bias gradients, each reduced within 64 nodes of the next, fused into one kernel at the backward's end.
    chain = node(60, 60 + fusion_guard.DEFAULT_MAX_GAP)
    assert choices.can_fuse_vertical(no_matmuls, node(59, 59), chain, 1)
    assert not choices.can_fuse_vertical(
        no_matmuls, node(58, 58), chain, 1
    )  # 1 node from the chain, 64 + 1 from its end
    assert not choices.can_fuse_vertical(
        no_matmuls, node(0, 0), node(fusion_guard.DEFAULT_MAX_GAP + 2, fusion_guard.DEFAULT_MAX_GAP + 2), 1
    )


class _TwoOutputs(nn.Module):
    """Returns a linear layer's output, which the backward never reads, and its tanh, which tanh's backward reads."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 256)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.linear(x)
        return hidden, torch.tanh(hidden)


@pytest.mark.parametrize("inductor", [False, FUSED_RECOMPUTE])
def test_an_output_the_loop_let_go_is_freed_only_where_the_plan_does_not_save_it(inductor: bool | str) -> None:
    """A measured tail names the outputs the loop let go before the backward (storage.Tail.dropped_outputs); every
    memory model frees one at the backward's start unless the backward reads it. (Counted in bytes, a tail learned
    while torch.compile's partition saved HF BERT's MLM logits kept them through every later plan's backward.)"""
    from dtr_compile.passes.storage import TAIL_META_KEY, Tail, tangent_placeholders

    torch.manual_seed(0)
    joint, n_out = decomposed_joint(_TwoOutputs(), torch.randn(32, 64, requires_grad=True))
    annotate_costs(joint, codegen="inductor" if inductor else "fx")
    output_bytes = 32 * 256 * 4
    tangents = tangent_placeholders(joint.graph)
    tangent_bytes = len(tangents) * output_bytes

    def backward_start(dropped: frozenset[int]) -> tuple[int, int]:
        for tangent in tangents:
            tangent.meta[TAIL_META_KEY] = Tail(tangent_bytes, tangent_bytes, dropped)
        facts = JointFacts(joint, n_out)
        trace = build_trace(facts, set())
        planned = emit_plan(joint, trace_as_plan(trace), num_fwd_outputs=n_out)
        modelled = schedule_peak(planned, num_fwd_outputs=n_out, inductor=inductor)
        simulated = simulate(facts, trace, inductor=inductor)
        assert simulated.peak == modelled.peak_bytes
        first_backward = next(p.bytes_live for p in modelled.timeline if p.phase == "backward")
        assert simulated.timeline[simulated.boundary] == first_backward
        return modelled.backward_start_bytes, first_backward

    held = backward_start(frozenset())
    assert backward_start(frozenset({0})) == tuple(b - output_bytes for b in held)  # the linear's output is freed
    assert backward_start(frozenset({1})) == held  # the tanh is saved: letting it go frees nothing
    assert backward_start(frozenset({0, 1})) == tuple(b - output_bytes for b in held)
