"""Models whose steps differ: control flow that depends on data, and inputs whose shape changes.

They are the case the handoff between the compiled path and the eager runtime exists for: under
`torch.compile`, Dynamo breaks the graph where control flow reads data, and the code between compiled
regions runs eagerly. Each case gives a different batch at every step:

    case = build_dynamic("transformer_branch", "tiny")
    for step in range(4):
        inputs, target = case.batch(step)
        loss = case.loss_fn(case.model(*inputs), target)

- `treelstm`: a TreeLSTM over a random binary tree per step (recursion over a data structure read from
  a tensor with `.tolist()`).
- `lstm`: an LSTM language model over sequences whose length changes from step to step.
- `transformer_branch`: a transformer whose every block takes a branch chosen by the data (a graph break
  per block).
- `moe`: a mixture-of-experts layer that routes each token to its top expert (data-dependent indexing:
  `nonzero` sizes depend on the routing).
Dropout is off, so plain eager is the correctness oracle. Weights and batches come from fixed seeds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .models import LSTMLanguageModel, TreeLSTM, random_binary_tree, token_loss

Batch = tuple[tuple[Tensor, ...], Tensor]


@dataclass(frozen=True)
class DynamicCase:
    name: str
    size: str
    model: nn.Module
    batch: Callable[[int], Batch]  # step -> (inputs, target): a different batch every step
    loss_fn: Callable[[Any, Tensor], Tensor]
    description: str


# ------------------------------------------------------------------------------------------------ LSTM


class StepLSTM(nn.Module):
    """An LSTM layer unrolled in Python, one cell application per time step (the input projection too), so
    that its activations are per-step tensors a rematerializer can free and recompute one by one."""

    def __init__(self, d_in: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.cell = nn.Linear(d_in + hidden, 4 * hidden)

    def forward(self, xs: Tensor) -> Tensor:  # (time, batch, d_in) -> (time, batch, hidden)
        h = xs.new_zeros(xs.shape[1], self.hidden)
        c = h
        outputs = []
        for t in range(xs.shape[0]):  # the length changes between steps: Dynamo unrolls per length
            i, f, g, o = self.cell(torch.cat([xs[t], h], dim=1)).chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outputs.append(h)
        return torch.stack(outputs)


# -------------------------------------------------------------------------- transformer with branches


class BranchingBlock(nn.Module):
    """A pre-norm transformer block whose feed-forward path is chosen by the data: a token-mean above
    zero takes the wide GELU path, otherwise the gated path. `if tensor:` breaks the graph."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.gate = nn.Linear(width, 4 * width), nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        h = self.ln2(x)
        if h.mean() > 0:  # data-dependent: a graph break in every block
            inner = F.gelu(self.up(h))
        else:
            inner = torch.sigmoid(self.gate(h)) * self.up(h)
        return x + self.down(inner)


class BranchingTransformer(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, layers: int, max_seq: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, width), nn.Embedding(max_seq, width)
        self.blocks = nn.ModuleList(BranchingBlock(width, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# ---------------------------------------------------------------------------------- mixture of experts


class Expert(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class MoELayer(nn.Module):
    """Top-1 routing: each token goes to the expert its router scores highest, weighted by that score.
    Which tokens an expert gets (and how many) depends on the data."""

    def __init__(self, width: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(Expert(width, hidden) for _ in range(experts))

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.norm(x).reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(tokens), dim=-1)
        weight, choice = probs.max(dim=-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            index = (choice == e).nonzero().squeeze(1)  # data-dependent size
            if index.numel() == 0:
                continue
            out = out.index_add(0, index, expert(tokens[index]) * weight[index, None])
        return x + out.reshape(x.shape)


class MoEModel(nn.Module):
    def __init__(self, d_in: int, width: int, hidden: int, experts: int, layers: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(MoELayer(width, hidden, experts) for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))


# ------------------------------------------------------------------------------------------- builders


def _generator(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + step)


def _treelstm(size: str, batch: int, leaves: int, hidden: int) -> DynamicCase:
    vocab, classes = 100, 5
    model = TreeLSTM(vocab, hidden, hidden, classes)

    def make(step: int) -> Batch:
        g = _generator(step)
        n = leaves + step % 3  # a different tree, and a different number of leaves, at every step
        tokens = torch.randint(0, vocab, (batch, n), generator=g)
        return (tokens, random_binary_tree(n, seed=step)), torch.randint(0, classes, (batch,), generator=g)

    return DynamicCase("treelstm", size, model, make, F.cross_entropy,
                       f"random tree per step, ~{leaves} leaves, hidden {hidden}, batch {batch}")


def _lstm(size: str, batch: int, seq: int, hidden: int, layers: int) -> DynamicCase:
    vocab = 64
    model = LSTMLanguageModel(vocab, hidden, layers, layer=StepLSTM)
    lengths = (seq, seq - seq // 4, seq + seq // 4, seq - seq // 8)

    def make(step: int) -> Batch:
        g = _generator(step)
        t = lengths[step % len(lengths)]
        ids = torch.randint(0, vocab, (t + 1, batch), generator=g)
        return (ids[:-1],), ids[1:]

    return DynamicCase("lstm", size, model, make, token_loss,
                       f"{layers} layers, hidden {hidden}, length {min(lengths)}-{max(lengths)}, batch {batch}")


def _transformer_branch(size: str, batch: int, seq: int, width: int, layers: int, heads: int) -> DynamicCase:
    vocab = 128
    model = BranchingTransformer(vocab, width, heads, layers, max_seq=2 * seq)

    lengths = (seq, seq - seq // 4, seq + seq // 4, seq - seq // 8)

    def make(step: int) -> Batch:  # the sequence length changes from step to step (dynamic shapes)
        g = _generator(step)
        ids = torch.randint(0, vocab, (batch, lengths[step % len(lengths)] + 1), generator=g)
        return (ids[:, :-1],), ids[:, 1:]

    return DynamicCase("transformer_branch", size, model, make, token_loss,
                       f"{layers} blocks, width {width}, seq {min(lengths)}-{max(lengths)}, batch {batch}, "
                       "a branch per block")


def _moe(size: str, batch: int, seq: int, width: int, experts: int, layers: int) -> DynamicCase:
    d_in, classes = 32, 10
    model = MoEModel(d_in, width, 4 * width, experts, layers, classes)

    def make(step: int) -> Batch:
        g = _generator(step)
        x = torch.randn(batch, seq, d_in, generator=g)
        return (x,), torch.randint(0, classes, (batch,), generator=g)

    return DynamicCase("moe", size, model, make, F.cross_entropy,
                       f"{layers} layers, {experts} experts, width {width}, {batch}x{seq} tokens, top-1 routing")


_BUILDERS: dict[str, tuple[Callable[..., DynamicCase], dict[str, dict[str, int]]]] = {
    # "test": the test suite (compiles with the FX code generator in seconds); "tiny": examples; "quick": the
    # benchmark. Activations, not weights and gradients, make most of each peak, as in the cases
    # rematerialization is for.
    "treelstm": (_treelstm, {
        "test": {"batch": 64, "leaves": 16, "hidden": 64},
        "tiny": {"batch": 64, "leaves": 24, "hidden": 64},
        "quick": {"batch": 128, "leaves": 32, "hidden": 128},
    }),
    "lstm": (_lstm, {
        "test": {"batch": 32, "seq": 16, "hidden": 64, "layers": 2},
        "tiny": {"batch": 32, "seq": 48, "hidden": 64, "layers": 2},
        "quick": {"batch": 64, "seq": 64, "hidden": 128, "layers": 2},
    }),
    "transformer_branch": (_transformer_branch, {
        "test": {"batch": 16, "seq": 64, "width": 64, "layers": 6, "heads": 4},
        "tiny": {"batch": 16, "seq": 64, "width": 64, "layers": 6, "heads": 4},
        "quick": {"batch": 16, "seq": 128, "width": 128, "layers": 6, "heads": 4},
    }),
    "moe": (_moe, {
        "test": {"batch": 64, "seq": 64, "width": 64, "experts": 4, "layers": 3},
        "tiny": {"batch": 64, "seq": 64, "width": 64, "experts": 4, "layers": 3},
        "quick": {"batch": 64, "seq": 128, "width": 128, "experts": 4, "layers": 4},
    }),
}  # fmt: skip

DYNAMIC_MODELS = tuple(_BUILDERS)
DYNAMIC_SIZES = ("test", "tiny", "quick")


def build_dynamic(name: str, size: str = "tiny", seed: int = 0) -> DynamicCase:
    """Build a dynamic case; the same (name, size, seed) gives the same weights and batches in every process."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown dynamic model {name!r}; expected one of {', '.join(DYNAMIC_MODELS)}")
    builder, sizes = _BUILDERS[name]
    if size not in sizes:
        raise ValueError(f"unknown size {size!r} for {name!r}; expected one of {', '.join(sorted(sizes))}")
    torch.manual_seed(seed)
    case = builder(size, **sizes[size])
    case.model.train()
    return case
