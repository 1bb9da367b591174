"""The chain of repeated blocks in a joint graph, and what each block may drop (issue 17).

Most models people train are a chain of repeated blocks: `transformer.h.0` .. `transformer.h.11`, Llama's
`model.layers.N`, a ResNet's `layer1.0` .. `layer4.1`. Dynamo records on every forward node the module path
that made it (`node.meta["nn_module_stack"]`, kept by AOTAutograd in the joint graph on torch 2.11 - 2.15);
a block is one element `prefix.N` of a module list, taken at the outermost level where such elements occur.
Backward nodes carry no module stack, but they share `seq_nr` with the forward op they differentiate,
which places them in the block of that op.

Per block the chain planner (chain_plan.py) chooses among a few options, each a set of forward values
the forward does not save:
- "save": nothing (the block saves every value its backward reads);
- "keep": what the starting partition (torch.compile's min-cut) drops inside the block;
- "sac": selective activation checkpointing: keep the outputs of matmul-like ops and attention (with its
  logsumexp and RNG outputs, which are the same node's), drop the rest;
- "checkpoint": drop everything computed inside the block except what later blocks read (the block's
  output: the next block's input), so its backward recomputes the block from its input, as
  `torch.utils.checkpoint` does.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import torch
from torch import fx

from .schedule import JointFacts

__all__ = ["OPTIONS", "Block", "boundaries", "find_chain", "option_drops", "sac_saves"]

OPTIONS = ("save", "keep", "sac", "checkpoint")
_ELEMENT = re.compile(r"^(.*)\.(\d+)$")  # "L['self'].transformer.h.3" -> ("L['self'].transformer.h", "3")
MIN_BLOCKS = 2

_aten = torch.ops.aten
# Expensive to compute, cheap to store: what selective checkpointing's save-matmuls policy keeps.
_MATMUL_LIKE = {
    _aten.mm.default,
    _aten.bmm.default,
    _aten.addmm.default,
    _aten.baddbmm.default,
    _aten.convolution.default,
}
_ATTENTION_PREFIX = "_scaled_dot_product"  # flash, efficient, cudnn, flash_attention_for_cpu: all kept


@dataclass(frozen=True)
class Block:
    """One element of the chain: its module path, its forward nodes, and the backward nodes of its ops."""

    path: str
    forward: frozenset[fx.Node]
    backward: frozenset[fx.Node]
    outputs: frozenset[fx.Node]  # forward nodes of the block read by forward nodes outside it


def _element_path(node: fx.Node) -> str | None:
    """The outermost `prefix.N` module path on `node`'s module stack (None: the node is in no module list)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for value in stack.values():
        path = value[0] if isinstance(value, tuple) else str(value)
        if _ELEMENT.match(path):
            return path
    return None


def find_chain(facts: JointFacts) -> list[Block] | None:
    """The blocks of the chain in forward order; None when the graph has fewer than two, or when blocks
    interleave (the forward runs one block's ops between another's: not a chain)."""
    members: dict[str, list[fx.Node]] = {}
    for node in facts.forward:
        path = _element_path(node)
        if path is not None:
            members.setdefault(path, []).append(node)
    if len(members) < MIN_BLOCKS:
        return None
    position = facts.position
    spans = sorted((position[nodes[0]], position[nodes[-1]], path) for path, nodes in members.items())
    for (_, end, _), (start, _, _) in itertools.pairwise(spans):
        if start <= end:
            return None
    by_seq: dict[int, str] = {}
    for path, nodes in members.items():
        for node in nodes:
            seq = node.meta.get("seq_nr")
            if seq is not None:
                by_seq.setdefault(seq, path)
    backward: dict[str, list[fx.Node]] = {path: [] for path in members}
    for node in facts.backward:
        path = by_seq.get(node.meta.get("seq_nr"))
        if path is not None:
            backward[path].append(node)
    blocks = []
    for _, _, path in spans:
        inside = frozenset(members[path])
        outputs = frozenset(
            n
            for n in inside
            if any(u in facts.is_forward and u not in inside for u in n.users) or n in facts.fwd_outputs
        )
        blocks.append(Block(path, inside, frozenset(backward[path]), outputs))
    return blocks


def boundaries(facts: JointFacts, blocks: list[Block]) -> frozenset[fx.Node]:
    """The values the chain's blocks start from: every block's outputs, and the forward values the first block
    reads (a plan may save them for a recompute: JointFacts.allow_saving)."""
    first = blocks[0].forward
    entry = {a for n in first for a in facts.inputs[n] if a in facts.is_forward and a not in first}
    return frozenset(entry).union(*(b.outputs for b in blocks))


def sac_saves(blocks: list[Block]) -> frozenset[fx.Node]:
    """The values the `sac` option keeps, in every block: a plan may save them although no backward op reads them
    (JointFacts.allow_saving). A matmul whose output reaches the backward only through pointwise ops (GPT-2's
    attention `c_proj` through the residual add) was otherwise recomputed by every `sac` block, where torch's
    save-matmuls policy saves it. On the CPU stand-in's Llama at SAC's peak our plan recomputed 16 `mm` a step
    (1.18x SAC's step); with them savable, 5 (1.04x)."""
    return frozenset(n for b in blocks for n in b.forward if _kept_by_sac(n))


def _kept_by_sac(node: fx.Node) -> bool:
    target = node.target
    if target in _MATMUL_LIKE:
        return True
    name = getattr(target, "__name__", "") or str(target)
    return name.startswith(_ATTENTION_PREFIX) or f".{_ATTENTION_PREFIX}" in name


def option_drops(facts: JointFacts, block: Block, option: str, start: frozenset[fx.Node]) -> frozenset[fx.Node]:
    """The forward values of `block` the forward does not save under `option` (`start`: the starting
    partition's dropped values)."""
    # A block's outputs are the next block's input: every option saves them (they cost nothing when nothing reads
    # them in the backward), so that recomputing a block never reaches into the block before it.
    candidates = [n for n in facts.candidates if n in block.forward and n not in block.outputs]
    if option == "save":  # what the backward reads: not the values only a recompute would read
        return frozenset(n for n in candidates if n in facts.savable_for_recompute)
    if option == "keep":
        return frozenset(n for n in candidates if n in start)
    if option == "checkpoint":
        return frozenset(candidates)
    if option == "sac":
        return frozenset(n for n in candidates if not _kept_by_sac(n))
    raise ValueError(f"unknown block option {option!r}; expected one of {OPTIONS}")
