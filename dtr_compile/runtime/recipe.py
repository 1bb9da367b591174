"""How to rerun one recorded aten call, and the executor the engine calls back into.

A recipe holds the call's flattened arguments with every tensor replaced by the `TensorValue` it read,
the RNG state it started from when the op is random (so dropout recomputes the forward's mask), and
where each engine output storage comes from in the call's results. Arguments the op mutates are
cloned before a rerun: a recompute must never repeat a side effect (BatchNorm's running statistics)
and an in-place op's new storage version is built on a copy of the old version.

A rerun reads what its op read, and some of it may not be there any more: an outside tensor whose owner freed
its bytes behind the runtime's back (FSDP2's resharded parameters: constants.py) is brought back by that owner
or the rerun raises, and a collective (a `c10d` op: all ranks must run it together) is never rerun on one rank.
Both raise `UnsupportedWrapperError` (constants.py), never compute on freed memory or hang.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import compat
from ..engine import Operation, Storage
from .calls import flatten_result, unflatten_call
from .constants import refuse_collective_rerun, refuse_dead_read, refuse_freed_read
from .refill import invoke_into, results_in_place
from .values import Buffer, Layout, TensorValue, buffer, view_of


@dataclass(frozen=True)
class RngState:
    """Generator state captured before a random op ran: the op's own `generator=` if it was given one,
    else the default generator of its device."""

    device: torch.device
    state: torch.Tensor
    generator: torch.Generator | None = None

    @staticmethod
    def capture(device: torch.device, generator: torch.Generator | None = None) -> RngState:
        if generator is not None:
            return RngState(device, generator.get_state(), generator)
        if device.type == "cuda":
            return RngState(device, torch.cuda.get_rng_state(device))
        return RngState(device, torch.get_rng_state())

    def replay(self) -> RngState:
        """Install this state; returns the state it replaced, to be restored with `.replay()` again."""
        current = RngState.capture(self.device, self.generator)
        if self.generator is not None:
            self.generator.set_state(self.state)
        elif self.device.type == "cuda":
            torch.cuda.set_rng_state(self.state, self.device)
        else:
            torch.set_rng_state(self.state)
        return current


@dataclass(frozen=True)
class OutputSource:
    """Where an engine output storage comes from when the recipe reruns.

    kind "fresh": the untyped storage of result leaf `index`. kind "mutated": argument leaf `index`,
    which the rerun builds on a copy of the old storage version and mutates in place.
    """

    kind: str
    index: int
    layout: Layout | None = None  # of a fresh result, where refills write in place (no storage swap: refill.py)


class Recipe:
    """Everything needed to rerun one aten call."""

    __slots__ = ("func", "leaves", "mutated", "rng", "sources", "spec")
    compiled = False  # reruns compiled code (a part of a compiled region)?
    fused = False  # reruns it as one Triton kernel (runtime/slice_kernels.py)?

    def __init__(
        self,
        func: torch._ops.OpOverload,
        spec: Any,
        leaves: list[Any],
        mutated: frozenset[int],
        sources: list[OutputSource],
        rng: RngState | None,
    ) -> None:
        self.func = func
        self.spec = spec
        self.leaves = leaves  # TensorValue for tensor arguments, the argument itself otherwise
        self.mutated = mutated  # leaf indices of arguments the op writes
        self.sources = sources  # one per engine output storage, in order
        self.rng = rng

    def invoke(self, flat: list[Any]) -> list[Any]:
        """Run the call on flattened arguments; its results, flattened."""
        args, kwargs = unflatten_call(flat, self.spec)
        return flatten_result(self.func(*args, **kwargs))[0]

    def rerun(self, op: Operation) -> None:
        # Without the storage swap, the evicted storages the program views are reopened (resized back) and the
        # rerun writes into them: a mutated argument's copy is made there, fresh results through `out=`.
        reopened: dict[tuple[str, int], torch.UntypedStorage] = {}
        if not compat.uses_storage_swap():
            for ref, source in zip(op.output_refs, self.sources):
                storage = ref()
                if storage is None or storage.resident:
                    continue
                payload = buffer(storage)
                if source.kind == "fresh" and not results_in_place(self, payload.device):
                    continue  # made elsewhere and copied in by `fill`
                target = payload.reopen(storage.nbytes)
                if target is not None:
                    reopened[source.kind, source.index] = target
        flat: list[Any] = []
        copies: dict[int, torch.UntypedStorage] = {}  # leaf index -> copy of a mutated argument's storage
        for i, leaf in enumerate(self.leaves):
            if not isinstance(leaf, TensorValue):
                flat.append(leaf)
            elif i in self.mutated:
                old = buffer(leaf.storage).untyped
                copy = reopened.get(("mutated", i))
                copy = copy.copy_(old) if copy is not None else old.clone()  # type: ignore[union-attr]
                copies[i] = copy
                flat.append(view_of(copy, leaf))
            else:
                flat.append(leaf.get())
        targets = {index: target for (kind, index), target in reopened.items() if kind == "fresh"}
        previous = self.rng.replay() if self.rng is not None else None
        try:
            results = (targets and invoke_into(self, flat, targets)) or self.invoke(flat)
        finally:
            if previous is not None:
                previous.replay()
        for ref, source in zip(op.output_refs, self.sources):
            storage = ref()
            if storage is None or storage.resident:
                continue  # still holds its value; the rerun's copy is dropped
            if source.kind == "fresh":
                fresh = results[source.index].untyped_storage()
                results[source.index] = None  # a copied refill frees each result before copying the next one
            else:
                fresh = copies[source.index]
            buffer(storage).fill(fresh)


def _check_readable(recipe: Recipe, op: Operation, restore_freed: Callable[[Storage, str], Any] | None) -> list[Any]:
    """Refuse a rerun of a collective, and have freed outside tensors the rerun reads brought back (see the
    module docstring); returns the FSDP2 groups gathered for this rerun alone, to reshard after it."""
    gathered: list[Any] = []
    if getattr(recipe.func, "namespace", None) == "c10d":
        refuse_collective_rerun(op.name)
    for leaf in recipe.leaves:
        if type(leaf) is not TensorValue or leaf.storage.producer is not None:
            continue
        held = buffer(leaf.storage)
        if held.loosened and not held.tighten():  # an outside tensor that died in the step (constants.py)
            refuse_dead_read(op.name)
        untyped = held.untyped
        if untyped is None or untyped.nbytes() >= leaf.storage.nbytes:
            continue
        if restore_freed is None:
            refuse_freed_read(untyped, op.name, None)
        group = restore_freed(leaf.storage, op.name)  # type: ignore[misc]
        if group is not True and group not in gathered:
            gathered.append(group)
    return gathered


class TorchExecutor:
    """The engine's callbacks for torch: rerun a recipe, free a version's bytes; times and counts them."""

    def __init__(self) -> None:
        self.recompute_seconds = 0.0
        self.region_evictions = 0  # live outputs of compiled regions evicted
        self.region_remats = 0  # reruns of compiled code
        self.kernel_remats = 0  # of those, as one Triton kernel
        self.parts_op_by_op = 0  # compiled parts run op by op because they did not fit as one operation
        # Brings back an outside tensor freed behind the runtime's back (ConstantRegistry.restore_freed).
        self.restore_freed: Callable[[Storage, str], Any] | None = None

    def recompute(self, op: Operation) -> None:
        start = time.perf_counter()
        gathered = _check_readable(op.payload, op, self.restore_freed)
        try:
            op.payload.rerun(op)
        finally:
            for group in gathered:
                group.reshard()  # gathered for this recompute alone (distributed.Fsdp2Params.regather)
        self.recompute_seconds += time.perf_counter() - start
        if op.payload.compiled:
            self.region_remats += 1
            self.kernel_remats += op.payload.fused

    def evict(self, storage: Storage) -> None:
        payload = storage.payload
        if not isinstance(payload, Buffer):
            return
        if storage.handles <= 0 and payload.shared:
            payload.detach()  # nothing of the program views it: stop managing it (freed with its last holder)
            return
        if storage.handles > 0 and storage.producer is not None and storage.producer.payload.compiled:
            self.region_evictions += 1
        payload.evict()
