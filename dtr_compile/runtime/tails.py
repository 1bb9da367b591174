"""Learning, from a whole step, what the code between a region's forward and its backward holds: its tail.

A region's plan decides what its forward leaves saved for its backward; between the two, code the region does
not contain runs while all of that is held: most often the loss (eager, or a later compiled region after a
graph break), whose own values and the gradients it sends back come on top. Before a step has run, every
memory model assumes a tail (passes/storage.py: one more tangent, the loss's scalars). A step under the runtime
measures it: a memory window (engine/window.py) opens when the region's forward returns and closes when its
backward begins. Two figures come out, both relative to the moment the forward returned:
  - `peak_bytes`: the most the tail held at once (its values, a later region's saved values and transient peak,
    the tangents it makes);
  - `at_backward_bytes`: what it still held when the backward began (the tangents, gradients of later regions'
    parameters), less what the program dropped meanwhile (outputs no one holds any more: negative when the
    loop lets the model's outputs go before the backward).
Only the tail of a region that is alone in its step is learned. When another region's forward returns inside
the window (a model split at graph breaks, DDP's buckets), that region's saved values are in the window too, yet
its own plan decides them under the same budget: counted in the first region's tail they would count twice. Such
regions keep the assumed tail (`spanned`). A region whose forward leaves almost nothing held (at most `LIGHT` of the
step's budget: a loss computed in a graph of its own, as transformers computes a causal LM's after a graph break)
does not count: what it holds in the window is its transient peak and the gradients it sends back, which its own
plan does not decide, and the tail that measures them is the loss's as the code runs it. With Inductor, GPT-2's
fused cross-entropy holds one logits-sized buffer where the assumed tail counts an eager loss's two, and lets the
logits go before the model's backward (CPU stand-in fit model at batch 15: its plan recomputed 135 ms of the step
for the assumed tail, 30 ms for the measured one). (A region planned again with an identical plan once moved
BranchyModel's step, tests/runtime at 0.7, from 0.9995 to 1.058 of its budget with the runtime's own count unchanged:
compiled again outside Dynamo's trace, its backward kept a dead dropout no Footprint held; passes/partition.py drops
it.)
The region plans again with the measured tail when it differs from the assumed one by more than a little of
the budget (backend/region.py); a tail is learned once per region, from the first step that shows it whole, so
that a plan is not remade every step.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..engine import Engine, Storage
from ..engine.window import MemoryWindow

# A region whose forward leaves at most this fraction of the step's budget held does not keep another region's tail
# from being learned: counted twice, it would move that region's plan by less than the 2% of the budget a measured
# tail must differ by before the region plans again (backend/region.py).
LIGHT = 0.01

# The loss's value and the seed gradient `backward()` makes, held at the backward's start where the loss ran unseen:
# two 0-d tensors, float64 at most.
UNSEEN_LOSS_SCALARS_BYTES = 16


@dataclass(frozen=True)
class MeasuredTail:
    peak_bytes: int
    at_backward_bytes: int  # not counting the drop of the region's own outputs (`dropped_outputs` says which)
    # Storages the runtime evicted inside the window to hold the budget: a tail larger than the plan left room for.
    evictions: int = 0
    # Positions among the forward's outputs of those the program no longer viewed when the backward began
    # (storage.Tail.dropped_outputs): what letting them go freed depends on the plan, which may save them.
    dropped_outputs: frozenset[int] = frozenset()


class TailMeter:
    """The open windows of the current step, one per region whose forward returned and whose backward has not
    begun, and the tails learned so far, by region name."""

    def __init__(self, engine: Engine, viewed: Callable[[Storage, frozenset[int]], bool]) -> None:
        """`viewed(storage, besides)`: does a tensor of the program (not one autograd saved, nor one whose id is in
        `besides`) view the storage now?"""
        self.engine = engine
        self.viewed = viewed
        self.learned: dict[str, MeasuredTail] = {}
        self.spanned: set[str] = set()  # regions that shared their step with another: not learned
        # region -> its window, the engine's evictions then, the storages of its outputs by position
        self._open: dict[str, tuple[MemoryWindow, int, tuple[Storage | None, ...]]] = {}
        self._seen: set[str] = set()  # regions whose forward ran in this step, but for the light ones (`LIGHT`)
        self._budget_bytes: int | None = None
        self.program_seen = True
        # Regions whose incoming gradients outlived their compiled backward (passes/storage.HELD_META_KEY), and those
        # whose backward was seen to free them all
        self.held_tangents: set[str] = set()
        self.freed_tangents: set[str] = set()

    def begin_step(self, budget_bytes: int | None = None) -> None:
        """`budget_bytes`: the step's budget (None: no budget, or a step calibrating a fraction)."""
        self._budget_bytes = budget_bytes
        # Does the runtime see the program's code between the regions (the loss)? Not where an implicit step began
        # inside TorchDynamo's frame (runtime/implicit.py: a compiled model's first step), which sets this.
        self.program_seen = True
        for window, _, _ in self._open.values():
            self.engine.close_window(window)
        self._open.clear()
        self._seen.clear()

    def forward_returned(self, region: str, held_bytes: int = 0, outputs: Sequence[Storage | None] = ()) -> None:
        """`held_bytes`: what the region's forward leaves allocated (its outputs and saved values, as planned);
        `outputs`: the storages of its outputs (the joint graph's forward outputs, in order; None: not the step's)."""
        budget = self._budget_bytes
        if budget is None or held_bytes > LIGHT * budget:  # (no budget: every region counts, as before)
            self._seen.add(region)
        if region in self.learned or region in self.spanned:
            return
        previous = self._open.pop(region, None)  # the region ran twice before a backward: measure the last run
        if previous is not None:
            self.engine.close_window(previous[0])
        watched = frozenset(storage.sid for storage in outputs if storage is not None)
        window = self.engine.open_window(watched)
        window.credit_early_drops = not self.program_seen  # what the unseen code made is counted as it is seen
        self._open[region] = (window, self.engine.evictions, tuple(outputs))

    def backward_begins(self, region: str, unseen_bytes: int = 0, inputs: Sequence[object] = ()) -> None:
        """`unseen_bytes`: incoming gradients of the region's backward allocated where the runtime could not see them
        (compiled_ops.CompiledPart._unseen_tangent_bytes): held at the backward's start all the same. `inputs`: the
        backward's inputs, which autograd holds for it: they do not make an output held by the program. (In the
        step that compiles the region, the saved values autograd unpacks for the backward are the forward's own
        tensor objects: HF BERT's MLM logits, which the loop had let go, counted as held.)"""
        opened = self._open.pop(region, None)
        if opened is None:
            return
        window, evictions, outputs = opened
        spanned = bool(self._seen - {region})  # another region ran in this step (and in the window, if it ran after)
        if not spanned:
            # What only cyclic garbage holds is not the program's. The step that measures a tail is the one that
            # compiled the regions, and Dynamo's compile of the loss's frame left the model's output in such a cycle
            # (a frame an exception's traceback kept): GPT-2's logits were counted held through the backward, where
            # the next steps free them when the loss's backward has run (CPU stand-in, batch 15: a measured tail of one
            # logits-sized buffer at the backward's start instead of none). Once per region.
            gc.collect()
        self.engine.close_window(window)
        if spanned:
            self.spanned.add(region)
        else:
            evicted = self.engine.evictions - evictions
            # Where the program's own code ran unseen (`program_seen`), the loss's scalars are held at the backward's
            # start all the same. Without them a budget named as a plan's floor overran by their 8 bytes at the next
            # step (a bf16 MLP; a model that checkpoints its own blocks; CPU).
            held = window.memory + unseen_bytes + (0 if self.program_seen else UNSEEN_LOSS_SCALARS_BYTES)
            autograds = frozenset(id(value) for value in inputs)
            dropped_outputs = frozenset(
                position
                for position, storage in enumerate(outputs)
                if storage is not None and not self.viewed(storage, autograds)
            )
            self.learned[region] = MeasuredTail(
                max(window.peak, held - window.released), held - window.dropped, evicted, dropped_outputs
            )

    def tangents_outlived(self, region: str) -> None:
        """An incoming gradient of `region`'s backward was still allocated when the backward returned: held by the
        autograd engine (torch 2.11) or the program. The region plans again holding them (backend/region.py)."""
        self.held_tangents.add(region)

    def tangents_freed(self, region: str) -> None:
        """Every incoming gradient of `region`'s backward was freed by it (a copy AOTAutograd made of a sum's expanded
        gradient, or a release that frees them: compat.FREES_BACKWARD_GRADS)."""
        self.freed_tangents.add(region)

    def tangents_known(self, region: str) -> bool:
        """Has a step's backward shown whether `region`'s incoming gradients outlive it?"""
        return region in self.held_tangents or region in self.freed_tangents

    def decided(self, region: str) -> bool:
        """Has a step shown this region's tail (measured, or shared with another region: the assumed one stays)?"""
        return region in self.learned or region in self.spanned
