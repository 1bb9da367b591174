"""Every kind of kernel the pass generates compiles for an H100 (sm_90) down to a cubin, on this CPU machine.

Triton's front end, MLIR passes, LLVM and its bundled ptxas run without a GPU; what a GPU-less CI cannot check is
how the kernels run. The compile runs in its own process (`python -m dtr_compile.kernels.aot`), because this
session imported triton for the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from kernel_harness import compiled_step, gpt2_blocks, ops, returned, trace

from dtr_compile.kernels import compile_chain, dropout_kernel
from dtr_compile.kernels.aot import describe_for_aot
from dtr_compile.kernels.codegen import generate
from dtr_compile.kernels.launch import _write_module


def _op_programs() -> list:
    """Programs covering every lowering: pointwise, broadcasts, reductions, layer norm, softmax, dtypes."""
    cases = [
        (lambda x, w, b: (F.gelu(F.layer_norm(x + b, (48,), w, b), approximate="tanh"),), (6, 10, 48), (48,), (48,)),
        (lambda x, m: (torch.softmax(x * 0.25 + m, -1), torch.log_softmax(x, -1)), (2, 3, 12, 12), (12, 12)),
        (lambda x, s: (x - x.mean(-1, keepdim=True), x.amax(-1), x.sum(-1) * s), (7, 50), ()),
        (
            lambda x, y: (torch.where(x > y, F.silu(x), torch.sigmoid(y)) ** 2 + torch.tanh(x) / (y.abs() + 1),),
            (37, 29),
            (37, 29),
        ),
    ]
    programs = []
    for fn, *shapes in cases:
        gm = trace(fn, *[torch.randn(s) for s in shapes])
        programs.append(compile_chain(ops(gm), returned(gm)).kernel.program)
    aten = torch.ops.aten
    backward = trace(
        lambda g, x, m: (
            aten.gelu_backward(g, x, approximate="tanh") + aten.gelu_backward(g, x),
            aten.native_dropout_backward(g, m, 1.25) + aten.threshold_backward(g, x, 0.0),
        ),
        torch.randn(16, 32),
        torch.randn(16, 32),
        torch.randn(16, 32) > 0,
    )
    programs.append(compile_chain(ops(backward), returned(backward)).kernel.program)
    half = trace(lambda x: (torch.softmax(x.float(), -1).half(), F.gelu(x)), torch.randn(8, 64).half())
    programs.append(compile_chain(ops(half), returned(half)).kernel.program)
    for dtype in (torch.float32, torch.bfloat16):
        programs.append(dropout_kernel((64, 100), dtype, 0.3).program)
    return programs


def test_generated_kernels_compile_for_sm90(tmp_path) -> None:
    model, x = gpt2_blocks(dropout=0.1)
    _, _, report = compiled_step(model, x, 0.5, "triton")
    programs = {region.kernel.program for region in report.fusion.regions} | set(_op_programs())
    entries = {}
    for program in programs:
        source = generate(program, "gpu")
        entries[source.name] = describe_for_aot(program, source, str(_write_module(source)))
    listing = tmp_path / "kernels.json"
    listing.write_text(json.dumps(list(entries.values())))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "dtr_compile.kernels.aot", str(listing), "--arch", "90"],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failed"] == {}, result["failed"]
    assert sorted(result["compiled"]) == sorted(entries) and len(entries) >= 10, len(entries)
    print(f"{len(entries)} kernels compiled for sm_90")
