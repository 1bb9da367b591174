"""A peer (selective or per-block checkpointing, or PyTorch's knob) against backend="dtr" at the peer's measured peak, in one process,
with a profile of each step.

The frontier (`python -m dtr_compile.bench --frontier`) times these pairs; this tool says where the time goes. Both
sides are the frontier's own methods (bench/methods.py: `sac_compile`, `hf_ckpt_compile`, `dtr_inductor`) on two
copies of the model. Their steps are interleaved as the frontier's pairs are (median of 7: process time on CPU,
synchronized wall time on CUDA), then one profiled step of each prints its ops by self time, so kernels and the
runtime's own Python can be told apart (BENCHMARKS.md section 7).

    python tools/pair_profile.py [--peer sac|checkpoint|knob] [--knob 0.5] [--size small] [--model gpt2]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch._functorch.config
from torch.profiler import ProfilerActivity, profile

from dtr_compile.bench.methods import Budget, get_method
from dtr_compile.bench.models import build_model
from dtr_compile.bench.timing import interleaved, median, timed
from dtr_compile.measure import measure_peak

PEERS = {"sac": "sac_compile", "checkpoint": "hf_ckpt_compile", "knob": "amb_inductor"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--size", default="small")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--peer", choices=sorted(PEERS), default="sac")
    parser.add_argument("--knob", type=float, default=0.5, help="the knob's activation_memory_budget (--peer knob)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def prepare(method: str, budget: Budget) -> Callable[[], object]:
        case = build_model(args.model, args.size)
        case.model.to(device)
        step = get_method(method).prepare(case, budget, case.make_batch(device))

        def fresh_step() -> object:  # gradients allocated anew in every step, as the frontier's steps do
            case.model.zero_grad(set_to_none=True)
            return step()

        return fresh_step

    peer_step = prepare(PEERS[args.peer], Budget(args.knob if args.peer == "knob" else None, None))
    for _ in range(2):
        peer_step()
    # The knob is read by the min-cut partitioner when a graph compiles, for the whole process: the peer has compiled,
    # and backend="dtr" starts from torch.compile's own partition, so it goes back to its default
    torch._functorch.config.activation_memory_budget = 1.0
    _, measured = measure_peak(peer_step, device)
    dtr_step = prepare("dtr_inductor", Budget(None, measured.peak_bytes))
    for _ in range(3):
        dtr_step()
    _, ours = measure_peak(dtr_step, device)
    print(f"{args.peer}'s peak {measured.peak_bytes / 2**20:.2f} MiB; backend='dtr' at it: "
          f"{ours.peak_bytes / 2**20:.2f} MiB ({ours.peak_bytes / measured.peak_bytes:.3f})")  # fmt: skip
    from dtr_compile.passes import running_plans

    print(running_plans.summary())
    ways = {"peer": peer_step, "dtr": dtr_step}
    times: dict[str, list[float]] = {"peer": [], "dtr": []}
    for way in interleaved(list(ways), args.steps, rotate=True):
        sample = timed(ways[way], device)[1]
        times[way].append(sample.cpu_s if device == "cpu" else sample.wall_s)
    peer_s, dtr_s = median(times["peer"]), median(times["dtr"])
    print(f"median step: {args.peer} {peer_s * 1e3:.1f} ms, backend='dtr' {dtr_s * 1e3:.1f} ms: {dtr_s / peer_s:.3f}x")
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
