"""A peer (selective or per-block checkpointing) against backend="dtr" at the peer's measured peak, in one process,
with a profile of each step.

The frontier (`python -m dtr_compile.bench --frontier`) times these pairs; this tool says where the time goes: the
steps are interleaved (median of 7: process time on CPU, synchronized wall time on CUDA), then one profiled step of
each prints its ops by self time, so kernels and the runtime's own Python can be told apart (BENCHMARKS.md section 7).

    python tools/pair_profile.py [--peer sac|checkpoint] [--size small] [--model gpt2]
"""

from __future__ import annotations

import argparse
import copy
import functools
import time

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import dtr_compile
from dtr_compile.bench.methods import _checkpoint_module, save_matmuls_policy
from dtr_compile.bench.models import build_model
from dtr_compile.measure import measure_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--size", default="small")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--peer", choices=("sac", "checkpoint"), default="sac")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, make_batch, loss_fn = build_model(args.model, args.size)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    inputs, target = make_batch(device)

    peer_model = copy.deepcopy(model)
    # Both peers as the frontier runs them (bench/methods.py): non-reentrant checkpoint per block, then torch.compile
    kwargs = {}
    if args.peer == "sac":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, save_matmuls_policy)
    for block in peer_model.blocks:
        _checkpoint_module(block, **kwargs)
    peer = torch.compile(peer_model)
    dtr_compile.config.codegen = "inductor"

    def step_of(module: torch.nn.Module, forward) -> callable:
        def step() -> None:
            module.zero_grad(set_to_none=True)
            loss_fn(forward(*inputs), target).backward()

        return step

    peer_step = step_of(peer_model, peer)
    for _ in range(2):
        peer_step()
    _, measured = measure_peak(peer_step)
    dtr_compile.config.memory_budget = measured.peak_bytes
    dtr_step = step_of(model, torch.compile(model, backend="dtr"))
    for _ in range(3):
        dtr_step()
    _, ours = measure_peak(dtr_step)
    print(f"{args.peer}'s peak {measured.peak_bytes / 2**20:.2f} MiB; backend='dtr' at it: "
          f"{ours.peak_bytes / 2**20:.2f} MiB ({ours.peak_bytes / measured.peak_bytes:.3f})")  # fmt: skip
    from dtr_compile.passes import running_plans

    print(running_plans.summary())
    clock = time.process_time if device == "cpu" else time.perf_counter
    times: dict[str, list[float]] = {"peer": [], "dtr": []}
    for _ in range(args.steps):
        for name, step in (("peer", peer_step), ("dtr", dtr_step)):
            if device == "cuda":
                torch.cuda.synchronize()
            start = clock()
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append(clock() - start)
    median = {name: sorted(values)[len(values) // 2] for name, values in times.items()}
    print(f"median step: {args.peer} {median['peer'] * 1e3:.1f} ms, backend='dtr' {median['dtr'] * 1e3:.1f}"
          f" ms: {median['dtr'] / median['peer']:.3f}x")  # fmt: skip
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    for name, step in ((args.peer, peer_step), ("backend='dtr'", dtr_step)):
        with profile(activities=activities) as prof:
            step()
        print(f"===== {name}")
        # On CUDA the kernels run asynchronously: the device's time says where the step goes, the CPU's where the
        # Python around the kernels does
        for key in ("self_device_time_total", "self_cpu_time_total") if device == "cuda" else ("self_cpu_time_total",):
            print(prof.key_averages().table(sort_by=key, row_limit=30))


if __name__ == "__main__":
    main()
