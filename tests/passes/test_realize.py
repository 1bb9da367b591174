"""Values computed before a recompute are pinned there for Inductor (passes/realize.py)."""

from __future__ import annotations

import torch
from torch import fx

from dtr_compile.passes.realize import REALIZE_META_KEY, pin_values_before_recomputes
from dtr_compile.passes.rewrite import RECOMPUTE_META_KEY

aten = torch.ops.aten


def backward_like_graph(*, others: bool = True, shared: bool = False) -> fx.GraphModule:
    """grad -> scaled (a pointwise gradient) ... recompute of h from x ... mm(scaled, h): the read is after it.
    With `others`, also a value read before the recompute and a view, neither of which needs pinning. With `shared`,
    a value read before the recompute and after it (a BatchNorm's masked gradient: its sum, then its product)."""
    graph = fx.Graph()
    grad, x, w = graph.placeholder("grad"), graph.placeholder("x"), graph.placeholder("w")
    scaled = graph.call_function(aten.mul.Tensor, (grad, 2.0))
    if others:
        early = graph.call_function(aten.neg.default, (grad,))
        early_use = graph.call_function(aten.sum.default, (early,))
        view = graph.call_function(aten.view.default, (grad, [-1]))
    if shared:
        masked = graph.call_function(aten.abs.default, (grad,))
        masked_sum = graph.call_function(aten.sum.default, (masked,))
    h = graph.call_function(aten.mm.default, (x, w))
    h.meta[RECOMPUTE_META_KEY] = "h"
    h_relu = graph.call_function(aten.relu.default, (h,))
    h_relu.meta[RECOMPUTE_META_KEY] = "h_relu"
    out = graph.call_function(aten.mm.default, (scaled, h_relu))
    if shared:
        out = graph.call_function(aten.mul.Tensor, (out, masked))
        out = graph.call_function(aten.add.Tensor, (out, masked_sum))
    if others:
        flat = graph.call_function(aten.sum.default, (view,))
        graph.output((out, early_use, flat))
    else:
        graph.output((out,))
    values = {"grad": torch.randn(64, 64), "x": torch.randn(64, 64), "w": torch.randn(64, 64)}
    for node in graph.nodes:  # the metadata the planner's graphs carry
        if node.op == "placeholder":
            node.meta["val"] = values[node.name]
        elif node.op == "call_function":
            node.meta["val"] = node.target(*[values[a.name] if isinstance(a, fx.Node) else a for a in node.args])
            values[node.name] = node.meta["val"]
    return fx.GraphModule(torch.nn.Module(), graph)


def test_only_values_read_after_a_recompute_are_pinned():
    gm = backward_like_graph()
    assert pin_values_before_recomputes(gm) == 1
    pinned = [node.name for node in gm.graph.nodes if node.meta.get(REALIZE_META_KEY)]
    # `early` is read before the recompute; `view` has no buffer of its own; recomputes stay where they are.
    assert pinned == [scaled_name(gm)]


def test_a_value_read_before_and_after_a_recompute_is_pinned():
    """Read by a reduction before the recompute and by a pointwise op after it, Inductor computes it inside both
    (it reads one buffer), so what it reads stays alive across the recompute: on the CPU stand-in's ResNet, a block's
    masked gradient kept the ReLU output and both residual gradients (3 MiB) where the plan held it (1 MiB); the
    first plan measured 1.058x its model at 0.6 of torch.compile's peak. Pinned, it is stored where the graph computes it."""
    gm = backward_like_graph(others=False, shared=True)
    assert pin_values_before_recomputes(gm) == 3
    pinned = [node.name for node in gm.graph.nodes if node.meta.get(REALIZE_META_KEY)]
    # `scaled`, the shared value, and its sum (made before the recompute, read only after it)
    assert pinned == [scaled_name(gm), "abs_default", "sum_default"]


def test_inductor_computes_a_pinned_value_where_the_graph_does():
    # Unpinned, Inductor computes the gradient where its reader (the second mm) needs it: after the recompute,
    # so that everything it reads stays alive across the recompute. Pinned, before the recompute, as planned.
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import run_and_get_code

    from dtr_compile.passes.fusion_guard import guarded_inner_compile

    def gradient_before_recompute(pin: bool) -> bool:
        gm = backward_like_graph(others=False)
        if pin:
            pin_values_before_recomputes(gm)
        inputs = [torch.randn(64, 64) for _ in range(3)]
        with torch._inductor.config.patch(fx_graph_cache=False):
            _, (code, *_) = run_and_get_code(lambda: guarded_inner_compile(compile_fx_inner)(gm, inputs))
        calls = [line.strip() for line in code[code.index("def call(") :].splitlines()]
        gradient = next(i for i, line in enumerate(calls) if line.startswith("cpp_fused") and "grad" in line)
        recompute = next(i for i, line in enumerate(calls) if line.startswith("extern_kernels.mm(x, w"))
        return gradient < recompute

    assert gradient_before_recompute(pin=True)
    assert not gradient_before_recompute(pin=False)


def scaled_name(gm: fx.GraphModule) -> str:
    return next(node.name for node in gm.graph.nodes if node.target == aten.mul.Tensor)
