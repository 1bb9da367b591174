"""Where each value of a program lives in the kernel's iteration space, and how inputs are indexed.

The kernel walks one *full* space of N elements: the largest value of the region, in row-major order.
When the region reduces rows (sum/mean/amax, softmax, layer norm over the last dimension, all of the
same length C), the kernel is a *row* kernel: each program holds whole rows, a [BLOCK_R, BLOCK_C] tile,
and a value is either *full* (N elements, one per tile lane, flat index i = r * C + c) or *row*
(N / C elements, one per row, a [BLOCK_R, 1] column broadcast against the tile). Without reductions it
is a *flat* kernel over i in blocks. Every computed value must be full or row; that is what makes the
region one kernel whose intermediates never leave registers.

Inputs are not computed, so they may have any shape that broadcasts to their reader's and any strides:
their element for the reader's flat index is found by `input_offset`, which composes two maps, both
coalesced to as few dimensions as possible: reader index -> element of the (possibly reshaped) input
under broadcasting, then element -> memory offset under the input's strides.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import Instr, Program, Ref, TensorType, UnsupportedRegion, contiguous_strides

# Ops that reduce their first argument over its last dimension.
ROW_REDUCING = frozenset({"sum", "mean", "amax", "softmax", "safe_softmax", "log_softmax", "layer_norm"})
# Outputs of those that hold one value per row (the others are full).
_ROW_OUTPUTS = {"sum": (0,), "mean": (0,), "amax": (0,), "layer_norm": (1, 2)}

MAX_ROW_LENGTH = 32768  # one row must fit in one tile (registers on GPU)


@dataclass(frozen=True)
class Layout:
    numel: int  # N
    row_length: int | None  # C for a row kernel, None for a flat kernel
    spaces: tuple[str, ...]  # per value: "full" | "row" | "input" (read from memory where used)
    roots: tuple[int | None, ...]  # per value: the input it is a view of (for "input" values)

    @property
    def rows(self) -> int:
        return self.numel // (self.row_length or self.numel)


def analyze(program: Program) -> Layout:
    """The iteration space of `program`; raises UnsupportedRegion when it has no single one."""
    types = program.types
    n_inputs = len(program.inputs)
    roots: list[int | None] = [i if i < n_inputs else None for i in range(len(types))]
    for instr in program.instrs:
        if instr.op == "alias" and isinstance(instr.args[0], Ref) and roots[instr.args[0].id] is not None:
            roots[instr.outs[0]] = roots[instr.args[0].id]
    numel = max((t.numel for t in types), default=0)
    if numel == 0:
        raise UnsupportedRegion("empty tensors")
    lengths = {_row_length(program, instr) for instr in program.instrs if instr.op in ROW_REDUCING}
    if len(lengths) > 1:
        raise UnsupportedRegion(f"reductions over rows of different lengths {sorted(lengths)}")
    row_length = lengths.pop() if lengths else None
    if row_length is not None:
        if numel % row_length:
            raise UnsupportedRegion(f"{numel} elements are not whole rows of {row_length}")
        if row_length > MAX_ROW_LENGTH:
            raise UnsupportedRegion(f"rows of {row_length} elements (more than {MAX_ROW_LENGTH} fit no tile)")
    spaces: list[str] = []
    row_outs = {o for i in program.instrs for k, o in enumerate(i.outs) if k in _ROW_OUTPUTS.get(i.op, ())}
    for value, ttype in enumerate(types):
        if roots[value] is not None:
            spaces.append("input")
        elif value in row_outs:
            if ttype.numel * (row_length or 1) != numel:
                raise UnsupportedRegion(f"row value %{value} {ttype.shape} is not one value per row")
            spaces.append("row")
        elif ttype.numel == numel:
            spaces.append("full")
        elif row_length is not None and ttype.numel * row_length == numel:
            spaces.append("row")
        else:
            raise UnsupportedRegion(
                f"value %{value} {ttype.shape} is neither the full space ({numel} elements) nor one value per row"
            )
    layout = Layout(numel, row_length, tuple(spaces), tuple(roots))
    for instr in program.instrs:
        _check_operands(program, layout, instr)
    return layout


def _row_length(program: Program, instr: Instr) -> int:
    source = instr.args[0]
    assert isinstance(source, Ref)
    shape = program.types[source.id].shape
    return shape[-1]


def _check_operands(program: Program, layout: Layout, instr: Instr) -> None:
    """Every computed operand must be readable in the instruction's space without leaving registers."""
    if instr.op == "alias":
        return
    out_space = layout.spaces[instr.outs[0]]
    out_type = program.types[instr.outs[0]]
    for arg in instr.args:
        if not isinstance(arg, Ref) or layout.spaces[arg.id] == "input":
            continue
        space = layout.spaces[arg.id]
        if instr.op in ROW_REDUCING and arg is instr.args[0]:
            if space != "full":
                raise UnsupportedRegion(f"{instr.op} of a per-row value %{arg.id}")
            continue
        if space == out_space:
            continue  # same numel: the same lanes
        if space == "row" and out_space == "full" and is_row_broadcast(program.types[arg.id], out_type, layout):
            continue
        raise UnsupportedRegion(
            f"{instr.op}: operand %{arg.id} {program.types[arg.id].shape} does not broadcast lane by lane to "
            f"{out_type.shape}"
        )


def is_row_broadcast(row: TensorType, full: TensorType, layout: Layout) -> bool:
    """True when broadcasting the per-row value `row` to `full` gives element i the value of row i // C."""
    dims = coalesce(broadcast_dims(row.shape, full.shape))
    expected = [(layout.rows, 1), (layout.row_length, 0)] if layout.rows > 1 else [(layout.row_length, 0)]
    return dims == [d for d in expected if d[0] != 1]


def broadcast_dims(source: tuple[int, ...], target: tuple[int, ...]) -> list[tuple[int, int]]:
    """Per dim of `target`: (size, stride of the source's row-major element index); 0 where broadcast."""
    source = tuple(source)
    while len(source) > len(target) and source[0] == 1:
        source = source[1:]
    if len(source) > len(target):
        raise UnsupportedRegion(f"shape {source} does not broadcast to {target}")
    strides = contiguous_strides(source)
    pad = len(target) - len(source)
    dims = []
    for k, size in enumerate(target):
        j = k - pad
        if j < 0 or (source[j] == 1 and size != 1):
            dims.append((size, 0))
        elif source[j] == size:
            dims.append((size, strides[j]))
        else:
            raise UnsupportedRegion(f"shape {source} does not broadcast to {target}")
    return dims


def coalesce(dims: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Drop size-1 dims and merge neighbours that step through memory as one (outer first)."""
    merged: list[tuple[int, int]] = []
    for size, stride in dims:
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            outer_size, _ = merged.pop()
            merged.append((outer_size * size, stride))
        else:
            merged.append((size, stride))
    return merged


def index_expr(index: str, dims: list[tuple[int, int]]) -> str:
    """Python source for sum_k ((index // inner_k) % size_k) * stride_k over coalesced `dims`."""
    terms = []
    inner = 1
    for position in range(len(dims) - 1, -1, -1):
        size, stride = dims[position]
        if stride != 0:
            term = index if inner == 1 else f"({index} // {inner})"
            if position > 0:  # the outermost dim needs no modulo: the index never passes its end
                term = f"({term} % {size})"
            if stride != 1:
                term = f"{term} * {stride}"
            terms.append(term)
        inner *= size
    return " + ".join(reversed(terms)) if terms else "0"


def input_offset(program: Program, layout: Layout, value: int, reader: TensorType, index: str) -> str:
    """Memory offset (source) of the element of input-rooted `value` that lane `index` of `reader` reads."""
    root = layout.roots[value]
    assert root is not None
    spec = program.inputs[root]
    element = index_expr(index, coalesce(broadcast_dims(program.types[value].shape, reader.shape)))
    memory = coalesce(list(zip(spec.type.shape, spec.stride, strict=True)))
    if memory == coalesce(list(zip(spec.type.shape, contiguous_strides(spec.type.shape), strict=True))):
        return element  # row-major in memory: the element index is the offset
    return index_expr(f"({element})", memory)
