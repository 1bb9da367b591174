"""One budget across graph breaks: a transformer with a data-dependent branch in every block.

    python examples/04_graph_breaks.py [--device cuda|cpu]   # default: cuda when a CUDA device is present

`if h.mean() > 0:` in every block makes TorchDynamo break the graph there, and the sequence length changes
from step to step. With `torch.compile(model, backend="dtr")` and a memory budget, each training step runs
under the eager DTR runtime: the compiled regions are operations it can evict and recompute, and the code
between them is managed too. No call in the training loop is needed. Prints the measured peak of each step
against the budget, the step time against plain eager, and what the runtime did across regions.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import dtr_compile
from dtr_compile.bench.dynamic_models import build_dynamic
from dtr_compile.measure import add_device_argument, device_from_args, measure_peak, move_to, synchronize


def train(model, case, steps: int, device: torch.device) -> list[tuple[float, int, float]]:
    """(loss, measured peak, seconds) of each SGD step on the case's changing batches, on `device`."""
    optimizer = torch.optim.SGD(case.model.parameters(), lr=0.01)
    results = []
    for step in range(steps):
        inputs, target = move_to(case.batch(step), device)

        def body(inputs=inputs, target=target) -> float:
            loss = case.loss_fn(model(*inputs), target)
            loss.backward()
            return loss.item()

        synchronize(device)
        start = time.perf_counter()
        loss, measured = measure_peak(body, device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        results.append((loss, measured.peak_bytes, time.perf_counter() - start))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    device = device_from_args(parser, parser.parse_args().device)
    torch.set_num_threads(1)
    case = build_dynamic("transformer_branch", "tiny")
    case.model.to(device)
    initial = copy.deepcopy(case.model.state_dict())
    steps = 6
    eager = train(case.model, case, steps, device)
    peak = max(p for _, p, _ in eager)
    print(f"{case.description}, on {device}; plain eager: peak {peak / 2**20:.1f} MiB, "
          f"median step {sorted(t for *_, t in eager)[steps // 2] * 1e3:.0f} ms")
    for fraction in (0.5, 0.3):
        case.model.load_state_dict(initial)
        torch._dynamo.reset()
        budget = int(fraction * peak)
        with dtr_compile.config.patch(memory_budget=budget, codegen="fx"):
            compiled = torch.compile(case.model, backend="dtr")
            results = train(compiled, case, steps, device)
        stats = dtr_compile.runtime.implicit_runtime().stats()
        later = results[1:]  # the first step compiles
        same = all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for (a, _, _), (b, _, _) in zip(results, eager))
        print(f"budget {fraction} ({budget / 2**20:.1f} MiB): measured peak / budget "
              f"{max(p for _, p, _ in later) / budget:.3f}, median step "
              f"{sorted(t for *_, t in later)[len(later) // 2] * 1e3:.0f} ms (first step, compiling: "
              f"{results[0][2]:.1f} s), losses equal eager's: {same}")
        print(f"  {stats}")


if __name__ == "__main__":
    main()
