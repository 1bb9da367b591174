"""Train a small transformer block stack under a memory budget with torch.compile(backend="dtr").

    python examples/02_compiled_budget.py [--device cuda|cpu]   # default: cuda when a CUDA device is present

Runs on CPU in well under a minute (plain-FX code generation, no C++ compile): prints the measured
peak memory and time per step without a budget and at 0.7 and 0.5 of the no-remat peak, and what the plan keeps.
On CUDA the recomputes of each region run as one Triton kernel (`recompute_kernels="auto"` with codegen="fx").
"""

import argparse
import time

import torch
from torch import nn

import dtr_compile
from dtr_compile.explain import explain
from dtr_compile.measure import add_device_argument, device_from_args, measure_peak, synchronize


class Block(nn.Module):
    def __init__(self, dim: int = 128) -> None:
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x)))))


def run(model: nn.Module, x: torch.Tensor, budget) -> tuple[int, float]:
    torch._dynamo.reset()
    with dtr_compile.config.patch(memory_budget=budget, codegen="fx"):
        compiled = torch.compile(model, backend="dtr")

        def step() -> None:
            model.zero_grad(set_to_none=True)
            compiled(x).sum().backward()

        step()  # compile
        _, peak = measure_peak(step, x.device)
        # On CPU, CPU time: on a shared machine wall time mostly measures the neighbours. On CUDA, wall time
        # between synchronizations (CPU time would miss the GPU's work).
        clock = time.perf_counter if x.is_cuda else time.process_time
        synchronize(x.device)
        start = clock()
        for _ in range(5):
            step()
        synchronize(x.device)
    return peak.peak_bytes, (clock() - start) / 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    device = device_from_args(parser, parser.parse_args().device)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(6)]).to(device)
    x = torch.randn(8, 64, 128).to(device)
    clock = "time" if device.type == "cuda" else "CPU time"
    print(f"device: {device}")
    base_peak, base_time = run(model, x, None)
    print(f"no budget : peak {base_peak / 2**20:7.2f} MiB   {clock}/step {base_time * 1e3:6.1f} ms")
    for budget in (0.7, 0.5):
        peak, step_time = run(model, x, budget)
        print(
            f"budget {budget:<3}: peak {peak / 2**20:7.2f} MiB ({peak / base_peak:.2f}x)   "
            f"{clock}/step {step_time * 1e3:6.1f} ms ({step_time / base_time:.2f}x)"
        )
    report = explain(model, x, memory_budget=0.5)
    print("\n".join(str(report).splitlines()[:12]))


if __name__ == "__main__":
    main()
