"""Fuse the plan's recomputes: one Triton kernel per region of recomputed ops (dtr_compile.kernels).

    fusion = fuse_recomputes(report.planned, num_fwd_outputs=n, budget_bytes=report.budget_bytes)
    forward, backward = split_joint(fusion.graph, num_fwd_outputs=n)

`emit_plan` places each recompute right before its first backward use, so recomputes come in *bursts*
of consecutive nodes. A recomputed multi-output node's getitems are first moved up to it (a dropout's mask or
a layer norm's statistics, read further on by their backward, would otherwise keep it out of every region).
Inside a burst, supported ops (pointwise, row reductions, dropout, order-keeping views) are grown greedily
into regions, in graph order: a node joins the regions its inputs come from when the merged region is still
one kernel (one iteration space) and nothing outside the region reads a member before the node; otherwise a
compute node starts a region of its own. Each region becomes one node calling its kernel, placed where its
last member was, whose outputs are only the members read outside the region (views of one value share one
output, re-viewed by aten).
Matmuls and other unsupported recomputes stay as they are, between regions.

Before that, every dropout of the graph switches to the counter-based RNG of `kernels.rng` (forward:
a drawn seed and a one-op kernel; recomputes: the same kernel on the saved seed), so the recomputed
mask equals the forward's bit for bit, and the budget does not change the random numbers.

When the pass steps aside (`recompute_kernels="off"`, or "auto" on CPU tensors, or any mode under
Inductor, which fuses recomputed pointwise/reduction chains into its own Triton kernels), the
graph is returned unchanged and `FusionReport.reason` says why. The input graph is never modified.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import operator
import warnings
from dataclasses import dataclass, field

import torch
from torch import fx

from .. import config
from ..kernels.codegen import generate
from ..kernels.ir import TensorType, UnsupportedRegion
from ..kernels.launch import RecomputeKernel, check_kernels_can_run, triton_available
from ..kernels.lower_fx import BACKWARD_CONSUMERS, ORDER_KEEPING_VIEWS, is_kernel_node, is_supported, lower_nodes
from ..kernels.rng import draw_seed, dropout_kernel
from .meta import DTR_META_KEY
from .peak import PeakModel, schedule_peak
from .rewrite import RECOMPUTE_META_KEY

log = logging.getLogger(__name__)

FUSED_META_KEY = "dtr_fused"  # on a fused region's node: its FusedRegion record

aten = torch.ops.aten
_run_and_save = torch._prims.rng_prims.run_and_save_rng_state
_run_with = torch._prims.rng_prims.run_with_rng_state

_NON_COMPUTE = ORDER_KEEPING_VIEWS | {operator.getitem}  # members that launch nothing and allocate nothing


@dataclass(frozen=True)
class FusedRegion:
    kernel: RecomputeKernel
    members: tuple[str, ...]  # the recompute nodes now inside the kernel
    outputs: tuple[str, ...]  # the members whose values it writes to memory
    positions: tuple[int, ...]  # per output: the kernel output holding its elements (re-viewed to its shape)
    unfused: fx.GraphModule  # the members as they were, one op at a time: inputs -> outputs (the oracle)

    def reference(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The region computed op by op, as the plan had it."""
        return tuple(self.unfused(*inputs))


@dataclass
class FusionReport:
    """What the pass did to one compiled region."""

    graph: fx.GraphModule  # the graph to split: the plan itself when the pass stepped aside
    enabled: bool
    reason: str  # why the kernels are on or off here
    regions: list[FusedRegion] = field(default_factory=list)
    unfused: list[tuple[str, str]] = field(default_factory=list)  # recompute nodes left alone, and why
    dropouts: int = 0  # dropouts switched to the counter-based RNG
    peak: PeakModel | None = None  # modelled peak of `graph` (None when unchanged)


def fuse_recomputes(
    planned: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    budget_bytes: int | None = None,
    codegen: str | None = None,
    mode: str | None = None,
) -> FusionReport:
    """The plan with its recompute regions fused (see the module docstring); `planned` is not modified.

    `mode` and `codegen` default to `config.recompute_kernels` and `config.codegen`.
    """
    mode = mode if mode is not None else config.recompute_kernels
    codegen = codegen if codegen is not None else config.codegen
    enabled, reason = _decide(planned, mode, codegen)
    if not enabled:
        log.info("recompute kernels off: %s", reason)
        return FusionReport(planned, False, reason)
    gm = fx.GraphModule(planned, copy.deepcopy(planned.graph))
    dropouts = _switch_dropouts(gm.graph)
    switched_peak = schedule_peak(_recompiled(gm), num_fwd_outputs=num_fwd_outputs)
    fused = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    regions, unfused = _fuse_bursts(fused.graph)
    peak = schedule_peak(_recompiled(fused), num_fwd_outputs=num_fwd_outputs)
    if budget_bytes is not None and peak.peak_bytes > max(budget_bytes, switched_peak.peak_bytes):
        # A kernel holds all its inputs and outputs at once where the ops could free some in between; should
        # that ever raise the peak past the budget, keep the ops as planned (the dropouts keep their kernels:
        # the random numbers must not depend on the budget).
        reason += f"; regions left unfused: fused peak {peak.peak_bytes} B would pass the budget {budget_bytes} B"
        return FusionReport(gm, True, reason, [], [], dropouts, switched_peak)
    log.info("recompute kernels: %d regions, %d dropouts on the counter-based RNG", len(regions), dropouts)
    return FusionReport(fused, True, reason, regions, unfused, dropouts, peak)


def _recompiled(gm: fx.GraphModule) -> fx.GraphModule:
    gm.graph.lint()
    gm.recompile()
    return gm


# ------------------------------------------------------------------------------------------ decision


def _device_of(gm: fx.GraphModule) -> torch.device | None:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return None


def _decide(gm: fx.GraphModule, mode: str, codegen: str) -> tuple[bool, str]:
    if mode == "off":
        return False, "recompute_kernels='off'"
    if codegen == "inductor":
        reason = (
            "codegen='inductor': Inductor's scheduler fuses the recomputed pointwise and reduction ops of the "
            "backward graph into its own kernels"
        )
        if mode == "triton":
            warnings.warn(
                f"recompute_kernels='triton' applies to codegen='fx' and to the eager runtime; {reason}",
                stacklevel=2,
            )
        return False, reason
    device = _device_of(gm)
    if mode == "auto":
        if device is None or device.type != "cuda":
            return False, f"recompute_kernels='auto' with tensors on {device}: the unfused recompute is the CPU path"
        if not triton_available():
            return False, "recompute_kernels='auto': triton is not installed"
        return True, "recompute_kernels='auto' with codegen='fx' on CUDA"
    check_kernels_can_run(device)
    return True, f"recompute_kernels='triton' with codegen='fx' on {device}"


# ------------------------------------------------------------------------------------------ dropouts


def _dropout_args(node: fx.Node) -> tuple[fx.Node, float] | None:
    """(input, p) of a dropout a kernel can run: native_dropout (plain, or under an RNG wrapper) in training,
    0 < p < 1, a float input of static shape."""
    if node.target is aten.native_dropout.default:
        args = node.args
    elif node.target is _run_and_save and node.args[0] is aten.native_dropout.default:
        args = node.args[1:]
    elif node.target is _run_with and node.args[1] is aten.native_dropout.default:
        args = node.args[2:]
    else:
        return None
    x = args[0]
    p = args[1] if len(args) > 1 else node.kwargs.get("p")
    train = args[2] if len(args) > 2 else node.kwargs.get("train")
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if train is False or not isinstance(p, float) or not 0.0 < p < 1.0 or not isinstance(val, torch.Tensor):
        return None
    if not all(isinstance(s, int) for s in (*val.shape, *val.stride())) or not val.is_floating_point():
        return None
    return x, p


def _switch_dropouts(graph: fx.Graph) -> int:
    """In place (on the pass's own copy): every convertible dropout draws from the counter-based RNG."""
    switched = 0
    seeds: set[fx.Node] = set()  # seed nodes, which replaced the RNG states that recomputes replay
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        found = _dropout_args(node)
        if found is None:
            continue
        x, p = found
        val = x.meta["val"]
        if node.target is _run_and_save and any(u.target is not operator.getitem for u in node.users):
            continue  # not the (state, outputs) pair emit_plan writes: leave it to aten's RNG replay
        if node.target is _run_with:
            if node.args[0] not in seeds:
                continue  # its forward was not switched: it keeps aten's RNG replay
            _replace_with_kernel(graph, node, x, node.args[0], p, node.meta)
            continue
        with graph.inserting_before(node):
            seed = graph.call_function(draw_seed, (x,))
        seed.meta["val"] = _fake_empty(val, (), torch.int64)
        seed.meta["partitioner_tag"] = node.meta.get("partitioner_tag", "is_forward")
        if node.target is _run_and_save:
            state, outputs = _pair_users(node)
            meta = dict(node.meta, val=outputs.meta["val"]) if outputs is not None else node.meta
            kernel_node = _replace_with_kernel(graph, node, x, seed, p, meta, replace=False)
            seeds.add(seed)
            if state is not None:
                state.replace_all_uses_with(seed)
                graph.erase_node(state)
            if outputs is not None:
                outputs.replace_all_uses_with(kernel_node)
                graph.erase_node(outputs)
            graph.erase_node(node)
        else:
            _replace_with_kernel(graph, node, x, seed, p, node.meta)
        switched += 1
    return switched


def _pair_users(pair: fx.Node) -> tuple[fx.Node | None, fx.Node | None]:
    """The (RNG state, op outputs) getitems of a run_and_save_rng_state node."""
    found = {user.args[1]: user for user in pair.users}
    return found.get(0), found.get(1)


def _replace_with_kernel(
    graph: fx.Graph, node: fx.Node, x: fx.Node, seed: fx.Node, p: float, meta: dict, *, replace: bool = True
) -> fx.Node:
    val = x.meta["val"]
    kernel = dropout_kernel(tuple(val.shape), val.dtype, p, tuple(val.stride()))
    with graph.inserting_before(node):
        new = graph.call_function(kernel, (x, seed))
    new.meta = dict(meta)
    new.meta["val"] = (_fake_empty(val, tuple(val.shape), val.dtype), _fake_empty(val, tuple(val.shape), torch.bool))
    cost = meta.get(DTR_META_KEY)
    if cost is not None:  # the kernel keeps no float copy of the mask, unlike aten's CPU dropout
        new.meta[DTR_META_KEY] = dataclasses.replace(cost, workspace_bytes=0)
    if replace:
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    return new


def _fake_empty(like: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor value of this shape and dtype on `like`'s device, in `like`'s fake mode."""
    fake_mode = getattr(like, "fake_mode", None)
    if fake_mode is None:
        return torch.empty(shape, dtype=dtype, device="meta")
    with fake_mode:
        return torch.empty(shape, dtype=dtype, device=like.device)


# ------------------------------------------------------------------------------------------ regions


def _bursts(graph: fx.Graph) -> list[list[fx.Node]]:
    """Maximal runs of consecutive recompute nodes, each with the pointwise backward ops right after it that read
    them (a dropout's backward reading the recomputed mask): those may join the region, so that what they read
    from it never reaches memory."""
    bursts: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    for node in graph.nodes:
        if node.op == "call_function" and RECOMPUTE_META_KEY in node.meta:
            current.append(node)
            continue
        if current and node.target in BACKWARD_CONSUMERS and any(a in current for a in node.all_input_nodes):
            current.append(node)
            continue
        if current:
            bursts.append(current)
            current = []
    if current:
        bursts.append(current)
    return bursts


def _is_compute(node: fx.Node) -> bool:
    return is_kernel_node(node) or node.target not in _NON_COMPUTE


def _region_outputs(members: list[fx.Node]) -> list[fx.Node]:
    inside = set(members)
    return [m for m in members if any(u not in inside for u in m.users)]


def _try_region(members: list[fx.Node], position: dict[fx.Node, int]) -> str | None:
    """None when `members` (graph order) can be one kernel placed at its last member, else why not."""
    last = position[members[-1]]
    inside = set(members)
    for member in members:
        for user in member.users:
            if user not in inside and position.get(user, last + 1) < last:
                return f"{user.name} reads {member.name} before the region would run"
    try:
        program, _, _ = lower_nodes(members, _region_outputs(members))
        generate(program)
    except UnsupportedRegion as error:
        return str(error)
    return None


def _unit(node: fx.Node, position: dict[fx.Node, int]) -> list[fx.Node] | None:
    """`node` with the getitems that read its outputs (a region returns tensors, never tuples).

    None when a multi-output node is read otherwise, or from outside the burst: it then stays as it is."""
    if not isinstance(node.meta.get("val"), (tuple, list)):
        return [node]
    items = list(node.users)
    if not all(u.target is operator.getitem and u in position for u in items):
        return None
    return [node, *sorted(items, key=position.__getitem__)]


def _group_burst(burst: list[fx.Node]) -> tuple[list[list[fx.Node]], list[tuple[str, str]]]:
    """Greedy regions of one burst (each in graph order) and the compute nodes left alone."""
    position = {n: i for i, n in enumerate(burst)}
    region_of: dict[fx.Node, int] = {}
    regions: list[list[fx.Node] | None] = []
    unfused: list[tuple[str, str]] = []
    for node in burst:
        if node in region_of:
            continue  # a getitem that joined with its multi-output parent
        recompute = RECOMPUTE_META_KEY in node.meta
        if not is_supported(node):
            if _is_compute(node) and recompute:
                unfused.append((node.name, f"no kernel lowering for {node.target}"))
            continue
        unit = _unit(node, position)
        if unit is None:
            if _is_compute(node) and recompute:
                unfused.append((node.name, "its outputs are read outside this burst"))
            continue
        sources = sorted({region_of[a] for m in unit for a in m.all_input_nodes if a in region_of})
        # Join every region the unit reads from, else the most recent one that still makes one kernel.
        choices = [sources] + [[s] for s in reversed(sources)] if len(sources) > 1 else [sources] if sources else []
        joined = False
        for chosen in choices:
            merged = sorted([m for s in chosen for m in regions[s]] + unit, key=position.__getitem__)
            if _try_region(merged, position) is None:
                keep = chosen[0]
                regions[keep] = merged
                for s in chosen[1:]:
                    regions[s] = None
                for member in merged:
                    region_of[member] = keep
                joined = True
                break
        if joined:
            continue
        if not _is_compute(node):
            continue  # a view of a value no region computes: aten's alias costs nothing
        if not recompute:
            continue  # a backward op joins a region that recomputes its inputs, or stays as it is
        why = _try_region(unit, position)
        if why is None:
            for member in unit:
                region_of[member] = len(regions)
            regions.append(unit)
        else:
            unfused.append((node.name, why))
    return [r for r in regions if r is not None], unfused


def _gather_getitems(graph: fx.Graph) -> None:
    """In place (on the pass's own copy): the getitems of each recomputed multi-output node right after it.

    `emit_plan` places every recompute before its first use, getitems included, so a recomputed dropout whose output
    a matmul reads has its mask read by the dropout's backward several ops later, in a burst of its own; so do a
    recomputed layer norm's mean and rstd. Its unit then reads outside its burst and could join no region (a plan
    that recomputed only attention dropouts fused none). A getitem computes and allocates nothing (its node made
    every output), so moving it up to its node changes no value's lifetime, and the node can join its burst's region,
    which then writes what the later readers need."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function" or RECOMPUTE_META_KEY not in node.meta:
            continue
        if not isinstance(node.meta.get("val"), (tuple, list)):
            continue
        items = list(node.users)
        if not items or not all(u.target is operator.getitem and RECOMPUTE_META_KEY in u.meta for u in items):
            continue
        anchor = node
        for item in sorted(items, key=order.__getitem__):
            anchor.append(item)
            anchor = item


def _fuse_bursts(graph: fx.Graph) -> tuple[list[FusedRegion], list[tuple[str, str]]]:
    """In place (on the pass's own copy): every region of every burst becomes one kernel call."""
    fused: list[FusedRegion] = []
    unfused: list[tuple[str, str]] = []
    _gather_getitems(graph)
    for burst in _bursts(graph):
        regions, left = _group_burst(burst)
        unfused += left
        for members in regions:
            if not any(_is_compute(m) for m in members):
                continue
            fused.append(_emit_region(graph, members))
    return fused, unfused


def _emit_region(graph: fx.Graph, members: list[fx.Node]) -> FusedRegion:
    outputs = _region_outputs(members)
    program, inputs, positions = lower_nodes(members, outputs)
    kernel = RecomputeKernel(program)
    like = _first_tensor(members)
    record = FusedRegion(
        kernel,
        tuple(m.name for m in members),
        tuple(o.name for o in outputs),
        tuple(positions),
        _unfused_module(members, inputs, outputs),
    )
    anchor = members[-1].next
    with graph.inserting_before(anchor):
        call = graph.call_function(kernel, tuple(inputs))
        call.meta["val"] = tuple(_fake_empty(like, t.shape, t.dtype) for t in _output_types(program))
        call.meta["partitioner_tag"] = "is_backward"
        call.meta[FUSED_META_KEY] = record
        produced = []
        for k, val in enumerate(call.meta["val"]):
            item = graph.call_function(operator.getitem, (call, k))
            item.meta.update(val=val, partitioner_tag="is_backward")
            produced.append(item)
        for node, k in zip(outputs, positions, strict=True):
            shape = tuple(node.meta["val"].shape)
            result = produced[k]
            if tuple(result.meta["val"].shape) != shape:
                result = graph.call_function(aten.view.default, (produced[k], list(shape)))
                result.meta.update(val=produced[k].meta["val"].view(shape), partitioner_tag="is_backward")
            inside = set(members)
            node.replace_all_uses_with(result, delete_user_cb=lambda user, inside=inside: user not in inside)
            if RECOMPUTE_META_KEY in node.meta:  # (an absorbed backward op is no recompute)
                result.meta[RECOMPUTE_META_KEY] = node.meta[RECOMPUTE_META_KEY]
    for member in reversed(members):
        graph.erase_node(member)
    return record


def _unfused_module(members: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> fx.GraphModule:
    """The members as a graph of their own, taking the kernel's inputs. A value the kernel does not read (a
    dropout's input when only its mask is wanted) feeds only outputs nobody reads: zeros stand in for it."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    inside = set(members)
    for member in members:
        for arg in member.all_input_nodes:
            if arg not in env and arg not in inside:
                val = arg.meta["val"]
                env[arg] = graph.call_function(
                    torch.zeros, (tuple(val.shape),), {"dtype": val.dtype, "device": val.device}
                )
    for member in members:
        env[member] = graph.node_copy(member, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    return fx.GraphModule({}, graph)


def _output_types(program) -> list[TensorType]:
    return [program.types[v] for v in program.outputs]


def _first_tensor(members: list[fx.Node]) -> torch.Tensor:
    for member in members:
        val = member.meta.get("val")
        leaves = val if isinstance(val, (tuple, list)) else (val,)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                return leaf
    raise UnsupportedRegion(f"region {[m.name for m in members]} has no tensor value")
