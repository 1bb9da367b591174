"""The methods the benchmark compares, each a way to turn a model into a training step.

A method's `prepare(case, budget, batch)` returns a `step()` that runs forward and backward once and
returns the loss as a float; the harness (child.py) times it and measures its peak. `prepare` raises
`NotBuilt` when the method's code is not in the tree yet, so the table can say so instead of crashing.

Budgets: `Budget.fraction` is the nominal value of the grid (a fraction of plain eager's measured peak);
`Budget.bytes` is that fraction times the baseline's measured peak of the same model and batch.
- The DTR methods (eager runtime and `backend="dtr"`) get the bytes: the same absolute budget for both, and
  the table can check the measured peak against it.
- PyTorch's `activation_memory_budget` gets the fraction as its own knob (a fraction of *saved* bytes, not
  of the peak); its measured peak shows where that lands.
- Plain eager and per-block `torch.utils.checkpoint` ignore the budget: one point each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import upstairs
from .models import BenchCase


class NotBuilt(Exception):
    """The method's implementation is missing from this tree (not an error of the method itself)."""


@dataclass(frozen=True)
class Budget:
    fraction: float | None  # nominal grid value; None for budget-independent methods
    bytes: int | None  # fraction x baseline measured peak (None when there is no baseline yet)


Step = Callable[[], float]


@dataclass(frozen=True)
class Method:
    name: str
    label: str  # for tables and plot legends
    uses_budget: bool  # False: one run, whatever the budget grid
    compiles: bool  # True: the first step includes a compile (reported separately)
    prepare: Callable[[BenchCase, Budget, Any], Step]  # (case, budget, batch) -> step


def _forward_backward(forward: Callable[..., Any], case: BenchCase, batch: Any) -> float:
    inputs, target = batch
    loss = case.loss_fn(forward(*inputs), target)
    loss.backward()
    return float(loss.detach())


# ------------------------------------------------------------------------------------ the methods


def _eager(case: BenchCase, budget: Budget, batch: Any) -> Step:
    return functools.partial(_forward_backward, case.model, case, batch)


def _checkpoint(case: BenchCase, budget: Budget, batch: Any) -> Step:
    for block in case.model.blocks:
        _checkpoint_module(block)
    return functools.partial(_forward_backward, case.model, case, batch)


def _checkpoint_module(block: nn.Module, **checkpoint_kwargs: Any) -> None:
    # Replacing the instance's `forward` keeps the module where it is (HF models index their layers),
    # and `nn.Module.__call__` still runs hooks outside the checkpoint.
    inner = block.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **checkpoint_kwargs, **kwargs)

    block.forward = forward


def _amb(backend: str) -> Callable[[BenchCase, Budget, Any], Step]:
    """PyTorch's own knob, `torch._functorch.config.activation_memory_budget`, under `backend`."""

    def prepare(case: BenchCase, budget: Budget, batch: Any) -> Step:
        import torch._functorch.config as functorch_config

        # Read by the min-cut partitioner when the graph compiles (on the first step); the child is a
        # fresh process, so setting it for the process is scoped enough.
        functorch_config.activation_memory_budget = budget.fraction
        compiled = torch.compile(case.model, backend=backend)
        return functools.partial(_forward_backward, compiled, case, batch)

    return prepare


def _compile(case: BenchCase, budget: Budget, batch: Any) -> Step:
    """torch.compile with Inductor and nothing else: the frontier's reference point (issue 17)."""
    return functools.partial(_forward_backward, torch.compile(case.model), case, batch)


def _hf_checkpoint_compile(case: BenchCase, budget: Budget, batch: Any) -> Step:
    """What a `transformers` user writes: `model.gradient_checkpointing_enable()`, then torch.compile."""
    hf = getattr(case.model, "hf", None)
    if hf is None or not getattr(hf, "supports_gradient_checkpointing", False):
        raise ValueError(f"{case.name} is not a transformers model with gradient checkpointing; use gpt2 or llama")
    # Non-reentrant: the reentrant autograd.Function breaks Dynamo's graph at every block.
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return functools.partial(_forward_backward, torch.compile(case.model), case, batch)


# Matmul-like and attention ops: expensive to recompute, cheap to store next to the pointwise ops around them.
_SAVE_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_cudnn_attention")  # fmt: skip


def save_matmuls_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective activation checkpointing: save matmul and attention outputs, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    saved = {getattr(torch.ops.aten, name).default for name in _SAVE_OPS if hasattr(torch.ops.aten, name)}
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _sac_compile(case: BenchCase, budget: Budget, batch: Any) -> Step:
    """Per-block selective activation checkpointing with the save-matmuls policy, then torch.compile."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    context_fn = functools.partial(create_selective_checkpoint_contexts, save_matmuls_policy)
    for block in case.model.blocks:
        _checkpoint_module(block, context_fn=context_fn)
    return functools.partial(_forward_backward, torch.compile(case.model), case, batch)


def _dtr_runtime(case: BenchCase, budget: Budget, batch: Any) -> Step:
    try:
        runtime = upstairs.load("runtime")
        enable = runtime.enable
    except (ImportError, AttributeError) as exc:
        raise NotBuilt(f"dtr_compile.runtime.enable is missing: {exc}") from exc
    state: dict[str, Any] = {}

    def step() -> float:
        with enable(memory_budget=budget.bytes) as rt:
            loss = _forward_backward(case.model, case, batch)
        state["stats"] = rt.stats()
        return loss

    step.runtime_state = state  # type: ignore[attr-defined]  # the child reports the last stats
    return step


def _dtr_backend(codegen: str) -> Callable[[BenchCase, Budget, Any], Step]:
    def prepare(case: BenchCase, budget: Budget, batch: Any) -> Step:
        try:
            backend = upstairs.load("backend").dtr_backend
        except (ImportError, AttributeError) as exc:
            raise NotBuilt(f"dtr_compile.backend.dtr_backend is missing: {exc}") from exc
        from dtr_compile import config

        # The flags stay set for the child's lifetime: the backend may read them at compile and at run time.
        config.memory_budget = budget.bytes
        config.codegen = codegen
        compiled = torch.compile(case.model, backend=_by_name_if_registered("dtr", backend))
        return functools.partial(_forward_backward, compiled, case, batch)

    return prepare


def _by_name_if_registered(name: str, fallback: Callable) -> str | Callable:
    # `backend="dtr"` resolves through the entry point when the package is installed (what users write);
    # the callable is the same function and also works from a source checkout that was never installed.
    try:
        torch._dynamo.lookup_backend(name)
    except Exception:  # noqa: BLE001 - any lookup failure: use the callable
        return fallback
    return name


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("eager", "plain eager (baseline)", False, False, _eager),
        Method("checkpoint", "torch.utils.checkpoint per block", False, False, _checkpoint),
        Method("compile", "torch.compile (Inductor)", False, True, _compile),
        Method("hf_ckpt_compile", "HF gradient checkpointing + compile", False, True, _hf_checkpoint_compile),
        Method("sac_compile", "selective checkpointing (save matmuls) + compile", False, True, _sac_compile),
        Method("amb_inductor", "activation_memory_budget, Inductor", True, True, _amb("inductor")),
        Method("amb_aot_eager", "activation_memory_budget, aot_eager", True, True, _amb("aot_eager")),
        Method("dtr_eager", "DTR eager runtime", True, False, _dtr_runtime),
        Method("dtr_inductor", 'backend="dtr", Inductor', True, True, _dtr_backend("inductor")),
        Method("dtr_fx", 'backend="dtr", fx', True, True, _dtr_backend("fx")),
    )
}
BASELINE = "eager"
# The frontier's own methods (frontier.py): compiled with Inductor, one compile each. The general bench runs them
# only when --methods names them, so --quick keeps its few compiles.
FRONTIER_ONLY = ("compile", "hf_ckpt_compile", "sac_compile")


def get_method(name: str) -> Method:
    """The method called `name`; unknown names raise ValueError listing the accepted ones."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; expected one of {', '.join(METHODS)}")
    return METHODS[name]
