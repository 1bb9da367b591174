"""The kernels suite's counts on planned graphs (nothing timed, CPU is enough): recompute launches and traffic,
fused against op by op (`--structure`), and the kernels Inductor generates for a plan's backward
(`--inductor-kernels`)."""

from __future__ import annotations

import argparse
import re

import torch

from ... import config
from .. import upstairs
from ..block_models import written_out_gpt
from ..markdown import mib_or_kib as mib


def model_of(args: argparse.Namespace, device: torch.device | str) -> tuple[torch.nn.Module, torch.Tensor]:
    return written_out_gpt(args.layers, args.dim, args.heads, args.seq, args.batch, args.dropout, device)


def compile_dtr(model: torch.nn.Module, budget: float, codegen: str) -> object:
    """backend="dtr" at `budget`; it plans (and fuses) on the first call, under the caller's config patch.
    The compiled model carries the backend's reports (`compiled.reports[-1]`: the last region's plan)."""
    backend = upstairs.load("backend").make_backend(budget, codegen=codegen)
    compiled = torch.compile(model, backend=backend)
    compiled.reports = backend.reports
    return compiled


def recompute_traffic(graph: torch.fx.Graph, absorbed: frozenset[str] = frozenset()) -> tuple[int, int]:
    """(launches, bytes read + written) of the backward's recomputes: one launch per recompute op that allocates
    (views launch nothing) or per fused kernel, traffic = its tensor inputs and outputs (counted from the graph).
    `absorbed`: backward ops the kernels took in (a dropout's backward), counted on the op-by-op side too."""
    fused_key = upstairs.load("passes.fuse_recompute").FUSED_META_KEY
    recompute_key = upstairs.load("passes.rewrite").RECOMPUTE_META_KEY
    storage = upstairs.load("passes.storage")
    storages = storage.StorageMap(graph)
    launches = traffic = 0
    for node in graph.nodes:
        if fused_key not in node.meta and recompute_key not in node.meta and node.name not in absorbed:
            continue
        written = storages.allocated_bytes(node)
        if written == 0:
            continue
        launches += 1
        traffic += written + sum(storage.tensor_nbytes(a.meta.get("val")) for a in set(node.all_input_nodes))
    return launches, traffic


def structure(args: argparse.Namespace) -> list[str]:
    """Kernel launches and memory traffic of the recomputes, fused and unfused: counted on the planned graphs of
    the full-size model (planned on CPU; nothing is timed)."""
    model, x = model_of(args, "cpu")
    with config.patch(codegen="fx", recompute_kernels="off"):
        compiled = compile_dtr(model, args.budget, "fx")
        compiled(x)  # plans the region (the forward runs op by op on CPU)
    report = compiled.reports[-1]
    fusion = upstairs.load("passes.fuse_recompute").fuse_recomputes(
        report.planned, num_fwd_outputs=report.num_fwd_outputs, budget_bytes=report.budget_bytes, codegen="fx",
        mode="triton",
    )  # fmt: skip
    planned = {n.name: n for n in report.planned.graph.nodes}
    absorbed = frozenset(
        m
        for region in fusion.regions
        for m in region.members
        if m in planned and "dtr_recompute_of" not in planned[m].meta
    )
    plain_launches, plain_traffic = recompute_traffic(report.planned.graph, absorbed)
    fused_launches, fused_traffic = recompute_traffic(fusion.graph.graph)
    return [
        f"### Recompute work per backward at budget {args.budget} (counted on the graphs, not timed)",
        "",
        "| recompute | launches | bytes read + written | modelled peak |",
        "|---|---|---|---|",
        f"| op by op | {plain_launches} | {mib(plain_traffic)} | {mib(report.planned_peak.peak_bytes)} |",
        f"| fused kernels | {fused_launches} | {mib(fused_traffic)} | {mib(fusion.peak.peak_bytes)} |",
        (
            f"| fused / op by op | {fused_launches / plain_launches:.3f} | {fused_traffic / plain_traffic:.3f} | "
            f"{fusion.peak.peak_bytes / report.planned_peak.peak_bytes:.3f} |"
        ),
        "",
        f"Model: layers {args.layers}, dim {args.dim}, heads {args.heads}, seq {args.seq}, batch {args.batch}, "
        f"dropout {args.dropout}; budget {mib(report.budget_bytes)} ({args.budget} of the no-remat peak "
        f"{mib(report.no_remat.peak_bytes)}). {len(fusion.regions)} regions fused, {len(absorbed)} of them with the "
        "backward op that reads them (counted on both sides); left as they are: "
        + ", ".join(sorted({why.split(" for ")[-1] for _, why in fusion.unfused}))
        + ".",
        "",
    ]


def inductor_kernels(args: argparse.Namespace, device: torch.device) -> list[str]:
    """What Inductor makes of a plan's recomputes: the fused kernels of the backward it generates for
    `backend="dtr"` at the budget (C++ on CPU, Triton on CUDA; the scheduler's fusion decisions are the same)."""
    from torch._inductor.utils import run_and_get_code

    model, x = model_of(args, device)
    with config.patch(codegen="inductor"):
        compiled = compile_dtr(model, args.budget, "inductor")
        _, codes = run_and_get_code(lambda: compiled(x).sum().backward())
    report = compiled.reports[-1]
    recomputes = sum(1 for n in report.planned.graph.nodes if "dtr_recompute_of" in n.meta)
    backward = codes[-1]
    kernels = re.findall(r"^(?:cpp|triton)_\w+", backward, re.MULTILINE)
    kernels = sorted(set(kernels), key=kernels.index)
    externs = len(re.findall(r"extern_kernels\.\w+\(", backward))
    return [
        f"### What Inductor does with the plan's recomputes (budget {args.budget}, {device.type})",
        "",
        (
            f"The plan recomputes {recomputes} nodes; Inductor's backward has {len(kernels)} generated kernels and "
            f"{externs} library calls (matmuls). Its kernels, named after the ops fused into them:"
        ),
        "",
        *[f"- `{k}`" for k in kernels],
        "",
    ]
