"""Inductor's compiled code of a plan, traced line by line: the buffers it holds at its peak, against the plan's model.

The memory model (passes/peak.py) predicts what Inductor's code of a plan allocates; verify.py measures the code and
re-aims the plan where the two differ. This tool says *why* they differ. It compiles a bench model under
`backend="dtr"` at a budget (a fraction of torch.compile's measured peak), runs one step with a line tracer on the
`call` function of each Inductor wrapper, and at every line sums the storages that function's frame holds (the
model's parameters and the batch excluded: they are live before the step). It prints, for the forward and the
backward, the line where that sum peaks and the buffers it holds there, then the storages the model counts at its own
peak (`PeakModel.live_at_peak`), so the two lists can be set side by side.

What the frame holds is what the step allocated inside the compiled code: the backward steals its saved tensors from
autograd (`args.clear()`), so its frame's sum is the backward's whole memory, and on the Llama block with LoRA
adapters below it agreed with the measured peak to the byte (10.5215 MiB). Anything held outside the frame (the
forward's outputs while the loss runs, eager tensors) is not in the sum.

    python tools/inductor_live.py [--model llama_lora] [--size quick] [--fraction 0.4] [--top 24]

CUDA when present (`--device`; a CUDA tensor's storage is counted as a CPU one's), else CPU. Turn the on-disk caches
off (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 and a fresh DTR_COMPILE_CACHE_DIR) to see a first plan.
"""

from __future__ import annotations

import argparse
import linecache
import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch

import dtr_compile
from dtr_compile.bench.models import build_model
from dtr_compile.errors import format_bytes
from dtr_compile.measure import measure_peak
from dtr_compile.passes import running_plans
from dtr_compile.passes.partition import model_flag
from dtr_compile.passes.peak import graph_peak


@dataclass
class WrapperPeak:
    """The line of one Inductor wrapper where its frame held the most, and what it held there."""

    path: str
    line: int = 0
    held_bytes: int = -1
    buffers: list[tuple[int, list[str]]] = field(default_factory=list)  # (bytes, the frame's names for the storage)


def _held(frame: FrameType, excluded: set[int]) -> tuple[int, list[tuple[int, list[str]]]]:
    """Bytes of the distinct storages the frame's locals reference (lists of tensors too), and each one's names."""
    storages: dict[int, tuple[int, list[str]]] = {}
    for name, value in frame.f_locals.items():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, torch.Tensor):
                storage = item.untyped_storage()
                if storage.data_ptr() not in excluded:
                    storages.setdefault(storage.data_ptr(), (storage.nbytes(), []))[1].append(name)
    return sum(nbytes for nbytes, _ in storages.values()), sorted(storages.values(), key=lambda entry: -entry[0])


def traced_step(step: Any, excluded: set[int]) -> list[WrapperPeak]:
    """Run `step` with every Inductor wrapper's `call` traced; the peak line of each wrapper, in the order run."""
    peaks: dict[str, WrapperPeak] = {}

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        code = frame.f_code
        if code.co_name != "call" or "torchinductor" not in code.co_filename:
            return None
        peak = peaks.setdefault(code.co_filename, WrapperPeak(code.co_filename))

        def on_line(frame: FrameType, event: str, arg: Any) -> Any:
            if event in ("line", "return"):
                held, buffers = _held(frame, excluded)
                if held > peak.held_bytes:
                    peak.line, peak.held_bytes, peak.buffers = frame.f_lineno, held, buffers
            return on_line

        return on_line

    sys.settrace(on_call)
    try:
        step()
    finally:
        sys.settrace(None)
    return list(peaks.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama_lora")
    parser.add_argument("--size", default="quick")
    parser.add_argument("--fraction", type=float, default=0.4, help="the budget, a fraction of torch.compile's peak")
    parser.add_argument("--top", type=int, default=24, help="buffers listed per peak")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model, make_batch, loss_fn = build_model(args.model, args.size)
    model.to(args.device)
    inputs, target = make_batch(args.device)

    def step_of(compiled: Any) -> Any:
        def step() -> None:
            loss_fn(compiled(*inputs), target).backward()
            model.zero_grad(set_to_none=True)

        return step

    reference = step_of(torch.compile(model))
    reference()
    reference_peak = measure_peak(reference, args.device)[1].peak_bytes
    torch._dynamo.reset()
    budget = int(args.fraction * reference_peak)
    with dtr_compile.config.patch(memory_budget=budget, codegen="inductor"):
        step = step_of(torch.compile(model, backend="dtr"))
        for _ in range(2):  # the first step runs FX code; Inductor's plan is compiled when it ends
            step()
        step_peak = measure_peak(step, args.device)[1].peak_bytes
        before_step = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), *inputs, target)}
        wrappers = traced_step(step, before_step)

    print(f"{args.model} {args.size} on {args.device}: budget {format_bytes(budget)} ({args.fraction} of torch.compile's "
          f"{format_bytes(reference_peak)}); the step measured {format_bytes(step_peak)}")  # fmt: skip
    for name, report in running_plans.running().items():
        model_peak = graph_peak(
            report.planned.graph,
            num_fwd_outputs=report.num_fwd_outputs,
            inductor=model_flag(report.memory_model),
            record_live=True,
        )
        measured = report.measured_peak_bytes
        against = f"{format_bytes(measured)} ({measured / model_peak.peak_bytes:.3f}x)" if measured else "not measured"
        print(f"\n{name}: {report.memory_model} model {format_bytes(model_peak.peak_bytes)} at {model_peak.peak_node}; "
              f"verify.py measured {against}")  # fmt: skip
        print("  the model counts at its peak:")
        for node, nbytes in model_peak.live_at_peak[: args.top]:
            print(f"    {format_bytes(nbytes):>12}  {node}")
    for wrapper in wrappers:
        text = linecache.getline(wrapper.path, wrapper.line).strip()
        print(
            f"\n{wrapper.path}: the frame held {format_bytes(wrapper.held_bytes)} at line {wrapper.line}: {text[:160]}"
        )
        for nbytes, names in wrapper.buffers[: args.top]:
            print(f"    {format_bytes(nbytes):>12}  {', '.join(names)}")


if __name__ == "__main__":
    main()
