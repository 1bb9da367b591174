"""The "dtr" torch.compile backend: AOTAutograd joint graph -> plan under the budget -> codegen.

    model = torch.compile(model, backend="dtr")   # found through the torch_dynamo_backends entry point

It reads `dtr_compile.config` when Dynamo hands it a graph: `memory_budget` (bytes, fraction of the
no-remat peak, or None) and `codegen` ("inductor": C++ on CPU, Triton on GPU; "fx": plain FX execution).
Both code generators run the planned graphs; the FX one frees every value, graph inputs included,
right after its last use, so that the measured peak is the planned one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx

from . import config
from .passes.costs import CostMode
from .passes.partition import DTRPartitioner

__all__ = ["compile_region", "dtr_backend"]


def dtr_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """Dynamo backend entry point (`backend="dtr"`). Extra `options=` from torch.compile are refused."""
    if kwargs:
        raise TypeError(
            f"backend 'dtr' takes no options {sorted(kwargs)}; set dtr_compile.config.memory_budget / codegen instead"
        )
    partitioner = DTRPartitioner(config.memory_budget, cost_mode=config.cost_mode, codegen=config.codegen)
    return compile_region(gm, example_inputs, partitioner, codegen=config.codegen)


def compile_region(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    partitioner: DTRPartitioner,
    *,
    codegen: str = "inductor",
) -> Callable[..., Any]:
    """Compile one Dynamo region with `partitioner` as AOTAutograd's partition function."""
    if codegen == "fx":
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(
            fw_compiler=_boxed_fx,
            bw_compiler=_boxed_fx,
            partition_fn=partitioner,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)
    if codegen == "inductor":
        import copy

        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        from .passes.fusion_guard import guarded_inner_compile
        from .passes.verify import compile_within_budget

        # Our plan must reach Inductor unchanged: its own partitioner is replaced by ours (as a config
        # patch, which Inductor re-applies when it compiles the backward later), its fusions may not
        # move nodes away from where the plan put them, and the AOTAutograd cache is bypassed so that
        # every compile plans (and reports) afresh. The backward is compiled with the forward (not on
        # the first backward) so that the result can be measured once, at compile time, and planned
        # again if Inductor's memory exceeds the budget (passes/verify.py).
        def compile_once() -> Callable[..., Any]:
            with torch._functorch.config.patch(enable_autograd_cache=False, force_non_lazy_backward_lowering=True):
                return compile_fx(
                    copy.deepcopy(gm),  # compile_fx takes ownership of the graph; a re-plan needs it again
                    example_inputs,
                    inner_compile=guarded_inner_compile(compile_fx_inner),
                    config_patches={"custom_partitioner_fn": partitioner},
                )

        return compile_within_budget(compile_once, example_inputs, partitioner)
    raise ValueError(f"codegen={codegen!r}; expected 'inductor' or 'fx'")


def _boxed_fx(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """Run a graph as plain FX code with the boxed calling convention.

    The generated function takes AOTAutograd's argument list, empties it, and drops each input after
    its last use; `make_boxed_func` would keep every saved activation alive for the whole backward.
    """
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return gm


def make_backend(
    budget: Any = None, *, codegen: str = "fx", cost_mode: CostMode = "estimate", start_from_min_cut: bool = False
) -> Callable[..., Any]:
    """A backend bound to explicit settings (used by `explain` and tests); its `.reports` lists the plans."""
    partitioner = DTRPartitioner(
        config.parse_budget(budget), cost_mode=cost_mode, start_from_min_cut=start_from_min_cut, codegen=codegen
    )

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        return compile_region(gm, example_inputs, partitioner, codegen=codegen)

    backend.reports = partitioner.reports  # type: ignore[attr-defined]
    return backend
