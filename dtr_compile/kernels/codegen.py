"""`Program` -> the Python source of one @triton.jit kernel (plus how to launch it).

The source is plain text, generated without importing triton, so that the fusion pass can reject
what it cannot compile before anything runs. Shapes are static: they are written into the source as
constants, and the kernel cache (launch.py) holds one kernel per program.

Arithmetic runs in float32 (float64 for float64 tensors): half-precision values are widened on load
and rounded on store, and an explicit dtype conversion inside the region rounds like aten does.
Dropout draws `tl.rand(seed, i)`, Philox keyed by a 64-bit seed and counted by the element's flat
index i in the dropout's tensor, so the same (seed, shape) gives the same mask in any kernel.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from .ir import Instr, Program, Ref, TensorType, UnsupportedRegion
from .layout import Layout, analyze, input_offset, is_row_broadcast

Target = str  # "gpu" (compiled for the device) or "interpreter" (TRITON_INTERPRET=1, CPU tensors)

_TL_STORAGE = {
    torch.float32: "tl.float32",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64",
    torch.bool: "tl.int1",
    torch.int64: "tl.int64",
    torch.int32: "tl.int32",
}

_HELPERS = {
    "_tanh": """@triton.jit
def _tanh(x):
    # tanh from one exp, stable for large |x| (triton.language has no portable tanh)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)
""",
}


@dataclass(frozen=True)
class KernelSource:
    name: str
    text: str  # a whole module: imports, helpers, the kernel
    grid: int  # number of programs
    num_warps: int
    layout: Layout


def compute_type(dtype: torch.dtype) -> str:
    if dtype == torch.float64:
        return "tl.float64"
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        return "tl.float32"
    if dtype == torch.bool:
        return "tl.int1"
    if dtype in _TL_STORAGE:
        return _TL_STORAGE[dtype]
    raise UnsupportedRegion(f"dtype {dtype}")


def literal(value: object) -> str:
    """Python source for a constant (non-finite floats spelled out)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f'float("{value}")'
    if isinstance(value, (bool, int, float)):
        return repr(value)
    raise UnsupportedRegion(f"constant {value!r}")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def generate(program: Program, target: Target = "gpu") -> KernelSource:
    """The kernel source of `program` for `target`; raises UnsupportedRegion."""
    layout = analyze(program)
    return _Emitter(program, layout, target).source()


class _Emitter:
    def __init__(self, program: Program, layout: Layout, target: Target) -> None:
        self.program = program
        self.layout = layout
        self.target = target
        self.lines: list[str] = []
        self.helpers: set[str] = set()
        self.expr: dict[int, str] = {}  # computed value -> variable holding it
        self.loads: dict[tuple[int, TensorType, str], str] = {}  # (input value, reader type, space) -> variable
        self.counter = 0

    # -- tiling

    def _tiles(self) -> tuple[dict[str, int], int, int]:
        """Block sizes, grid and warps. The interpreter runs each program in Python: big tiles, few programs."""
        big = self.target == "interpreter"
        n = self.layout.numel
        if self.layout.row_length is None:
            block = min(_next_pow2(n), 65536 if big else 1024)
            block = max(block, 16)
            return {"BLOCK": block}, -(-n // block), 4
        block_c = max(_next_pow2(self.layout.row_length), 1)
        budget = 65536 if big else 2048
        block_r = max(1, min(_next_pow2(self.layout.rows), budget // block_c))
        warps = 4 if block_r * block_c <= 2048 else (8 if block_r * block_c <= 8192 else 16)
        return {"BLOCK_R": block_r, "BLOCK_C": block_c}, -(-self.layout.rows // block_r), warps

    # -- source

    def source(self) -> KernelSource:
        blocks, grid, warps = self._tiles()
        program = self.program
        wide = self.layout.numel >= 2**31 or any(
            sum((size - 1) * abs(stride) for size, stride in zip(s.type.shape, s.stride, strict=True)) >= 2**31
            for s in program.inputs
        )
        if self.layout.row_length is None:
            self._line(
                f"i = tl.program_id(0){'.to(tl.int64)' if wide else ''} * {blocks['BLOCK']} + "
                f"tl.arange(0, {blocks['BLOCK']})"
            )
            self._line(f"m = i < {self.layout.numel}")
        else:
            self._line(
                f"r = (tl.program_id(0){'.to(tl.int64)' if wide else ''} * {blocks['BLOCK_R']} + "
                f"tl.arange(0, {blocks['BLOCK_R']}))[:, None]"
            )
            self._line(f"c = tl.arange(0, {blocks['BLOCK_C']})[None, :]")
            self._line(f"rm = r < {self.layout.rows}")
            self._line(f"m = rm & (c < {self.layout.row_length})")
            self._line(f"i = r * {self.layout.row_length} + c")
        for instr in program.instrs:
            self._instr(instr)
        for k, value in enumerate(program.outputs):
            self._store(k, value)
        params = [f"in{i}" for i in range(len(program.inputs))] + [f"out{k}" for k in range(len(program.outputs))]
        body = "\n".join(self.lines)
        digest = hashlib.sha256(f"{params}\n{body}".encode()).hexdigest()[:16]
        name = f"dtr_region_{digest}"
        helpers = "\n\n".join(_HELPERS[h] for h in sorted(self.helpers))
        text = (
            f'"""Generated by dtr_compile.kernels from this program:\n{program.describe()}\n"""\n'
            "import triton\nimport triton.language as tl\n\n\n"
            + (helpers + "\n\n" if helpers else "")
            + f"@triton.jit\ndef {name}({', '.join(params)}):\n{body}\n"
        )
        return KernelSource(name, text, grid, warps, self.layout)

    def _line(self, text: str) -> None:
        self.lines.append("    " + text)

    def _fresh(self, prefix: str = "t") -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    # -- operands

    def _index_and_mask(self, space: str) -> tuple[str, str]:
        if space == "row":
            return "r", "rm"
        return "i", "m"

    def operand(self, arg: object, reader: TensorType, space: str) -> str:
        """Source for `arg` as read by an instruction whose output is `reader` in `space`."""
        if not isinstance(arg, Ref):
            return literal(arg)
        kind = self.layout.spaces[arg.id]
        if kind != "input":
            if kind == "row" and space == "full":
                assert is_row_broadcast(self.program.types[arg.id], reader, self.layout)
            return self.expr[arg.id]
        key = (arg.id, reader, space)
        if key not in self.loads:
            index, mask = self._index_and_mask(space)
            offset = input_offset(self.program, self.layout, arg.id, reader, index)
            root = self.layout.roots[arg.id]
            dtype = self.program.types[arg.id].dtype
            var = self._fresh("x")
            if offset == "0":  # one element for every lane: a scalar load (a block mask needs a block pointer)
                self._line(f"{var} = tl.load(in{root}).to({compute_type(dtype)})")
            else:
                self._line(f"{var} = tl.load(in{root} + {offset}, mask={mask}, other=0).to({compute_type(dtype)})")
            self.loads[key] = var
        return self.loads[key]

    def _scalar_input(self, arg: object) -> str:
        """A 0-d input read once (the dropout seed)."""
        assert isinstance(arg, Ref) and self.layout.spaces[arg.id] == "input"
        return f"tl.load(in{self.layout.roots[arg.id]})"

    # -- instructions

    def _instr(self, instr: Instr) -> None:
        out_type = self.program.types[instr.outs[0]]
        space = self.layout.spaces[instr.outs[0]]
        if instr.op == "alias":
            source = instr.args[0]
            assert isinstance(source, Ref)
            if self.layout.spaces[instr.outs[0]] != "input":
                self.expr[instr.outs[0]] = self.expr[source.id]
            return
        if instr.op == "dropout":
            self._dropout(instr, out_type)
            return
        if instr.op in _ROW_OPS:
            source_type = self.program.types[instr.args[0].id]  # type: ignore[union-attr]
            args = [self.operand(a, source_type, "full") if a is not None else None for a in instr.args]
            results = _ROW_OPS[instr.op](self, instr, args)
        else:
            args = [self._converted(a, self.operand(a, out_type, space), instr, k) for k, a in enumerate(instr.args)]
            results = [_POINTWISE[instr.op](self, instr, args)]
        for value, text in zip(instr.outs, results, strict=True):
            var = f"v{value}"
            if text != var:
                self._line(f"{var} = {text}")
            self.expr[value] = var

    def _converted(self, arg: object, text: str, instr: Instr, position: int) -> str:
        """Bool operands of arithmetic become numbers; a where's condition becomes bool."""
        if not isinstance(arg, Ref):
            return text
        dtype = self.program.types[arg.id].dtype
        if instr.op == "where" and position == 0:
            return text if dtype == torch.bool else f"({text} != 0)"
        if instr.op in _ARITHMETIC and dtype not in _FLOATS:
            return f"{text}.to(tl.float32)"
        return text

    def _dropout(self, instr: Instr, out_type: TensorType) -> None:
        if self.layout.spaces[instr.outs[0]] != "full":
            raise UnsupportedRegion("dropout of a per-row value")
        if self.layout.numel >= 2**32:
            raise UnsupportedRegion("dropout over 2**32 elements or more (Philox offsets are 32-bit)")
        seed = self._scalar_input(instr.args[1])
        p = float(instr.param("p"))
        keep = f"v{instr.outs[1]}"
        self._line(f"{keep} = tl.rand({seed}, i.to(tl.uint32)) > {literal(p)}")
        self.expr[instr.outs[1]] = keep
        if instr.args[0] is not None:  # None: only the mask is read (the program was pruned)
            x = self.operand(instr.args[0], out_type, "full")
            self._line(f"v{instr.outs[0]} = tl.where({keep}, {x} * {literal(1.0 / (1.0 - p))}, 0.0)")
            self.expr[instr.outs[0]] = f"v{instr.outs[0]}"

    def _store(self, k: int, value: int) -> None:
        ttype = self.program.types[value]
        space = self.layout.spaces[value]
        if space == "input":  # an output that is a view of an input: copy it
            space = "full" if ttype.numel == self.layout.numel else "row"
            if space == "row" and (self.layout.row_length is None or ttype.numel != self.layout.rows):
                raise UnsupportedRegion(f"output %{value} {ttype.shape} is a view of an input of another size")
            source = self.operand(Ref(value), ttype, space)
        else:
            source = self.expr[value]
        index, mask = self._index_and_mask(space)
        self._line(f"tl.store(out{k} + {index}, ({source}).to({_TL_STORAGE[ttype.dtype]}), mask={mask})")


# Pointwise instructions: f(emitter, instr, operand sources) -> expression source.
def _cast(e: _Emitter, instr: Instr, a: list[str]) -> str:
    dtype = instr.param("dtype")
    if dtype == torch.bool:
        return f"{a[0]} != 0"
    if dtype in (torch.float16, torch.bfloat16):  # round to the narrow type, compute on in float32
        return f"{a[0]}.to({_TL_STORAGE[dtype]}).to(tl.float32)"
    return f"{a[0]}.to({compute_type(dtype)})"


def _pow(e: _Emitter, instr: Instr, a: list[str]) -> str:
    exponent = instr.param("exponent")
    if exponent == 0.5:
        return f"tl.sqrt({a[0]})"
    if float(exponent).is_integer() and 0 < abs(exponent) <= 8:
        product = " * ".join([a[0]] * int(abs(exponent)))
        return f"({product})" if exponent > 0 else f"1.0 / ({product})"
    if exponent == 0:
        return f"tl.full({a[0]}.shape, 1.0, tl.float32)"
    return f"tl.exp({literal(float(exponent))} * tl.log({a[0]}))"


def _gelu(e: _Emitter, instr: Instr, a: list[str]) -> str:
    x = a[0]
    if instr.param("approximate") == "tanh":
        e.helpers.add("_tanh")
        return f"0.5 * {x} * (1.0 + _tanh(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})))"
    return f"0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))"


def _gelu_backward(e: _Emitter, instr: Instr, a: list[str]) -> str:
    """aten's gelu_backward: grad * d/dx gelu(x), exact (erf) or tanh-approximated."""
    grad, x = a
    if instr.param("approximate") == "tanh":
        e.helpers.add("_tanh")
        inner, t = e._fresh("gi"), e._fresh("gt")
        e._line(f"{inner} = 0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})")
        e._line(f"{t} = _tanh({inner})")
        slope = (
            f"0.5 * (1.0 + {t}) + 0.5 * {x} * (1.0 - {t} * {t}) * 0.7978845608028654 * "
            f"(1.0 + 3.0 * 0.044715 * {x} * {x})"
        )
        return f"{grad} * ({slope})"
    cdf = f"0.5 * (1.0 + tl.erf({x} * 0.7071067811865476))"
    pdf = f"tl.exp(-0.5 * {x} * {x}) * 0.3989422804014327"
    return f"{grad} * ({cdf} + {x} * {pdf})"


def _tanh(e: _Emitter, instr: Instr, a: list[str]) -> str:
    e.helpers.add("_tanh")
    return f"_tanh({a[0]})"


_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_ARITHMETIC = frozenset({"add", "sub", "mul", "div", "maximum", "minimum", "where", "neg", "abs", "gelu_backward"})

_POINTWISE = {
    "neg": lambda e, i, a: f"-{a[0]}",
    "abs": lambda e, i, a: f"tl.abs({a[0]})",
    "relu": lambda e, i, a: f"tl.where({a[0]} < 0, 0.0, {a[0]})",  # keeps NaN, like aten
    "tanh": _tanh,
    "sigmoid": lambda e, i, a: f"tl.sigmoid({a[0]})",
    "silu": lambda e, i, a: f"{a[0]} * tl.sigmoid({a[0]})",
    "exp": lambda e, i, a: f"tl.exp({a[0]})",
    "log": lambda e, i, a: f"tl.log({a[0]})",
    "sqrt": lambda e, i, a: f"tl.sqrt({a[0]})",
    "rsqrt": lambda e, i, a: f"tl.rsqrt({a[0]})",
    "reciprocal": lambda e, i, a: f"1.0 / {a[0]}",
    "gelu": _gelu,
    "gelu_backward": _gelu_backward,
    "add": lambda e, i, a: f"{a[0]} + {a[1]}",
    "sub": lambda e, i, a: f"{a[0]} - {a[1]}",
    "mul": lambda e, i, a: f"{a[0]} * {a[1]}",
    "div": lambda e, i, a: f"{a[0]} / {a[1]}",
    "maximum": lambda e, i, a: f"tl.maximum({a[0]}, {a[1]})",
    "minimum": lambda e, i, a: f"tl.minimum({a[0]}, {a[1]})",
    "pow": _pow,
    "gt": lambda e, i, a: f"{a[0]} > {a[1]}",
    "ge": lambda e, i, a: f"{a[0]} >= {a[1]}",
    "lt": lambda e, i, a: f"{a[0]} < {a[1]}",
    "le": lambda e, i, a: f"{a[0]} <= {a[1]}",
    "eq": lambda e, i, a: f"{a[0]} == {a[1]}",
    "ne": lambda e, i, a: f"{a[0]} != {a[1]}",
    "where": lambda e, i, a: f"tl.where({a[0]}, {a[1]}, {a[2]})",
    "cast": _cast,
}


# Row instructions: the first operand is full; each returns one source per output.
def _row_sum(e: _Emitter, x: str) -> str:
    return f"tl.sum(tl.where(m, {x}, 0.0), axis=1)[:, None]"


def _row_max(e: _Emitter, x: str) -> str:
    return f'tl.max(tl.where(m, {x}, float("-inf")), axis=1)[:, None]'


def _softmax_parts(e: _Emitter, x: str) -> tuple[str, str, str]:
    """Row max, exp(x - max) masked to the row, and its row sum, as variables."""
    top, exps, total = e._fresh("mx"), e._fresh("ex"), e._fresh("sm")
    e._line(f"{top} = {_row_max(e, x)}")
    e._line(f"{exps} = tl.where(m, tl.exp({x} - {top}), 0.0)")
    e._line(f"{total} = tl.sum({exps}, axis=1)[:, None]")
    return top, exps, total


def _softmax(e: _Emitter, instr: Instr, a: list[str]) -> list[str]:
    top, exps, total = _softmax_parts(e, a[0])
    if instr.op == "log_softmax":
        return [f"({a[0]} - {top}) - tl.log({total})"]
    if instr.op == "safe_softmax":  # rows that are all -inf give 0, not NaN
        return [f'tl.where({top} == float("-inf"), 0.0, {exps} / {total})']
    return [f"{exps} / {total}"]


def _layer_norm(e: _Emitter, instr: Instr, a: list[str]) -> list[str]:
    length = e.layout.row_length
    mean, centered, rstd = f"v{instr.outs[1]}", e._fresh("d"), f"v{instr.outs[2]}"
    e._line(f"{mean} = {_row_sum(e, a[0])} / {length}")
    e._line(f"{centered} = tl.where(m, {a[0]} - {mean}, 0.0)")
    e._line(
        f"{rstd} = tl.rsqrt(tl.sum({centered} * {centered}, axis=1)[:, None] / {length} + "
        f"{literal(float(instr.param('eps')))})"
    )
    out = f"{centered} * {rstd}"
    if a[1] is not None:
        out = f"{out} * {a[1]}"
    if a[2] is not None:
        out = f"{out} + {a[2]}"
    return [out, mean, rstd]


_ROW_OPS = {
    "sum": lambda e, i, a: [_row_sum(e, a[0])],
    "mean": lambda e, i, a: [f"{_row_sum(e, a[0])} / {e.layout.row_length}"],
    "amax": lambda e, i, a: [_row_max(e, a[0])],
    "softmax": _softmax,
    "safe_softmax": _softmax,
    "log_softmax": _softmax,
    "layer_norm": _layer_norm,
}
