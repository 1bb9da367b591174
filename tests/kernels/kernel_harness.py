"""Shared helpers of the kernel tests: trace a function to aten FX nodes, run them fused and unfused."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

triton = pytest.importorskip(
    "triton", reason="triton cannot be imported: the kernel tests need it (pip install -e '.[test]')"
)

from dtr_compile import config
from dtr_compile.backend import make_backend
from dtr_compile.bench.block_models import WrittenOutBlock
from dtr_compile.kernels import compile_chain
from dtr_compile.measure import measure_peak


def trace(fn: Callable, *examples: torch.Tensor) -> fx.GraphModule:
    """`fn` as a graph of aten ops whose nodes carry fake-tensor values (what AOTAutograd hands the passes)."""
    return make_fx(fn, tracing_mode="fake")(*examples)


def ops(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def returned(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes the traced function returns."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return list(output.args[0])


def run_fused_and_unfused(
    fn: Callable, inputs: Sequence[torch.Tensor]
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(kernel outputs, the same FX nodes run op by op by PyTorch) for `fn` traced on `inputs`; the kernel
    computes what `fn` returns."""
    gm = trace(fn, *inputs)
    chain = compile_chain(ops(gm), returned(gm))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = dict(zip(placeholders, inputs, strict=True))
    fused = chain(*[values[n] for n in chain.inputs])
    # The unfused recompute: the same nodes, each run by PyTorch, read at the chain's outputs.
    env: dict[fx.Node, object] = dict(values)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            args = fx.map_arg(node.args, env.__getitem__)
            kwargs = fx.map_arg(node.kwargs, env.__getitem__)
            env[node] = node.target(*args, **kwargs)
    return fused, tuple(env[n] for n in chain.outputs)


def assert_close_at_magnitude(got: torch.Tensor, want: torch.Tensor, msg: str | None = None) -> None:
    """`assert_close` at 1e-5 of the tensor's magnitude, not of each element's: a float32 reduction summed in another
    order differs by ~1e-6 of what it sums, and a layer norm's `w * x_hat + b` can cancel to near zero (elementwise,
    about one random draw in a hundred failed in CI)."""
    scale = max(1.0, want.abs().max().item())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=msg)


# ------------------------------------------------------------------------------ compiled-path models


def gpt2_blocks(dropout: float, layers: int = 2, dim: int = 64) -> tuple[nn.Module, torch.Tensor]:
    """GPT-2's blocks with their attention written out (softmax and dropout as ops: what the kernels fuse)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[WrittenOutBlock(dim, 4, dropout) for _ in range(layers)], nn.Linear(dim, 1))
    return model, torch.randn(4, 32, dim)


def mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(96, 96), nn.LayerNorm(96), nn.GELU()) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(96, 1)), torch.randn(128, 96)


def compiled_step(model: nn.Module, x: torch.Tensor, budget, kernels: str, *, seed: int = 0):
    """A step through backend="dtr" with the FX code generator, after one that compiles: (grads, measured peak,
    plan report). It runs outside any dispatch mode an earlier test left active (see `_no_leaked_modes`)."""
    with _no_leaked_modes():
        return _compiled_step(model, x, budget, kernels, seed=seed)


@contextlib.contextmanager
def _no_leaked_modes():
    """These tests are about the compiled path alone. A `backend="dtr"` step run with compiled_steps="runtime"
    (tests/e2e) leaves the eager runtime's dispatch mode on the stack after its backward (reported to the
    runtime's owner); under it, this path's RNG wrappers fail. Step outside it, and say so."""
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

    leaked = _get_current_dispatch_mode_stack()
    if not leaked:
        yield
        return
    warnings.warn(f"dispatch modes left active by an earlier test: {leaked}", stacklevel=3)
    with _disable_current_modes():
        yield


def _compiled_step(model: nn.Module, x: torch.Tensor, budget, kernels: str, *, seed: int = 0):
    torch._dynamo.reset()
    backend = make_backend(budget, codegen="fx")
    with config.patch(codegen="fx", recompute_kernels=kernels):
        compiled = torch.compile(model, backend=backend)
        compiled(x).sum().backward()  # compiles: the measured step below is a steady one
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        _, measurement = measure_peak(lambda: compiled(x).sum().backward())
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return grads, measurement.peak_bytes, backend.reports[-1]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)
