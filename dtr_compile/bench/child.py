"""One benchmark run in its own process: `python -m dtr_compile.bench.child '<RunSpec JSON>'`.

Builds the model, prepares the method, runs the warm-up steps (the first includes any compile), times the
measured steps, then runs one more step under `measure_peak` (the profiler slows a step down, so that step
is not timed) and compares its loss and gradients with the baseline's. Prints one JSON line.

Every training step starts with the gradients set to None, so the gradients are allocated inside the step
and count towards its peak, as DESIGN.md's budget semantics say. There is no optimizer step: the weights
stay those of the baseline, so every run's gradients are comparable with the baseline's.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from typing import Any

import torch

from ..errors import BudgetError, ThrashError
from ..measure import device_name, measure_peak
from ..passes import running_plans
from .methods import Budget, NotBuilt, get_method
from .models import build_model
from .spec import RESULT_KEY, RunSpec
from .timing import Sample, interleaved, median, timed, warm_then_time

# Tolerances of the correctness column. Compiled code reorders floating-point reductions, so "equal" means
# equal to fp32 rounding accumulated over the model, not bitwise.
LOSS_RTOL = 1e-4
GRAD_RTOL = 1e-3  # max |g - g_ref| / (max |g_ref| + floor), per parameter, worst parameter
# Some gradients are zero in exact arithmetic and rounding noise in practice (the key bias of attention:
# softmax ignores a constant shift), so a parameter's scale is floored at this fraction of the largest gradient.
GRAD_SCALE_FLOOR = 1e-6
# Under bf16 autocast every method rounds its matmuls to 8 mantissa bits, and a compiled graph fuses (and so
# rounds) differently from another partition of the same graph: "equal" is then equal to bf16 rounding.
BF16_LOSS_RTOL = 1e-2
BF16_GRAD_RTOL = 5e-2


def run(spec: RunSpec) -> dict[str, Any]:
    """Run one spec and return its result fields (status and whatever could be measured)."""
    torch.set_num_threads(spec.threads)
    if spec.device.startswith("cuda"):
        # TF32 convolutions would make CUDA gradients differ from the fp32 reference by ~1e-3.
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    result: dict[str, Any] = {"device_name": device_name(spec.device), "torch_version": torch.__version__}
    try:
        result.update(_measure(spec))
        result["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row, never a crash of the bench
        status, reason = classify(exc)
        result.update(status=status, reason=reason)
        floor = _named_floor(exc)
        if floor is not None:
            result["floor_bytes"] = floor
        if status == "error":
            result["traceback"] = traceback.format_exc()[-4000:]
    return result


def _measure(spec: RunSpec) -> dict[str, Any]:
    if spec.peer is not None:
        return _measure_pair(spec)
    case = build_model(spec.model, spec.size, seed=spec.seed)
    model = case.model.to(spec.device)
    batch = case.make_batch(spec.device)
    plain_step = get_method(spec.method).prepare(case, Budget(spec.budget, spec.budget_bytes), batch)
    step = _under_autocast(plain_step, spec)

    def clear_grads() -> None:
        model.zero_grad(set_to_none=True)

    warmups, samples = warm_then_time(step, spec.warmup, spec.steps, spec.device, setup=clear_grads)
    model.zero_grad(set_to_none=True)
    loss, peak = measure_peak(step, spec.device)
    grads = {name: p.grad for name, p in model.named_parameters()}
    out: dict[str, Any] = {"description": case.description, **_timings(warmups, samples, peak.peak_bytes), "loss": loss}
    stats = getattr(plain_step, "runtime_state", {}).get("stats")
    if stats is not None:
        out["runtime_stats"] = _jsonable(stats)
    plan = running_plans.summary()
    if plan:
        out["plan"] = plan
    if spec.write_reference:
        _save_reference(spec.reference, loss, grads)
        out.update(loss_err=0.0, grad_err=0.0, correct=True)
    else:
        out.update(_compare(spec.reference, loss, grads, bf16=spec.autocast == "bf16"))
    return out


def _measure_pair(spec: RunSpec) -> dict[str, Any]:
    """The spec's method and its peer on two copies of the model in this process: each compiled by its own first
    steps (the peer first, with PyTorch's knob set only while it compiles: the knob is global, and our partitioner
    starts from the min-cut one that reads it), then their timed steps interleaved, rotating who goes first, then
    each one's peak. The gradients compared with the reference are the spec's method's."""
    import torch._functorch.config as functorch_config

    def prepare(method: str, budget: Budget) -> tuple[Any, Any, str]:
        case = build_model(spec.model, spec.size, seed=spec.seed)
        case.model.to(spec.device)
        batch = case.make_batch(spec.device)
        step = _under_autocast(get_method(method).prepare(case, budget, batch), spec)
        return case.model, step, case.description

    knob = functorch_config.activation_memory_budget
    try:
        peer_model, peer_step, _ = prepare(spec.peer, Budget(spec.peer_budget, None))
        peer_warmups = [_one(peer_step, peer_model, spec) for _ in range(spec.warmup)]
    finally:
        functorch_config.activation_memory_budget = knob
    model, step, description = prepare(spec.method, Budget(spec.budget, spec.budget_bytes))
    warmups = [_one(step, model, spec) for _ in range(spec.warmup)]
    samples: dict[str, list[Sample]] = {"peer": [], "self": []}
    ways = {"peer": (peer_step, peer_model), "self": (step, model)}
    for way in interleaved(list(ways), spec.steps, rotate=True):
        samples[way].append(_one(*ways[way], spec))
    peer_model.zero_grad(set_to_none=True)
    _, peer_peak = measure_peak(peer_step, spec.device)
    peer_model.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    loss, peak = measure_peak(step, spec.device)
    grads = {name: p.grad for name, p in model.named_parameters()}
    peer = _timings(peer_warmups, samples["peer"], peer_peak.peak_bytes)
    out: dict[str, Any] = {
        "description": description,
        **_timings(warmups, samples["self"], peak.peak_bytes),
        "loss": loss,
        "peer_peak_bytes": peer["peak_bytes"],
        "peer_step_wall_s": peer["step_s"],
        "peer_step_cpu_s": peer["step_cpu_s"],
        "peer_first_step_s": peer["first_step_s"],
    }
    out.update(_compare(spec.reference, loss, grads, bf16=spec.autocast == "bf16"))
    plan = running_plans.summary()
    if plan:
        out["plan"] = plan
    return out


def _timings(warmups: list[Sample], samples: list[Sample], peak_bytes: int) -> dict[str, Any]:
    """A run's result fields from its warm-up and timed steps and its measured peak (medians of the timed steps)."""
    wall_times = [s.wall_s for s in samples]
    return {
        "peak_bytes": peak_bytes,
        "step_s": median(wall_times),
        "step_cpu_s": median([s.cpu_s for s in samples]),
        "step_times_s": wall_times,
        "first_step_s": warmups[0].wall_s if warmups else None,
    }


def _one(step: Any, model: torch.nn.Module, spec: RunSpec) -> Sample:
    """One step from cleared gradients (allocated inside it, as in every run), timed."""
    model.zero_grad(set_to_none=True)
    return timed(step, spec.device)[1]


def _under_autocast(step: Any, spec: RunSpec) -> Any:
    """The step under `torch.autocast(device type, bfloat16)` when the spec asks for bf16, else the step."""
    if spec.autocast is None:
        return step
    device_type = torch.device(spec.device).type

    def autocast_step() -> float:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return step()

    return autocast_step


def _named_floor(exc: BaseException) -> int | None:
    """The smallest feasible budget a BudgetError in the chain names, in bytes (None when it names none)."""
    for e in _exception_chain(exc):
        if isinstance(e, BudgetError) and e.smallest_feasible_bytes is not None:
            return int(e.smallest_feasible_bytes)
    return None


def _save_reference(path: str, loss: float, grads: dict[str, torch.Tensor | None]) -> None:
    plain = {name: None if g is None else g.detach().cpu().clone() for name, g in grads.items()}
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save({"loss": loss, "grads": plain}, tmp)
    os.replace(tmp, path)  # a reader never sees half a file


def _compare(path: str, loss: float, grads: dict[str, torch.Tensor | None], bf16: bool = False) -> dict[str, Any]:
    loss_rtol, grad_rtol = (BF16_LOSS_RTOL, BF16_GRAD_RTOL) if bf16 else (LOSS_RTOL, GRAD_RTOL)
    ref = torch.load(path)
    loss_err = abs(loss - ref["loss"]) / max(abs(ref["loss"]), 1e-12)
    grad_err, worst = 0.0, ""
    problems = []
    largest = max((g.abs().max().item() for g in ref["grads"].values() if g is not None and g.numel()), default=0.0)
    floor = max(GRAD_SCALE_FLOOR * largest, 1e-30)
    for name, ref_grad in ref["grads"].items():
        grad = grads.get(name)
        if (grad is None) != (ref_grad is None):
            problems.append(f"{name}: gradient {'missing' if grad is None else 'unexpected'}")
            continue
        if grad is None:
            continue
        grad = grad.detach().cpu()
        if grad.shape != ref_grad.shape:
            problems.append(f"{name}: shape {tuple(grad.shape)} != {tuple(ref_grad.shape)}")
            continue
        scale = ref_grad.abs().max().item() if ref_grad.numel() else 0.0
        err = (grad - ref_grad).abs().max().item() / (scale + floor) if grad.numel() else 0.0
        if not math.isfinite(err):  # NaN would compare as "not worse" below
            err = math.inf
        if err > grad_err:
            grad_err, worst = err, name
    if grad_err > grad_rtol:
        problems.append(f"worst gradient {worst}: relative error {grad_err:.1e}")
    correct = not problems and loss_err <= loss_rtol
    out: dict[str, Any] = {"loss_err": loss_err, "grad_err": grad_err, "correct": correct}
    if problems:
        out["reason"] = "; ".join(problems[:3])
    return out


def classify(exc: BaseException) -> tuple[str, str]:
    """Map a failure to (status, reason), looking through the chain torch.compile wraps errors in."""
    chain = _exception_chain(exc)
    for e in chain:
        if isinstance(e, (BudgetError, ThrashError)):
            return "infeasible", f"{type(e).__name__}: {e}"
    for e in chain:
        if isinstance(e, (NotBuilt, NotImplementedError)) or _is_our_missing_module(e):
            return "not built", f"{type(e).__name__}: {e}"
    last = chain[-1]
    return "error", f"{type(last).__name__}: {last}"


def _is_our_missing_module(exc: BaseException) -> bool:
    # A dtr_compile module that does not exist yet (e.g. the backend importing a pass still being written).
    return isinstance(exc, ImportError) and (exc.name or "").startswith("dtr_compile")


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        # Dynamo's BackendCompilerFailed keeps the backend's exception in `inner_exception`.
        current = getattr(current, "inner_exception", None) or current.__cause__ or current.__context__
    return chain


def _jsonable(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict

        value = asdict(value)
    if hasattr(value, "_asdict"):
        value = value._asdict()
    try:
        return json.loads(json.dumps(value, default=str))
    except (TypeError, ValueError):
        return str(value)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m dtr_compile.bench.child '<RunSpec JSON>'", file=sys.stderr)
        return 2
    spec = RunSpec.from_json(argv[0])
    result = run(spec)
    sys.stdout.flush()
    print(json.dumps({RESULT_KEY: result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
