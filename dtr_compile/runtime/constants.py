"""Plain tensors that enter the runtime from outside the step: parameters, buffers, inputs.

They are pinned engine storages outside the budget (DESIGN.md: what was live when the step began is
not counted). One record per underlying storage, so `W` and a view of it share one record.

When an op mutates such a tensor in place (BatchNorm's running statistics, an optimizer step inside
the context), a recorded op that read the old value may still need to be recomputed. Then the old
value is snapshotted first and those ops are pointed at the snapshot; otherwise the mutation is free.

Some outside tensors have an owner that frees and refills their bytes behind the runtime's back: FSDP2 resizes
its unsharded parameters' storages to 0 after a block's forward and gathers them again before its backward
(dtr_compile/distributed.py). Such a refill writes the same values back, so it is no mutation: nothing is
snapshotted (a snapshot would copy the freshly allocated, unwritten bytes). A recompute that reads such a tensor
while it is freed asks the owner for its bytes or raises (recipe.py, `restore_freed`); and the bytes the owner
gathers, which no aten call allocates, are counted from its first refill in the step to the step's end
(`owner.reserve_bytes`).

An outside tensor can also be born inside the step, below the runtime's view: a collective's kernel makes one
(gloo's reduce-scatter with FSDP2, in the backward), or code that runs while the mode is off. Its record outlives
it in the recipes of the ops that read it, and a record that held its bytes strongly kept them allocated,
uncounted, until the step ended (FSDP2 on 2 gloo ranks: one such buffer per block, 1.067-1.113x the budget at 0.6).
One first seen in a backward pass is read only by ops that are never rerun (a backward's outputs stay resident
while held, and no forward recompute reads them): when it dies, its record holds its bytes weakly
(`Buffer.loosen`), so they go with the program's last reference, unless an op outside a backward read it and may
still be rerun. One first seen in the forward stays held (the conservative choice; no case has needed more). A
rerun that finds such bytes gone raises (`refuse_dead_read`), never reads freed memory.

An entry follows its storage, not the tensor object it was first seen through: AOTAutograd hands compiled code
aliases of parameters that die when the call returns, and an entry forgotten with them lost its readers, so that a
later in-place write to the parameter kept no old value for their recomputes (an evicted compiled output came back
computed from the new value). Compiled parts are noted as readers too (compiled_ops.record_by_slices).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import config
from ..engine import Engine, Operation, Storage
from ..errors import DTRError, UnsupportedWrapperError
from .backward_pass import in_backward_pass
from .values import Buffer, TensorValue, buffer, storage_key

# How far the liveness search below walks before it assumes the old value is needed (and snapshots).
_LIVENESS_SEARCH_LIMIT = 256


class ConstantEntry:
    __slots__ = ("born_in_backward", "consumers", "on_death", "storage", "tensor", "values")

    def __init__(self, storage: Storage, tensor: torch.Tensor, on_death) -> None:
        self.born_in_backward = in_backward_pass()  # first seen in a backward pass
        self.storage = storage
        self.on_death = on_death
        # A tensor on the storage, weakly: the entry follows the storage, not this object. When it dies while other
        # tensors still view the bytes (it was an alias made for one call: AOTAutograd hands compiled code such
        # aliases of parameters), the entry stays, its consumers with it, and `value_of` points it at the next one.
        self.tensor = weakref.ref(tensor, on_death)
        # The recorded ops that read it -> whether one was recorded outside a backward pass (the only ones a
        # recompute may rerun).
        self.consumers: weakref.WeakKeyDictionary[Operation, bool] = weakref.WeakKeyDictionary()
        # id(tensor object) -> (weak tensor, its value): a parameter read by every step gets one value, not one
        # per op (values are immutable until a mutation snapshot moves them, which clears this cache).
        self.values: dict[int, tuple[weakref.ref, TensorValue]] = {}

    def old_value_may_be_read(self) -> bool:
        """Could a recorded op that reads this tensor still be rerun (and so need its value as it is now)?"""
        return any(_may_be_recomputed(op) for op in list(self.consumers))


class ConstantRegistry:
    """Maps outside tensors to pinned engine storages, keyed by the address of their storage."""

    def __init__(self, engine: Engine, pin_tensor: Callable[[torch.Tensor], None]) -> None:
        """`pin_tensor`: makes the runtime never evict a tensor it manages (used for accumulated gradients)."""
        self.engine = engine
        self.pin_tensor = pin_tensor
        self._entries: dict[int, ConstantEntry] = {}
        self.snapshot_bytes = 0
        self._grad_hooks: dict[int, Any] = {}  # id(leaf) -> hook handle, removed when the step ends
        self.gradients: list[weakref.ref] = []  # the leaves this step accumulated gradients into, weakly
        self.owner: Any = None  # of outside tensors freed and refilled behind the runtime (distributed.Fsdp2Params)
        self._owner_reserve: Storage | None = None  # the bytes the owner gathers, counted in this step
        self._held_to_end: list[Storage] = []  # bytes allocated outside aten calls, counted until the step ends
        # Does this step's code run unseen before its backward (a first step begun inside TorchDynamo's frame:
        # runtime/tails.TailMeter.program_seen)? Then an outside tensor first seen in the backward was made by that
        # code, in this step: `unseen_births` counts its bytes until a region's backward begins.
        self.counts_unseen_births: Callable[[], bool] = lambda: False
        self.unseen_births: list[Storage] = []
        if hasattr(engine.executor, "restore_freed"):  # the torch executor asks before a recompute (recipe.py)
            engine.executor.restore_freed = self.restore_freed

    def watch_gradient(self, tensor: torch.Tensor) -> None:
        """Pin the gradient autograd accumulates into `tensor` (a parameter or an input leaf).

        A leaf's gradient outlives the step; evicting it would make the step end by recomputing a piece of
        the backward. The autograd engine assigns it without an aten call, so a hook is the only place to see it.
        """
        if id(tensor) in self._grad_hooks or not tensor.requires_grad or not tensor.is_leaf:
            return
        pin_tensor = self.pin_tensor

        gradients = self.gradients

        def pin_gradient(leaf: torch.Tensor) -> None:
            if leaf.grad is not None:
                pin_tensor(leaf.grad)
                gradients.append(weakref.ref(leaf))

        self._grad_hooks[id(tensor)] = tensor.register_post_accumulate_grad_hook(pin_gradient)

    def end_step(self) -> None:
        if self._owner_reserve is not None:
            self._held_to_end.append(self._owner_reserve)
            self._owner_reserve = None
        for storage in self._held_to_end:
            self.engine.release(storage)
        self._held_to_end.clear()
        self.unseen_births.clear()  # released above, where no region's backward began
        for handle in self._grad_hooks.values():
            handle.remove()
        self._grad_hooks.clear()
        # Entries kept when their tensor died while another viewed the bytes, whose bytes nothing else views now:
        # forgotten, as their tensor's death would have (their records live on in the recipes that read them).
        for key, entry in list(self._entries.items()):
            if entry.tensor() is None and not _viewed_elsewhere(entry):
                del self._entries[key]
        # Views of a parameter made anew each step (a transposed weight) leave dead entries in its value cache:
        # drop them, or the cache grows by a few objects every step for as long as the Runtime lives.
        for entry in list(self._entries.values()):
            dead = [k for k, (ref, _) in entry.values.items() if ref() is None]
            for k in dead:
                del entry.values[k]

    def value_of(self, tensor: torch.Tensor, key: int | None = None) -> TensorValue:
        """The value an operation reads from the outside tensor `tensor` (`key`: its `storage_key`, if known)."""
        if key is None:
            key = storage_key(tensor)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._register(tensor, key)
        elif entry.tensor() is None:
            entry.tensor = weakref.ref(tensor, entry.on_death)
        if tensor.requires_grad:
            self.watch_gradient(tensor)
        cached = entry.values.get(id(tensor))
        if cached is not None and cached[0]() is tensor:
            value = cached[1]
            same_view = value.size == tensor.shape and value.stride == tensor.stride()
            if same_view and value.offset == tensor.storage_offset() and value.dtype == tensor.dtype:
                return value
        value = TensorValue(entry.storage, tensor)
        entry.values[id(tensor)] = (weakref.ref(tensor), value)
        return value

    def entry_of(self, storage: Storage) -> ConstantEntry | None:
        untyped = buffer(storage).untyped
        entry = self._entries.get(untyped._cdata) if untyped is not None else None
        return entry if entry is not None and entry.storage is storage else None

    def note_readers(self, op: Operation, *, in_backward: bool = False) -> None:
        """`op` read the outside tensors among its inputs; `in_backward`: it ran in a backward pass (never rerun)."""
        for storage in op.inputs:
            entry = self.entry_of(storage) if storage.producer is None else None
            if entry is not None:
                entry.consumers[op] = entry.consumers.get(op, False) or not in_backward

    def live_tensors(self) -> Iterable[torch.Tensor]:
        for entry in list(self._entries.values()):
            tensor = entry.tensor()
            if tensor is not None:
                yield tensor

    def mutation_needs_no_record(self, key: int) -> bool:
        """Could the outside tensor on torch storage `key` be written in place with nothing kept or counted?
        True when no recorded op that may be rerun reads it (`before_mutation` would keep no snapshot) and no
        owner refills its bytes (whose gathers the registry counts)."""
        entry = self._entries.get(key)
        if entry is None:
            return self.owner is None
        if self.owner is not None:
            return False
        return not entry.old_value_may_be_read()

    def before_mutation(self, storage: Storage, op_has_fresh_outputs: bool) -> Storage | None:
        """`storage` (a constant) is about to be mutated in place: keep its old value where needed.

        `op_has_fresh_outputs`: the mutating op itself produces outputs it may have to recompute.
        Returns the storage of the old value, or None when no recorded op can need it. With a snapshot, the
        record every recorded op reads becomes the snapshot and the live tensor gets a new record: ask
        `value_of` again for it.
        """
        entry = self.entry_of(storage)
        if entry is None:
            return None
        if self.owner is not None and self.owner.group_of(buffer(storage).untyped) is not None:
            self._count_owner_bytes()
            return None  # the owner refills what it freed: the same values (see the module docstring)
        if not (op_has_fresh_outputs or entry.old_value_may_be_read()):
            return None
        old = buffer(storage)
        # The snapshot is made outside any aten call the runtime sees: count it (room made first) until the step
        # ends, as long as the recipes that read it may live.
        self.hold_to_end(old.untyped.nbytes(), "snapshot of an outside tensor before its mutation")  # type: ignore[union-attr]
        snapshot = old.untyped.clone()  # type: ignore[union-attr]
        self.snapshot_bytes += snapshot.nbytes()
        live = old.untyped
        storage.payload = Buffer(snapshot, old.device, shared=False)  # what recorded ops read from now on
        entry.storage = self._pinned(storage.nbytes, Buffer(live, old.device, shared=True))
        entry.consumers = weakref.WeakKeyDictionary()
        entry.values.clear()
        return storage

    def _count_owner_bytes(self) -> None:
        """From the owner's first refill of the step on, its gathered bytes are counted (they are not seen as
        they come and go: they are resized in, not allocated by an aten call)."""
        nbytes = self.owner.reserve_bytes
        if self._owner_reserve is not None or nbytes <= 0:
            return
        self._owner_reserve = self.hold_to_end(nbytes, "gathered parameters")

    def hold_to_end(self, nbytes: int, name: str, *, make_room: bool = True) -> Storage:
        """Count `nbytes` the step holds outside any aten call (room made first, unless `make_room` is False: at the
        step's start, where there is nothing to evict and the first operation that finds no room raises) until the
        step ends."""
        if make_room:
            self.engine.reserve([], nbytes, name)
            self.engine.abandon([])
        storage = self.engine.constant(nbytes, counted=True)
        self._held_to_end.append(storage)
        return storage

    def release_unseen_births(self) -> None:
        """A region's backward begins: the loss's backward is over, and autograd has let go of what its unseen forward
        saved (`unseen_births`)."""
        for storage in self.unseen_births:
            if storage in self._held_to_end:
                self._held_to_end.remove(storage)
                self.engine.release(storage)
        self.unseen_births.clear()

    def restore_freed(self, storage: Storage, op_name: str) -> Any:
        """A recompute of `op_name` reads `storage`, an outside tensor whose bytes were freed behind the runtime's
        back: its owner brings them back, or this raises (`refuse_freed_read`). Returns what to give
        back once the recompute ran (an FSDP2 group gathered for it alone), or a true non-group value."""
        return refuse_freed_read(buffer(storage).untyped, op_name, self.owner)

    def _register(self, tensor: torch.Tensor, key: int) -> ConstantEntry:
        untyped = tensor.untyped_storage()
        if untyped.nbytes() == 0 and tensor.numel() > 0:
            raise DTRError(
                f"a tensor of shape {tuple(tensor.shape)} whose memory dtr_compile freed (an evicted activation) "
                "was read without the runtime knowing it. Inside a step, hand tensors to code outside torch "
                "through `rt.materialize(tensor)`; tensors that outlive a step are restored when it ends."
            )
        storage = self._pinned(untyped.nbytes(), Buffer(untyped, tensor.device, shared=True))
        entries = self._entries

        def forget(_ref: object) -> None:
            """The outside tensor died (e.g. last step's batch): its record lives on only in recipes that read it,
            which hold its bytes where one of them may still be rerun (see the module docstring)."""
            # Another tensor still viewing these bytes keeps the entry (see ConstantEntry), not its bytes: where no
            # recipe may rerun a reader, they are held weakly as well, and go with that tensor. Held, a loss's
            # log-softmax the runtime first saw read in the backward (its forward ran unseen, inside TorchDynamo's
            # frame) stayed allocated through the model's backward while autograd's saved copy of it lived on: the
            # first step of an MLP measured 1.12x its budget where every later step measured 0.96.
            viewed = _viewed_elsewhere(entry, dying=True)
            if not viewed and entries.get(key) is entry:
                del entries[key]
            rerunnable = [op for op, outside_backward in list(entry.consumers.items()) if outside_backward]
            if entry.born_in_backward and not any(_may_be_recomputed(op) for op in rerunnable):
                buffer(entry.storage).loosen()

        entry = ConstantEntry(storage, tensor, forget)
        entries[key] = entry
        if entry.born_in_backward and tensor.is_floating_point() and self.counts_unseen_births():
            # What a loss's unseen forward saved for its backward (a mean of squares' difference, a cross-entropy's
            # log-softmax) or its unseen backward made (a mean's gradient): allocated in this step all the same, and
            # counted, room made for it, while the loss's backward runs. Uncounted, the first step of an MLP with its
            # mean of squares outside the model measured 1.15x the budget. Integer tensors (the targets the loss
            # reads) were made before the step: not counted.
            made_unseen = self.hold_to_end(untyped.nbytes(), "a tensor made by code the runtime did not see")
            self.unseen_births.append(made_unseen)
        return entry

    def _pinned(self, nbytes: int, payload: Buffer) -> Storage:
        storage = self.engine.constant(nbytes, payload=payload)
        self.engine.drop_handle(storage)  # pinned, so never evicted; without a handle the engine does not hold it
        return storage


def _viewed_elsewhere(entry: ConstantEntry, *, dying: bool = False) -> bool:
    """Does anything but the entry's own record hold the bytes of its storage (a tensor, another storage object)?
    `dying`: asked from the weak reference's callback of a tensor on it, which still holds its storage then."""
    untyped = buffer(entry.storage).untyped
    return untyped is not None and torch._C._storage_Use_Count(untyped._cdata) > (2 if dying else 1)


def _may_be_recomputed(op: Operation) -> bool:
    """Could some live handle still need `op` rerun? Walks evicted, handle-less descendants."""
    frontier = [op]
    seen = 0
    while frontier:
        current = frontier.pop()
        for out in current.outputs:
            seen += 1
            if seen > _LIVENESS_SEARCH_LIMIT:
                return True
            if out.handles > 0:
                return True
            frontier.extend(out.consumers)
    return False


def deterministic_runtime() -> str | None:
    """Why the runtime's eviction decisions may differ between ranks (so it must not run a collective of its
    own), or None: they are functions of shapes, the op sequence and the seed alone."""
    if config.cost_mode == "measure":
        return "config.cost_mode = 'measure' (measured op times differ between ranks)"
    if config.memory_budget == "auto":
        return "memory_budget = 'auto' (each rank's free device memory differs)"
    return None


def refuse_freed_read(untyped: torch.UntypedStorage, op_name: str, fsdp: Any) -> Any:
    """A recompute of `op_name` reads an outside tensor whose bytes were freed behind the runtime's back: bring
    them back (`distributed.Fsdp2Params.regather`; returns what it returned) or raise. Never computes on freed memory."""
    why = deterministic_runtime()
    if fsdp is not None:
        regathered = fsdp.regather(untyped, gather=why is None)
        if regathered is not None:
            return regathered
    owned = fsdp is not None and fsdp.group_of(untyped) is not None
    reason = (
        f"parameters FSDP2 (fully_shard) has resharded, which the runtime may gather again only where every rank "
        f"decides alike, not with {why}" if owned and why is not None
        else "a tensor whose memory was freed outside the runtime (its storage was resized to 0 bytes)"
    )
    raise UnsupportedWrapperError(
        f"a recompute of {op_name} needs {reason}. Raise dtr_compile.config.memory_budget, or change what the "
        "message names."
    )


def refuse_dead_read(op_name: str) -> None:
    """A recompute reads an outside tensor that died during the step, whose bytes went with it."""
    raise DTRError(
        f"a recompute of {op_name} needs an outside tensor (one the runtime did not see being made) that the "
        "program freed during the step, when no recorded op seemed to need it again. Please report this with the "
        "model; raising dtr_compile.config.memory_budget avoids the recompute."
    )


def refuse_collective_rerun(op_name: str) -> None:
    """A recompute would rerun a collective on this rank alone (the other ranks would never join it)."""
    raise UnsupportedWrapperError(
        f"dtr_compile would have to rerun the collective {op_name} to recompute a value it evicted, on this rank "
        "alone. Raise dtr_compile.config.memory_budget."
    )
