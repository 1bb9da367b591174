"""Plans kept across compiles and processes: compiling the same graph under the same budget again skips the
planner and the compile-time measurement (issue 17: "a cache makes the second process free").

    key = plan_key(joint, num_fwd_outputs, settings)     # the graph's structure + the budget + the settings
    entry = load(key)                                    # None, or what `store` kept
    plan = plan_from_data(joint, entry["plan"])          # the same Plan, on this process's nodes

Key: every node of the joint graph (name, op, target, arguments by name, and its value's shape, stride and dtype),
the number of forward outputs, the budget as the user gave it (bytes or a fraction), the planner's settings, the
source of `passes/` and the torch release. A plan is stored as plain data (each op it runs by node name and
version), so a different graph can never be handed another's plan: a name that does not resolve is a miss.

An entry holds the plan (or, for a budget below what the graph can run in, the floor the BudgetError named), the
memory model and model_scale that made it, its modelled peak and its measured one. It lives in memory and, unless
`dtr_compile.config.plan_cache` is False or Inductor's caches are forced off (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1),
as one JSON file under `$DTR_COMPILE_CACHE_DIR`, or else `<Inductor's cache dir>/dtr_plans` (TORCHINDUCTOR_CACHE_DIR,
default /tmp/torchinductor_<user>): a fresh Inductor cache directory is a fresh plan cache too.

The same store keeps, per graph structure (any budget), the last measured ratio of Inductor's memory to the
model's (`calibration`): a later budget of the same graph aims its first plan with it (verify.py). And the loss tail a
step measured after the graph's forward (`remember_tail`): a later process's first step plans with it, not with the
assumed tail, and compiles with Inductor at once (kept under `dynamo_structure` too: backend/region.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
from collections import Counter
from typing import Any, NamedTuple

import torch
from torch import fx

from .. import config
from ..tensor_bytes import size_hint
from .planner import Emitted, Plan, paused_gc
from .storage import Tail

ENV_DIR = "DTR_COMPILE_CACHE_DIR"

# What happened, for tests and explain: "hits", "misses", "stores", and "plans" (plan_joint calls, partition.py).
COUNTS: Counter[str] = Counter()

_MEMORY: dict[str, dict[str, Any]] = {}


def clear_memory() -> None:
    """Forget the in-memory entries (the on-disk ones stay): as a fresh process would start."""
    _MEMORY.clear()


def enabled_on_disk() -> bool:
    return bool(config.plan_cache) and os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES") != "1"


def cache_dir() -> pathlib.Path:
    """$DTR_COMPILE_CACHE_DIR, else `dtr_plans` in Inductor's cache directory."""
    explicit = os.environ.get(ENV_DIR)
    if explicit:
        return pathlib.Path(explicit)
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    return pathlib.Path(inductor_cache_dir()) / "dtr_plans"


# ------------------------------------------------------------------------------------------------ keys


def graph_structure(joint: fx.GraphModule, num_fwd_outputs: int) -> str:
    """A digest of what the planner reads of `joint`: its nodes, their arguments, and their values' layout."""
    return _digest(joint, f"{num_fwd_outputs}", "val")


def dynamo_structure(gm: fx.GraphModule) -> str:
    """The digest of the graph TorchDynamo handed the backend, by its example values: known before anything is traced,
    and the same whichever code generator traces its joint graph (the first step's FX code and Inductor decompose it
    differently, so a `tail_key` of one's joint `graph_structure` is not found by the other)."""
    return _digest(gm, "", "example_value")


def _digest(gm: fx.GraphModule, seed: str, value_key: str) -> str:
    digest = hashlib.sha256(seed.encode())
    for node in gm.graph.nodes:
        # Dynamo's targets are Python functions, which print with their address: not the same in the next process
        described = repr((node.name, node.op, str(node.target), node.args, node.kwargs))
        digest.update(_ADDRESS.sub("", described).encode())
        digest.update(_layout(node.meta.get(value_key)).encode())
    return digest.hexdigest()


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _layout(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        # A symbolic size prints as its symbol: the values a plan is made at (planned_sizes.py) tell its plans apart.
        layout = f"T{tuple(value.shape)}{tuple(value.stride())}{value.dtype}{value.device.type}"
        if any(isinstance(size, torch.SymInt) for size in value.shape):
            layout += f"@{tuple(size_hint(size) for size in value.shape)}"
        return layout
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_layout(v) for v in value) + ")"
    return type(value).__name__ if value is not None else "-"


def plan_key(structure: str, settings: tuple[Any, ...]) -> str:
    """The key of one (graph, budget, settings) triple; `settings` must be reprs of plain values."""
    return hashlib.sha256(repr((structure, settings, torch.__version__)).encode()).hexdigest()


def calibration_key(structure: str, settings: tuple[Any, ...]) -> str:
    return plan_key(structure, ("calibration", *settings))


# ------------------------------------------------------------------------------------------------ store


def load(key: str) -> dict[str, Any] | None:
    entry = _peek(key)
    COUNTS["hits" if entry is not None else "misses"] += 1
    return entry


def store(key: str, entry: dict[str, Any]) -> None:
    """Keep `entry` (plain JSON data) in memory and, when enabled, on disk (written whole, then renamed)."""
    _MEMORY[key] = entry
    COUNTS["stores"] += 1
    if not enabled_on_disk():
        return
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f"{key}.{os.getpid()}.tmp"
        partial.write_text(json.dumps(entry))
        partial.replace(directory / f"{key}.json")
    except OSError:  # a read-only or full disk costs the next process a plan, nothing else
        pass


def _peek(key: str) -> dict[str, Any] | None:
    """The entry under `key`, from memory or disk; counts no hit or miss (`load` does, for plans)."""
    entry = _MEMORY.get(key)
    if entry is None and enabled_on_disk():
        try:
            # (a plan's entry holds tens of thousands of lists: the collector, run by their allocation over the heap
            # of a compile in progress, took 0.3 s of a 2.8 ms parse, twice per warm first call of Llama small)
            with paused_gc():
                entry = json.loads((cache_dir() / f"{key}.json").read_text())
        except (OSError, ValueError):
            return None
        _MEMORY[key] = entry
    return entry if isinstance(entry, dict) else None


def calibration(key: str) -> float | None:
    """The last measured / modelled peak ratio stored under `key` (no hit or miss is counted)."""
    entry = _peek(key)
    ratio = entry.get("ratio") if entry else None
    return float(ratio) if isinstance(ratio, (int, float)) and ratio > 0 else None


# The measured / modelled ratios a calibration keeps. Outside them the model did not describe the plan measured at
# all, and its ratio says nothing of the graph's other plans: the frontier's GPT-2 (CPU stand-in) at 0.1 of
# torch.compile's peak, far below its floor, compiled a plan modelled at 24 MiB that measured 173 MiB; the ratio, 7.2,
# kept under the graph's key, held every later plan of that graph, in every process, to 0.136 of its budget.
CALIBRATION_RANGE = (0.5, 2.0)


def calibrate(key: str, ratio: float) -> bool:
    """Keep `ratio` (measured / modelled peak of a plan of the graph `key` names) for the graph's next plans, if it is
    within CALIBRATION_RANGE; returns whether it was kept."""
    low, high = CALIBRATION_RANGE
    if not low <= ratio <= high:
        return False
    store(key, {"ratio": ratio})
    return True


# ------------------------------------------------------------------------------------------------ loss tails


def tail_key(structure: str, sizes: str) -> str:
    """Where the loss tail measured after a graph's forward is kept: the graph, at the sizes its step ran."""
    return plan_key(structure, ("tail", sizes))


class RememberedTail(NamedTuple):
    """What a step learned after a graph's forward that its plans are made for: the loss tail it measured (None: the
    assumed one, storage.default_tail, which it measured close enough to keep), and whether the incoming gradients
    outlived the compiled backward (storage.HELD_META_KEY: the autograd engine of torch 2.11 holds them). Without the
    second, a floor named under torch 2.11 raised at a new process's first step, planned with the gradients freed after
    their last read (a 5-layer MLP's 44 MiB floor named 50 MiB)."""

    tail: Tail | None
    tangents_held: bool = False


def remember_tail(key: str, tail: Tail | None, tangents_held: bool = False) -> None:
    """Keep the tail a step measured (storage.Tail; None: the assumed one), and whether its backward held the incoming
    gradients, for the first step of the same graph in a later process."""
    data = None if tail is None else [tail.peak_bytes, tail.at_backward_bytes, sorted(tail.dropped_outputs)]
    store(key, {"tail": data, "tangents_held": tangents_held})


def remembered_tail(key: str) -> RememberedTail | None:
    """What `remember_tail` kept under `key` (no hit or miss is counted), or None."""
    entry = _peek(key)
    if not entry or "tail" not in entry:
        return None
    held = entry.get("tangents_held") is True
    if entry["tail"] is None:
        return RememberedTail(None, held)
    try:
        peak, at_backward, dropped = entry["tail"]
        tail = Tail(int(peak), int(at_backward), frozenset(int(p) for p in dropped))
    except (TypeError, ValueError):
        return None
    return RememberedTail(tail, held)


# ------------------------------------------------------------------------------------------------ plans


def plan_to_data(plan: Plan) -> dict[str, Any]:
    """`plan` as JSON data: nodes by name."""
    return {
        "budget_bytes": plan.budget_bytes,
        "trace": [[e.node.name, e.version, [[a.name, v] for a, v in e.arg_versions]] for e in plan.trace],
        "boundary": plan.boundary,
        "fwd_versions": [[n.name, v] for n, v in plan.fwd_versions.items()],
        "final_versions": [[n.name, v] for n, v in plan.final_versions.items()],
        "replay_peak_bytes": plan.replay_peak_bytes,
        "fits": plan.fits,
        "recompute_s": plan.recompute_s,
        "compute_s": plan.compute_s,
        "evictions": [[n.name, position] for n, position in plan.evictions],
        "smallest_peak_bytes": plan.smallest_peak_bytes,
        "dropped": sorted(n.name for n in plan.dropped),
        "block_options": list(plan.block_options) if plan.block_options is not None else None,
    }


def plan_from_data(joint: fx.GraphModule, data: dict[str, Any]) -> Plan:
    """The plan `plan_to_data` wrote, on the nodes of `joint`; KeyError if a name is not in `joint`."""
    nodes = {n.name: n for n in joint.graph.nodes}
    trace = [
        Emitted(nodes[name], version, tuple((nodes[a], v) for a, v in args)) for name, version, args in data["trace"]
    ]
    options = data["block_options"]
    return Plan(
        budget_bytes=data["budget_bytes"],
        trace=trace,
        boundary=data["boundary"],
        fwd_versions={nodes[n]: v for n, v in data["fwd_versions"]},
        final_versions={nodes[n]: v for n, v in data["final_versions"]},
        replay_peak_bytes=data["replay_peak_bytes"],
        fits=data["fits"],
        recompute_s=data["recompute_s"],
        compute_s=data["compute_s"],
        evictions=[(nodes[n], position) for n, position in data["evictions"]],
        planning_s=0.0,
        smallest_peak_bytes=data["smallest_peak_bytes"],
        dropped=frozenset(nodes[n] for n in data["dropped"]),
        block_options=tuple(options) if options is not None else None,
    )
