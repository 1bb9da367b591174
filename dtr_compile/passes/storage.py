"""Which storage each value of an FX graph lives in, and how many bytes that storage holds.

Memory is counted per storage, as the allocator sees it: a view (`permute`, `view`, `alias`, ...) or a
`getitem` of a multi-output op allocates nothing and keeps its base storage alive; a multi-output op
(`native_batch_norm`, `native_dropout`) allocates one storage per fresh tensor output. Graph inputs
(parameters, user inputs) are not counted: they were live before the step began.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

StorageKey = tuple[fx.Node, int]  # (producing node, index of the output)


@dataclass(frozen=True)
class StorageInfo:
    key: StorageKey
    nbytes: int
    counted: bool  # False for graph inputs and their views


def tensor_nbytes(val: object) -> int:
    """Bytes of a (fake) tensor's data; 0 for non-tensors. Symbolic sizes use their hints."""
    if not isinstance(val, torch.Tensor):
        return 0
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    numel = 1
    for size in val.shape:
        numel *= optimization_hint(size, fallback=4096)
    return int(numel) * val.element_size()


def _returns_alias(node: fx.Node) -> bool:
    """True when the op's (first) output aliases an input: a view, not a fresh allocation."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    returns = target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


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

    def __init__(self, graph: fx.Graph, counted_inputs: set[fx.Node] = frozenset()) -> None:
        """`counted_inputs`: placeholders whose memory counts (tangents, which autograd allocates)."""
        self.keys: dict[fx.Node, tuple[StorageKey, ...]] = {}
        self.info: dict[StorageKey, StorageInfo] = {}
        for node in graph.nodes:
            self.keys[node] = self._keys_of(node, counted_inputs)

    def _new(self, node: fx.Node, index: int, val: object, counted: bool) -> StorageKey:
        key = (node, index)
        self.info[key] = StorageInfo(key, tensor_nbytes(val), counted)
        return key

    def _keys_of(self, node: fx.Node, counted_inputs: set[fx.Node]) -> tuple[StorageKey, ...]:
        val = node.meta.get("val")
        if node.op == "placeholder":
            return (self._new(node, 0, val, node in counted_inputs),) if isinstance(val, torch.Tensor) else ()
        if node.op != "call_function":
            return ()
        if node.target is operator.getitem:
            parent, index = node.args[0], node.args[1]
            parent_keys = self.keys.get(parent, ())
            if len(parent_keys) > index and isinstance(parent.meta.get("val"), (tuple, list)):
                return (parent_keys[index],)
            return parent_keys  # a getitem of a view-returning op (split, unbind)
        if _returns_alias(node):
            base = _first_node_arg(node)
            return self.keys.get(base, ()) if base is not None else ()
        if isinstance(val, (tuple, list)):
            return tuple(self._new(node, i, v, True) for i, v in enumerate(val))
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
