"""Hand-written GPT-style and CNN models of the compiled and kernels suites, their blocks written out.

models.py holds the grid's models (transformers' GPT-2, ResNet, ...), built by name and size. The suites here
need models whose code they control: the compiled suite a small GPT-2-style model and a CNN with a `ckpt`
switch that wraps every block in `torch.utils.checkpoint`, each returning its loss; the kernels suite GPT-2's
block with its attention written out (softmax and dropout as ops, as in GPT-2's eager attention), so that a
plan's recomputes have pointwise work to fuse. Both blocks hold the same parameters, made in the same order, so
the same seed gives them the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class GPTBlock(nn.Module):
    """A pre-norm GPT-2 block: causal attention through scaled_dot_product_attention, then a GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class WrittenOutBlock(GPTBlock):
    """GPT-2's block with its attention written out (softmax and dropout as ops) and tanh GELU, as GPT-2's eager
    code runs it: the pointwise work between the matmuls is what recompute kernels fuse."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__(dim, heads)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5)
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        attention = self.drop(torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)) @ v
        x = x + self.drop(self.proj(attention.transpose(1, 2).reshape(batch, length, dim)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh")))


def _blocks(blocks: nn.ModuleList, x: torch.Tensor, ckpt: bool) -> torch.Tensor:
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=False) if ckpt else block(x)
    return x


class GPT(nn.Module):
    """GPT-2 style: token and position embeddings, pre-norm blocks, causal attention, LM head; returns the loss
    of predicting its own input ids (the compiled suite times `model(ids).backward()`)."""

    def __init__(self, vocab: int = 512, dim: int = 128, heads: int = 4, layers: int = 4, ckpt: bool = False) -> None:
        super().__init__()
        self.ckpt = ckpt
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Embedding(256, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = _blocks(self.blocks, self.emb(ids) + self.pos(torch.arange(ids.shape[1])), self.ckpt)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(cin, cout, 3, stride=stride, padding=1), nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


class CNN(nn.Module):
    """Two stages of conv-BatchNorm-ReLU blocks, as in a small ResNet without the skips: 4 blocks of 32 channels
    at full resolution, then 4 of 64 channels at half (the first one strided). Returns the sum of its logits."""

    STAGES = ((32, 4, 1), (64, 4, 2))  # (channels, blocks, stride of the stage's first block)

    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        self.ckpt = ckpt
        blocks, cin = [], 3
        for channels, count, stride in self.STAGES:
            for i in range(count):
                blocks.append(ConvBlock(cin, channels, stride if i == 0 else 1))
                cin = channels
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(cin, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_blocks(self.blocks, x, self.ckpt).mean((2, 3))).sum()


COMPILED_MODELS = {
    "gpt": "GPT-2 style, 4 blocks, dim 128, 4 heads, seq 128, batch 4, vocab 512",
    "cnn": "CNN, 8 conv-BatchNorm-ReLU blocks: 4 of 32 channels at 48x48, 4 of 64 at 24x24 (first strided), batch 8",
}


def compiled_model(name: str, ckpt: bool = False, layers: int = 4) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """One of COMPILED_MODELS (the GPT with `layers` blocks) and its inputs; the step is `model(*inputs).backward()`."""
    torch.manual_seed(0)
    if name == "gpt":
        return GPT(ckpt=ckpt, layers=layers), (torch.randint(0, 512, (4, 128)),)
    return CNN(ckpt=ckpt), (torch.randn(8, 3, 48, 48),)


def written_out_gpt(
    layers: int, dim: int, heads: int, seq: int, batch: int, dropout: float, device: torch.device | str = "cpu"
) -> tuple[nn.Module, torch.Tensor]:
    """The kernels suite's model (WrittenOutBlocks, a LayerNorm and a one-output head) and its input."""
    torch.manual_seed(0)
    blocks = [WrittenOutBlock(dim, heads, dropout) for _ in range(layers)]
    model = nn.Sequential(*blocks, nn.LayerNorm(dim), nn.Linear(dim, 1)).to(device)
    return model, torch.randn(batch, seq, dim, device=device)
