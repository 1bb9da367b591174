"""Suite `kernels`: recompute kernels on a GPT-2-style model, backward time fused vs unfused, and the step against
PyTorch's knob.

    python -m dtr_compile.bench kernels                 # CUDA: the figures BENCHMARKS.md asks for
    python -m dtr_compile.bench kernels --smoke         # CPU, tiny sizes, Triton's interpreter: checks the suite
    python -m dtr_compile.bench kernels --structure     # launches and traffic counted on the graphs (CPU)

1. Backward at one budget (default 0.5 of the no-remat peak), `backend="dtr"` with `codegen="fx"`:
   `recompute_kernels="triton"` (one Triton kernel per recompute region) against `"off"` (the planned
   recomputes op by op), the same plan. Forward and backward are timed separately (synchronized wall time
   around each), rounds interleaved, medians reported; the ratio is fused / unfused backward time.
2. End to end against PyTorch's knob: the fused step above (measured peak P) against Inductor with
   `torch._functorch.config.activation_memory_budget` at the largest knob value in a grid whose measured
   peak is within 2% of P or below it, and against `backend="dtr"` under Inductor at the same budget (there our
   pass steps aside and Inductor fuses the recomputes itself). Step time ratio = ours / theirs.
Peaks come from `dtr_compile.measure.measure_peak` (allocator statistics on CUDA, profiler events on CPU).
A smoke run prints the same tables, but its times are Triton's interpreter on CPU: they mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable, Sequence

import torch

from ... import config
from ...measure import measure_peak
from .. import provenance
from ..markdown import mib_or_kib as mib
from ..markdown import table, write
from ..timing import interleaved, median, timed
from .args import positive
from .kernels_graphs import compile_dtr, inductor_kernels, model_of, structure

SUMMARY = "recompute kernels: backward fused vs op by op, and the step against the knob at equal peak (CUDA)"
DEFAULT_KNOBS = "1.0,0.8,0.6,0.5,0.4,0.3,0.2,0.1,0.0"  # PyTorch's knob values tried, largest first
PEAK_SLACK = 1.02  # a knob value "reaches our peak" within 2% of it


def compile_knob(model: torch.nn.Module, knob: float) -> Callable:
    """Inductor with PyTorch's knob set while the graph compiles. A backend function of its own per knob value:
    Dynamo shares compiled code between copies of a module when the backends compare equal, and two
    `backend="inductor"` wrappers do, whatever the knob was when each compiled."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        with torch._functorch.config.patch(activation_memory_budget=knob, enable_autograd_cache=False):
            return compile_fx(gm, example_inputs)

    return torch.compile(model, backend=backend)


class Way:
    """One way to run the step, on its own copy of the model (Dynamo keeps one compiled entry per module object,
    so the ways never share or overwrite each other's compiled code): compiled and warm, its measured peak, its
    forward and backward times."""

    def __init__(self, name: str, model: torch.nn.Module, x: torch.Tensor, build: Callable, patch: dict) -> None:
        self.name, self.model, self.x, self.patch = name, copy.deepcopy(model), x, patch
        with config.patch(**patch):
            self.compiled = build(self.model)
            self.step()  # compile
            self.step()
            _, measurement = measure_peak(self.step, x.device)
        self.peak = measurement.peak_bytes
        self.forward_s: list[float] = []
        self.backward_s: list[float] = []

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.compiled(self.x).sum().backward()

    def timed_round(self) -> None:
        self.model.zero_grad(set_to_none=True)
        with config.patch(**self.patch):
            loss, forward = timed(lambda: self.compiled(self.x).sum(), self.x.device)
            self.forward_s.append(forward.wall_s)
            self.backward_s.append(timed(loss.backward, self.x.device)[1].wall_s)

    @property
    def step_s(self) -> float:
        return median([f + b for f, b in zip(self.forward_s, self.backward_s, strict=True)])


def time_side_by_side(ways: list[Way], rounds: int) -> None:
    """Timed rounds, one step of every way per round; a recompile here would be timed, so it is an error."""
    with torch.compiler.set_stance("fail_on_recompile"):
        for way in interleaved(ways, rounds):
            way.timed_round()


def knob_ways(
    model: torch.nn.Module, x: torch.Tensor, knobs: Sequence[float], peak: int
) -> tuple[list[Way], list[str]]:
    """The knob values in order until one reaches `peak`: their ways, and each value's peak (or failure)."""
    ways, tried = [], []
    for knob in knobs:
        try:
            way = Way(f"Inductor, activation_memory_budget={knob}", model, x, lambda m, k=knob: compile_knob(m, k), {})
        except Exception as error:  # noqa: BLE001 - a knob value that does not compile is reported, not fatal
            tried.append(f"{knob}: {type(error).__name__}")
            continue
        tried.append(f"{knob}: {mib(way.peak)}")
        ways.append(way)
        if way.peak <= PEAK_SLACK * peak:
            break
    return ways, tried


def timed_tables(args: argparse.Namespace, device: torch.device) -> list[str]:
    """Sections 1 and 2 of the docstring: fused against op by op, then against the knob and Inductor."""
    model, x = model_of(args, device)
    dtr_fx = lambda m: compile_dtr(m, args.budget, "fx")
    fused = Way("dtr fx, kernels", model, x, dtr_fx, {"codegen": "fx", "recompute_kernels": "triton"})
    unfused = Way("dtr fx, op by op", model, x, dtr_fx, {"codegen": "fx", "recompute_kernels": "off"})
    fusion = fused.compiled.reports[-1].fusion
    assert fusion.enabled and fusion.regions, f"the kernels are not on: {fusion.reason}"
    assert not unfused.compiled.reports[-1].fusion.enabled
    recomputes = sum(1 for n in fused.compiled.reports[-1].planned.graph.nodes if "dtr_recompute_of" in n.meta)
    lines = [
        (
            f"The plan recomputes {recomputes} nodes (views included); the pass fuses {len(fusion.regions)} regions "
            f"({sum(len(r.members) for r in fusion.regions)} nodes) and leaves {len(fusion.unfused)} compute nodes "
            f"(matmuls, transposes, ...) as they are; {fusion.dropouts} dropouts draw from the counter-based RNG."
        ),
        "",
    ]
    time_side_by_side([fused, unfused], args.rounds)
    backward_ratio = median(fused.backward_s) / median(unfused.backward_s)
    lines += [
        f"### Backward at budget {args.budget}: fused / unfused = {backward_ratio:.3f}",
        "",
        *table(
            ("way", "budget", "measured peak", "median forward", "median backward"),
            ([way.name, mib(way.compiled.reports[-1].budget_bytes), mib(way.peak), f"{median(way.forward_s) * 1e3:.2f} ms",
              f"{median(way.backward_s) * 1e3:.2f} ms"] for way in (fused, unfused)),
        ),
    ]  # fmt: skip

    # PyTorch's knob: the largest setting whose measured peak is within 2% of ours or below; when none gets
    # there, the one with the lowest peak, said so.
    knobs, tried = knob_ways(model, x, args.knobs, fused.peak)
    ways = [fused]
    knob_note = "no knob value compiled"
    if knobs:
        reached = knobs[-1].peak <= PEAK_SLACK * fused.peak
        knob_way = knobs[-1] if reached else min(knobs, key=lambda w: w.peak)
        ways.append(knob_way)
        knob_note = (
            "its measured peak is within 2% of ours or below"
            if reached
            else f"no knob value reaches our peak; the lowest it reaches is {mib(knob_way.peak)}"
        )
    try:
        dtr_inductor = lambda m: compile_dtr(m, args.budget, "inductor")
        ways.append(Way("dtr Inductor (pass steps aside)", model, x, dtr_inductor, {"codegen": "inductor"}))
    except Exception as error:  # noqa: BLE001
        named = [line for line in str(error).splitlines() if "Error" in line]  # Dynamo wraps the real one
        first = named[-1] if named else str(error).strip()[:300]
        lines += ["", f"`backend='dtr'` under Inductor at {args.budget} failed: {type(error).__name__}: {first[:300]}"]
    fused.forward_s.clear()
    fused.backward_s.clear()
    time_side_by_side(ways, args.rounds)
    lines += [
        "",
        "### Step time against PyTorch's knob at equal measured peak",
        "",
        f"Knob values tried (measured peak): {'; '.join(tried)}. Compared: {knob_note}.",
        "",
        *table(
            ("way", "measured peak", "median step", "ours (fused) / this way"),
            (
                [way.name, mib(way.peak), f"{way.step_s * 1e3:.2f} ms", f"{fused.step_s / way.step_s:.3f}"]
                for way in ways
            ),
        ),
    ]
    return lines


def _knobs(text: str) -> list[float]:
    try:
        return [float(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated knob values, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dtr_compile.bench kernels", description=SUMMARY)
    p.add_argument("--layers", type=positive, default=4)
    p.add_argument("--dim", type=positive, default=768)
    p.add_argument("--heads", type=positive, default=12)
    p.add_argument("--seq", type=positive, default=512)
    p.add_argument("--batch", type=positive, default=8)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--rounds", type=positive, default=10)
    p.add_argument("--knobs", type=_knobs, default=_knobs(os.environ.get("KNOBS", DEFAULT_KNOBS)),
                   help=f"activation_memory_budget values to try, largest first (default {DEFAULT_KNOBS}, or $KNOBS)")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, Triton's interpreter (no timings)")
    p.add_argument("--structure", action="store_true", help="only count recompute launches and traffic (CPU is enough)")
    p.add_argument("--inductor-kernels", action="store_true", help="only list Inductor's backward kernels for the plan")
    p.add_argument("--out", default="benchmarks/kernels.md", help="Markdown fragment to write ('-': stdout only)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.smoke or args.structure:  # chosen before the backend imports triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.structure:
        print("\n".join(structure(args)))
        return 0
    if args.inductor_kernels:
        print("\n".join(inductor_kernels(args, torch.device("cuda" if torch.cuda.is_available() else "cpu"))))
        return 0
    if args.smoke:
        args.layers, args.dim, args.heads, args.seq, args.batch, args.rounds = 2, 64, 4, 32, 4, 2
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("this suite times Triton kernels on a GPU: no CUDA device here (use --smoke to test it)", file=sys.stderr)
        return 1
    torch._dynamo.config.cache_size_limit = 64  # one entry per way, all alive at once
    torch._dynamo.config.accumulated_cache_size_limit = 256
    sizes = (
        f"layers {args.layers}, dim {args.dim}, heads {args.heads}, seq {args.seq}, batch {args.batch}, "
        f"dropout {args.dropout}, budget {args.budget}, {args.rounds} interleaved rounds"
    )
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, Triton interpreter"
    lines = [
        f"Command: `{provenance.command('kernels', argv)}` ({sizes})  ",
        f"Device: {device_name}; torch {torch.__version__}; {provenance.utc_now():%Y-%m-%d %H:%M} UTC",
        "",
    ]
    if args.smoke:
        lines += ["**Smoke run: Triton's interpreter on CPU. The times below mean nothing.**", ""]
    text = "\n".join(lines + timed_tables(args, device)) + "\n"
    print(text)
    if not args.smoke:
        write(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
