"""Cost annotation: one `NodeCost` record per node of the joint graph under `node.meta["dtr"]`.

FLOPs come from PyTorch's formulas (`torch.utils.flop_counter`: matmul, conv, attention); every other op
is memory-bound and costed by the bytes it reads and writes. The estimated time is a roofline,
max(flops / peak flop rate, bytes / bandwidth) plus a fixed launch overhead, at the rates of the device the
node's values are on and of the dtype it computes in (roofline.rates_for: a GPU prices pointwise ops far
below matmuls, a CPU much less so, and the planner's choice of what to recompute follows). `mode="measure"` also
times each node on real tensors of its shapes; the timings are cached per (op, shapes), so a second
compile of the same shapes does not pay again.
"""

from __future__ import annotations

import operator
import time
from typing import Literal

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from .. import matmul_scratch
from ..kernels.lower_fx import is_supported
from ..roofline import at_hints, call_flops, compute_dtype, device_of, estimate_seconds
from .meta import DTR_META_KEY, NodeCost, Phase
from .storage import StorageMap, is_mutating, tensor_nbytes

CostMode = Literal["estimate", "measure"]

# (op, shapes/dtypes/strides, non-tensor args) -> seconds; filled by mode="measure" and kept for the
# whole process so that recompiling the same shapes does not time them again.
_MEASURED: dict[tuple, float | None] = {}


def _output_bytes_ws(node: fx.Node) -> int:
    leaves, _ = tree_flatten(node.meta.get("val"))
    return tensor_nbytes(leaves[0]) if leaves else 0


def _conv_ws(node: fx.Node) -> int:
    # mkldnn reorders the larger of its input and output: a strided convolution copies its input.
    data = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    return max(_output_bytes_ws(node), tensor_nbytes(data.meta.get("val")) if data is not None else 0)


def _conv_backward_ws(node: fx.Node) -> int:
    # two buffers the size of the larger of grad_output and input (a strided convolution: its input)
    sizes = [tensor_nbytes(a.meta.get("val")) for a in node.args[:2] if isinstance(a, fx.Node)]
    return 2 * max([_output_bytes_ws(node), *sizes])


def _quarter_output_bytes_ws(node: fx.Node) -> int:
    return _output_bytes_ws(node) // 4


def _channels_last_conv_backward_ws(node: fx.Node) -> int:
    # mkldnn computes a weight's gradient in a layout of its own, then copies it out: two weight-sized buffers live at
    # the call's end (measured on every convolution of the CPU stand-in's ResNet, 9 KiB to 144 KiB weights); about a
    # sixteenth of the input's gradient besides (strided convolutions).
    mask = node.args[-1] if isinstance(node.args[-1], (list, tuple)) else (True, True)
    weight = node.args[2] if len(node.args) > 2 and isinstance(node.args[2], fx.Node) else None
    weight_bytes = tensor_nbytes(weight.meta.get("val")) if weight is not None and len(mask) > 1 and mask[1] else 0
    return 2 * weight_bytes + _output_bytes_ws(node) // 16


# Temporaries an ATen kernel allocates and frees inside one call, read off the profiler on CPU: the
# dropout kernels turn the boolean mask into a float copy before multiplying; mkldnn convolution of
# contiguous tensors reorders the larger of its output and input (a strided convolution copies its input);
# its backward holds two buffers the size of the larger of grad_output and input; batch norm's backward allocates a second input-sized buffer
# next to its gradient.
# Without them the model of the peak misses one or two activations wherever these ops sit at the peak.
WORKSPACE = {
    torch.ops.aten.native_dropout.default: _output_bytes_ws,
    torch.ops.aten.native_dropout_backward.default: _output_bytes_ws,
    torch.ops.aten.convolution.default: _conv_ws,
    torch.ops.aten.convolution_backward.default: _conv_backward_ws,
    torch.ops.aten.native_batch_norm_backward.default: _output_bytes_ws,
}

# Under Inductor on CPU, layout optimization runs convolutions on channels-last tensors, for which mkldnn
# needs no reordered copies of the activations: measured 0.03x the output for the forward and 0.06x for the backward;
# a quarter of the output covers the forward's. The backward also holds two copies of the weight's gradient
# (`_channels_last_conv_backward_ws`): with a quarter of the output instead, the CPU stand-in's ResNet plan measured
# 1.02x its model, its peak inside a 64x64x3x3 convolution's backward. (The copies of the inputs themselves are
# layout_copies.py's.)
INDUCTOR_CPU_WORKSPACE = {
    **WORKSPACE,
    torch.ops.aten.convolution.default: _quarter_output_bytes_ws,
    torch.ops.aten.convolution_backward.default: _channels_last_conv_backward_ws,
}


# On CUDA, aten's dropout kernels write the output and the boolean mask directly (fused_dropout_kernel,
# masked_scale_kernel), as the recompute kernels' dropout does (kernels/rng.py): no float copy of the mask, which
# the model of a CUDA plan counted wherever a dropout or its backward ran. (Convolutions keep the CPU's figures:
# cuDNN's workspace depends on the algorithm it picks.)
CUDA_WORKSPACE = {
    op: size
    for op, size in WORKSPACE.items()
    if op not in (torch.ops.aten.native_dropout.default, torch.ops.aten.native_dropout_backward.default)
}


def _workspace(node: fx.Node, codegen: str) -> int:
    table = _workspace_table(node, codegen)
    known = table[node.target](node) if node.target in table else 0
    return known + matmul_scratch.scratch_bytes(node.target, _arg_values(node))


def _arg_values(node: fx.Node) -> tuple:
    """The (fake) values of a call's positional arguments, as the kernel will receive them."""
    return tuple(a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args)


def _workspace_table(node: fx.Node, codegen: str) -> dict:
    leaves = [v for v in _leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)]
    if leaves and leaves[0].device.type == "cuda":
        return CUDA_WORKSPACE
    if codegen != "inductor":
        return WORKSPACE
    on_cpu = not leaves or leaves[0].device.type == "cpu"
    channels_last = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    return INDUCTOR_CPU_WORKSPACE if on_cpu and channels_last else WORKSPACE


def _leaves(value: object) -> list:
    """`tree_flatten(value)`'s leaves, without pytree's walk for the common value, one tensor (the cost pass reads
    every node's value several times: pytree was a fifth of it)."""
    if isinstance(value, torch.Tensor):
        return [value]
    return tree_flatten(value)[0]


def annotate_costs(gm: fx.GraphModule, *, mode: CostMode = "estimate", codegen: str = "fx") -> fx.GraphModule:
    """Write `node.meta["dtr"]` on every node of a joint graph (and nothing else); returns `gm`.

    `codegen`: who will run the graph ("fx" or "inductor"); kernel workspaces depend on it."""
    if mode not in ("estimate", "measure"):
        raise ValueError(f"cost mode {mode!r}; expected 'estimate' or 'measure'")
    phases = classify_phases(gm.graph)
    tangents = {n for n, p in phases.items() if p == "tangent"}
    storages = StorageMap(gm.graph, counted_inputs=tangents)
    # One profiler session for every 16-bit CPU matmul shape of the graph, not one per node.
    matmul_scratch.measure_missing((n.target, _arg_values(n)) for n in gm.graph.nodes if n.op == "call_function")
    for node in gm.graph.nodes:
        node.meta[DTR_META_KEY] = _cost_of(node, phases[node], storages, mode, codegen)
    return gm


def classify_phases(graph: fx.Graph) -> dict[fx.Node, Phase]:
    """primal/tangent inputs, forward and backward nodes, the output.

    PyTorch's partitioner tag decides when present; otherwise a node that depends on a tangent is
    backward and every other node forward.
    """
    phases: dict[fx.Node, Phase] = {}
    for node in graph.nodes:
        tag = node.meta.get("partitioner_tag")
        if node.op == "placeholder":
            phases[node] = "tangent" if node.name.startswith("tangents") else "primal"
        elif node.op == "output":
            phases[node] = "output"
        elif tag == "is_backward":
            phases[node] = "backward"
        elif tag == "is_forward":
            phases[node] = "forward"
        elif any(phases[a] in ("tangent", "backward") for a in node.all_input_nodes):
            phases[node] = "backward"
        else:
            phases[node] = "forward"
    return phases


def is_random(node: fx.Node) -> bool:
    """An op that draws random numbers here. Attention kernels carry the random tag for their dropout;
    with `dropout_p == 0` they are deterministic and need no RNG replay."""
    target = node.target
    if not (isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags):
        return False
    for index, argument in enumerate(target._schema.arguments):
        if argument.name == "dropout_p":
            value = node.args[index] if index < len(node.args) else node.kwargs.get("dropout_p", argument.default_value)
            return not (isinstance(value, (int, float)) and value == 0)
    return True


def _why_not_recomputable(node: fx.Node, phase: Phase) -> str | None:
    if phase == "primal":
        return "graph input (parameter or user input): always resident, nothing to recompute"
    if phase == "tangent":
        return "incoming gradient"
    if phase == "output":
        return "graph output"
    if phase == "backward":
        return "backward value: depends on incoming gradients"
    if node.op != "call_function":
        return f"{node.op} node"
    if is_mutating(node):
        return "mutates an input"
    if node.is_impure(impure_random=False):
        return "has side effects"
    val = node.meta.get("val")
    leaves = _leaves(val)
    if not any(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return "produces no tensor (symbolic size or scalar)"
    return None


def _source_line(node: fx.Node) -> str | None:
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    # The last frame: searched from the end (a trace is dozens of lines, and every node of the graph has one).
    last = next((line for line in map(str.strip, reversed(trace.splitlines())) if line.startswith("File ")), None)
    if last is None:
        return None
    # 'File "x.py", line 12, in forward' -> 'x.py:12 in forward'
    parts = last.split(", ")
    if len(parts) >= 3:
        return f"{parts[0][6:-1]}:{parts[1].removeprefix('line ')} {parts[2]}"
    return last


def _attention_flops(node: fx.Node) -> int | None:
    """The CPU flash-attention kernels, which `flop_registry` does not list (causal masks not discounted)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    target = node.target
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    if target is not forward and target is not backward:  # before reading shapes: this runs for every node
        return None
    # At the hints of symbolic sizes: computing on SymInts would specialize the graph to one size.
    args = [at_hints(a.meta.get("val")) if isinstance(a, fx.Node) else a for a in node.args]
    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
    if target is forward and len(shapes) >= 3:
        return sdpa_flop_count(*shapes[:3])
    if target is backward and len(shapes) >= 4:
        return sdpa_backward_flop_count(*shapes[:4])
    return None


def _flops(node: fx.Node) -> int:
    """FLOPs by PyTorch's formula (roofline.call_flops: 0 for symbolic sizes, which the formulas would turn
    into numbers and so specialize the graph to one size)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0
    try:
        attention = _attention_flops(node)
    except Exception:  # noqa: BLE001 - unexpected shapes: cost the node by bytes instead
        attention = None
    if attention is not None:
        return int(attention)
    if target.overloadpacket not in flop_registry:
        return 0
    args = tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, node.args)
    kwargs = tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, node.kwargs)
    return call_flops(target, args, kwargs, node.meta.get("val"))


def _bytes_moved(node: fx.Node) -> int:
    read = sum(tensor_nbytes(a.meta.get("val")) for a in node.all_input_nodes)
    written = _leaves(node.meta.get("val"))
    return read + sum(tensor_nbytes(v) for v in written)


def _fused_call(node: fx.Node, device: torch.device, codegen: str) -> bool:
    """Whether `node` pays a fused op's fixed cost (no launch of its own) rather than an eager call's.

    Inductor fuses pointwise ops into their neighbours' loops. The FX code generator runs each op as an eager aten
    call, except, on CUDA, the recomputes that the recompute kernels fuse (fuse_recompute.py; on there by default):
    a recomputed matmul pays a launch that a recomputed pointwise chain or dropout does not, which at small sizes is
    most of either's time, so the planner recomputes those chains first. (Priced for recompute_kernels="auto": with
    "off" they are eager calls too.) CPU graphs keep the fused cost everywhere, as every CPU plan was made with it."""
    if codegen == "inductor" or device.type != "cuda":
        return True
    return is_supported(node)


def _cost_of(node: fx.Node, phase: Phase, storages: StorageMap, mode: CostMode, codegen: str) -> NodeCost:
    why_not = _why_not_recomputable(node, phase)
    is_call = node.op == "call_function"
    alias = is_call and (storages.is_alias(node) or node.target is operator.getitem)
    flops = _flops(node) if is_call else 0
    moved = 0 if alias or not is_call else _bytes_moved(node)
    if alias:
        estimated = 0.0  # views and getitem cost nothing: no kernel, no allocation
    elif is_call:
        inputs = [leaf for a in node.all_input_nodes for leaf in _leaves(a.meta.get("val"))]
        outputs = _leaves(node.meta.get("val"))
        device = device_of(inputs + outputs)
        fused = _fused_call(node, device, codegen)
        estimated = estimate_seconds(flops, moved, device=device, dtype=compute_dtype(inputs), fused=fused)
    else:
        estimated = 0.0
    measured = _measure(node) if mode == "measure" and is_call and not alias else None
    return NodeCost(
        phase=phase,
        out_bytes=storages.allocated_bytes(node),
        workspace_bytes=_workspace(node, codegen) if is_call else 0,
        flops=flops,
        bytes_moved=moved,
        estimated_s=estimated,
        measured_s=measured,
        recomputable=why_not is None,
        why_not=why_not,
        needs_rng_replay=is_random(node),
        source=_source_line(node),
    )


# ---------------------------------------------------------------------------------------- measured mode


def _describe(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype, tuple(value.stride()), str(value.device))
    return repr(value)


def _materialize(value: object) -> object:
    """A real tensor like a fake one (zeros for integer/bool, so indices stay in range)."""
    if not isinstance(value, torch.Tensor):
        return value
    shape = [int(s) for s in value.shape]
    stride = [int(s) for s in value.stride()]
    real = torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device)
    return real.normal_() if real.is_floating_point() else real.zero_()


def _measure(node: fx.Node) -> float | None:
    args = tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, node.args)
    kwargs = tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, node.kwargs)
    key = (str(node.target), tree_map(_describe, (args, kwargs)).__repr__())
    if key in _MEASURED:
        return _MEASURED[key]
    result: float | None = None
    try:
        with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.no_grad():
            real_args, real_kwargs = tree_map(_materialize, (args, kwargs))
            node.target(*real_args, **real_kwargs)  # warm-up (first-call dispatch costs)
            best = float("inf")
            for _ in range(5):
                # Process CPU time: on a shared machine wall-clock time measures the other jobs too.
                start = time.process_time()
                node.target(*real_args, **real_kwargs)
                best = min(best, time.process_time() - start)
            result = best
    except Exception:  # noqa: BLE001 - ops that cannot run on synthetic data keep their estimate
        result = None
    _MEASURED[key] = result
    return result
