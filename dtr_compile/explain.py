"""`dtr_compile.explain(model, *inputs)`: what the compiled path saves, what it recomputes, and where.

    report = dtr_compile.explain(model, x, memory_budget=0.5)
    print(report)                       # per tensor: saved or recomputed, bytes, cost, source line
    report.plot("memory.png")           # memory over the schedule with the budget line (matplotlib)

It compiles the model with the FX code generator and runs one forward pass (the plan is made when the
forward compiles); parameters, buffers and gradients are restored afterwards, so it has no side effects.
The plan is made for the device the model and inputs are on (CPU or CUDA: the examples pass `--device`);
parameters and inputs on different devices are refused with a `DeviceError` before anything compiles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import config
from .errors import DeviceError, format_bytes

if TYPE_CHECKING:  # torch is imported on first use, so that `import dtr_compile` stays light
    import torch
    from torch import fx

    from .passes.partition import PlanReport

__all__ = ["Explanation", "TensorDecision", "explain"]


@dataclass(frozen=True)
class TensorDecision:
    name: str  # node name in the joint graph
    decision: str  # "saved" or "recomputed"
    nbytes: int
    recomputes: int  # how many times the backward (or forward) runs it again
    cost_s: float  # modelled time of one computation
    source: str | None


@dataclass
class Explanation:
    reports: list[PlanReport]

    def decisions(self, region: int = -1) -> list[TensorDecision]:
        """Saved and recomputed tensors of one compiled region (default: the last one)."""
        return _decisions(self.reports[region])

    def __str__(self) -> str:
        parts = []
        for i, report in enumerate(self.reports):
            budget = "none" if report.budget_bytes is None else format_bytes(report.budget_bytes)
            plan = report.plan
            parts.append(
                f"region {i}: planned peak {format_bytes(report.planned_peak.peak_bytes)} against budget {budget} "
                f"(no-remat peak {format_bytes(report.no_remat.peak_bytes)}); recompute "
                f"{plan.recompute_s * 1e3:.2f} ms modelled over {plan.compute_s * 1e3:.2f} ms of compute; "
                f"planned in {plan.planning_s:.3f} s"
            )
            parts.append(f"  {report.times}")
            parts.append(f"  {_tail_line(report)}")
            parts.append(f"  {'tensor':<36} {'decision':<14} {'bytes':>12} {'cost':>10}  source")
            for d in _decisions(report):
                what = d.decision if d.recomputes <= 1 else f"{d.decision} x{d.recomputes}"
                parts.append(
                    f"  {d.name:<36} {what:<14} {format_bytes(d.nbytes):>12} {d.cost_s * 1e6:>8.1f}us  {d.source or ''}"
                )
        return "\n".join(parts)

    def plot(self, path: str, region: int = -1) -> str:
        """Memory over the schedule (no remat vs the plan) with the budget line; needs matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ImportError(
                "Explanation.plot needs matplotlib: 1) pip install matplotlib  2) call report.plot(path) again"
            ) from exc
        report = self.reports[region]
        figure, axes = plt.subplots(figsize=(9, 4))
        for model, label in ((report.no_remat, "no remat"), (report.planned_peak, "planned")):
            axes.plot([p.bytes_live / 2**20 for p in model.timeline], label=label)
        if report.budget_bytes is not None:
            axes.axhline(report.budget_bytes / 2**20, color="red", linestyle="--", label="budget")
        axes.set_xlabel("op in schedule (forward, then backward)")
        axes.set_ylabel("MiB above step start")
        axes.legend()
        figure.tight_layout()
        figure.savefig(path)
        plt.close(figure)
        return path


def _tail_line(report: PlanReport) -> str:
    """What the plan leaves room for between its forward and backward (the loss: passes/storage.Tail)."""
    from .passes.storage import TAIL_META_KEY, StorageMap, assumed_tail, tangent_placeholders

    graph = report.planned.graph
    tangents = tangent_placeholders(graph)
    storages = StorageMap(graph, counted_inputs=set(tangents))
    tangent_bytes = sum(storages.info[k].nbytes for t in tangents for k in storages.keys[t])
    tail = assumed_tail(tangents, tangent_bytes)
    how = "measured by a step" if any(TAIL_META_KEY in t.meta for t in tangents) else "assumed"
    if report.least_tail:
        how = "the least, until a step measures it: the assumed one left the budget no plan"
    let_go = ""
    if tail.dropped_outputs:
        positions = ", ".join(str(p) for p in sorted(tail.dropped_outputs))
        let_go = f"; outputs {positions} let go before the backward (freed there unless the plan saves them)"
    return (
        f"loss tail ({how}): {format_bytes(tail.peak_bytes)} at most after the forward, "
        f"{format_bytes(tail.at_backward_bytes)} at the backward's start (tangents included){let_go}"
    )


def _decisions(report: PlanReport) -> list[TensorDecision]:
    from .passes.rewrite import RECOMPUTE_META_KEY
    from .passes.storage import StorageMap

    graph = report.planned.graph
    storages = StorageMap(graph)
    backward = [n for n in graph.nodes if n.meta.get("partitioner_tag") == "is_backward"]
    recomputed: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if RECOMPUTE_META_KEY in node.meta:
            recomputed.setdefault(node.meta[RECOMPUTE_META_KEY], []).append(node)
    saved: dict[str, fx.Node] = {}
    for reader in backward:
        for arg in reader.all_input_nodes:
            forward = arg.op == "call_function" and arg.meta.get("partitioner_tag") == "is_forward"
            if forward and storages.allocated_bytes(arg) > 0:
                saved.setdefault(arg.name, arg)
    rows = []
    for name, node in saved.items():
        rows.append(_row(name, "saved", node, storages.allocated_bytes(node), 0))
    for name, nodes in recomputed.items():
        nbytes = storages.allocated_bytes(nodes[0])
        if nbytes > 0:  # views are re-derived for free; listing them would only add noise
            rows.append(_row(name, "recomputed", nodes[0], nbytes, len(nodes)))
    order = {n.name: i for i, n in enumerate(report.joint.graph.nodes)}
    return sorted(rows, key=lambda r: (order.get(r.name, len(order)), r.decision))


def _row(name: str, decision: str, node: fx.Node, nbytes: int, count: int) -> TensorDecision:
    from .passes.meta import DTR_META_KEY

    cost = node.meta.get(DTR_META_KEY)
    return TensorDecision(
        name=name,
        decision=decision,
        nbytes=nbytes,
        recomputes=count,
        cost_s=cost.time_s if cost is not None else 0.0,
        source=cost.source if cost is not None else None,
    )


def explain(
    model: torch.nn.Module, *inputs: Any, memory_budget: Any = "config", cost_mode: str = "estimate"
) -> Explanation:
    """Plan `model(*inputs)` under `memory_budget` (default: `dtr_compile.config.memory_budget`)."""
    import torch

    from .backend import make_backend

    budget = config.memory_budget if memory_budget == "config" else memory_budget
    _check_one_device(model, inputs)
    backend = make_backend(budget, codegen="fx", cost_mode=cost_mode)  # type: ignore[arg-type]
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    torch._dynamo.reset()
    try:
        with torch.enable_grad():
            torch.compile(model, backend=backend)(*inputs)
    finally:
        torch._dynamo.reset()
        model.load_state_dict(state)
        for name, param in model.named_parameters():
            param.grad = grads[name]
    if not backend.reports:
        raise ValueError(
            "explain found no trainable region: the model produced no graph that needs a backward "
            "(are any parameters or inputs requiring grad?)"
        )
    return Explanation(list(backend.reports))


def _check_one_device(model: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
    import torch

    where: dict[str, str] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        where.setdefault(str(tensor.device), f"parameter or buffer {name!r}")
    for i, value in enumerate(inputs):
        if isinstance(value, torch.Tensor):
            where.setdefault(str(value.device), f"input {i}")
    if len(where) > 1:
        found = ", ".join(f"{what} on {device}" for device, what in where.items())
        raise DeviceError(
            f"explain plans one device, but the model and inputs span {len(where)}: {found}. Move both to one "
            "device first, e.g. model.to(device) and x.to(device)"
        )
