"""Emit a plan as a new joint graph: the forward as planned, then the backward with each recompute
placed right before its first use. The input graph is not modified.

Random ops that the plan recomputes run in the forward under `run_and_save_rng_state`, which returns
the generator state they started from; each recompute runs under `run_with_rng_state` with that state,
so it draws the same numbers (a dropout mask recomputed in the backward is the forward's mask). On
CPU the state is the generator's 5 KB state tensor; Inductor runs both wrappers as fallback kernels.
"""

from __future__ import annotations

import copy
import operator

import torch
from torch import fx

from .costs import is_random
from .meta import DTR_META_KEY
from .planner import Plan, Version

RECOMPUTE_META_KEY = "dtr_recompute_of"  # on recompute copies: the name of the node they recompute


def _rng_state_val(val: object) -> torch.Tensor:
    """A fake tensor like the RNG state `run_and_save_rng_state` returns for `val`'s device."""
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode()
    leaf = val[0] if isinstance(val, (tuple, list)) else val
    if fake_mode is None and isinstance(leaf, torch._subclasses.FakeTensor):
        fake_mode = leaf.fake_mode
    device = leaf.device if isinstance(leaf, torch.Tensor) else torch.device("cpu")
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    return fake_mode.from_tensor(state) if fake_mode is not None else state


def emit_plan(gm: fx.GraphModule, plan: Plan, *, num_fwd_outputs: int) -> fx.GraphModule:
    """A new joint GraphModule that runs `plan.trace` in order."""
    return fx.GraphModule(gm, emit_graph(gm, plan, num_fwd_outputs=num_fwd_outputs))


def emit_graph(gm: fx.GraphModule, plan: Plan, *, num_fwd_outputs: int) -> fx.Graph:
    """`emit_plan`'s graph, without the GraphModule, whose Python code generation was half of emitting: a graph
    that is only modelled (the no-remat schedule's, when a budget needs a plan) need not pay it."""
    graph = fx.Graph()
    env: dict[tuple[fx.Node, Version], fx.Node] = {}
    replayed_random = {e.node for e in plan.trace if e.is_recompute and is_random(e.node)}
    rng_states: dict[fx.Node, fx.Node] = {}

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[(node, 0)] = graph.node_copy(node)

    for index, emitted in enumerate(plan.trace):
        node = emitted.node
        versions = dict(emitted.arg_versions)
        tag = "is_forward" if index < plan.boundary else "is_backward"

        def lookup(arg: fx.Node, versions: dict[fx.Node, Version] = versions) -> fx.Node:
            return env[(arg, versions[arg])]

        if node in replayed_random:
            new = _emit_random(graph, node, emitted.version, lookup, rng_states)
        else:
            new = graph.node_copy(node, lookup)
            new.meta = copy.copy(node.meta)
        if emitted.is_recompute:
            new._rename(f"{node.name}_recomp")
            new.meta[RECOMPUTE_META_KEY] = node.name
        new.meta["partitioner_tag"] = tag
        env[(node, emitted.version)] = new

    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs = list(output.args[0])
    new_outs = []
    for i, out in enumerate(outs):
        if isinstance(out, fx.Node):
            versions = plan.fwd_versions if i < num_fwd_outputs else plan.final_versions
            new_outs.append(env[(out, versions.get(out, 0))])
        else:
            new_outs.append(out)
    new_output = graph.output(tuple(new_outs) if isinstance(output.args[0], tuple) else new_outs)
    new_output.meta = copy.copy(output.meta)
    graph.lint()
    return graph


def _device_as_keyword(target, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The RNG wrappers find the device from a tensor argument or a `device=` keyword only: an op with no
    tensor input and a positional device (Inductor's `prims.inductor_seeds(count, device)`, which Inductor's
    random lowering puts in the joint graph before it is planned) gets its device passed by keyword."""
    schema = getattr(target, "_schema", None)
    if schema is None or "device" in kwargs or any(isinstance(a, (torch.Tensor, fx.Node)) for a in args):
        return args, kwargs
    names = [a.name for a in schema.arguments]
    if "device" not in names or names.index("device") >= len(args):
        return args, kwargs
    i = names.index("device")  # it and the positional arguments after it become keywords
    return args[:i], {**kwargs, **dict(zip(names[i:], args[i:]))}


def _emit_random(graph: fx.Graph, node: fx.Node, version: Version, lookup, rng_states: dict) -> fx.Node:
    args, kwargs = _device_as_keyword(node.target, fx.map_arg(node.args, lookup), fx.map_arg(node.kwargs, lookup))
    if version == 0:
        pair = graph.call_function(torch._prims.rng_prims.run_and_save_rng_state, (node.target, *args), kwargs)
        state = graph.call_function(operator.getitem, (pair, 0))
        state.meta["val"] = _rng_state_val(node.meta.get("val"))
        pair.meta["val"] = (state.meta["val"], node.meta.get("val"))
        if DTR_META_KEY in node.meta:  # the wrapper runs the kernel (and its workspace), not the getitem
            pair.meta[DTR_META_KEY] = node.meta[DTR_META_KEY]
        out = graph.call_function(operator.getitem, (pair, 1))
        out.meta = copy.copy(node.meta)
        rng_states[node] = state
        return out
    out = graph.call_function(torch._prims.rng_prims.run_with_rng_state, (rng_states[node], node.target, *args), kwargs)
    out.meta = copy.copy(node.meta)
    return out
