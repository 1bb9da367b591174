"""The program of one recompute region: a straight-line list of tensor instructions, hashable.

A `Program` is what the code generator turns into one Triton kernel and what the kernel cache is keyed
by. It is built from FX nodes by `lower_fx.py`, never by hand outside tests, and it holds only plain,
hashable data (shapes, strides, dtypes, constants), so two regions with the same structure share one
compiled kernel.

Values are numbered: the region's inputs first (0 .. len(inputs) - 1, tensors read from memory), then
the outputs of the instructions in order. An instruction's arguments are `Ref`s to values or Python
constants. `outputs` lists the values the kernel writes to fresh contiguous tensors; everything else
lives in registers only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class UnsupportedRegion(ValueError):
    """The nodes cannot run as one generated kernel; the message says which node and why."""


@dataclass(frozen=True)
class Ref:
    """A reference to value number `id` of a program."""

    id: int


Arg = Ref | float | int | bool | None


@dataclass(frozen=True)
class TensorType:
    """Logical shape and dtype of a value (instruction outputs are contiguous by construction)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n


@dataclass(frozen=True)
class InputSpec:
    """A tensor the kernel reads: its type and the strides it has in memory (in elements)."""

    type: TensorType
    stride: tuple[int, ...]


@dataclass(frozen=True)
class Instr:
    """One operation: `op` (a key of codegen's lowering table) on `args`, with static `params`."""

    op: str
    args: tuple[Arg, ...]
    params: tuple[tuple[str, object], ...]
    outs: tuple[int, ...]

    def param(self, name: str) -> object:
        for key, value in self.params:
            if key == name:
                return value
        raise KeyError(f"instruction {self.op} has no parameter {name!r}")


@dataclass(frozen=True)
class Program:
    inputs: tuple[InputSpec, ...]
    instrs: tuple[Instr, ...]
    types: tuple[TensorType, ...]  # the type of every value, inputs first
    outputs: tuple[int, ...]  # values written to memory, in the order the kernel returns them

    def describe(self) -> str:
        """A readable listing, for error messages and debugging."""
        lines = [f"  in{i}: {tuple(s.type.shape)} {s.type.dtype} stride {s.stride}" for i, s in enumerate(self.inputs)]
        for instr in self.instrs:
            args = ", ".join(f"%{a.id}" if isinstance(a, Ref) else repr(a) for a in instr.args)
            params = "".join(f", {k}={v!r}" for k, v in instr.params)
            outs = ", ".join(f"%{o}" for o in instr.outs)
            lines.append(f"  {outs} = {instr.op}({args}{params})")
        lines.append(f"  return {', '.join(f'%{o}' for o in self.outputs)}")
        return "\n".join(lines)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    running = 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))
