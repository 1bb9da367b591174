"""One Dynamo region through AOTAutograd: our partitioner (plan under the budget) and a code generator.

`compile_region` is what a `Region` (region.py) compiles itself with; `make_backend` binds explicit settings
for `explain` and tests. Inductor ("inductor": C++ on CPU, Triton on GPU) or plain FX execution ("fx"), whose
graphs free every value, graph inputs included, right after its last use, so that the measured peak is the
planned one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx
from torch.utils._python_dispatch import _disable_current_modes

from .. import auto_budget, config
from ..passes.costs import CostMode
from ..passes.partition import DTRPartitioner

__all__ = ["PartWrapper", "boxed_fx", "compile_region", "make_backend"]


# wrap(a part's graph, "forward" | "backward" | "inference"), called before the part is compiled (a code
# generator may rewrite the graph), returns finish(compiled part) -> what AOTAutograd calls instead.
PartWrapper = Callable[[fx.GraphModule, str], Callable[[Any], Any]]


def compile_region(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    partitioner: DTRPartitioner,
    *,
    codegen: str = "inductor",
    wrap: PartWrapper | None = None,
    measure_on: Sequence[Any] | None = None,
    measure_floor: bool = True,
) -> Callable[..., Any]:
    """Compile one Dynamo region with `partitioner` as AOTAutograd's partition function.

    `wrap`, if given, receives every compiled part (region.py makes them operations of the eager runtime).
    `measure_on`: the inputs Inductor's code is measured on (passes/verify.py), when not `example_inputs`.
    `measure_floor`: see verify.compile_within_budget."""
    if codegen == "fx":
        from torch._dynamo.backends.common import aot_autograd

        def compiler(phase: str) -> Callable[[fx.GraphModule, Sequence[Any]], Any]:
            def compile_part(part: fx.GraphModule, inputs: Sequence[Any]) -> Any:
                finish = wrap(part, phase) if wrap is not None else None
                compiled = boxed_fx(part, inputs)
                return finish(compiled) if finish is not None else compiled

            return compile_part

        return aot_autograd(
            fw_compiler=compiler("forward"),
            bw_compiler=compiler("backward"),
            inference_compiler=compiler("inference"),
            partition_fn=partitioner,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)
    if codegen == "inductor":
        import copy

        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        from ..passes.fusion_guard import guarded_inner_compile, keep_distant_matmuls_in_place
        from ..passes.inlining import PLANNED_PART_SETTINGS
        from ..passes.verify import compile_within_budget
        from ..runtime.runtime import current_step

        guarded = guarded_inner_compile(compile_fx_inner)
        # Inductor's own settings, for the parts that run torch.compile's partition
        own = {name: getattr(torch._inductor.config, name) for name in PLANNED_PART_SETTINGS}

        def inner_compile(part: fx.GraphModule, inputs: Sequence[Any], **kwargs: Any) -> Any:
            phase = (
                "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
            )
            finish = wrap(part, phase) if wrap is not None else None
            # A region that runs torch.compile's own partition (no recompute planned), and an inference part,
            # get Inductor's own scheduling and fusions too: the step is torch.compile's.
            unplanned = phase == "inference" or partitioner.reports[-1].partition == "min_cut"
            if not unplanned:
                keep_distant_matmuls_in_place(part)
            with (
                _disable_current_modes(),  # a backward compiled lazily runs inside a step's backward pass
                torch._inductor.config.patch(own if unplanned else PLANNED_PART_SETTINGS),
            ):
                compiled = (compile_fx_inner if unplanned else guarded)(part, inputs, **kwargs)
            return finish(compiled) if finish is not None else compiled

        # Our plan must reach Inductor unchanged: its own partitioner is replaced by ours (as a config
        # patch, which Inductor re-applies when it compiles the backward later), its fusions may not
        # move nodes away from where the plan put them, nor may its own peak-memory reordering or its
        # buffer reuse move allocations and frees (passes/inlining.PLANNED_PART_SETTINGS), and the
        # AOTAutograd cache is bypassed so that
        # every compile plans (and reports) afresh. The backward is compiled with the forward (not on
        # the first backward) so that the result can be measured once, at compile time, and planned
        # again if Inductor's memory exceeds the budget (passes/verify.py).
        def compile_once() -> Callable[..., Any]:
            with torch._functorch.config.patch(enable_autograd_cache=False, force_non_lazy_backward_lowering=True):
                return compile_fx(
                    copy.deepcopy(gm),  # compile_fx takes ownership of the graph; a re-plan needs it again
                    example_inputs,
                    inner_compile=inner_compile,
                    config_patches={"custom_partitioner_fn": partitioner, "reorder_for_peak_memory": False},
                )

        if current_step() is not None:
            # Compiled in the middle of a runtime step (a graph first seen there): running it once to
            # measure would be recorded by the step. The runtime accounts for the region's parts by the
            # plan's model and makes room around them.
            return compile_once()
        return compile_within_budget(
            compile_once, example_inputs if measure_on is None else measure_on, partitioner, measure_floor=measure_floor
        )
    raise ValueError(f"codegen={codegen!r}; expected 'inductor' or 'fx'")


def boxed_fx(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """Run a graph as plain FX code with the boxed calling convention.

    The generated function takes AOTAutograd's argument list, empties it, and drops each input after
    its last use; `make_boxed_func` would keep every saved activation alive for the whole backward.
    """
    from torch.fx.graph import _BoxedCodeGen

    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return gm


def make_backend(
    budget: Any = None, *, codegen: str = "fx", cost_mode: CostMode = "estimate", start_from_min_cut: bool = True
) -> Callable[..., Any]:
    """A backend bound to explicit settings (used by `explain` and tests); its `.reports` lists the plans."""
    partitioner = DTRPartitioner(
        auto_budget.concrete(config.parse_budget(budget)),
        cost_mode=cost_mode,
        start_from_min_cut=start_from_min_cut,
        codegen=codegen,
    )

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
        return compile_region(gm, example_inputs, partitioner, codegen=codegen)

    backend.reports = partitioner.reports  # type: ignore[attr-defined]
    return backend
