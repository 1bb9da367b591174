"""The largest batch that trains within a memory limit, per method, found by measurement (issue 19).

    python -m dtr_compile.fit gpt2 --set n_layer=2 --set n_embd=64 --seq 64 --limit 8MB --device cpu
    python -m dtr_compile.fit mypkg.models:build --limit 8GB          # CUDA: the device, capped at 8 GB

For each method (no rematerialization, Hugging Face gradient checkpointing, torch's
`activation_memory_budget` knob, and `backend="dtr"` with the limit as its budget), the batch size doubles
until a training step no longer fits, then a bisection finds the largest that does. A step fits when it runs
(no BudgetError, no out-of-memory) and its measured peak (dtr_compile.measure: the profiler on CPU,
`max_memory_allocated` on CUDA, above what was live at the step's start, as DESIGN.md counts a step) is at most
the limit. At each method's largest batch the throughput is timed (samples per second over a few steps after a
warm-up). The result is a table and, with `--plot`, throughput against batch size.

The model: a `transformers` model type ("gpt2", "llama", ...) built from its default config with `--set key=value`
overrides and random weights (no download), trained as a causal LM on random tokens without its key/value cache
(as checkpointing trains); or `module:function`, where `function()` returns `(model, make_batch)` and
`make_batch(batch_size)` returns the keyword arguments of one step; the model's output is the loss, or has a `.loss`,
or is summed into one.

On CUDA `--limit` is the device memory of the whole process (parameters, gradients, everything): it caps the
process with `torch.cuda.set_per_process_memory_fraction`, so a method that goes above it runs out of memory as it
would on a smaller device, and a step fits when what was allocated at its start plus its measured peak is within
it; `backend="dtr"` gets the rest (the limit less what is allocated at the step's start) as its byte budget. On
CPU the limit counts the step alone, as a budget does (DESIGN.md), and is the budget. (The CUDA path has not run
on a GPU yet.) Compiled methods compile with `--compiler`
(default: inductor on CUDA; on CPU "aot_eager", whose compiles take a second where Inductor's take tens).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from . import config
from .errors import BudgetError, ConfigError, DTRError
from .measure import add_device_argument, device_from_args, device_name, measure_peak, synchronize

METHODS = ("none", "checkpoint", "knob", "dtr")
METHOD_TITLES = {
    "none": "no rematerialization",
    "checkpoint": "HF gradient checkpointing",
    "knob": "activation_memory_budget=0.5",
    "dtr": 'backend="dtr" (budget = limit)',
}
KNOB_BUDGET = 0.5  # torch's activation_memory_budget for the "knob" method


@dataclass
class Trial:
    batch: int
    fits: bool
    peak_bytes: int | None  # measured; None if the step raised
    error: str = ""


@dataclass
class MethodResult:
    method: str
    largest_batch: int = 0
    peak_bytes: int | None = None
    samples_per_s: float | None = None
    trials: list[Trial] = field(default_factory=list)
    note: str = ""


# ------------------------------------------------------------------------------------------- models


def model_from_spec(spec: str, overrides: dict[str, Any], seq: int) -> tuple[torch.nn.Module, Callable[[int], dict]]:
    """(model, make_batch) from a transformers model type or `module:function`."""
    if ":" in spec:
        module_name, _, function = spec.partition(":")
        try:
            built = getattr(importlib.import_module(module_name), function)()
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"model {spec!r}: cannot load {function!r} from {module_name!r} ({exc})") from exc
        if not (isinstance(built, tuple) and len(built) == 2 and callable(built[1])):
            raise ConfigError(f"model {spec!r}: {function}() must return (model, make_batch); got {type(built)}")
        return built
    try:
        import transformers
    except ImportError as exc:
        raise ConfigError(f"model {spec!r} names a transformers model type, and transformers is not installed") from exc
    # A training step has no use for the key/value cache, and checkpointing turns it off (transformers does, under
    # gradient checkpointing): left on for the other methods, their compiled graphs return every layer's keys and
    # values, held through the loss, and the comparison is unequal (GPT-2 at batch 13: 6.5 MiB of a 46 MiB budget,
    # which the runtime made room for by evicting and recomputing saved activations every step). `--set use_cache=true`
    # keeps it.
    overrides = {"use_cache": False, **overrides}
    try:
        model_config = transformers.AutoConfig.for_model(spec, **overrides)
    except ValueError as exc:
        raise ConfigError(f"model {spec!r}: not a transformers model type, nor module:function ({exc})") from exc
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(model_config)
    vocab = model_config.vocab_size

    def make_batch(batch: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(batch))
        return {"input_ids": ids, "labels": ids}

    return model, make_batch


def parse_overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected key=value")
        for cast in (int, float):
            try:
                out[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key] = {"true": True, "false": False}.get(value.lower(), value)
    return out


def _loss(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.sum()
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise ConfigError(f"the model returned {type(output).__name__}: expected a loss, a tensor, or an object with .loss")


# ------------------------------------------------------------------------------------------ methods


@contextlib.contextmanager
def prepared(method: str, model: torch.nn.Module, limit: int, compiler: str, device: torch.device) -> Iterator[Any]:
    """The callable a step of `method` runs, with the settings it needs for the duration."""
    torch._dynamo.reset()
    if method == "checkpoint":
        if not hasattr(model, "gradient_checkpointing_enable"):
            raise ConfigError("method 'checkpoint' needs a transformers model (gradient_checkpointing_enable)")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            yield _compiled(model, compiler)
        finally:
            model.gradient_checkpointing_disable()
        return
    if method == "none":
        yield _compiled(model, compiler)
        return
    if method == "knob":
        knob_backend = compiler if compiler == "inductor" else "aot_eager_decomp_partition"  # min-cut partitioner
        with torch._functorch.config.patch(activation_memory_budget=KNOB_BUDGET):
            yield torch.compile(model, backend=knob_backend)
        return
    if method == "dtr":
        codegen = "inductor" if compiler == "inductor" else "fx"
        with config.patch(memory_budget=step_limit(limit, device), codegen=codegen):
            yield torch.compile(model, backend="dtr")
        return
    raise ConfigError(f"method {method!r}: expected one of {', '.join(METHODS)}")


def step_limit(limit: int, device: torch.device) -> int:
    """The bytes a step may allocate above its start: on CUDA the device limit less what the process holds now
    (parameters, optimizer state), on CPU the limit itself."""
    if device.type != "cuda":
        return limit
    held = torch.cuda.memory_allocated(device)
    if held >= limit:
        raise ConfigError(f"--limit {limit:,} bytes: the model alone holds {held:,} bytes on {device}; raise the limit")
    return limit - held


def _compiled(model: torch.nn.Module, compiler: str) -> Any:
    return model if compiler == "eager" else torch.compile(model, backend=compiler)


# ------------------------------------------------------------------------------------------- search


def _on_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _step(runner: Any, model: torch.nn.Module, batch: dict) -> None:
    model.zero_grad(set_to_none=True)
    _loss(runner(**batch)).backward()


def try_batch(
    method: str,
    model: torch.nn.Module,
    make_batch: Callable[[int], dict],
    batch_size: int,
    limit: int,
    compiler: str,
    device: torch.device,
) -> Trial:
    """Does a training step of `batch_size` fit within `limit`? (a warm-up step, then a measured one)"""
    batch = _on_device(make_batch(batch_size), device)
    allowed = step_limit(limit, device)
    try:
        with prepared(method, model, limit, compiler, device) as runner:
            _step(runner, model, batch)  # compiles; a fraction or the allocator's first use settles
            _, measured = measure_peak(lambda: _step(runner, model, batch), device)
            model.zero_grad(set_to_none=True)
    except (BudgetError, torch.OutOfMemoryError) as exc:
        return Trial(batch_size, False, None, type(exc).__name__)
    finally:
        _release(device)
    return Trial(batch_size, measured.peak_bytes <= allowed, measured.peak_bytes)


def largest_batch(
    method: str,
    model: torch.nn.Module,
    make_batch: Callable[[int], dict],
    limit: int,
    compiler: str,
    device: torch.device,
    max_batch: int,
    resolution: float = 0.0,
) -> MethodResult:
    """Doubling from 1, then bisection: the largest batch of `method` that fits (0 if even 1 does not). The bisection
    stops when the batches left untried are at most `resolution` x the largest that fit (0: none left, the exact
    largest). It once stopped at 10% on its own: GPT-2's fit with Inductor (CPU stand-in) reported 20 for
    `backend="dtr"` after 22 failed, and never tried 21, which fits."""
    result = MethodResult(method)
    good, bad = 0, None
    size = 1
    while size <= max_batch:
        trial = try_batch(method, model, make_batch, size, limit, compiler, device)
        result.trials.append(trial)
        if not trial.fits:
            bad = size
            break
        good, result.peak_bytes = size, trial.peak_bytes
        size *= 2
    if bad is None and good < max_batch:
        bad = max_batch + 1
    while bad is not None and bad - good > 1 and (bad - good - 1) / max(good, 1) > resolution:
        mid = (good + bad) // 2
        trial = try_batch(method, model, make_batch, mid, limit, compiler, device)
        result.trials.append(trial)
        if trial.fits:
            good, result.peak_bytes = mid, trial.peak_bytes
        else:
            bad = mid
    result.largest_batch = good
    if good == max_batch:
        result.note = f"reached --max-batch {max_batch}"
    elif bad is not None and bad - good > 1:
        result.note = f"{bad - 1} untried: --resolution {resolution:g}"
    return result


def throughput(
    method: str,
    model: torch.nn.Module,
    make_batch: Callable[[int], dict],
    batch_size: int,
    limit: int,
    compiler: str,
    device: torch.device,
    steps: int,
) -> float:
    """Samples per second of `method` at `batch_size` over `steps` steps after a warm-up step."""
    batch = _on_device(make_batch(batch_size), device)
    with prepared(method, model, limit, compiler, device) as runner:
        _step(runner, model, batch)
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            _step(runner, model, batch)
        synchronize(device)
        elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    _release(device)
    return batch_size * steps / elapsed


def _release(device: torch.device) -> None:
    from .runtime import finish_steps

    finish_steps()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fit(
    model: torch.nn.Module,
    make_batch: Callable[[int], dict],
    limit: int,
    *,
    methods: tuple[str, ...] = METHODS,
    device: str | torch.device = "cpu",
    compiler: str | None = None,
    max_batch: int = 4096,
    timing_steps: int = 3,
    resolution: float = 0.0,
) -> list[MethodResult]:
    """The largest batch within `limit` bytes and its throughput, per method (the function behind the command)."""
    device = torch.device(device)
    compiler = compiler or ("inductor" if device.type == "cuda" else "aot_eager")
    for method in methods:
        if method not in METHODS:
            raise ConfigError(f"method {method!r}: expected one of {', '.join(METHODS)}")
    if limit <= 0:
        raise ConfigError(f"limit={limit}: expected a positive number of bytes")
    if max_batch < 1 or timing_steps < 1:
        raise ConfigError(f"--max-batch {max_batch}, --timing-steps {timing_steps}: expected at least 1 each")
    if not 0.0 <= resolution < 1.0:
        raise ConfigError(f"--resolution {resolution}: expected a fraction in [0, 1) (0: the exact largest batch)")
    model = model.to(device).train()
    results = []
    for method in methods:
        result = largest_batch(method, model, make_batch, limit, compiler, device, max_batch, resolution)
        if result.largest_batch:
            result.samples_per_s = throughput(
                method, model, make_batch, result.largest_batch, limit, compiler, device, timing_steps
            )
        results.append(result)
    return results


# ------------------------------------------------------------------------------------------- report


def table(results: list[MethodResult], limit: int, where: str) -> str:
    base = next((r for r in results if r.method == "none" and r.largest_batch), None)
    lines = [
        f"Largest batch within {limit:,} bytes ({where})",
        "",
        "| method | largest batch | x no-remat batch | measured peak (bytes) | samples/s | x no-remat samples/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio_b = f"{r.largest_batch / base.largest_batch:.2f}" if base and r.largest_batch else "-"
        ratio_t = (
            f"{r.samples_per_s / base.samples_per_s:.2f}" if base and base.samples_per_s and r.samples_per_s else "-"
        )
        sps = f"{r.samples_per_s:.1f}" if r.samples_per_s else "-"
        peak = f"{r.peak_bytes:,}" if r.peak_bytes is not None else "-"
        note = f" ({r.note})" if r.note else ""
        lines.append(
            f"| {METHOD_TITLES[r.method]} | {r.largest_batch}{note} | {ratio_b} | {peak} | {sps} | {ratio_t} |"
        )
    return "\n".join(lines)


def plot(results: list[MethodResult], path: str) -> None:
    """Throughput at each method's largest batch against that batch (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(figsize=(6, 4))
    for r in results:
        if r.largest_batch and r.samples_per_s:
            axes.scatter([r.largest_batch], [r.samples_per_s], label=METHOD_TITLES[r.method], s=60)
    axes.set_xlabel("largest batch within the limit")
    axes.set_ylabel("samples / s at that batch")
    axes.set_xscale("log", base=2)
    axes.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtr_compile.fit", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a transformers model type (gpt2, llama, ...) or module:function")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--seq", type=int, default=128, help="sequence length of a transformers model's batches")
    parser.add_argument("--limit", required=True, help="memory limit: bytes or '8GB', '512MiB'")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--compiler", default=None, help="eager, aot_eager or inductor (default: see above)")
    parser.add_argument("--max-batch", type=int, default=4096)
    parser.add_argument("--timing-steps", type=int, default=3)
    parser.add_argument(
        "--resolution",
        type=float,
        default=0.0,
        help="stop bisecting when the untried batches are at most this fraction of the largest that fit "
        "(default 0: the exact largest; 0.1 saves trials where each compiles for minutes)",
    )
    parser.add_argument("--plot", default=None, help="write throughput against batch size to this PNG")
    add_device_argument(parser)
    args = parser.parse_args(argv)
    device = device_from_args(parser, args.device)
    try:
        limit = config.parse_budget(args.limit)
        if not isinstance(limit, int):
            raise ConfigError(f"--limit {args.limit!r}: give bytes ('8GB', '512MiB', 8000000000), not a fraction")
        model, make_batch = model_from_spec(args.model, parse_overrides(args.set), args.seq)
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
        methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
        results = fit(
            model,
            make_batch,
            limit,
            methods=methods,
            device=device,
            compiler=args.compiler,
            max_batch=args.max_batch,
            timing_steps=args.timing_steps,
            resolution=args.resolution,
        )
    except DTRError as exc:
        parser.error(str(exc))
    where = f"{device_name(device)}, torch {torch.__version__}"
    print(table(results, limit, where))
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["METHODS", "MethodResult", "Trial", "fit", "main"]
