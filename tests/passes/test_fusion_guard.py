"""Inductor's addmm patterns may not move a matmul to a distant add (passes/fusion_guard.py)."""

from __future__ import annotations

import torch
from torch import fx

from dtr_compile.passes.fusion_guard import keep_distant_matmuls_in_place

aten = torch.ops.aten


def tied_weight_gradient(*, adjacent: bool = False) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """grad_w = mm(grad^T, x) early, other backward work, then grad_w + the other gradient (a tied weight's two
    gradients): the shape of GPT-2's lm_head / wte gradient. `adjacent`: the add right after the mm."""
    graph = fx.Graph()
    grad, x, other, grad_e = (graph.placeholder(name) for name in ("grad", "x", "other", "grad_e"))
    grad_t = graph.call_function(aten.permute.default, (grad, [1, 0]))
    grad_w = graph.call_function(aten.mm.default, (grad_t, x))
    if adjacent:
        total = graph.call_function(aten.add.Tensor, (grad_w, grad_e))
        work = graph.call_function(aten.relu.default, (other,))
    else:  # the other gradient is ready only after the other work, as the embedding's is at the backward's end
        work = graph.call_function(aten.relu.default, (other,))
        scale = graph.call_function(aten.sum.default, (work,))
        late = graph.call_function(aten.mul.Tensor, (grad_e, scale))
        total = graph.call_function(aten.add.Tensor, (late, grad_w))
    graph.output((total, work))
    torch.manual_seed(0)
    inputs = [torch.randn(128, 64), torch.randn(128, 32), torch.randn(256, 256), torch.randn(64, 32)]
    return fx.GraphModule(torch.nn.Module(), graph), inputs


def test_a_distant_add_of_a_matmul_becomes_the_same_sum_no_pattern_matches() -> None:
    gm, inputs = tied_weight_gradient()
    expected = gm(*inputs)
    assert keep_distant_matmuls_in_place(gm) == 1
    (rewritten,) = [n for n in gm.graph.nodes if n.target is aten.sub.Tensor]
    assert rewritten.kwargs == {"alpha": -1}
    assert not [n for n in gm.graph.nodes if n.target is aten.add.Tensor]
    for got, want in zip(gm(*inputs), expected, strict=True):
        assert torch.equal(got, want)  # bit for bit: c - (-1 * m) is c + m


def test_an_add_right_after_its_matmul_is_left_to_fuse() -> None:
    gm, _ = tied_weight_gradient(adjacent=True)
    assert keep_distant_matmuls_in_place(gm) == 0


def test_inductor_computes_the_matmul_where_the_graph_does() -> None:
    """Left alone, Inductor's post-grad pattern turns add(grad_e, mm) into addmm at the add: the mm runs after
    the other work, and `grad` stays alive until then. Rewritten, the mm runs first."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.utils import run_and_get_code

    def matmul_runs_first(guard: bool) -> bool:
        gm, inputs = tied_weight_gradient()
        if guard:
            keep_distant_matmuls_in_place(gm)
        with torch._inductor.config.patch(fx_graph_cache=False):
            _, (code, *_) = run_and_get_code(lambda: compile_fx_inner(gm, inputs))
        calls = [line.strip() for line in code[code.index("def call(") :].splitlines()]
        matmul = next(i for i, line in enumerate(calls) if line.startswith("extern_kernels.") and "mm(" in line)
        work = next(i for i, line in enumerate(calls) if line.startswith("cpp_fused") and "other" in line)
        return matmul < work

    assert matmul_runs_first(guard=True)
    assert not matmul_runs_first(guard=False)
