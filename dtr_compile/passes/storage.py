"""Which storage each value of an FX graph lives in, and how many bytes that storage holds.

Memory is counted per storage, as the allocator sees it: a view (`permute`, `view`, `alias`, ...) or a
`getitem` of a multi-output op allocates nothing and keeps its base storage alive; a multi-output op
(`native_batch_norm`, `native_dropout`) allocates one storage per fresh tensor output. Graph inputs
(parameters, user inputs) are not counted: they were live before the step began.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from ..tensor_bytes import tensor_nbytes

StorageKey = tuple[fx.Node, object]  # (producing node, index of the output: an int, or a tuple when nested)

# Index of the extra storage a random op's forward allocates when the plan recomputes it: the generator
# state its recompute replays (rewrite.py). Only the planner's fast simulation uses this key.
RNG_STATE_INDEX = "rng_state"


@dataclass(frozen=True)
class StorageInfo:
    key: StorageKey
    nbytes: int
    counted: bool  # False for graph inputs and their views


# The code that runs between a region's forward and its backward (most often the loss, computed eagerly on the
# region's outputs) is not in the graph, yet it runs while every saved value is live. A cross-entropy over logits
# holds the logits' log-softmax, then its gradient, beside the tangent it makes. Every memory model (peak.py,
# schedule.py's simulation, ilp.py) reserves that much at the forward/backward boundary: the outputs (held by
# the user) and the tangents are counted already, and LOSS_TAIL_TANGENTS more tangents' bytes on top, plus the
# loss's own scalars (its value, the gradient seed `backward()` makes: the CPU stand-in's step overran a budget of
# exactly this model's floor by 8 bytes without them). Found on an H200 (GPT-2 124M shape, vocab 8192, loss
# outside the compiled model): a plan held to 1311.7 MiB measured 1215.9 MiB for the region alone, and the step's
# eager loss then needed 768 MiB more than the saved values.
# A region with a scalar differentiable output computes its loss itself (a Hugging Face model given labels
# returns the loss and the logits): nothing is reserved for it.
LOSS_TAIL_TANGENTS = 1
LOSS_TAIL_SCALAR_BYTES = 1024
# What room a first step makes for a loss it cannot see (compiled_ops.make_room_for_unseen_tail), in incoming
# gradients' bytes: a mean of squares holds three values of the output's size above the forward's end at once (the
# difference it saves, the mean's gradient, and two temporaries of the square's backward formula, less the output
# it let go), and the runtime does not see the mean's gradient being made. With the planning tail's one, the first
# step of an MLP at 0.78 of eager's peak measured 1.026x its budget. Only the first step pays it (a few evictions).
UNSEEN_LOSS_TANGENTS = 3


def loss_tail_bytes(tangents: Iterable[fx.Node], tangent_bytes: int) -> int:
    """Bytes the eager code between forward and backward is assumed to hold above the outputs and `tangents`."""
    values = [t.meta.get("val") for t in tangents]
    if not tangent_bytes or any(isinstance(v, torch.Tensor) and v.numel() == 1 for v in values):
        return 0
    return LOSS_TAIL_TANGENTS * tangent_bytes + LOSS_TAIL_SCALAR_BYTES


@dataclass(frozen=True)
class Tail:
    """What the code between a region's forward and its backward holds, in bytes above what the forward left
    when it returned: at most (`peak_bytes`, the tangents it makes included) and when the backward begins
    (`at_backward_bytes`: the tangents, less what the program dropped meanwhile that was not the region's own
    outputs). `dropped_outputs`: the positions, among the joint graph's forward outputs, of the outputs the
    program let go before the backward (`loss = model(**batch).loss`: the logits). What letting one go frees
    depends on the plan, not on the loop: nothing where the plan saves the output for the backward, its bytes
    where it does not, so each memory model frees them itself (`let_go_keys`). Counted in bytes, a tail learned
    while the region ran torch.compile's partition (which saved HF BERT's MLM logits) kept the logits of every
    later plan (which saved another buffer instead) through the backward: 0.5 MiB of the CPU stand-in's 10.8 MiB
    budget unused, 0.88 of it measured.
    Assumed (`default_tail`) until a step under the runtime measures it (runtime/tails.py); a measured one is
    put on the joint graph's tangent placeholders under TAIL_META_KEY, where every memory model reads it."""

    peak_bytes: int
    at_backward_bytes: int
    dropped_outputs: frozenset[int] = frozenset()


TAIL_META_KEY = "dtr_tail"


def tangent_placeholders(graph: fx.Graph) -> list[fx.Node]:
    """The joint graph's (or a backward's) incoming gradients, in order: AOTAutograd names them `tangents_*`."""
    return [n for n in graph.find_nodes(op="placeholder") if n.name.startswith("tangents")]


def default_tail(tangents: Iterable[fx.Node], tangent_bytes: int) -> Tail:
    tangents = list(tangents)
    return Tail(tangent_bytes + loss_tail_bytes(tangents, tangent_bytes), tangent_bytes)


# Stands for the least tail a step can have (`DTRPartitioner(tail=LEAST_TAIL)` stamps `Tail(tangent bytes, 0)`):
# the incoming gradients at most, and nothing above the forward's end when the backward begins (the loop let the
# outputs go as it made their gradients: `cross_entropy(compiled(x), y).backward()`). What a region plans its first
# step with when the assumed tail leaves the budget no plan (backend/region.py): the step runs under the runtime,
# which holds the budget, and measures the real tail for the next plan.
LEAST_TAIL = Tail(-1, -1)
LEAST_TAIL_META_KEY = "dtr_tail_least"  # on the tangents beside TAIL_META_KEY: the tail is LEAST_TAIL's, not measured


def let_go_keys(
    tail: Tail, outputs: Sequence[Any], num_fwd_outputs: int, keys: Mapping[fx.Node, Iterable[StorageKey]]
) -> set[StorageKey]:
    """Storages of the forward outputs the program let go before the backward (`Tail.dropped_outputs`) that no
    other output (one it holds, a gradient) shares. `outputs`: the joint graph's output arguments, the forward's
    first. A memory model frees those of them that the plan does not save for the backward."""
    gone: set[StorageKey] = set()
    held: set[StorageKey] = set()
    for position, out in enumerate(outputs):
        if isinstance(out, fx.Node):
            dropped = position < num_fwd_outputs and position in tail.dropped_outputs
            (gone if dropped else held).update(keys[out])
    return gone - held


def tangent_bytes(tangents: Iterable[fx.Node]) -> int:
    """Bytes of a graph's incoming gradients (`tangent_placeholders`), from their example values."""
    return sum(tensor_nbytes(t.meta.get("val")) for t in tangents)


def resolved_tail(tail: Tail, tangents: Iterable[fx.Node]) -> Tail:
    """`tail`, with LEAST_TAIL made the bytes of `tangents`."""
    if tail != LEAST_TAIL:
        return tail
    return Tail(tangent_bytes(tangents), 0)


def assumed_tail(tangents: Iterable[fx.Node], tangent_bytes: int) -> Tail:
    """The tail every memory model plans for: the measured one on the tangents, else `default_tail`.
    `tangent_bytes`: the counted tangents' bytes; held ones (`held_by_engine`) are added here."""
    tangents = list(tangents)
    measured = next((t.meta[TAIL_META_KEY] for t in tangents if TAIL_META_KEY in t.meta), None)
    if measured is not None:
        return measured
    held = sum(tensor_nbytes(t.meta.get("val")) for t in tangents if held_by_engine(t))
    return default_tail(tangents, tangent_bytes + held)


# On a tangent placeholder: the incoming gradient stays allocated until the backward returns, whatever the backward
# frees. torch 2.11 hands a compiled backward its gradients in a tuple the autograd engine holds
# (compat.FREES_BACKWARD_GRADS); AOTAutograd copies one only when its strides differ from the traced ones (a sum's
# expanded gradient: the copy is freed after its last read), so a cross-entropy's logits gradient is held whole. A
# step learns it (the gradient outlived the compiled backward: runtime/compiled_ops.py) and the region plans again
# with it. A held tangent is not counted as one of the backward's own storages (it is never freed there); the tail
# counts it instead, through the whole backward (`Tail.at_backward_bytes` is tangents included, and every memory
# model holds what the tail holds above its counted tangents to the backward's end). Freed after its last read, a
# 4-block MLP's logits gradient under torch 2.11 put the step at 1.10x its budget (FX code and Inductor alike).
HELD_META_KEY = "dtr_held_by_engine"


def held_by_engine(node: fx.Node) -> bool:
    """Is this tangent placeholder held until the backward returns (`HELD_META_KEY`)?"""
    return bool(node.meta.get(HELD_META_KEY))


def rng_state_nbytes(node: fx.Node) -> int:
    """Bytes of the generator state `run_and_save_rng_state` saves for a random op on `node`'s device."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    leaves = [v for v in _leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    device = leaves[0].device if leaves else torch.device("cpu")
    with unset_fake_temporarily():
        state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    return state.numel() * state.element_size()


def _leaves(val: object) -> list[object]:
    if isinstance(val, (tuple, list)):
        return [leaf for v in val for leaf in _leaves(v)]
    return [val]


def returns_alias(node: fx.Node) -> bool:
    """True when the op's (first) output aliases an input: a view, not a fresh allocation."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target in _UNANNOTATED_VIEWS:
        return True
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


# Ops that return a view of their input without saying so in their schema. `_unsafe_view` is the reshape of a value
# no one else reads (a matmul's result back to its batch shape): its output shares the input's storage, in eager code
# and in Inductor's alike. Counted as an allocation of its own, a Linear's 3-D output held two buffers in the model
# where the step held one; torch 2.15 decomposes every 3-D Linear so (a 4-block MLP's no-remat step: the model's
# room for the backward was 4 MiB above what the step allocated, and its saved values 16 MiB below).
_UNANNOTATED_VIEWS = frozenset({torch.ops.aten._unsafe_view.default})


def is_mutating(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def _first_node_arg(node: fx.Node) -> fx.Node | None:
    for arg in node.args:
        if isinstance(arg, fx.Node):
            return arg
    return None


class StorageMap:
    """For every node of a graph: the storages its value occupies (a view shares its base's)."""

    def __init__(
        self,
        graph: fx.Graph,
        counted_inputs: set[fx.Node] = frozenset(),
        inline: Any = None,
    ) -> None:
        """`counted_inputs`: placeholders whose memory counts (tangents, which autograd allocates).
        `inline`: an `inlining.InlineDecider`: the nodes it inlines (computed inside their readers'
        kernels) allocate nothing, and reading one reads its inputs."""
        self.keys: dict[fx.Node, tuple[StorageKey, ...]] = {}
        self.info: dict[StorageKey, StorageInfo] = {}
        # Multi-output nodes: the storages of each element of the output, for `getitem` (elements may
        # themselves be tuples: `run_and_save_rng_state(native_dropout, ...)` returns (state, (out, mask))).
        self._elements: dict[fx.Node, list[tuple[StorageKey, ...]]] = {}
        for node in graph.nodes:
            if inline is not None and inline.may_inline(node):
                reads = tuple(dict.fromkeys(k for a in node.all_input_nodes for k in self.keys[a]))
                if inline.inlines(node, len(reads)):
                    self.keys[node] = reads
                    continue
            self.keys[node] = self._keys_of(node, counted_inputs)

    def _new(self, node: fx.Node, index: object, val: object, counted: bool) -> StorageKey:
        key = (node, index)
        self.info[key] = StorageInfo(key, tensor_nbytes(val), counted)
        return key

    def _structure(self, node: fx.Node, index: object, val: object) -> list[tuple[StorageKey, ...]]:
        """One fresh storage per tensor leaf of a (possibly nested) tuple output, grouped by element."""
        elements = []
        for i, element in enumerate(val):
            sub = i if index is None else (*index, i) if isinstance(index, tuple) else (index, i)
            if isinstance(element, (tuple, list)):
                inner = self._structure(node, sub, element)
                elements.append(tuple(k for keys in inner for k in keys))
            else:
                elements.append((self._new(node, sub, element, True),))
        return elements

    def _keys_of(self, node: fx.Node, counted_inputs: set[fx.Node]) -> tuple[StorageKey, ...]:
        val = node.meta.get("val")
        if node.op == "placeholder":
            counted = node in counted_inputs and not held_by_engine(node)  # a held tangent: the tail counts it
            return (self._new(node, 0, val, counted),) if isinstance(val, torch.Tensor) else ()
        if node.op != "call_function":
            return ()
        if node.target is operator.getitem:
            parent, index = node.args[0], node.args[1]
            elements = self._elements.get(parent)
            if elements is not None and isinstance(index, int) and index < len(elements):
                keys = elements[index]
                if isinstance(val, (tuple, list)) and len(keys) == len(val):
                    self._elements[node] = [(k,) for k in keys]
                return keys
            return self.keys.get(parent, ())  # a getitem of a view-returning op (split, unbind)
        if returns_alias(node):
            base = _first_node_arg(node)
            return self.keys.get(base, ()) if base is not None else ()
        if isinstance(val, (tuple, list)):
            elements = self._structure(node, None, val)
            self._elements[node] = elements
            return tuple(k for keys in elements for k in keys)
        if isinstance(val, torch.Tensor):
            return (self._new(node, 0, val, True),)
        return ()

    def allocated_bytes(self, node: fx.Node) -> int:
        """Bytes this node allocates when it runs (its fresh, counted storages)."""
        return sum(self.info[k].nbytes for k in self.keys.get(node, ()) if k[0] is node and self.info[k].counted)

    def is_alias(self, node: fx.Node) -> bool:
        """True when the node allocates no storage of its own (a view or a getitem)."""
        keys = self.keys.get(node, ())
        return node.op == "call_function" and all(k[0] is not node for k in keys)
