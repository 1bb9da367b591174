"""Typed configuration of dtr_compile, validated on assignment.

    import dtr_compile
    dtr_compile.config.memory_budget = "8GB"
    with dtr_compile.config.patch(memory_budget=0.5, heuristic="dtr"):
        ...

Every flag is a typed module-level assignment with its reason. Assigning an unknown name or an invalid
value raises `ConfigError` at once, naming what is accepted. This module imports nothing from torch.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import math
import re
import sys
import types
from collections.abc import Iterator
from typing import Any, Literal, Self

from .errors import ConfigError

Budget = int | float | str | None
"""A normalized budget: int = bytes, float in (0, 1] = fraction of the no-remat peak, "auto" = what the CUDA device
has free at each step's start less a margin (auto_budget.py), None = no remat."""

# ---------------------------------------------------------------------------------------------- flags

# Peak memory a training step may allocate above what was live when it began (parameters, optimizer
# state and inputs are not counted). Bytes as an int or a string ("1.5GB", "512MiB", "800 MB"), a float
# in (0, 1] as a fraction of the same step's peak without rematerialization, or None for no remat. A bare
# number in a string (from argv or the environment) reads as the same number would in Python: "0.5" is the
# fraction 0.5 (so is "1": the whole peak), and a whole number above 1 is bytes ("8e9", "123"). "auto": on CUDA,
# the device's free memory at each step's start less a margin for the allocator (dtr_compile/auto_budget.py);
# on CPU a DeviceError asks for a number when a step or a compile resolves it.
memory_budget: Budget = None

# Eviction heuristic of the online runtime (see dtr_compile.engine.heuristics for the formulas).
# "dtr_eq_retain" is h_DTR with union-find equivalence classes (as good as the full neighbourhood, much
# cheaper) that first evicts storages no handle refers to any more, but keeps such a dead storage (evictable)
# while an evicted storage the program still holds needs it to be recomputed, instead of freeing it when its
# last handle dies. Why: freeing it can turn one cheap recompute into a chain back through the whole step
# (89% of the step's compute on ResNet-32 at 0.2 x peak). On the DTR authors' logs it matches or beats the
# authors' h_DTR_eq at every budget ratio where theirs succeeds, and succeeds where theirs fails on LSTM
# (0.1) and InceptionV4 (0.2) (benchmarks/sim.md). "dtr_eq" is the paper's heuristic, "dtr_eq_dead" the
# previous default (no retention).
heuristic: str = "dtr_eq_retain"

# How many eviction candidates to score per eviction: "sqrt" samples sqrt(n) of the n candidates
# (the DTR prototype's trick, keeps search time low), "all" scores every candidate, an int samples that many.
candidate_sampling: Literal["sqrt", "all"] | int = "sqrt"

# Tensors smaller than this fraction of the mean resident tensor size are never evicted: they free
# almost nothing and cost a search and a recompute (the prototype used 1%).
min_evictable_fraction: float = 0.01

# Tensors smaller than this many bytes are never evicted, whatever the mean (bookkeeping dominates).
min_evictable_bytes: int = 0

# Abort with ThrashError when recompute cost exceeds this multiple of the original compute cost so far
# (1.0 = the reference simulator's rule: total overhead above 2x counts as thrashing). None disables.
thrash_limit: float | None = 1.0

# Seed for candidate sampling and the "random" heuristic, so runs are reproducible.
random_seed: int = 0

# Code generator of the compiled path: "inductor" (C++ on CPU, Triton on GPU) or "fx" (plain FX
# execution of the planned graphs; no compile cost, useful for debugging and tests).
codegen: Literal["inductor", "fx"] = "inductor"

# How ops are costed, for the compiled path's planner and the runtime's eviction policy: "estimate" (a
# roofline from FLOPs and bytes moved: the same on every run, so choices are reproducible) or "measure"
# (the compiled path times each node once on real tensors of its shapes, cached per op and shapes for the
# process; the runtime charges each call signature the fastest wall time it has seen).
cost_mode: Literal["estimate", "measure"] = "estimate"

# Fused recompute kernels (dtr_compile.kernels): one Triton kernel per region of recomputed pointwise ops,
# row reductions and dropout, so a recompute pays neither a launch nor a memory round trip per op.
# "auto" uses them with codegen="fx" on CUDA tensors when triton imports, and steps aside otherwise (on CPU
# the unfused recompute stays; under Inductor, Inductor fuses recomputes into its own kernels). "triton"
# forces them with codegen="fx", CPU included (CPU tensors need TRITON_INTERPRET=1: slow, for tests). "off"
# never uses them. With kernels on, dropout draws from a counter-based RNG keyed by a saved seed. The same
# setting decides whether the eager runtime reruns a fusible slice of a compiled region as one kernel when it
# brings back an evicted output (runtime/slice_kernels.py), under either code generator.
recompute_kernels: Literal["auto", "triton", "off"] = "auto"

# How a training step of a `torch.compile(backend="dtr")` model is managed. "runtime": the whole step runs
# under the eager DTR runtime (started by the first compiled region, ended with the backward pass): the
# eager code between compiled regions (graph breaks, data-dependent control flow) is managed online, and
# the regions join the runtime as operations, so one budget covers the whole step. "plan_only": each
# compiled region follows its own static plan, planned alone against the budget; code between regions is
# not managed (no per-op overhead outside the regions, but nothing bounds what it allocates).
compiled_steps: Literal["runtime", "plan_only"] = "runtime"

# Keep compiled regions' plans on disk (passes/plan_cache.py), keyed by the joint graph's structure, the budget and
# the settings, with the peak measured at compile time: a second process compiling the same graph under the same
# budget neither plans nor measures. Under $DTR_COMPILE_CACHE_DIR, else Inductor's cache directory (dtr_plans/);
# TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 turns it off too. False: plans are kept in memory only.
plan_cache: bool = True

# ------------------------------------------------------------------------------------------ validation

_SI = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_IEC = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_UNITS = {**_SI, **_IEC}
_BUDGET_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+))?\s*([A-Za-z]*)\s*$")
_ACCEPTED_BUDGETS = (
    "an int number of bytes, a string like '1.5GB', '512MiB' or '800 MB' (units B, KB, MB, GB, TB, KiB, MiB, "
    "GiB, TiB), a float fraction in (0, 1] of the no-remat peak (also as a string: '0.5'), 'auto' (the CUDA "
    "device's free memory less a margin), or None for no rematerialization"
)
# The most bytes a budget or a byte count may name: 2**62 B (4 EiB), far above any device, and small enough
# that sums of a few of them stay within the int64 and float arithmetic that torch, numpy and the planner use.
MAX_BYTES = 2**62


def _short(value: Any) -> str:
    """repr(value), cut to a readable length (an argv string may be thousands of characters)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}...{text[-10:]} ({len(text)} characters)"


def check_bytes(name: str, value: int) -> int:
    """`value` if it is a byte count no machine could exceed (<= MAX_BYTES); else ConfigError naming `name`."""
    if value > MAX_BYTES:
        raise ConfigError(
            f"{name}={value if value < 10**30 else f'<a {value.bit_length()}-bit number>'} bytes is larger than any device "
            f"(the most accepted is 2**62 = {MAX_BYTES:,} B); give the budget in bytes of the device, e.g. '8GB'"
        )
    return value


def parse_budget(value: Any) -> Budget:
    """Normalize a user budget to int bytes, a float fraction in (0, 1], or None. Raises ConfigError."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"memory_budget={_short(value)} is a bool; expected {_ACCEPTED_BUDGETS}")
    if isinstance(value, int):
        if value <= 0:
            raise ConfigError(f"memory_budget={value} bytes must be positive; expected {_ACCEPTED_BUDGETS}")
        return check_bytes("memory_budget", value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value) or value <= 0:
            raise ConfigError(
                f"memory_budget={_short(value)} must be a positive finite number; expected {_ACCEPTED_BUDGETS}"
            )
        if value <= 1.0:
            return value
        if value.is_integer():  # 8e9 reads naturally as bytes
            return check_bytes("memory_budget", int(value))
        raise ConfigError(
            f"memory_budget={_short(value)}: a float is a fraction in (0, 1] of the no-remat peak; for bytes pass an "
            f"int or a string such as '{value:g}B'"
        )
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, str):
        match = _BUDGET_RE.match(value)
        if not match:
            raise ConfigError(f"memory_budget={_short(value)} cannot be parsed; expected {_ACCEPTED_BUDGETS}")
        if not match.group(3):
            # A bare number, as read from argv or an environment variable, means what the same number means
            # in Python: in (0, 1] a fraction ("0.5"), above 1 a whole number of bytes ("8e9", "123").
            try:
                number = float(match.group(1)) * (10.0 ** int(match.group(2) or 0))
            except (OverflowError, ValueError):
                number = math.inf
            if math.isinf(number):
                raise ConfigError(f"memory_budget={_short(value)} is too large to be a number of bytes") from None
            if 0 < number <= 1.0:
                return number
            if number > 1 and not number.is_integer():
                raise ConfigError(
                    f"memory_budget={_short(value)}: a bare number in (0, 1] is a fraction of the no-remat peak and one "
                    f"above 1 is a whole number of bytes; write a fraction in (0, 1] or bytes with a unit, e.g. "
                    f"'{value.strip()}B' or '{value.strip()}MB'"
                )
        unit = match.group(3).upper() or "B"
        if unit not in _UNITS:
            raise ConfigError(
                f"memory_budget={_short(value)}: unknown unit {match.group(3)!r}; expected {_ACCEPTED_BUDGETS}"
            )
        try:
            n_bytes = round(float(match.group(1)) * (10.0 ** int(match.group(2) or 0)) * _UNITS[unit])
        except (OverflowError, ValueError):
            raise ConfigError(f"memory_budget={_short(value)} is too large to be a number of bytes") from None
        if n_bytes <= 0:
            raise ConfigError(f"memory_budget={_short(value)} must be positive; expected {_ACCEPTED_BUDGETS}")
        return check_bytes("memory_budget", n_bytes)
    raise ConfigError(f"memory_budget={_short(value)} has type {type(value).__name__}; expected {_ACCEPTED_BUDGETS}")


def check_positive_bytes(name: str, value: Any) -> int:
    """A positive int byte count (not a bool, at most MAX_BYTES); else ConfigError naming `name`."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return check_bytes(name, value)
    raise ConfigError(f"{name}={_short(value)}; expected a positive int number of bytes")


# The eviction heuristics' names. The engine's registry (engine/heuristics.py HEURISTICS) holds one function for
# each; config names them itself so that it sits on the floor beside the engine instead of above it
# (tests/test_architecture.py checks the floors, tests/test_config.py that the two lists agree).
HEURISTIC_NAMES = (
    "dtr",
    "dtr_eq",
    "dtr_eq_dead",
    "dtr_eq_retain",
    "future",
    "dtr_local",
    "msps",
    "lru",
    "size",
    "random",
)


def _check_heuristic(value: Any) -> str:
    if not isinstance(value, str) or value not in HEURISTIC_NAMES:
        raise ConfigError(f"heuristic={_short(value)} is unknown; expected one of {sorted(HEURISTIC_NAMES)}")
    return value


def _check_sampling(value: Any) -> str | int:
    if isinstance(value, str) and value in ("sqrt", "all"):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ConfigError(f"candidate_sampling={_short(value)}; expected 'sqrt', 'all' or a positive int")


def _check_fraction(value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value < 1.0:
        return float(value)
    raise ConfigError(f"min_evictable_fraction={_short(value)}; expected a float in [0, 1)")


def _check_nonneg_int(name: str):
    def check(value: Any) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        raise ConfigError(f"{name}={_short(value)}; expected a non-negative int")

    return check


def _check_thrash(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf:
        try:
            return float(value)
        except OverflowError:
            pass
    raise ConfigError(
        f"thrash_limit={_short(value)}; expected a positive number (recompute / original compute) or None"
    )


def _check_codegen(value: Any) -> str:
    if isinstance(value, str) and value in ("inductor", "fx"):
        return value
    raise ConfigError(f"codegen={_short(value)}; expected 'inductor' or 'fx'")


def _check_bool(name: str):
    def check(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name}={_short(value)}; expected True or False")

    return check


def _check_compiled_steps(value: Any) -> str:
    if isinstance(value, str) and value in ("runtime", "plan_only"):
        return value
    raise ConfigError(f"compiled_steps={_short(value)}; expected 'runtime' or 'plan_only'")


def _check_cost_mode(value: Any) -> str:
    if isinstance(value, str) and value in ("estimate", "measure"):
        return value
    raise ConfigError(f"cost_mode={_short(value)}; expected 'estimate' or 'measure'")


def _check_recompute_kernels(value: Any) -> str:
    if not isinstance(value, str) or value not in ("auto", "triton", "off"):
        raise ConfigError(f"recompute_kernels={_short(value)}; expected 'auto', 'triton' or 'off'")
    if value == "triton" and importlib.util.find_spec("triton") is None:
        raise ConfigError(
            "recompute_kernels='triton' needs triton, which is not installed. To fix it:\n"
            "  1. pip install 'dtr_compile[triton]'   (or: pip install triton)\n"
            "  2. on CPU, also set TRITON_INTERPRET=1 in the environment (kernels then run in Triton's interpreter)\n"
            "  3. or keep recompute_kernels='auto' (kernels where they pay off) or 'off'"
        )
    return value


_VALIDATORS = {
    "memory_budget": parse_budget,
    "heuristic": _check_heuristic,
    "candidate_sampling": _check_sampling,
    "min_evictable_fraction": _check_fraction,
    "min_evictable_bytes": _check_nonneg_int("min_evictable_bytes"),
    "thrash_limit": _check_thrash,
    "random_seed": _check_nonneg_int("random_seed"),
    "codegen": _check_codegen,
    "cost_mode": _check_cost_mode,
    "recompute_kernels": _check_recompute_kernels,
    "compiled_steps": _check_compiled_steps,
    "plan_cache": _check_bool("plan_cache"),
}


def validate(name: str, value: Any) -> Any:
    """Validate and normalize one flag; unknown names raise ConfigError with the closest known name."""
    if name not in _VALIDATORS:
        close = difflib.get_close_matches(name, list(_VALIDATORS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown dtr_compile.config flag {name!r}.{hint} Known flags: {sorted(_VALIDATORS)}")
    return _VALIDATORS[name](value)


def snapshot() -> dict[str, Any]:
    """The current value of every flag."""
    module = sys.modules[__name__]
    return {name: getattr(module, name) for name in _VALIDATORS}


@contextlib.contextmanager
def _patched(changes: dict[str, Any]) -> Iterator[None]:
    module = sys.modules[__name__]
    old = {name: getattr(module, name) for name in changes}
    for name, value in changes.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            module.__dict__[name] = value


class patch(contextlib.ContextDecorator):
    """Set flags for a scope; usable as `with config.patch(...):` and as a decorator.

    All values are validated when the patch is created, so a typo fails before any work starts.
    """

    def __init__(self, **changes: Any) -> None:
        self._changes = {name: validate(name, value) for name, value in changes.items()}
        self._stack: list[contextlib.AbstractContextManager] = []

    def __enter__(self) -> Self:
        cm = _patched(self._changes)
        cm.__enter__()
        self._stack.append(cm)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.pop().__exit__(*exc)


class _ConfigModule(types.ModuleType):
    """Makes `config.flag = value` validate, and `config.typo = value` fail loudly."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            super().__setattr__(name, value)
            return
        super().__setattr__(name, validate(name, value))


sys.modules[__name__].__class__ = _ConfigModule
