"""Each generated kernel equals the unfused recompute (the same aten nodes run by PyTorch) on fresh inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_harness import ops, returned, run_fused_and_unfused, trace

from dtr_compile.kernels import UnsupportedRegion, compile_chain


@pytest.fixture
def fresh() -> torch.Generator:
    """A generator with a fresh seed (printed on failure), so every run checks new inputs."""
    generator = torch.Generator()
    seed = generator.seed()
    print(f"input seed {seed}")
    return generator


def randn(generator: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(dtype)


def assert_same(fused, unfused, **tolerance) -> None:
    assert len(fused) == len(unfused)
    for got, want in zip(fused, unfused, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, **tolerance)


def test_bias_add_gelu_erf_and_tanh(fresh) -> None:
    x, bias = randn(fresh, 4, 9, 96), randn(fresh, 96)

    def fn(x, bias):
        h = x + bias
        return F.gelu(h), F.gelu(h * 0.5, approximate="tanh")

    assert_same(*run_fused_and_unfused(fn, [x, bias]))


def test_residual_layer_norm_with_and_without_affine(fresh) -> None:
    x, residual, weight, bias = randn(fresh, 3, 7, 80), randn(fresh, 3, 7, 80), randn(fresh, 80), randn(fresh, 80)

    def fn(x, residual, weight, bias):
        h = x + residual
        out, mean, rstd = torch.ops.aten.native_layer_norm(h, [80], weight, bias, 1e-5)
        plain = F.layer_norm(h * 2.0, (80,))
        return out, mean, rstd, plain

    fused, unfused = run_fused_and_unfused(fn, [x, residual, weight, bias])
    assert len(fused) == 4  # out, mean and rstd of one layer norm, and a second one: one kernel
    assert_same(fused, unfused, rtol=2e-5, atol=2e-5)


def test_attention_softmax_with_broadcast_mask(fresh) -> None:
    scores = randn(fresh, 2, 3, 12, 12)
    mask = torch.triu(torch.full((12, 12), float("-inf")), diagonal=1)

    def fn(scores, mask):
        return (torch.softmax(scores * 0.25 + mask, dim=-1),)

    assert_same(*run_fused_and_unfused(fn, [scores, mask]))


def test_safe_softmax_zeroes_fully_masked_rows_and_log_softmax(fresh) -> None:
    scores = randn(fresh, 5, 33)
    scores[1] = float("-inf")  # a row with nothing to attend to: 0, not NaN

    def fn(scores):
        return torch.ops.aten._safe_softmax(scores, -1), torch.log_softmax(scores.clamp(min=-5.0), dim=-1)

    fused, unfused = run_fused_and_unfused(fn, [scores])
    assert torch.all(fused[0][1] == 0)
    assert_same(fused, unfused)


def test_row_reductions_and_their_broadcasts(fresh) -> None:
    x = randn(fresh, 6, 4, 50)

    def fn(x):
        centered = x - x.mean(-1, keepdim=True)
        return centered, x.sum(-1), x.amax(-1, keepdim=True), centered / (centered.abs().sum(-1, keepdim=True) + 1)

    assert_same(*run_fused_and_unfused(fn, [x]), rtol=1e-5, atol=2e-5)


def test_pointwise_zoo(fresh) -> None:
    x, y = randn(fresh, 37, 29), randn(fresh, 37, 29)
    flags = randn(fresh, 37, 29) > 0

    def fn(x, y, flags):
        a = torch.tanh(x) + torch.sigmoid(y) - F.silu(x) * torch.relu(-y)
        b = torch.exp(-x.abs()) + torch.log(y.abs() + 1) + torch.sqrt(x.abs()) + torch.rsqrt(y.abs() + 1)
        c = torch.reciprocal(x.abs() + 0.5) + x**2 - y**3 + (x.abs() + 1) ** 0.5 + (y.abs() + 1) ** -1.0
        d = (x.abs() + 1) ** 1.7 + torch.maximum(x, y) - torch.minimum(x, 2.0 * y) + torch.clamp(x, -0.5, 0.7)
        e = torch.where(x > y, x, y * 2) + x.masked_fill(flags, -3.0) + torch.sub(x, y, alpha=2) + (1 - x)
        f = (x >= 0) * x + (x != y).to(torch.float32) - torch.neg(y) / (x.abs() + 1)
        return a, b, c, d, e, f

    assert_same(*run_fused_and_unfused(fn, [x, y, flags]), rtol=1e-5, atol=1e-5)


def test_half_precision_in_and_out(fresh) -> None:
    x, bias = randn(fresh, 8, 64, dtype=torch.float16), randn(fresh, 64, dtype=torch.float16)

    def fn(x, bias):
        h = (x + bias).float()  # widened like an autocast region does
        return torch.softmax(h, -1).half(), F.gelu(x + bias)

    fused, unfused = run_fused_and_unfused(fn, [x, bias])
    assert fused[0].dtype == torch.float16
    # The kernel keeps the fp16 add in float32 inside (aten rounds it to fp16 first): one fp16 ulp apart.
    assert_same(fused, unfused, rtol=2e-3, atol=2e-3)


def test_strided_and_broadcast_inputs(fresh) -> None:
    """Inputs are read where they are: a transposed tensor, a [B, 1, C] scale and a per-row [B, T, 1] shift."""
    base, scale, shift = randn(fresh, 10, 4, 24), randn(fresh, 4, 1, 24), randn(fresh, 4, 10, 1)
    transposed = base.transpose(0, 1)  # (4, 10, 24), not contiguous

    def fn(x, scale, shift):
        return (torch.softmax(x * scale + shift, -1),)

    assert_same(*run_fused_and_unfused(fn, [transposed, scale, shift]))


def test_a_kernel_respecializes_to_the_layout_it_is_given(fresh) -> None:
    x = randn(fresh, 16, 12)
    gm = trace(lambda x: (torch.sigmoid(x) * 3,), x)
    chain = compile_chain(ops(gm))
    other = randn(fresh, 12, 16).t()  # same shape, other strides
    for tensor in (x, other):
        torch.testing.assert_close(chain(tensor)[0], torch.sigmoid(tensor) * 3)


def test_views_inside_a_region_and_outputs_sharing_elements(fresh) -> None:
    x = randn(fresh, 6, 20)

    def fn(x):
        h = torch.tanh(x).view(2, 3, 20).unsqueeze(0)
        return h, h.reshape(120), torch.softmax(h, -1).squeeze(0)

    gm = trace(fn, x)
    chain = compile_chain(ops(gm), returned(gm))
    # The two views of tanh(x) share one kernel output: the kernel writes two tensors, not three.
    assert len(chain.kernel.program.outputs) == 2
    assert_same(*run_fused_and_unfused(fn, [x]))


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (lambda x: (torch.relu(torch.mm(x, x)),), "aten.mm"),
        (lambda x: (torch.ops.aten.native_dropout(x, 0.5, True)[0],), "native_dropout"),
        (lambda x: (torch.softmax(x, -1).t().contiguous(),), "aten.t"),
        (lambda x: (x.sum(-1), x.view(2, 32).sum(-1)), "rows of different lengths"),
    ],
)
def test_what_is_not_one_kernel_is_refused_with_the_node(fn, reason: str) -> None:
    gm = trace(fn, torch.randn(8, 8))
    with pytest.raises(UnsupportedRegion, match=reason):
        compile_chain(ops(gm))


def test_backward_ops_that_read_recomputed_values(fresh) -> None:
    """The pointwise backward ops a region may absorb (so the recomputed value they read never reaches memory)."""
    grad, x = randn(fresh, 24, 40), randn(fresh, 24, 40)
    mask = randn(fresh, 24, 40) > 0
    aten = torch.ops.aten

    def fn(grad, x, mask):
        y = torch.sigmoid(x)
        t = torch.tanh(x)
        return (
            aten.gelu_backward(grad, x),
            aten.gelu_backward(grad, x, approximate="tanh"),
            aten.threshold_backward(grad, torch.relu(x), 0.0),
            aten.sigmoid_backward(grad, y),
            aten.tanh_backward(grad, t),
            aten.native_dropout_backward(grad, mask, 1.25),
        )

    assert_same(*run_fused_and_unfused(fn, [grad, x, mask]), rtol=1e-5, atol=1e-5)
