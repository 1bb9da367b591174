"""Compiled code as operations of the eager runtime: the handoff between the two paths of DESIGN.md.

A region TorchDynamo compiled with `backend="dtr"` runs as AOTAutograd's compiled parts: a forward (or an
inference graph) and a backward. Each is a `CompiledPart`. With no runtime step active it is a plain call.
Inside a step it is one multi-output engine operation, like an aten call of the eager code around it:
  - its tensor inputs are locked and made resident (an evicted one is recomputed first);
  - room is made, before it runs, for what it will allocate: its outputs and its transient peak, both read
    off the region's plan (the modelled peak of its schedule; see `Footprint`);
  - its outputs become runtime storages: the values it returns to the program and the activations
    AOTAutograd saves for the backward (seen as saved tensors, saved.py). The runtime may evict them like
    any other storage, and recomputes them by running the compiled part again on the same inputs, with
    the RNG state of the first run replayed, so that a dropout mask comes back identical.
The region's own plan decides what its backward recomputes inside the compiled code; the runtime decides
what survives between operations of the step. How the budget is split between the two: see backend/region.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import _disable_current_modes

from ..compat import FREES_BACKWARD_GRADS, uses_storage_swap
from ..engine import Storage
from ..errors import BudgetError
from ..tensor_bytes import tensor_nbytes
from .backward_pass import backward_keeps_graph, in_backward_pass
from .interface import RuntimeInterface
from .operations import Inputs, record_outputs
from .recipe import OutputSource, Recipe, RngState
from .rng_memory import hold_rng_state, rng_workspace_bytes
from .slices import OutputSlice
from .values import Buffer, TensorValue, buffer, held_by_program, storage_key


@dataclass(frozen=True)
class Footprint:
    """What one compiled part allocates, from the region's plan, at the example input sizes.

    `new_bytes`: bytes its outputs hold when it returns (above its inputs); `transient_bytes`: bytes it
    allocates and frees while running, above those. Other input sizes (dynamic shapes) scale both by the
    growth of the largest input, squared when it grows (attention scores grow with the square of the
    sequence): generous, so that the room made before the call is enough; the outputs are then counted
    exactly once the part has run.
    """

    new_bytes: int
    transient_bytes: int
    example_numels: tuple[int, ...]  # numel of each tensor input at the example sizes

    def scale(self, flat: Sequence[Any]) -> float:
        numels = [x.numel() for x in flat if isinstance(x, torch.Tensor)]
        ratio = max((n / e for n, e in zip(numels, self.example_numels) if e > 0), default=1.0)
        return ratio * ratio if ratio > 1.0 else 1.0

    def reserve_bytes(self, flat: Sequence[Any]) -> int:
        """Bytes to make room for before a call on `flat`: its outputs and its transient peak."""
        return int((self.new_bytes + self.transient_bytes) * self.scale(flat))


NO_FOOTPRINT = Footprint(0, 0, ())


class CompiledPart:
    """A compiled forward, backward or inference graph; an engine operation when a runtime step is active.

    It keeps AOTAutograd's boxed calling convention: it takes the argument list and empties it.
    """

    def __init__(
        self,
        inner: Callable[[list[Any]], Any],
        *,
        name: str,
        footprint: Footprint = NO_FOOTPRINT,
        estimated_s: float | None = None,
        random: bool = False,
        mutated_inputs: Sequence[int] = (),
        slices: Sequence[OutputSlice | None] | None = None,
        on_call: Callable[[RuntimeInterface], None] | None = None,
        op_by_op: Callable[[list[Any]], Any] | None = None,
        tail_of: tuple[str, str] | None = None,
        tangents: Sequence[int] = (),
        forward_outputs: int = 0,
        tangents_held: bool = False,
        unseen_tail_bytes: int = 0,
    ) -> None:
        """`estimated_s`: the plan's modelled time of the part (its cost to the engine unless costs are
        measured); `random`: it draws random numbers (its RNG state is replayed by a recompute);
        `mutated_inputs`: positions of the inputs it writes in place; `slices`: per output, how to recompute
        it alone (slices.py; None: only by rerunning the part); `on_call`: told the runtime whenever the part
        runs inside a step (the backward part ends an implicit step through it); `op_by_op`: the part's FX
        code (boxed), to run with every aten op an operation of the runtime when the part does not fit the
        budget as one operation (see `run_part`); `tail_of`: (region, "forward" or "backward"): the part's
        return (a forward) or call (a backward) bounds its region's tail, which the runtime measures (tails.py);
        `tangents`: positions of a backward's incoming gradients among its inputs (part of that tail);
        `forward_outputs`: how many of a forward's results are the region's outputs (the rest are saved for the
        backward): the tail notes which of them the program let go before the backward; `tangents_held`: the plan
        holds the incoming gradients through the backward (passes/storage.HELD_META_KEY); `unseen_tail_bytes`: what the
        code after a forward may hold (its region's tail), made room for when the forward returns into code the runtime
        cannot see (`make_room_for_unseen_tail`)."""
        if not getattr(inner, "_boxed_call", False):
            from torch._functorch.aot_autograd import make_boxed_func

            inner = make_boxed_func(inner)
        # An instance attribute: AOTAutograd wraps a backward part in `torch._dynamo.disable`, whose wrapper
        # copies the instance's attributes, so the part is still called boxed (and can free its inputs early).
        self._boxed_call = True
        self.inner = inner
        self.name = name
        self.footprint = footprint
        self.estimated_s = estimated_s
        self.random = random
        self.mutated_inputs = tuple(mutated_inputs)
        self.slices = list(slices) if slices is not None else None
        self.on_call = on_call
        self.op_by_op = op_by_op
        self.tail_of = tail_of
        self.tangents = tuple(tangents)
        self.forward_outputs = forward_outputs
        self.tangents_held = tangents_held
        self.unseen_tail_bytes = unseen_tail_bytes
        self._measured_s = float("inf")

    def __call__(self, *call_args: Any) -> Any:
        # Boxed (one list, which the callee empties), as AOTAutograd calls parts; unboxed arguments are
        # accepted too, for a caller that wraps the part without copying its attributes.
        args = call_args[0] if len(call_args) == 1 and type(call_args[0]) is list else list(call_args)
        runtime = active_runtime()
        if runtime is None:
            return self.inner(args)
        if not runtime.in_backward and in_backward_pass():
            runtime.backward_began()
        tail_of = self.tail_of
        if tail_of is not None and tail_of[1] == "backward":
            runtime.constants.release_unseen_births()
            runtime.tails.backward_begins(tail_of[0], self._unseen_tangent_bytes(runtime, args), args)
        if self.on_call is not None:
            self.on_call(runtime)
        ends_forward = tail_of is not None and tail_of[1] == "forward"
        # What the forward leaves held, read before the call empties `args` (tails.LIGHT)
        held_bytes = int(self.footprint.new_bytes * self.footprint.scale(args)) if ends_forward else 0
        watched = self._watch_tangents(args) if tail_of is not None and tail_of[1] == "backward" else []
        try:
            results = self._run(runtime, args)
        except BaseException:
            runtime.failed = True
            raise
        if any(not weak.expired() for weak in watched):
            runtime.tails.tangents_outlived(tail_of[0])  # type: ignore[index]
        elif watched:
            runtime.tails.tangents_freed(tail_of[0])  # type: ignore[index]
        if ends_forward:
            # The outputs' storages matter only while the region's tail is being learned (tails.py)
            outputs = (
                []
                if runtime.tails.decided(tail_of[0])
                else [
                    runtime.index.lookup(r) if isinstance(r, torch.Tensor) else None
                    for r in list(results)[: self.forward_outputs]
                ]
            )
            runtime.tails.forward_returned(tail_of[0], held_bytes, outputs)
            if not runtime.tails.program_seen:
                make_room_for_unseen_tail(runtime, self, list(results))
        return results

    def _watch_tangents(self, args: list[Any]) -> list[StorageWeakRef]:
        """Weak references to the storages of the incoming gradients the plan frees after their last read (none where
        it holds them), to tell, once the part has run, whether something outside it held one through it (the
        autograd engine under torch 2.11: passes/storage.HELD_META_KEY)."""
        if self.tangents_held:
            return []
        return [
            StorageWeakRef(args[i].untyped_storage())
            for i in self.tangents
            if i < len(args) and isinstance(args[i], torch.Tensor) and args[i].untyped_storage().nbytes() > 0
        ]

    def _unseen_tangent_bytes(self, runtime: RuntimeInterface, args: list[Any]) -> int:
        """Bytes of the incoming gradients the runtime never saw allocated: the autograd engine casts a gradient to
        its input's dtype in C++, out of the dispatch mode's sight (bf16 autocast, whose loss upcasts the logits:
        their gradient comes back in fp32 and is cast to bf16 there). They are held when the backward begins."""
        unseen = 0
        for i in self.tangents:
            value = args[i] if i < len(args) else None
            if isinstance(value, torch.Tensor) and runtime.index.lookup(value) is None:
                unseen += tensor_nbytes(value)
        return unseen

    def _run(self, runtime: RuntimeInterface, args: list[Any]) -> Any:
        try:
            return run_part(runtime, self, args)
        except PartDoesNotFit:
            pass
        # Outside the handler, whose exception holds run_part's frame and so the inputs this code frees as it
        # goes. Where the runtime's dispatch mode sees the aten ops, each is an operation of the step; where
        # it does not (the first step's backward: implicit.py), the part runs unmanaged like the code around it.
        runtime.executor.parts_op_by_op += 1
        if not _mode_sees_ops():
            return self.inner(args)
        assert self.op_by_op is not None
        return self.op_by_op(args)

    def cost(self, seconds: float, measure: bool) -> float:
        self._measured_s = min(self._measured_s, seconds)
        if measure or self.estimated_s is None:
            return self._measured_s
        return self.estimated_s


class SliceRecipe(Recipe):
    """Recompute one output of a compiled forward from its slice (its boundary values as inputs).

    The slice is the FX graph the code generator was given, not the code it generated: its result can be laid
    out differently (Inductor picks the strides of the outputs it writes). A rematerialization hands its bytes to
    the program's tensors, which read them with the first run's layout, so a result laid out otherwise is
    copied into that layout first."""

    __slots__ = ("kernel", "kernel_inputs", "layout", "module")
    compiled = True

    def __init__(self, output_slice: OutputSlice, leaves: list[Any], first_run: torch.Tensor) -> None:
        super().__init__(output_slice.module, None, leaves, frozenset(), [OutputSource("fresh", 0)], None)
        self.module = output_slice.module
        self.kernel = output_slice.kernel  # one Triton kernel for the whole slice (slice_kernels.py), or None
        self.kernel_inputs = output_slice.kernel_inputs
        self.layout = (first_run.dtype, tuple(first_run.shape), first_run.stride(), first_run.storage_offset(),
                       first_run.untyped_storage().nbytes())

    @property
    def fused(self) -> bool:
        return self.kernel is not None

    def invoke(self, flat: list[Any]) -> list[Any]:
        if self.kernel is not None:
            result = self.kernel(*(flat[i] for i in self.kernel_inputs))[0]
        else:
            result = self.module(*flat)
        dtype, size, stride, offset, nbytes = self.layout
        if (result.dtype, result.stride(), result.storage_offset(), result.untyped_storage().nbytes()) != (
            dtype, stride, offset, nbytes
        ):
            storage = torch.UntypedStorage(nbytes, device=result.device)
            laid_out = torch.empty(0, dtype=dtype, device=result.device).set_(storage, offset, size, stride)
            laid_out.copy_(result)
            result = laid_out
        return [result]


class PartRecipe(Recipe):
    """Rerun a compiled part on the values it read (mutated inputs on copies, RNG state replayed)."""

    __slots__ = ("part",)
    compiled = True

    def __init__(self, part: CompiledPart, leaves: list[Any], mutated: frozenset[int], sources: list[OutputSource],
                 rng: RngState | None) -> None:
        super().__init__(part.inner, None, leaves, mutated, sources, rng)
        self.part = part

    def invoke(self, flat: list[Any]) -> list[Any]:
        return list(self.part.inner(flat))


def active_runtime() -> RuntimeInterface | None:
    """The runtime whose dispatch mode is on this thread's mode stack (the autograd engine's threads
    inherit the stack of the thread that called backward), or None."""
    from .dispatch import DTRMode

    for i in range(torch._C._len_torch_dispatch_stack()):
        mode = torch._C._get_dispatch_stack_at(i)
        if isinstance(mode, DTRMode) and mode.runtime._mode is mode:  # not one an ended step left behind
            return mode.runtime
    return None


class PartDoesNotFit(Exception):
    """The part cannot run as one operation within the budget, and it can run op by op instead."""


def run_part(rt: RuntimeInterface, part: CompiledPart, args: list[Any]) -> list[Any]:
    """Run `part` on the boxed `args` as one operation of the step. The part empties the list as it goes
    (a backward frees each saved activation after its last use); nothing here keeps the inputs alive.

    One operation holds all of its inputs (a backward: every activation it was saved) and its whole transient
    peak at once. When that cannot fit the budget (the region was planned against the room its forward had,
    and its backward runs with more of the step resident: gradients, parameters' gradients) and the part has
    FX code, raises PartDoesNotFit: the caller runs that code op by op under the runtime, which can then
    evict and recompute the part's own inputs between its ops, as the eager runtime does for eager code."""
    engine = rt.engine
    with _disable_current_modes():  # the compiled code runs plainly: it is one operation of the step
        inputs = Inputs(rt, args)
        written = [i for i in part.mutated_inputs if i < len(args) and isinstance(args[i], torch.Tensor)]
        if written:
            inputs.before_writes(rt, args, written, True)
        device = device_of(args)
        need = part.footprint.reserve_bytes(args) + (rng_workspace_bytes(device) if part.random else 0)
        # The inputs a part frees as it goes (see `loosened` below) stay allocated through a backward pass that keeps
        # its graph; its plan's room counted them freed (at most all of them before its peak): room for them too.
        # Made room for the plan's alone, a retained backward measured 1.5x the step's budget (a 4-block MLP).
        frees_inputs = [s for s in inputs.storages if s.producer is not None and buffer(s).shared]
        if frees_inputs and backward_keeps_graph():
            need += sum(s.nbytes for s in frees_inputs)
        elif part.tangents and not part.tangents_held and _tangents_may_be_held(rt, part):
            # torch 2.11 hands the incoming gradients in a tuple the autograd engine holds until the backward returns,
            # unless AOTAutograd copied one (a sum's expanded gradient): until a step has shown which (the region then
            # plans holding them, or goes on freeing them), room for them all. Also where a step has shown them held
            # and the region has not planned for it yet (its plan made again at a step's end, inside a profiler).
            tangents = [args[i] for i in part.tangents if i < len(args) and isinstance(args[i], torch.Tensor)]
            need += sum(tensor_nbytes(tangent) for tangent in tangents)
        # What the output registration needs of the arguments once the part has freed them: the written ones.
        described = [args[i] if i in written else leaf for i, leaf in enumerate(inputs.leaves)]
        try:
            engine.reserve(inputs.storages, need, part.name, strict=part.op_by_op is not None)
        except BudgetError as error:
            if part.op_by_op is None:
                raise
            raise PartDoesNotFit from error
        # A part frees each input it was handed alone after its last use (the activations AOTAutograd passes
        # a backward): the runtime holds the inputs weakly while it runs, and those that did not survive it
        # count as consumed by it (evicted, recomputable from their producers).
        loosened = [s for s in inputs.storages if s.producer is not None and buffer(s).shared]  # (after any refill)
        for storage in loosened:
            buffer(storage).loosen()
        try:
            rng = RngState.capture(device) if part.random else None
            hold_rng_state(rt, rng)  # its bytes count against the budget (room made in `need`)
            start = time.perf_counter()
            results = list(part.inner(args))
            elapsed = time.perf_counter() - start
        except BaseException:
            for storage in loosened:
                buffer(storage).tighten()
            engine.abandon(inputs.storages)
            raise
        consumed = [s for s in loosened if not buffer(s).tighten()]
        rt.compute_seconds += elapsed
        cost = part.cost(elapsed, rt.measure_costs)
        if part.slices is not None and not written and not consumed and rt.recorder is None:
            record_by_slices(rt, part, inputs, results, cost, need, rng)
        else:
            # A rerun allocates every output again, those still resident included (their copies are dropped):
            # its workspace is all of what the first run made room for.
            record_outputs(rt, part.name, described, inputs, written, results, cost, need,
                           lambda sources: PartRecipe(part, inputs.leaves, frozenset(written), sources, rng),
                           unpredicted=True, consumed=consumed)
    return results


def make_room_for_unseen_tail(rt: RuntimeInterface, part: CompiledPart, results: list[Any]) -> None:
    """A forward returns into code the runtime cannot see (a compiled model's first step begins inside TorchDynamo's
    frame: runtime/implicit.py): the loss that runs there allocates out of the runtime's sight, so it cannot evict to
    make room as the loss needs it. Room is made now for the region's tail instead (the larger of the plan's and the
    assumed one: a first step may plan with the least tail), evicting saved values the backward will recompute, as
    far as they go: the tail is a guess, so falling short raises nothing (a loss that needs less still runs). Without
    it the first step of an MLP whose plan could not meet the budget (0.7 of eager's peak, the loss outside the
    model) measured 1.07x the budget with no error; the next step named the floor."""
    engine = rt.engine
    if part.unseen_tail_bytes <= 0 or engine.budget_bytes is None:
        return
    # Only what autograd alone holds is evicted: the backward reads it through the runtime's saved-tensor hooks,
    # which bring it back. What the program holds (the forward's outputs) the unseen code reads as it is: evicted,
    # the loss summed a storage of 0 bytes (a segmentation fault). `results` still holds the values the forward saves
    # for its backward, which autograd alone will hold once the part returns: those may go.
    index = rt.index
    outputs = {index.lookup(r) for r in results[: part.forward_outputs] if isinstance(r, torch.Tensor)}
    saved = {index.lookup(r) for r in results[part.forward_outputs :] if isinstance(r, torch.Tensor)} - outputs
    held = [storage for storage in engine.pool if storage not in saved and held_by_program(storage)]
    engine.make_room(part.unseen_tail_bytes, keep=held)


def _tangents_may_be_held(rt: RuntimeInterface, part: CompiledPart) -> bool:
    """May `part`'s incoming gradients outlive it: shown so by a step, or not shown either way under torch 2.11?"""
    if part.tail_of is None:
        return not FREES_BACKWARD_GRADS
    region = part.tail_of[0]
    return region in rt.tails.held_tangents or (not FREES_BACKWARD_GRADS and not rt.tails.tangents_known(region))


def _mode_sees_ops() -> bool:
    """Does the runtime's dispatch mode see the aten ops run now? Not in the first step's backward, whose mode
    was pushed inside TorchDynamo's frame (implicit.py)."""
    return torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.Python)


def record_by_slices(
    rt: RuntimeInterface, part: CompiledPart, inputs: Inputs, results: list[Any], cost: float, workspace: int,
    rng: RngState | None,
) -> None:
    """Register a forward's outputs as one operation each, recomputed by its slice; outputs without a slice
    (random ones) as one operation that reruns the whole part. The region's inputs are locked (reserved
    before the part ran); every output is resident."""
    engine, index = rt.engine, rt.index
    assert part.slices is not None
    storage_of: dict[int, Storage] = dict(inputs.keys)  # torch storage key -> engine storage
    fresh: dict[int, int] = {}  # torch storage key -> position of the first output on it
    for k, r in enumerate(results):
        if isinstance(r, torch.Tensor):
            key = storage_key(r)
            if key not in storage_of and key not in fresh:
                fresh[key] = k
    by_position: dict[int, Storage] = {}
    new: list[Storage] = []

    def adopt(storage: Storage, k: int, key: int) -> None:
        r = results[k]
        storage.payload = Buffer(r.untyped_storage(), r.device, shared=True)
        index.set_current(key, storage)
        storage_of[key] = storage
        by_position[k] = storage
        new.append(storage)

    # Outputs without a slice come back only by rerunning the whole part: that is their cost (not what the
    # slices leave of it, which made them look free to evict), and its footprint the room a rerun needs.
    whole = [(key, k) for key, k in fresh.items() if part.slices[k] is None]
    if whole:
        sources = [OutputSource("fresh", k) for _, k in whole]
        op = engine.record(part.name, inputs.storages, [results[k].untyped_storage().nbytes() for _, k in whole],
                           cost, payload=PartRecipe(part, inputs.leaves, frozenset(), sources, rng),
                           workspace=workspace)
        for storage, (key, k) in zip(op.outputs, whole):
            adopt(storage, k, key)
    else:
        engine.abandon(inputs.storages)

    pending = [(key, k) for key, k in fresh.items() if part.slices[k] is not None]
    while pending:  # in dependency order: a slice reads outputs registered before it
        waiting = []
        for key, k in pending:
            output_slice = part.slices[k]
            leaves: list[Any] = []  # a TensorValue per tensor boundary, the value itself for a symbolic size
            ready = True
            for kind, j in output_slice.boundaries:
                if kind == "input":
                    leaves.append(inputs.leaves[j])
                elif not isinstance(results[j], torch.Tensor):
                    leaves.append(results[j])
                else:
                    storage = by_position.get(j) or _storage_of_result(results[j], storage_of)
                    if storage is None:  # an output registered later in this loop
                        ready = False
                        break
                    leaves.append(TensorValue(storage, results[j]))
            if not ready:
                waiting.append((key, k))
                continue
            storages = list(dict.fromkeys(leaf.storage for leaf in leaves if isinstance(leaf, TensorValue)))
            engine.reserve(storages, 0, part.name)  # all resident: locks them for the record
            nbytes = results[k].untyped_storage().nbytes()
            # Without the storage swap (compat.py) a refill copies the slice's result in: room for one more.
            op = engine.record(f"{part.name}[{k}]", storages, [nbytes],
                               output_slice.estimated_s, payload=SliceRecipe(output_slice, leaves, results[k]),
                               workspace=max(output_slice.workspace_bytes, 0 if uses_storage_swap() else nbytes))
            adopt(op.outputs[0], k, key)
        if len(waiting) == len(pending):
            raise AssertionError(f"dtr_compile internal error: cyclic output slices in {part.name}")
        pending = waiting

    # The outside tensors the part read (parameters, inputs): if the program writes one in place later in the step,
    # a rerun of these records must read its old value, which the registry keeps only for the consumers it knows
    # (constants.py). Unnoted, an evicted output came back computed from the new value, silently.
    in_backward = in_backward_pass()
    for op in dict.fromkeys(storage.producer for storage in new if storage.producer is not None):
        rt.constants.note_readers(op, in_backward=in_backward)
    for r in results:
        if isinstance(r, torch.Tensor):
            storage = storage_of.get(storage_key(r))
            if storage is not None and storage.producer is not None:
                index.track(r, storage)
    for storage in new:
        engine.drop_handle(storage)  # the engine's initial handle: from now on only the program's handles count
    engine.reserve([], 0, part.name)  # the outputs' true size is known now: restore the budget


def _storage_of_result(result: Any, storage_of: dict[int, Storage]) -> Storage | None:
    return storage_of.get(storage_key(result)) if isinstance(result, torch.Tensor) else None


def device_of(flat: Sequence[Any]) -> torch.device:
    """The device of the first tensor among `flat` (CPU when there is none)."""
    for x in flat:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


