"""What each rank runs in the distributed tests: a model under DDP or FSDP2, compiled with `backend="dtr"`.

`train_steps(rank, world, spec)` trains the same model (same initial weights on every rank, a different batch
per rank) for `STEPS` steps with no budget and then under each budget of `spec.budgets`, each time freshly
wrapped and compiled, and reports for every run: the measured peak of each step (dtr_compile.measure, on this
rank), the budget in bytes the runtime resolved, its evictions, and how far the gradients of the last step are
from the no-budget run's. Gradients are compared in the rank (tensors do not cross the process boundary) and
summed to a checksum that must agree across ranks (DDP and FSDP2 average them: ranks that trained on different
data end with the same gradients only if the collectives ran).

Step 0 compiles; under DDP step 1 rebuilds its gradient buckets (dtr_compile/distributed.py); with a fraction,
the first whole step after those runs with no budget to measure the peak the fraction refers to. The steps the
tests hold to the budget are the ones after: `measured_from(spec)`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

STEPS = 5


@dataclass(frozen=True)
class Spec:
    wrapper: str = "ddp"  # "ddp" | "fsdp2"
    model: str = "mlp"  # "mlp" | "gpt2"
    budgets: tuple[Any, ...] = (0.5,)  # each a budget, or (budget, split): split=False turns DDPOptimizer off
    codegen: str = "fx"
    steps: int = STEPS
    options: dict = field(default_factory=dict)
    infeasible_ok: bool = False  # a budget whose steps raise BudgetError is reported (its named floor), not raised


def measured_from(spec: Spec) -> int:
    """Index of the first step held to the budget (see the module docstring)."""
    return 3 if spec.wrapper == "ddp" else 2


class Block(torch.nn.Module):
    """Linear then GELU. A class of its own, not `nn.Sequential`: TorchDynamo does not compile a frame of torch's
    own code on its own, and under FSDP2 (whose hooks break the graph around every block) each block's forward
    is such a frame."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.linear(x))


class MLP(torch.nn.Module):
    """Linear+GELU blocks: activations (batch x width per op) dominate its weights' gradients."""

    def __init__(self, width: int = 256, depth: int = 8) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def build(spec: Spec, rank: int) -> tuple[torch.nn.Module, Any]:
    """(model with the same weights on every rank, loss(compiled model) on this rank's batch)."""
    torch.manual_seed(0)
    data = torch.Generator().manual_seed(100 + rank)
    if spec.model == "mlp":
        model = MLP()
        x = torch.randn(512, 256, generator=data)
        return model, lambda compiled: compiled(x)
    if spec.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0
        )
        model = GPT2LMHeadModel(config)
        ids = torch.randint(0, 256, (4, 64), generator=data)
        return model, lambda compiled: compiled(input_ids=ids, labels=ids).loss
    raise ValueError(spec.model)


def blocks_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.blocks) if isinstance(model, MLP) else list(model.transformer.h)


def wrap(spec: Spec, model: torch.nn.Module) -> torch.nn.Module:
    if spec.wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # 1 MB buckets (the least DDPOptimizer accepts: DDP's first bucket is 1 MB) split the MLP's graph in two.
        return DistributedDataParallel(model, bucket_cap_mb=spec.options.get("bucket_cap_mb", 1))
    if spec.wrapper == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for block in blocks_of(model):
            fully_shard(block, mesh=mesh, **spec.options)
        fully_shard(model, mesh=mesh, **spec.options)
        return model
    raise ValueError(spec.wrapper)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):  # FSDP2: a DTensor shard; gather the whole gradient
            g = g.full_tensor()
        out.append(None if g is None else g.detach().clone())
    return out


def train_steps(rank: int, world: int, spec: Spec) -> dict[Any, dict[str, Any]]:
    import dtr_compile
    from dtr_compile.distributed import fsdp2_params
    from dtr_compile.errors import BudgetError
    from dtr_compile.measure import measure_peak
    from dtr_compile.runtime import finish_steps
    from dtr_compile.runtime.implicit import implicit_runtime

    base, loss_of = build(spec, rank)
    results: dict[Any, dict[str, Any]] = {}
    reference: list[torch.Tensor] | None = None
    for run in (None, *spec.budgets):
        budget, split = run if isinstance(run, tuple) else (run, True)
        torch._dynamo.reset()
        torch._dynamo.config.optimize_ddp = split  # DDPOptimizer: one graph per gradient bucket
        model = copy.deepcopy(base)
        wrapped = wrap(spec, model)
        peaks: list[int] = []
        with dtr_compile.config.patch(memory_budget=budget, codegen=spec.codegen):
            compiled = torch.compile(wrapped, backend="dtr")
            try:
                # The no-budget run takes as many steps as the others: step i draws its dropout masks from seed i, so
                # the last steps' gradients are comparable only at the same i (GPT-2's dropout: 0.067 apart when the
                # reference stopped at step 2 and the budgeted run at step 4).
                for i in range(spec.steps):
                    model.zero_grad(set_to_none=True)
                    torch.manual_seed(i)
                    peaks.append(measure_peak(lambda c=compiled: loss_of(c).backward())[1].peak_bytes)
            except BudgetError as error:
                if not spec.infeasible_ok or budget is None:
                    raise
                finish_steps()
                results[run] = {"peaks": peaks, "error": str(error), "floor": error.smallest_feasible_bytes,
                                "budget_bytes": error.budget_bytes}
                continue
            finish_steps()
        grads = _grads(model)
        fsdp = fsdp2_params(compiled) if budget is not None else None
        stats = implicit_runtime().stats() if budget is not None else None
        if reference is None:
            reference = grads
        diff = max((a - b).abs().max().item() for a, b in zip(grads, reference) if a is not None)
        results[run] = {
            "peaks": peaks,
            "budget_bytes": None if stats is None else stats.budget_bytes,
            "evictions": None if stats is None else stats.evictions,
            "runtime_peak": None if stats is None else stats.peak_bytes,
            "grad_diff": diff,
            "grad_scale": max(g.abs().max().item() for g in reference if g is not None),
            "grad_checksum": sum(float(g.double().sum()) for g in grads if g is not None),
            "missing_grads": sum(g is None for g in grads),
            "early_copy_outs": None if fsdp is None else fsdp.early_copy_outs,
            "gathers": None if fsdp is None else fsdp.gathers,
            "rematerializations": None if stats is None else stats.rematerializations,
        }
    return results
