"""Compiled kernels: the callable a graph node runs, the kernel cache, and where triton comes from.

`RecomputeKernel(program)` is the target of the fused nodes the pass emits: calling it with the
region's input tensors allocates the outputs, launches one Triton kernel and returns the outputs.
Kernels are generated on first call for the device the inputs are on and cached for the process by
(program, target): two regions of the same structure and shapes share one kernel. An input whose
strides differ from the program's (the eager runtime may hand over another layout) gets a kernel of
its own, specialized to those strides.

CUDA tensors run the compiled kernel. CPU tensors run it in Triton's interpreter, which needs
TRITON_INTERPRET=1 in the environment when the kernel is first built: slow, for correctness tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import os
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch

from ..errors import ConfigError
from .codegen import KernelSource, Target, generate
from .ir import InputSpec, Program

TRITON_MISSING = (
    "dtr_compile's recompute kernels need triton, which is not installed. To fix it:\n"
    "  1. pip install 'dtr_compile[triton]'   (or: pip install triton)\n"
    "  2. on CPU, also set TRITON_INTERPRET=1 in the environment (kernels then run in Triton's interpreter)\n"
    "  3. or turn the kernels off: dtr_compile.config.recompute_kernels = 'off'"
)

INTERPRETER_NEEDED = (
    "recompute kernels on CPU tensors run in Triton's interpreter, which needs TRITON_INTERPRET=1 in the "
    "environment (it is slow: meant for correctness tests). Set TRITON_INTERPRET=1, or set "
    "dtr_compile.config.recompute_kernels = 'off' (the default behaviour on CPU with 'auto')."
)


def import_triton() -> ModuleType:
    """triton, or an ImportError that says how to get it."""
    try:
        import triton
    except ImportError as error:
        raise ImportError(TRITON_MISSING) from error
    return triton


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def check_kernels_can_run(device: torch.device | None) -> None:
    """Raise, saying what to change, when Triton kernels cannot run on `device` in this process."""
    if not triton_available():
        raise ImportError(TRITON_MISSING)
    if device is not None and device.type == "cpu":
        problem = interpreter_problem()
        if problem is not None:
            raise ConfigError(problem)


def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run kernels on CPU tensors in this process, or None when it can."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return INTERPRETER_NEEDED
    triton = import_triton()
    import triton.language as tl

    if isinstance(tl.sum, triton.runtime.jit.JITFunction):  # triton.language was built for compiled kernels
        return (
            "TRITON_INTERPRET=1 was set after triton was imported (importing torch._dynamo imports it), so "
            "triton.language was set up for compiled kernels. Set TRITON_INTERPRET=1 in the environment before "
            "Python starts (or before the first `import torch._dynamo`)."
        )
    return None


def target_for(device: torch.device) -> Target:
    """How kernels run on `device`; raises ConfigError when they cannot."""
    if device.type == "cuda":
        return "gpu"
    if device.type == "cpu":
        problem = interpreter_problem()
        if problem is not None:
            raise ConfigError(problem)
        return "interpreter"
    raise ConfigError(f"recompute kernels run on CUDA (or on CPU in Triton's interpreter), not on {device.type}")


@dataclasses.dataclass
class _Compiled:
    source: KernelSource
    path: Path
    kernel: object  # the @triton.jit function


_CACHE: dict[tuple[Program, Target], _Compiled] = {}
_LOCK = threading.Lock()


def compiled_kernel(program: Program, target: Target) -> _Compiled:
    """The cached kernel of `program` for `target`, generated and loaded on first request."""
    key = (program, target)
    found = _CACHE.get(key)
    if found is not None:
        return found
    with _LOCK:
        if key not in _CACHE:
            import_triton()
            source = generate(program, target)
            path = _write_module(source)
            module = _load_module(path, source.name)
            _CACHE[key] = _Compiled(source, path, getattr(module, source.name))
    return _CACHE[key]


def cache_size() -> int:
    return len(_CACHE)


def _kernel_dir() -> Path:
    root = os.environ.get("DTR_COMPILE_KERNEL_DIR") or os.path.join(
        tempfile.gettempdir(), f"dtr_compile_kernels_{os.getuid()}"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write_module(source: KernelSource) -> Path:
    """Triton reads a kernel's source with `inspect`, so the module lives in a file (named by its hash)."""
    path = _kernel_dir() / f"{source.name}.py"
    if not path.exists() or path.read_text() != source.text:
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(source.text)
        os.replace(scratch, path)
    return path


def _load_module(path: Path, name: str) -> ModuleType:
    module_name = f"dtr_compile_kernels.{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


class RecomputeKernel:
    """Runs one program as one kernel: `kernel(*inputs) -> tuple of output tensors` (fresh, contiguous)."""

    def __init__(self, program: Program, *, label: str = "recompute_kernel") -> None:
        self.program = program
        self.__name__ = label  # FX names the graph's global after it
        self.__qualname__ = label
        # (input strides, device type) -> the compiled kernel for them: the per-call path is one dict lookup.
        self._compiled: dict[tuple[tuple[tuple[int, ...], ...], str], _Compiled] = {}

    def __repr__(self) -> str:
        return f"RecomputeKernel({len(self.program.instrs)} ops, {len(self.program.outputs)} outputs)"

    def source(self, target: Target = "gpu") -> str:
        """The generated Triton source (no triton import needed)."""
        return generate(self.program, target).text

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self._check(inputs)
        device = inputs[0].device
        key = (tuple(tuple(t.stride()) for t in inputs), device.type)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = compiled_kernel(self._program_for(key[0]), target_for(device))
            self._compiled[key] = compiled
        types = self.program.types
        outputs = tuple(torch.empty(types[v].shape, dtype=types[v].dtype, device=device) for v in self.program.outputs)
        launch = compiled.kernel[(compiled.source.grid,)]
        with torch.profiler.record_function(self.__name__), _quiet_interpreter(device):
            launch(*inputs, *outputs, num_warps=compiled.source.num_warps)
        if device.type == "cpu":
            # Triton's interpreter keeps its host views of the arguments in a reference cycle (a recursive
            # closure in GridExecutor._init_args_hst): without a collection here every input and output of the
            # launch stays allocated until the garbage collector happens to run, and the measured peak is off.
            gc.collect(1)
        return outputs

    def _check(self, inputs: Sequence[torch.Tensor]) -> None:
        specs = self.program.inputs
        if len(inputs) != len(specs):
            raise TypeError(f"{self!r} takes {len(specs)} tensors, got {len(inputs)}")
        for index, (tensor, spec) in enumerate(zip(inputs, specs, strict=True)):
            if tuple(tensor.shape) != spec.type.shape or tensor.dtype != spec.type.dtype:
                raise TypeError(
                    f"{self!r}: input {index} is {tuple(tensor.shape)} {tensor.dtype}, expected "
                    f"{spec.type.shape} {spec.type.dtype}"
                )

    def _program_for(self, strides: tuple[tuple[int, ...], ...]) -> Program:
        """The program, specialized to the strides the inputs have in memory."""
        specs = self.program.inputs
        if all(s == spec.stride for s, spec in zip(strides, specs, strict=True)):
            return self.program
        respecialized = tuple(InputSpec(spec.type, s) for spec, s in zip(specs, strides, strict=True))
        return dataclasses.replace(self.program, inputs=respecialized)


def _quiet_interpreter(device: torch.device) -> contextlib.AbstractContextManager:
    """The interpreter computes masked-off lanes too (0/0 in padding rows): numpy must not warn about them."""
    if device.type != "cpu":
        return contextlib.nullcontext()
    import numpy

    return numpy.errstate(all="ignore")
