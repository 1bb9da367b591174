"""FX nodes -> `Program`: the supported aten ops and how each becomes instructions.

    program, inputs, outputs = lower_nodes(nodes, outputs)

`nodes` are the region's members in graph order; every node they read that is not a member is an
input of the region. Supported (float tensors of static shapes):
- pointwise: add/sub/rsub/mul/div (tensor or scalar, broadcasting), neg, abs, relu, gelu (erf and
  tanh), silu, tanh, sigmoid, exp, log, sqrt, rsqrt, reciprocal, pow by a constant, maximum, minimum,
  clamp, comparisons, where, masked_fill, dtype conversions;
- reductions over the last dimension: sum, mean, amax; softmax, safe softmax and log-softmax over the
  last dimension; layer norm over the last dimension (outputs, mean and rstd);
- pointwise backward ops that read recomputed values: dropout's, GELU's, ReLU's (threshold), sigmoid's and
  tanh's backward (the fusion pass lets them join the region that recomputes what they read);
- views that keep the row-major order of the elements (view, reshape, squeeze, unsqueeze, expand to the
  same size, clone, detach, alias) and getitem of multi-output members;
- nodes that already run a generated kernel (`RecomputeKernel`, such as the counter-based dropout the
  fusion pass puts in place of aten's): their program is inlined.
aten's own `native_dropout` draws its mask from aten's generator, which no kernel can reproduce, so it
is refused; the fusion pass first switches dropouts to the counter-based kernel (see rng.py).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
from torch import fx

from .ir import Arg, InputSpec, Instr, Program, Ref, TensorType, UnsupportedRegion

aten = torch.ops.aten

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def tensor_type_of(val: object, node: fx.Node) -> TensorType:
    """The static type of a (fake) tensor; raises UnsupportedRegion for symbolic shapes."""
    if not isinstance(val, torch.Tensor):
        raise UnsupportedRegion(f"{node.format_node()}: value is not a tensor ({type(val).__name__})")
    shape = []
    for size in val.shape:
        if not isinstance(size, int):
            raise UnsupportedRegion(
                f"{node.format_node()}: symbolic shape {tuple(val.shape)} (kernels need static shapes)"
            )
        shape.append(size)
    return TensorType(tuple(shape), val.dtype)


def _input_spec(node: fx.Node) -> InputSpec:
    val = node.meta.get("val")
    ttype = tensor_type_of(val, node)
    stride = tuple(val.stride())
    if not all(isinstance(s, int) for s in stride):
        raise UnsupportedRegion(f"{node.format_node()}: symbolic strides")
    return InputSpec(ttype, stride)


def _bind(node: fx.Node) -> dict[str, object]:
    """Arguments of an aten call by schema name, defaults filled in."""
    schema = node.target._schema
    bound: dict[str, object] = {}
    for index, argument in enumerate(schema.arguments):
        if index < len(node.args) and not argument.kwarg_only:
            bound[argument.name] = node.args[index]
        elif argument.name in node.kwargs:
            bound[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
        else:
            bound[argument.name] = None
    return bound


class _Builder:
    """Accumulates the program of a region while its members are lowered in graph order."""

    def __init__(self, members: Sequence[fx.Node]) -> None:
        self.members = set(members)
        self.inputs: list[fx.Node] = []
        self.specs: list[InputSpec] = []
        self.types: list[TensorType] = []
        self.instrs: list[Instr] = []
        self.values: dict[fx.Node, Ref | tuple[Ref, ...]] = {}
        self.input_refs: dict[fx.Node, Ref] = {}

    # -- values

    def tensor(self, arg: object, node: fx.Node) -> Ref:
        """The value of tensor argument `arg` of `node` (a member's output or a new input)."""
        if not isinstance(arg, fx.Node):
            raise UnsupportedRegion(f"{node.format_node()}: expected a tensor argument, got {arg!r}")
        if arg in self.values:
            value = self.values[arg]
            if isinstance(value, tuple):
                raise UnsupportedRegion(f"{node.format_node()}: reads a multi-output node without getitem")
            return value
        if arg in self.members:
            raise UnsupportedRegion(f"{node.format_node()}: reads member {arg.name} before it is computed")
        if arg not in self.input_refs:
            spec = _input_spec(arg)
            self.inputs.append(arg)
            self.specs.append(spec)
            self.input_refs[arg] = Ref(len(self.types))
            self.types.append(spec.type)
        return self.input_refs[arg]

    def operand(self, arg: object, node: fx.Node) -> Arg:
        """A tensor value, or a Python number kept as a constant."""
        if isinstance(arg, (bool, int, float)):
            return arg
        return self.tensor(arg, node)

    def emit(self, op: str, args: Sequence[Arg], out_types: Sequence[TensorType], **params: object) -> tuple[Ref, ...]:
        """Append an instruction; returns refs to its outputs."""
        first = len(self.types)
        outs = tuple(range(first, first + len(out_types)))
        self.types.extend(out_types)
        self.instrs.append(Instr(op, tuple(args), tuple(sorted(params.items())), outs))
        return tuple(Ref(o) for o in outs)

    def type_of(self, ref: Ref) -> TensorType:
        return self.types[ref.id]

    def prune(self, outputs: Sequence[Ref]) -> None:
        """Drop what the outputs do not need: instructions whose outputs nobody reads, a dropout's input when only
        its mask is read (the mask needs only the seed), and inputs no instruction reads any more."""
        live = {o.id for o in outputs}
        kept: list[Instr] = []
        for instr in reversed(self.instrs):
            if not any(o in live for o in instr.outs):
                continue
            if instr.op == "dropout" and instr.outs[0] not in live:
                instr = Instr(instr.op, (None, *instr.args[1:]), instr.params, instr.outs)
            live.update(a.id for a in instr.args if isinstance(a, Ref))
            kept.append(instr)
        self.instrs = kept[::-1]
        self.inputs = [node for node in self.inputs if self.input_refs[node].id in live]
        self.specs = [_input_spec(node) for node in self.inputs]

    def program(self, outputs: Sequence[Ref]) -> Program:
        self.prune(outputs)
        # Inputs come first in the numbering, but `tensor` appends them lazily: renumber so that they do.
        input_ids = [self.input_refs[node].id for node in self.inputs]
        computed = sorted(o for instr in self.instrs for o in instr.outs)
        new_id = {old: new for new, old in enumerate(input_ids + computed)}

        def remap(arg: Arg) -> Arg:
            return Ref(new_id[arg.id]) if isinstance(arg, Ref) else arg

        instrs = tuple(
            Instr(i.op, tuple(remap(a) for a in i.args), i.params, tuple(new_id[o] for o in i.outs))
            for i in self.instrs
        )
        return Program(
            inputs=tuple(self.specs),
            instrs=instrs,
            types=tuple(self.types[old] for old in input_ids + computed),
            outputs=tuple(new_id[o.id] for o in outputs),
        )


# ------------------------------------------------------------------------------------------ lowerings

Lowering = Callable[[_Builder, fx.Node], "Ref | tuple[Ref, ...]"]
LOWERINGS: dict[object, Lowering] = {}


def _register(*targets: object) -> Callable[[Lowering], Lowering]:
    def decorate(fn: Lowering) -> Lowering:
        for target in targets:
            LOWERINGS[target] = fn
        return fn

    return decorate


def _out_type(node: fx.Node) -> TensorType:
    return tensor_type_of(node.meta.get("val"), node)


def _float_out(node: fx.Node) -> TensorType:
    out = _out_type(node)
    if out.dtype not in FLOAT_DTYPES:
        raise UnsupportedRegion(f"{node.format_node()}: output dtype {out.dtype} (kernels compute float tensors)")
    return out


_UNARY = {
    aten.neg.default: "neg",
    aten.abs.default: "abs",
    aten.relu.default: "relu",
    aten.tanh.default: "tanh",
    aten.sigmoid.default: "sigmoid",
    aten.silu.default: "silu",
    aten.exp.default: "exp",
    aten.log.default: "log",
    aten.sqrt.default: "sqrt",
    aten.rsqrt.default: "rsqrt",
    aten.reciprocal.default: "reciprocal",
}


@_register(*_UNARY)
def _unary(b: _Builder, node: fx.Node) -> Ref:
    (out,) = b.emit(_UNARY[node.target], [b.tensor(node.args[0], node)], [_float_out(node)])
    return out


@_register(aten.gelu.default)
def _gelu(b: _Builder, node: fx.Node) -> Ref:
    approximate = _bind(node)["approximate"]
    if approximate not in ("none", "tanh"):
        raise UnsupportedRegion(f"{node.format_node()}: gelu approximate={approximate!r}")
    (out,) = b.emit("gelu", [b.tensor(node.args[0], node)], [_float_out(node)], approximate=approximate)
    return out


def _scaled(b: _Builder, node: fx.Node, value: Arg, alpha: object) -> Arg:
    """`alpha * value` (aten's add/sub alpha), folded when alpha is 1 or value a constant."""
    if alpha in (None, 1):
        return value
    if not isinstance(value, Ref):
        return value * alpha  # type: ignore[operator]
    (scaled,) = b.emit("mul", [value, alpha], [b.type_of(value)])
    return scaled


_BINARY = {
    aten.add.Tensor: "add",
    aten.add.Scalar: "add",
    aten.sub.Tensor: "sub",
    aten.sub.Scalar: "sub",
    aten.mul.Tensor: "mul",
    aten.mul.Scalar: "mul",
    aten.div.Tensor: "div",
    aten.div.Scalar: "div",
    aten.maximum.default: "maximum",
    aten.minimum.default: "minimum",
}


@_register(*_BINARY)
def _binary(b: _Builder, node: fx.Node) -> Ref:
    out = _float_out(node)
    left = b.operand(node.args[0], node)
    right = b.operand(node.args[1], node)
    if node.target in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar):
        right = _scaled(b, node, right, node.kwargs.get("alpha", 1))
    (result,) = b.emit(_BINARY[node.target], [left, right], [out])
    return result


@_register(aten.rsub.Scalar, aten.rsub.Tensor)
def _rsub(b: _Builder, node: fx.Node) -> Ref:
    bound = _bind(node)
    tensor = _scaled(b, node, b.tensor(node.args[0], node), bound["alpha"])
    (result,) = b.emit("sub", [b.operand(node.args[1], node), tensor], [_float_out(node)])
    return result


@_register(aten.pow.Tensor_Scalar)
def _pow(b: _Builder, node: fx.Node) -> Ref:
    exponent = node.args[1]
    if not isinstance(exponent, (int, float)) or isinstance(exponent, bool):
        raise UnsupportedRegion(f"{node.format_node()}: pow needs a constant exponent")
    (result,) = b.emit("pow", [b.tensor(node.args[0], node)], [_float_out(node)], exponent=exponent)
    return result


@_register(aten.clamp.default)
def _clamp(b: _Builder, node: fx.Node) -> Ref:
    bound = _bind(node)
    value = b.tensor(node.args[0], node)
    out = _float_out(node)
    if bound["min"] is None and bound["max"] is None:
        (value,) = b.emit("alias", [value], [out])
    if bound["min"] is not None:
        (value,) = b.emit("maximum", [value, bound["min"]], [out])
    if bound["max"] is not None:
        (value,) = b.emit("minimum", [value, bound["max"]], [out])
    return value


_COMPARE = {
    aten.gt.Tensor: "gt", aten.gt.Scalar: "gt",
    aten.ge.Tensor: "ge", aten.ge.Scalar: "ge",
    aten.lt.Tensor: "lt", aten.lt.Scalar: "lt",
    aten.le.Tensor: "le", aten.le.Scalar: "le",
    aten.eq.Tensor: "eq", aten.eq.Scalar: "eq",
    aten.ne.Tensor: "ne", aten.ne.Scalar: "ne",
}  # fmt: skip


@_register(*_COMPARE)
def _compare(b: _Builder, node: fx.Node) -> Ref:
    out = _out_type(node)
    (result,) = b.emit(_COMPARE[node.target], [b.operand(node.args[0], node), b.operand(node.args[1], node)], [out])
    return result


@_register(aten.where.self)
def _where(b: _Builder, node: fx.Node) -> Ref:
    args = [b.tensor(node.args[0], node), b.operand(node.args[1], node), b.operand(node.args[2], node)]
    (result,) = b.emit("where", args, [_float_out(node)])
    return result


@_register(aten.masked_fill.Scalar)
def _masked_fill(b: _Builder, node: fx.Node) -> Ref:
    value = node.args[2]
    args = [b.tensor(node.args[1], node), value, b.tensor(node.args[0], node)]
    (result,) = b.emit("where", args, [_float_out(node)])
    return result


# Backward ops that consume recomputed values pointwise: the fusion pass lets them join the region that
# recomputes their inputs, so those inputs (a dropout mask, an activation) never reach memory.
BACKWARD_CONSUMERS = frozenset(
    {
        aten.native_dropout_backward.default,
        aten.threshold_backward.default,
        aten.gelu_backward.default,
        aten.sigmoid_backward.default,
        aten.tanh_backward.default,
    }
)


@_register(aten.native_dropout_backward.default)
def _dropout_backward(b: _Builder, node: fx.Node) -> Ref:
    grad, mask, scale = node.args
    out = _float_out(node)
    (keep,) = b.emit("cast", [b.tensor(mask, node)], [out], dtype=out.dtype)
    (masked,) = b.emit("mul", [b.tensor(grad, node), keep], [out])
    (result,) = b.emit("mul", [masked, float(scale)], [out])  # aten: grad * mask * scale, in that order
    return result


@_register(aten.threshold_backward.default)
def _threshold_backward(b: _Builder, node: fx.Node) -> Ref:
    grad, source, threshold = node.args
    out = _float_out(node)
    (below,) = b.emit("le", [b.tensor(source, node), threshold], [TensorType(out.shape, torch.bool)])
    (result,) = b.emit("where", [below, 0.0, b.tensor(grad, node)], [out])
    return result


@_register(aten.gelu_backward.default)
def _gelu_backward(b: _Builder, node: fx.Node) -> Ref:
    approximate = _bind(node)["approximate"]
    if approximate not in ("none", "tanh"):
        raise UnsupportedRegion(f"{node.format_node()}: gelu approximate={approximate!r}")
    args = [b.tensor(node.args[0], node), b.tensor(node.args[1], node)]
    (result,) = b.emit("gelu_backward", args, [_float_out(node)], approximate=approximate)
    return result


@_register(aten.sigmoid_backward.default, aten.tanh_backward.default)
def _activation_backward(b: _Builder, node: fx.Node) -> Ref:
    grad, output = b.tensor(node.args[0], node), b.tensor(node.args[1], node)
    out = _float_out(node)
    if node.target is aten.sigmoid_backward.default:  # grad * (1 - y) * y
        (one_minus,) = b.emit("sub", [1.0, output], [out])
        (slope,) = b.emit("mul", [one_minus, output], [out])
    else:  # grad * (1 - y * y)
        (square,) = b.emit("mul", [output, output], [out])
        (slope,) = b.emit("sub", [1.0, square], [out])
    (result,) = b.emit("mul", [grad, slope], [out])
    return result


@_register(aten.native_dropout.default)
def _aten_dropout(b: _Builder, node: fx.Node) -> Ref:
    raise UnsupportedRegion(
        f"{node.format_node()}: aten's native_dropout draws its mask from aten's generator, which no kernel can "
        "reproduce; with recompute_kernels on, the fusion pass first puts dropouts on the counter-based RNG"
    )


@_register(aten._to_copy.default, torch.ops.prims.convert_element_type.default)
def _convert(b: _Builder, node: fx.Node) -> Ref:
    out = _out_type(node)
    if node.target is aten._to_copy.default:
        bound = _bind(node)
        source = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if bound["device"] is not None and source is not None and torch.device(bound["device"]) != source.device:
            raise UnsupportedRegion(f"{node.format_node()}: copies across devices")
        if bound["layout"] not in (None, torch.strided):
            raise UnsupportedRegion(f"{node.format_node()}: layout {bound['layout']}")
    if out.dtype not in (*FLOAT_DTYPES, torch.bool):
        raise UnsupportedRegion(f"{node.format_node()}: converts to {out.dtype}")
    (result,) = b.emit("cast", [b.tensor(node.args[0], node)], [out], dtype=out.dtype)
    return result


# Views that keep the elements' row-major order: inside a kernel they are the same register values. (clone
# copies in aten, but in a kernel it is the same values too.)
ORDER_KEEPING_VIEWS = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.squeeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.unsqueeze.default,
        aten.detach.default,
        aten.alias.default,
        aten.expand.default,
    }
)


@_register(*ORDER_KEEPING_VIEWS, aten.clone.default)
def _view(b: _Builder, node: fx.Node) -> Ref:
    source = b.tensor(node.args[0], node)
    out = _out_type(node)
    if out.numel != b.type_of(source).numel:
        raise UnsupportedRegion(f"{node.format_node()}: broadcasting expand (changes the number of elements)")
    if node.target is aten.clone.default and _bind(node)["memory_format"] not in (
        None,
        torch.contiguous_format,
        torch.preserve_format,
    ):
        raise UnsupportedRegion(f"{node.format_node()}: clone to {node.kwargs['memory_format']}")
    (result,) = b.emit("alias", [source], [out])
    return result


def _last_dim_only(node: fx.Node, dims: object, rank: int) -> None:
    if isinstance(dims, int):
        dims = [dims]
    if rank == 0 or not isinstance(dims, (list, tuple)) or len(dims) != 1 or dims[0] % rank != rank - 1:
        raise UnsupportedRegion(f"{node.format_node()}: reduces dims {dims}, kernels reduce the last dim only")


@_register(aten.sum.dim_IntList, aten.mean.dim, aten.amax.default)
def _reduction(b: _Builder, node: fx.Node) -> Ref:
    source = b.tensor(node.args[0], node)
    bound = _bind(node)
    _last_dim_only(node, bound["dim"], len(b.type_of(source).shape))
    if bound.get("dtype") is not None:
        raise UnsupportedRegion(f"{node.format_node()}: reduction with dtype=")
    op = {aten.sum.dim_IntList: "sum", aten.mean.dim: "mean", aten.amax.default: "amax"}[node.target]
    (result,) = b.emit(op, [source], [_float_out(node)])
    return result


@_register(aten._softmax.default, aten._safe_softmax.default, aten._log_softmax.default)
def _softmax(b: _Builder, node: fx.Node) -> Ref:
    source = b.tensor(node.args[0], node)
    bound = _bind(node)
    _last_dim_only(node, bound["dim"], len(b.type_of(source).shape))
    if bound.get("half_to_float") or bound.get("dtype") is not None:
        raise UnsupportedRegion(f"{node.format_node()}: softmax with a dtype change")
    op = {aten._softmax.default: "softmax", aten._safe_softmax.default: "safe_softmax"}.get(node.target, "log_softmax")
    (result,) = b.emit(op, [source], [_float_out(node)])
    return result


@_register(aten.native_layer_norm.default)
def _layer_norm(b: _Builder, node: fx.Node) -> tuple[Ref, ...]:
    bound = _bind(node)
    source = b.tensor(bound["input"], node)
    shape = b.type_of(source).shape
    normalized = list(bound["normalized_shape"])
    if len(normalized) != 1 or not shape or normalized[0] != shape[-1]:
        raise UnsupportedRegion(f"{node.format_node()}: layer norm over {normalized}, kernels normalize the last dim")
    weight = b.tensor(bound["weight"], node) if bound["weight"] is not None else None
    bias = b.tensor(bound["bias"], node) if bound["bias"] is not None else None
    vals = node.meta.get("val")
    out_types = [tensor_type_of(v, node) for v in vals]
    if out_types[0].dtype not in FLOAT_DTYPES:
        raise UnsupportedRegion(f"{node.format_node()}: dtype {out_types[0].dtype}")
    return b.emit("layer_norm", [source, weight, bias], out_types, eps=float(bound["eps"]))


@_register(operator.getitem)
def _getitem(b: _Builder, node: fx.Node) -> Ref:
    parent, index = node.args
    if parent not in b.values:
        raise UnsupportedRegion(f"{node.format_node()}: getitem of {parent} which is not in the region")
    values = b.values[parent]
    if not isinstance(values, tuple):
        raise UnsupportedRegion(f"{node.format_node()}: getitem of a single-output node")
    return values[index]


def _inline_kernel(b: _Builder, node: fx.Node) -> tuple[Ref, ...]:
    """A node that already runs a generated kernel: copy its program's instructions in."""
    program: Program = node.target.program
    args = [b.tensor(a, node) for a in node.args]
    if len(args) != len(program.inputs):
        raise UnsupportedRegion(f"{node.format_node()}: expects {len(program.inputs)} inputs")
    mapping: dict[int, Ref] = dict(enumerate(args))
    for index, spec in enumerate(program.inputs):
        if b.type_of(args[index]) != spec.type:
            raise UnsupportedRegion(f"{node.format_node()}: input {index} is {b.type_of(args[index])}, not {spec.type}")
    for instr in program.instrs:
        inner_args = [mapping[a.id] if isinstance(a, Ref) else a for a in instr.args]
        outs = b.emit(instr.op, inner_args, [program.types[o] for o in instr.outs], **dict(instr.params))
        mapping.update(zip(instr.outs, outs, strict=True))
    return tuple(mapping[o] for o in program.outputs)


def is_supported(node: fx.Node) -> bool:
    """Whether `node`'s op has a lowering (its arguments may still make it unsupported)."""
    return node.op == "call_function" and (node.target in LOWERINGS or is_kernel_node(node))


def is_kernel_node(node: fx.Node) -> bool:
    return node.op == "call_function" and hasattr(node.target, "program") and isinstance(node.target.program, Program)


def lower_nodes(nodes: Sequence[fx.Node], outputs: Sequence[fx.Node]) -> tuple[Program, list[fx.Node], list[int]]:
    """The program computing `outputs` from the region `nodes` (members, in graph order).

    Returns the program, the FX nodes to pass as its inputs (in order), and, for each requested output,
    the index of the program output holding its elements (outputs that are order-keeping views of one
    another share one program output; the caller re-views it to each node's shape).
    """
    builder = _Builder(nodes)
    for node in nodes:
        if node.op != "call_function":
            raise UnsupportedRegion(f"{node.format_node()}: not a call_function")
        if is_kernel_node(node):
            builder.values[node] = _inline_kernel(builder, node)
            continue
        lowering = LOWERINGS.get(node.target)
        if lowering is None:
            raise UnsupportedRegion(f"{node.format_node()}: no kernel lowering for {node.target}")
        builder.values[node] = lowering(builder, node)
    program_outputs: list[Ref] = []
    positions: list[int] = []
    for node in outputs:
        value = builder.values.get(node)
        if not isinstance(value, Ref):
            raise UnsupportedRegion(f"{node.format_node()}: an output must be a single tensor of the region")
        base = _base_value(builder, value)
        if base not in program_outputs:
            program_outputs.append(base)
        positions.append(program_outputs.index(base))
    program = builder.program(program_outputs)
    return program, list(builder.inputs), positions


def _base_value(builder: _Builder, value: Ref) -> Ref:
    """Follow order-keeping views back to the value that computes the elements."""
    by_out = {out: instr for instr in builder.instrs for out in instr.outs}
    while value.id in by_out and by_out[value.id].op == "alias":
        source = by_out[value.id].args[0]
        assert isinstance(source, Ref)
        if source.id not in by_out:  # a view of an input: the view itself is materialized
            break
        value = source
    return value
