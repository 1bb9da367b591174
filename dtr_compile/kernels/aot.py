"""Compile generated kernels for a GPU ahead of time, without a GPU: the check that the GPU path compiles.

    python -m dtr_compile.kernels.aot kernels.json [--arch 90]

`kernels.json` lists {"path": module file, "name": kernel function, "signature": {param: "*fp32", ...}} as
written by `describe_for_aot`. Triton's front end, its MLIR passes, LLVM and the bundled ptxas all run on
the CPU, so each kernel goes through every stage down to a cubin for the given architecture (sm_90 = H100);
what this cannot show is that the kernel runs correctly or fast on the device. Triton must be imported
without TRITON_INTERPRET=1 (the interpreter replaces the compiler), so this runs as its own process.
Prints one JSON line: {"compiled": [names], "failed": {name: error}}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

from .codegen import KernelSource
from .ir import Program

_POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float64: "*fp64",
    torch.bool: "*i1",
    torch.int64: "*i64",
    torch.int32: "*i32",
}


def describe_for_aot(program: Program, source: KernelSource, path: str) -> dict:
    """The JSON entry that lets `main` compile `source` (written at `path`) for a GPU."""
    signature = {f"in{i}": _POINTER_TYPES[spec.type.dtype] for i, spec in enumerate(program.inputs)}
    for k, value in enumerate(program.outputs):
        signature[f"out{k}"] = _POINTER_TYPES[program.types[value].dtype]
    return {"path": path, "name": source.name, "signature": signature, "num_warps": source.num_warps}


def compile_entries(entries: list[dict], arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    compiled, failed = [], {}
    for entry in entries:
        try:
            spec = importlib.util.spec_from_file_location(f"dtr_aot_{entry['name']}", entry["path"])
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            source = ASTSource(fn=getattr(module, entry["name"]), signature=entry["signature"], constexprs={})
            kernel = triton.compile(source, target=target, options={"num_warps": entry["num_warps"]})
            if not kernel.asm.get("cubin"):
                raise RuntimeError("no cubin produced")
            compiled.append(entry["name"])
        except Exception as error:  # noqa: BLE001 - every failure is reported, with its kernel
            failed[entry["name"]] = f"{type(error).__name__}: {error}"[:2000]
    return {"compiled": compiled, "failed": failed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("entries", help="JSON file of kernels to compile")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90 = H100)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces Triton's compiler")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
    with open(args.entries) as handle:
        entries = json.load(handle)
    print(json.dumps(compile_entries(entries, args.arch)))


if __name__ == "__main__":
    main()
