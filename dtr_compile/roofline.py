"""The estimated time of one aten call: a roofline over its FLOPs and the bytes it moves, at the rates of the
device it runs on.

FLOPs come from PyTorch's formulas (`torch.utils.flop_counter`: matmul, convolution, attention); every
other op is memory-bound and costed by the bytes it reads and writes. The estimate is
max(flops / flop rate, bytes / bandwidth) plus a fixed per-call overhead. Unlike a wall-clock timing, the
estimate is the same on every run and under any load, so eviction choices are reproducible.

Only ratios between ops matter to an eviction policy, and those ratios differ between devices. A GPU's tensor
cores outgrow its memory bandwidth far more than a CPU's cores outgrow theirs (FLOPs per byte moved: H200 ~13
in fp32, ~220 in bf16; this CPU 2.5), so next to a matmul a pointwise op weighs far more on a GPU than on a
CPU, and a 16-bit matmul far less than an fp32 one. Costing CUDA graphs at CPU rates (as this module once did)
priced matmuls against pointwise ops in the wrong proportions, and the whole step at the wrong scale (H200,
torch 2.11: a 136.7 ms GPT-2 step modelled as 57.9 s of compute). So the rates are per device (`rates_for`):
CPU rates are constants, CUDA rates are measured once per process and device, and the flop rate depends on
the dtype the op computes in (fp32, TF32, or 16-bit tensor cores).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from . import compat
from .planned_sizes import planned_value


def size_hint(size: Any) -> int:
    """A size's value at the sizes a plan is made at (planned_sizes.py), else its hint, without a guard (as
    tensor_bytes.size_hint, which this floor cannot import)."""
    planned = planned_value(size)
    return planned if planned is not None else compat.size_hint(size)


@dataclass(frozen=True)
class DeviceRates:
    """What one device does per second. Matmul-like FLOPs (matmul, convolution, attention: the flop counter's
    ops, which all run on the same units) at a rate per dtype class; every other op is costed by bytes."""

    fp32_flops_per_s: float  # fp32 matmuls in full precision
    tf32_flops_per_s: float  # fp32 matmuls allowed TF32 (tensor cores, 10-bit mantissa)
    half_flops_per_s: float  # bf16 / fp16 (and narrower) matmuls
    bytes_per_s: float  # memory bandwidth, bytes read plus bytes written
    overhead_s: float  # fixed cost of one eager aten call
    fused_overhead_s: float  # fixed cost of an op a code generator fuses into its neighbours' loops

    def flops_per_s(self, dtype: torch.dtype | None, tf32: bool = False) -> float:
        """The rate for matmul-like FLOPs on inputs of `dtype`; `tf32`: fp32 matmuls may use TF32 now."""
        if dtype is not None and dtype.is_floating_point and dtype.itemsize <= 2:
            return self.half_flops_per_s
        if dtype == torch.float32 and tf32:
            return self.tf32_flops_per_s
        # fp32, and what no tensor core runs (fp64, integers, complex) or no dtype at all: the fp32 rate
        return self.fp32_flops_per_s


# Measured on one core of the development machine (thread CPU time): a 50 MFLOP addmm takes 0.47 ms
# (~1e11 FLOP/s), a 1 MB pointwise op (2 MB moved) 20-60 us. One rate for every dtype: these constants are
# what CPU plans (and the tests that check them) were made with, and a CPU's bf16 matmul is no faster in
# the order of magnitude that an eviction policy sees.
PEAK_FLOPS_PER_S = 1e11
BYTES_PER_S = 4e10
# Fixed cost of one call: an eager aten call pays the dispatcher (a few microseconds); ops that a code
# generator fuses into its neighbours' loops pay almost nothing.
OVERHEAD_S = 2e-6
FUSED_OVERHEAD_S = 1e-6

CPU_RATES = DeviceRates(
    fp32_flops_per_s=PEAK_FLOPS_PER_S,
    tf32_flops_per_s=PEAK_FLOPS_PER_S,
    half_flops_per_s=PEAK_FLOPS_PER_S,
    bytes_per_s=BYTES_PER_S,
    overhead_s=OVERHEAD_S,
    fused_overhead_s=FUSED_OVERHEAD_S,
)

# An eager CUDA call pays the dispatcher and a kernel launch (~5 us of host time, which the GPU waits for
# when kernels are short); a fused op adds instructions to a kernel that runs anyway, as on a CPU.
CUDA_OVERHEAD_S = 5e-6
CUDA_FUSED_OVERHEAD_S = FUSED_OVERHEAD_S

# Used when measuring a CUDA device fails (no CUDA runtime, out of memory, deterministic cuBLAS without its
# workspace setting, a capture in progress, ...): about what an A100 achieves (datasheet: 19.5 TFLOP/s fp32,
# 156 TF32, 312 bf16/fp16, 1.6-2 TB/s), the slowest datacenter GPU the tensor-core ratios hold for. Newer ones
# (H100/H200: ~50-60 fp32, ~400 TF32, ~800 bf16, 3.3-4.8 TB/s) are faster on both sides by a similar factor,
# so the ratios between ops that the planner reads stay about right.
FALLBACK_CUDA_RATES = DeviceRates(
    fp32_flops_per_s=1.5e13,
    tf32_flops_per_s=1.0e14,
    half_flops_per_s=2.0e14,
    bytes_per_s=1.3e12,
    overhead_s=CUDA_OVERHEAD_S,
    fused_overhead_s=CUDA_FUSED_OVERHEAD_S,
)

# The measurement: one square matmul per dtype class, large enough (2 * 4096**3 = 137 GFLOP) to reach the
# tensor cores' peak rather than launch latency, and one copy of 64 MiB (larger than an H100's/H200's 50 MB L2
# cache, so it measures device memory). Median of a few repeats after a warm-up. 192 MiB of device memory while
# it runs (the operands; the copy reuses them), freed to the caching allocator after. H200, torch 2.11: 0.54 s
# with CUDA's and cuBLAS's start-up, which the program's first matmul pays otherwise; measured 51 TFLOP/s fp32,
# 431 TF32, 860 bf16, 3.6-3.9 TB/s.
MEASURE_SIZE = 4096
MEASURE_REPEATS = 5

_cuda_rates: dict[int, DeviceRates] = {}
_cuda_rates_lock = threading.Lock()  # the autograd engine's device threads estimate calls too


def rates_for(device: torch.device | str | None = None) -> DeviceRates:
    """The rates of `device` (None: CPU). CUDA devices are measured on first use, once per process and
    index. Other device types (MPS, XPU, ...) get the CPU rates: there is no timer common to them here, and
    the CPU rates are at least the estimates this module always gave them."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type != "cuda":
        return CPU_RATES
    index = _cuda_index(device)
    found = _cuda_rates.get(index)
    if found is not None:
        return found
    if _capturing_cuda_graph():
        return FALLBACK_CUDA_RATES  # no synchronizing inside a capture; measured at the next chance
    with _cuda_rates_lock:
        if index not in _cuda_rates:
            _cuda_rates[index] = measure_cuda_rates(index)
        return _cuda_rates[index]


def _cuda_index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def _capturing_cuda_graph() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def measure_cuda_rates(index: int) -> DeviceRates:
    """Measure CUDA device `index` (see MEASURE_SIZE); FALLBACK_CUDA_RATES if that fails for any reason, since
    a plan priced with a datacenter GPU's typical rates is better than no plan."""
    try:
        with _quiet_cuda_context(index):
            return _measured_cuda_rates(torch.device("cuda", index))
    except Exception:  # noqa: BLE001 - any failure to measure: the documented fallback
        return FALLBACK_CUDA_RATES


@contextlib.contextmanager
def _quiet_cuda_context(index: int) -> Iterator[None]:
    """Plain CUDA tensors on device `index`: outside the dispatch modes of whoever asked (fake tensors at
    compile time, the eager runtime's mode), without autograd or autocast (which would turn the fp32 matmul
    into a bf16 one)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with (
        _disable_current_modes(),
        torch.no_grad(),
        torch.autocast("cuda", enabled=False),
        torch.cuda.device(index),
    ):
        yield


def _measured_cuda_rates(device: torch.device) -> DeviceRates:
    a, b, c = _operands(device, torch.float32)
    with _cuda_tf32(False):
        fp32 = _matmul_flops_per_s(a, b, c)
    with _cuda_tf32(True):
        tf32 = _matmul_flops_per_s(a, b, c)
    bytes_per_s = _copy_bytes_per_s(a, c)
    del a, b, c  # before the 16-bit operands are made: 192 MiB at most
    half = _matmul_flops_per_s(*_operands(device, _half_dtype(device)))
    return DeviceRates(
        fp32_flops_per_s=fp32,
        tf32_flops_per_s=tf32,
        half_flops_per_s=half,
        bytes_per_s=bytes_per_s,
        overhead_s=CUDA_OVERHEAD_S,
        fused_overhead_s=CUDA_FUSED_OVERHEAD_S,
    )


def _operands(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two MEASURE_SIZE-square matrices and room for their product. Constant, not random: drawing random
    operands would advance the program's CUDA generator."""
    shape = (MEASURE_SIZE, MEASURE_SIZE)
    ones = torch.ones(shape, device=device, dtype=dtype)
    return ones, ones.clone(), torch.empty(shape, device=device, dtype=dtype)


def _copy_bytes_per_s(source: torch.Tensor, target: torch.Tensor) -> float:
    return 2 * target.nbytes / _median_seconds(lambda: target.copy_(source))  # bytes read plus bytes written


def _matmul_flops_per_s(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> float:
    return 2 * a.shape[0] * a.shape[1] * b.shape[1] / _median_seconds(lambda: torch.mm(a, b, out=out))


def _half_dtype(device: torch.device) -> torch.dtype:
    """bf16 where tensor cores run it (compute capability 8.0 on: what training uses there); fp16 before,
    where bf16 is emulated and fp16 is the 16-bit type programs use."""
    return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16


def _median_seconds(run: Callable[[], Any]) -> float:
    """Median device time of `run` over MEASURE_REPEATS, after a warm-up (cuBLAS picks its kernel, clocks rise)."""
    run()
    events = []
    for _ in range(MEASURE_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


@contextlib.contextmanager
def _cuda_tf32(enabled: bool) -> Iterator[None]:
    """fp32 CUDA matmuls with TF32 `enabled`, then the program's settings back. Set through the legacy flag,
    which sets the legacy precision and CUDA matmuls' `fp32_precision` together (some torch releases refuse
    fp32 matmuls where the two disagree), and restored in three steps, since the legacy setter also sets
    mkldnn's matmul precision. A program that set TF32 through the new API alone has a legacy precision that
    cannot be read: there only the new API is used."""
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # "mix of the legacy and new APIs"
        legacy = None
    cuda_matmul = torch.backends.cuda.matmul.fp32_precision
    mkldnn_matmul = torch.backends.mkldnn.matmul.fp32_precision
    if legacy is None:
        torch.backends.cuda.matmul.fp32_precision = "tf32" if enabled else "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
        torch.backends.cuda.matmul.fp32_precision = cuda_matmul
        torch.backends.mkldnn.matmul.fp32_precision = mkldnn_matmul


def tf32_enabled() -> bool:
    """Whether fp32 CUDA matmuls may run on TF32 tensor cores now: `allow_tf32 = True` and
    `set_float32_matmul_precision("high"/"medium")` set the same state as `fp32_precision = "tf32"`."""
    matmul = torch.backends.cuda.matmul
    try:
        return matmul.fp32_precision == "tf32"
    except AttributeError:  # a torch without the fp32_precision API
        return bool(matmul.allow_tf32)


def device_of(values: list[Any]) -> torch.device:
    """The device an op with these argument/result leaves runs on: its first tensor's, where that is a real
    device. Meta tensors (sizes only) count as CPU, as every estimate did before rates were per device."""
    for value in values:
        if isinstance(value, torch.Tensor) and value.device.type != "meta":
            return value.device
    return torch.device("cpu")


def compute_dtype(values: list[Any]) -> torch.dtype | None:
    """The dtype an op with these input leaves computes in: its first floating-point input's."""
    for value in values:
        if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
            return value.dtype
    return None


def has_symbolic_sizes(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape)


def tensor_bytes(value: Any) -> int:
    """Bytes of a tensor's data. Symbolic sizes count at their hints: converting them to numbers would make
    TorchDynamo specialize the graph to this one size (a guard), and recompile at every new size."""
    if not isinstance(value, torch.Tensor):
        return 0
    if has_symbolic_sizes(value):
        numel = 1
        for size in value.shape:
            numel *= size_hint(size)
        return numel * value.element_size()
    return value.numel() * value.element_size()


def at_hints(value: Any) -> Any:
    """A meta tensor with `value`'s sizes at their hints (a formula can compute on it without guards)."""
    if not has_symbolic_sizes(value):
        return value
    return torch.empty_strided(
        [size_hint(s) for s in value.shape], [size_hint(s) for s in value.stride()], dtype=value.dtype, device="meta"
    )


def call_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of `func(*args, **kwargs) -> out` by PyTorch's formula; 0 for ops without one. Symbolic sizes
    count at their hints (see `tensor_bytes`)."""
    packet = getattr(func, "overloadpacket", None)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is None:
        return 0
    if any(has_symbolic_sizes(x) for x in tree_flatten((args, kwargs, out))[0]):
        args, kwargs, out = tree_map(at_hints, (args, kwargs, out))
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a formula that rejects these arguments: the op is costed by bytes
        return 0


def estimate_seconds(
    flops: int,
    bytes_moved: int,
    overhead_s: float | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    fused: bool = False,
) -> float:
    """Roofline seconds of an op on `device` (None: CPU) computing in `dtype` (its inputs' dtype: 16-bit
    matmuls run at the 16-bit rate, fp32 ones at the TF32 rate when the program allows TF32 now). The fixed
    cost is `overhead_s` if given, else the device's per-call overhead (`fused`: for an op that a code
    generator fuses into its neighbours)."""
    rates = rates_for(device)
    flop_rate = rates.flops_per_s(dtype, tf32=dtype == torch.float32 and tf32_enabled())
    if overhead_s is None:
        overhead_s = rates.fused_overhead_s if fused else rates.overhead_s
    return max(flops / flop_rate, bytes_moved / rates.bytes_per_s) + overhead_s


def estimate_call(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    """Estimated seconds of one call, from its real (or fake) arguments and result, at the rates of the
    device they are on (fake tensors carry the device they stand for)."""
    inputs = tree_flatten((args, kwargs))[0]
    outputs = tree_flatten(out)[0]
    read = sum(tensor_bytes(x) for x in inputs)
    written = sum(tensor_bytes(x) for x in outputs)
    return estimate_seconds(
        call_flops(func, args, kwargs, out),
        read + written,
        device=device_of(inputs + outputs),
        dtype=compute_dtype(inputs),
    )
