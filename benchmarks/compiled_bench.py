"""Benchmark of the compiled path on CPU: dtr budgets vs PyTorch's activation_memory_budget vs checkpoint.

    python benchmarks/compiled_bench.py [--models gpt cnn] [--out benchmarks/compiled.md]

For each model: the no-remat step (Inductor, no budget) sets the reference peak and step time; then
`backend="dtr"` at budgets 1.0/0.7/0.5/0.35/0.25 (Inductor codegen), PyTorch's Inductor with
`torch._functorch.config.activation_memory_budget` at the same settings, and
`torch.utils.checkpoint` on every block compiled by Inductor. Peaks come from
`dtr_compile.measure.measure_peak` (profiler allocation events). Step time is the process CPU time of
one step on one thread (the fastest of 5): on a shared machine wall-clock time measures the neighbours'
load, CPU time of a single-threaded process does not.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import dtr_compile
from dtr_compile.backend import make_backend
from dtr_compile.measure import measure_peak

BUDGETS = (1.0, 0.7, 0.5, 0.35, 0.25)


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, heads: int = 4, layers: int = 4, ckpt: bool = False) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Embedding(256, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class CNN(nn.Module):
    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        self.ckpt = ckpt
        widths = (3, 32, 32, 64, 64, 64)
        self.blocks = nn.ModuleList(ConvBlock(a, b) for a, b in itertools.pairwise(widths))
        self.head = nn.Linear(widths[-1], 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return self.head(x.mean((2, 3))).sum()


def make(name: str, ckpt: bool = False) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(ckpt=ckpt), (torch.randint(0, 512, (4, 128)),)
    return CNN(ckpt=ckpt), (torch.randn(8, 3, 48, 48),)


def measure(model: nn.Module, inputs, compiled) -> tuple[int, float]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        compiled(*inputs).backward()

    step()  # compile
    step()
    _, peak = measure_peak(step)
    times = []
    for _ in range(5):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return peak.peak_bytes, min(times)


def run_model(name: str) -> list[tuple[str, str, float, float]]:
    rows = []
    torch._dynamo.reset()
    model, inputs = make(name)
    base_peak, base_time = measure(model, inputs, torch.compile(model))
    rows.append(("no remat (Inductor)", "-", 1.0, 1.0))
    print(f"[{name}] no-remat peak {base_peak} B, step {base_time * 1e3:.1f} ms", flush=True)
    for budget in BUDGETS:
        torch._dynamo.reset()
        backend = make_backend(budget, codegen="inductor")
        try:
            peak, step_time = measure(model, inputs, torch.compile(model, backend=backend))
            plan = backend.reports[-1]
            note = f"planned {plan.planned_peak.peak_bytes / base_peak:.2f}, planning {plan.plan.planning_s:.2f}s"
            rows.append((f"dtr {budget}", note, peak / base_peak, step_time / base_time))
        except torch._dynamo.exc.BackendCompilerFailed as exc:  # an infeasible budget names the smallest feasible
            reason = next((line for line in str(exc).splitlines() if "BudgetError" in line), str(exc))
            rows.append((f"dtr {budget}", reason[:200], math.nan, math.nan))
        print(rows[-1], flush=True)
    for knob in BUDGETS + (0.1, 0.0):
        torch._dynamo.reset()
        with torch._functorch.config.patch(activation_memory_budget=knob):
            peak, step_time = measure(model, inputs, torch.compile(model))
        rows.append((f"activation_memory_budget {knob}", "-", peak / base_peak, step_time / base_time))
        print(rows[-1], flush=True)
    torch._dynamo.reset()
    ckpt_model, _ = make(name, ckpt=True)
    ckpt_model.load_state_dict(model.state_dict())
    peak, step_time = measure(ckpt_model, inputs, torch.compile(ckpt_model))
    rows.append(("checkpoint every block", "-", peak / base_peak, step_time / base_time))
    print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt", "cnn"], choices=["gpt", "cnn"])
    parser.add_argument("--out", default="benchmarks/compiled.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    header = (
        f"torch {torch.__version__}, dtr_compile {dtr_compile.__version__}, {torch.get_num_threads()} thread, CPU time per step. "
        "Ratios are to the no-remat Inductor step of the same model."
    )
    lines = ["## Compiled path (CPU, Inductor)", "", header, ""]
    for name in args.models:
        rows = run_model(name)
        lines += [
            f"### {name}",
            "",
            "| method | measured peak / no-remat | step time / no-remat | note |",
            "|---|---|---|---|",
        ]
        lines += [f"| {m} | {p:.2f} | {t:.2f} | {n} |" for m, n, p, t in rows]
        lines.append("")
    with open(args.out, "w") as handle:
        handle.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
