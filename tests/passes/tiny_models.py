"""Small models and graph helpers the planner tests share (imported by module name, as pytest puts this folder on
sys.path)."""

from __future__ import annotations

import torch
from torch import fx, nn

from dtr_compile.passes.planner import Plan


class Residual(nn.Module):
    """Two residual blocks, each an MLP with a pointwise nonlinearity. torch.compile's min-cut partition recomputes
    their tanh and sigmoid, which the planner's fill saves again under a budget that has room for them."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.c, self.d = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.b(torch.tanh(self.a(x)))
        x = x + self.d(torch.sigmoid(self.c(x)))
        return x.square()


class BiasedAttention(nn.Module):
    """Attention written out as HF BLOOM writes it (no fused kernel): scores from `baddbmm` over a per-head linear
    bias, a causal mask added, softmax. Recomputed, its softmax is one fused kernel under Inductor."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.register_buffer("slopes", torch.linspace(0.1, 0.5, heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h, e = self.heads, d // self.heads
        q, k, v = self.qkv(x).view(b, t, 3, h, e).permute(2, 0, 3, 1, 4).reshape(3, b * h, t, e)
        bias = (self.slopes[:, None, None] * torch.arange(t, device=x.device)).expand(h, t, t).repeat(b, 1, 1)
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=e**-0.5).view(b, h, t, t)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        probs = (scores + torch.where(causal, 0.0, -1e9)).softmax(-1).view(b * h, t, t)
        return x + self.out((probs @ v).view(b, h, t, e).transpose(1, 2).reshape(b, t, d))


def biased_attention(batch: int = 4, seq: int = 128, dim: int = 64) -> tuple[nn.Module, torch.Tensor]:
    """Two BiasedAttention layers and a head; with the defaults each (batch, heads, seq, seq) buffer is 1 MiB."""
    torch.manual_seed(0)
    model = nn.Sequential(BiasedAttention(dim, 4), BiasedAttention(dim, 4), nn.Linear(dim, 1))
    return model, torch.randn(batch, seq, dim)


def decomposed_joint(model: nn.Module, *inputs: torch.Tensor) -> tuple[fx.GraphModule, int]:
    """The joint graph as Inductor sees it (its decompositions applied), without compiling anything."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition
    from torch._inductor.decomposition import select_decomp_table

    captured = {}

    def partition(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
        captured["joint"], captured["n"] = joint, num_fwd_outputs
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    backend = aot_autograd(fw_compiler=lambda gm, _: gm, partition_fn=partition, decompositions=select_decomp_table())
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(*inputs)
    return captured["joint"], captured["n"]


def trace_as_plan(trace) -> Plan:
    """A schedule.Trace as the Plan `emit_plan` takes."""
    return Plan(None, trace.ops, trace.boundary, trace.fwd_versions, trace.final_versions, 0, True, 0.0, 0.0)
