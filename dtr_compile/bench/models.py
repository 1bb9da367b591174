"""Benchmark models: download-free, deterministic, dropout off, each in three sizes.

    case = build_model("gpt2", "quick")
    model, make_batch, loss_fn = case
    inputs, target = make_batch("cpu")
    loss = loss_fn(model(*inputs), target)

Sizes: "tiny" (tests, a step in milliseconds), "quick" (`--quick` bench and examples, a step in tens
of milliseconds on one CPU thread), "full" (the benchmark proper, about a second per step on one thread).

Every model exposes `model.blocks`, the modules `torch.utils.checkpoint` wraps one by one. Dropout is
off everywhere, so that plain eager is the correctness oracle of every method: with dropout, recompute
and Inductor draw their own random numbers and the gradients differ legitimately (see DESIGN.md).
Weights and batches come from fixed seeds, so two processes building the same case get the same tensors.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SIZES = ("tiny", "quick", "full")

Batch = tuple[tuple[Tensor, ...], Tensor]
"""(model inputs, target): the step is `loss_fn(model(*inputs), target)`."""


@dataclass(frozen=True)
class BenchCase:
    """One model at one size, with its batch and loss. Unpacks as `model, make_batch, loss_fn`."""

    name: str
    size: str
    model: nn.Module
    make_batch: Callable[[Any], Batch]  # device -> (inputs, target), the same tensors on every call
    loss_fn: Callable[[Any, Tensor], Tensor]
    description: str  # shape of the case in a few words, for tables

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.make_batch, self.loss_fn))


# -------------------------------------------------------------------------------------------- MLP


class ResidualMLPBlock(nn.Module):
    """Pre-norm residual MLP block: x + W2 gelu(W1 norm(x))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class MLP(nn.Module):
    def __init__(self, in_features: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(ResidualMLPBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _mlp(size: str, batch: int, width: int, depth: int) -> BenchCase:
    in_features, classes = 256, 10
    model = MLP(in_features, width, depth, classes)

    def make_batch(device: Any) -> Batch:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, in_features, generator=g)
        y = torch.randint(0, classes, (batch,), generator=g)
        return (x.to(device),), y.to(device)

    return BenchCase("mlp", size, model, make_batch, F.cross_entropy, f"{depth} blocks, width {width}, batch {batch}")


# -------------------------------------------------------------------------------------- ResNet CNN


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv + BatchNorm, with a projected shortcut when the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width: int, blocks_per_stage: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        blocks: list[nn.Module] = []
        c_in = width
        for stage in range(3):
            c_out = width * 2**stage
            for i in range(blocks_per_stage):
                blocks.append(BasicBlock(c_in, c_out, stride=2 if (stage > 0 and i == 0) else 1))
                c_in = c_out
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def _resnet(size: str, batch: int, width: int, blocks_per_stage: int, image: int) -> BenchCase:
    classes = 10
    model = ResNet(width, blocks_per_stage, classes)

    def make_batch(device: Any) -> Batch:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(batch, 3, image, image, generator=g)
        y = torch.randint(0, classes, (batch,), generator=g)
        return (x.to(device),), y.to(device)

    desc = f"{3 * blocks_per_stage} blocks, width {width}, {image}x{image}, batch {batch}"
    return BenchCase("resnet", size, model, make_batch, F.cross_entropy, desc)


# ------------------------------------------------------------------------------ GPT-2 and BERT (HF)


class HFLanguageModel(nn.Module):
    """A `transformers` model with random weights, returning logits; `blocks` are its transformer layers."""

    def __init__(self, hf_model: nn.Module, layers_path: str) -> None:
        super().__init__()
        self.hf = hf_model
        self.layers_path = layers_path  # a path, not a second reference that would register the layers twice

    @property
    def blocks(self) -> Sequence[nn.Module]:
        return self.hf.get_submodule(self.layers_path)

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.hf(input_ids=input_ids).logits


def _token_batch(batch: int, seq: int, vocab: int) -> Callable[[Any], Batch]:
    def make_batch(device: Any) -> Batch:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = torch.randint(0, vocab, (batch, seq), generator=g)
        return (ids.to(device),), labels.to(device)

    return make_batch


def token_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """A language model's loss: cross-entropy over every token (dynamic_models.py's models use it too)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _gpt2(size: str, batch: int, seq: int, width: int, layers: int, heads: int, vocab: int) -> BenchCase:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    hf = GPT2LMHeadModel(config)
    model = HFLanguageModel(hf, "transformer.h")
    desc = f"{layers} layers, width {width}, seq {seq}, batch {batch}"
    return BenchCase("gpt2", size, model, _token_batch(batch, seq, vocab), token_loss, desc)


def _bert(size: str, batch: int, seq: int, width: int, layers: int, heads: int, vocab: int) -> BenchCase:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=4 * width, max_position_embeddings=seq,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    hf = BertForMaskedLM(config)
    model = HFLanguageModel(hf, "bert.encoder.layer")
    desc = f"{layers} layers, width {width}, seq {seq}, batch {batch}"
    return BenchCase("bert", size, model, _token_batch(batch, seq, vocab), token_loss, desc)


def _llama(size: str, batch: int, seq: int, width: int, layers: int, heads: int, vocab: int) -> BenchCase:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
        attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    hf = LlamaForCausalLM(config)
    model = HFLanguageModel(hf, "model.layers")
    desc = f"{layers} layers, width {width}, seq {seq}, batch {batch}"
    return BenchCase("llama", size, model, _token_batch(batch, seq, vocab), token_loss, desc)


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update, `base(x) + scale * up(down(x))` (LoRA, Hu et al.
    2021): what fine-tuning with adapters trains, most often with gradient checkpointing on. The base weights take no
    gradient, so the backward has no weight-gradient matmuls of theirs, and recomputing a block costs more of the
    step than in full training."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        # LoRA starts `up` at zero; random here, so that every adapter's gradient is nonzero and compared
        nn.init.normal_(self.up.weight, std=0.02)
        self.scale = alpha / rank

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.up(self.down(x)) * self.scale


def with_lora(case: BenchCase, rank: int = 8, alpha: float = 16.0) -> BenchCase:
    """`case`'s model with every weight frozen and a LoRA adapter on each linear layer of its blocks (attention and
    MLP, as adapter fine-tuning of Llama commonly targets)."""
    model = case.model
    model.requires_grad_(False)
    for block in model.blocks:
        for name, module in list(block.named_modules()):
            if isinstance(module, nn.Linear):
                parent = block.get_submodule(name.rpartition(".")[0]) if "." in name else block
                setattr(parent, name.rpartition(".")[2], LoRALinear(module, rank, alpha))
    return BenchCase(
        f"{case.name}_lora", case.size, model, case.make_batch, case.loss_fn, f"{case.description}, LoRA rank {rank}"
    )


def _llama_lora(size: str, batch: int, seq: int, width: int, layers: int, heads: int, vocab: int) -> BenchCase:
    return with_lora(_llama(size, batch, seq, width, layers, heads, vocab))


# -------------------------------------------------------------------------------------- TreeLSTM


class TreeLSTMLeaf(nn.Module):
    """Leaf of a TreeLSTM: gates from the token embedding alone."""

    def __init__(self, d_in: int, hidden: int) -> None:
        super().__init__()
        self.gates = nn.Linear(d_in, 3 * hidden)  # input, output and update gates

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        i, o, u = self.gates(x).chunk(3, dim=1)
        c = torch.sigmoid(i) * torch.tanh(u)
        return torch.sigmoid(o) * torch.tanh(c), c


class TreeLSTMNode(nn.Module):
    """Inner node of a binary (N-ary, Tai et al. 2015) TreeLSTM: one forget gate per child."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gates = nn.Linear(2 * hidden, 5 * hidden)  # input, two forget, output and update gates

    def forward(self, left_h: Tensor, left_c: Tensor, right_h: Tensor, right_c: Tensor) -> tuple[Tensor, Tensor]:
        i, f_left, f_right, o, u = self.gates(torch.cat([left_h, right_h], dim=1)).chunk(5, dim=1)
        c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(f_left) * left_c + torch.sigmoid(f_right) * right_c
        return torch.sigmoid(o) * torch.tanh(c), c


class TreeLSTM(nn.Module):
    """Classifies a batch of token sequences that share one binary parse tree.

    The tree is an input tensor, `children[node] = (left, right)` or (-1, -1) for a leaf, nodes in post-order
    with the root last. Reading it with `.tolist()` and recursing makes the control flow depend on data:
    Dynamo breaks the graph there, which is the case the eager runtime exists for.
    """

    def __init__(self, vocab: int, d_in: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_in)
        self.leaf = TreeLSTMLeaf(d_in, hidden)
        self.node = TreeLSTMNode(hidden)
        self.blocks = [self.leaf, self.node]  # checkpointing "every block" = every cell application
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens: Tensor, children: Tensor) -> Tensor:
        structure = children.tolist()  # data-dependent: graph break under torch.compile
        x = self.embed(tokens)  # (batch, leaves, d_in)
        leaf_of = {}
        for node, (left, _right) in enumerate(structure):
            if left < 0:
                leaf_of[node] = len(leaf_of)
        h, _c = self._visit(len(structure) - 1, structure, leaf_of, x)
        return self.head(h)

    def _visit(self, node: int, structure: list, leaf_of: dict, x: Tensor) -> tuple[Tensor, Tensor]:
        left, right = structure[node]
        if left < 0:
            return self.leaf(x[:, leaf_of[node]])
        left_h, left_c = self._visit(left, structure, leaf_of, x)
        right_h, right_c = self._visit(right, structure, leaf_of, x)
        return self.node(left_h, left_c, right_h, right_c)


def random_binary_tree(leaves: int, seed: int) -> Tensor:
    """A random binary tree over `leaves` leaves as a (2 * leaves - 1, 2) child table in post-order."""
    rng = random.Random(seed)
    table: list[tuple[int, int]] = []

    def build(n: int) -> int:
        if n == 1:
            table.append((-1, -1))
            return len(table) - 1
        split = rng.randint(1, n - 1)
        left = build(split)
        right = build(n - split)
        table.append((left, right))
        return len(table) - 1

    build(leaves)
    return torch.tensor(table, dtype=torch.long)


def _treelstm(size: str, batch: int, leaves: int, hidden: int) -> BenchCase:
    vocab, classes = 1000, 5
    model = TreeLSTM(vocab, hidden, hidden, classes)

    def make_batch(device: Any) -> Batch:
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, vocab, (batch, leaves), generator=g)
        y = torch.randint(0, classes, (batch,), generator=g)
        return (tokens.to(device), random_binary_tree(leaves, seed=1).to(device)), y.to(device)

    desc = f"{leaves} leaves, hidden {hidden}, batch {batch}"
    return BenchCase("treelstm", size, model, make_batch, F.cross_entropy, desc)


# ------------------------------------------------------------------------------------------ LSTM


class LSTMLayer(nn.Module):
    """One LSTM layer unrolled in Python over time.

    Written out rather than `nn.LSTM` because Dynamo graph-breaks on RNN modules (`allow_rnn` is off by
    default), and because the unrolled steps are the per-timestep activations a rematerializer manages.
    """

    def __init__(self, d_in: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.ih = nn.Linear(d_in, 4 * hidden)
        self.hh = nn.Linear(hidden, 4 * hidden, bias=False)

    def forward(self, xs: Tensor) -> Tensor:  # (time, batch, d_in) -> (time, batch, hidden)
        gates_x = self.ih(xs)  # the input projection of every step at once
        h = xs.new_zeros(xs.shape[1], self.hidden)
        c = h
        outputs = []
        for t in range(xs.shape[0]):
            i, f, g, o = (gates_x[t] + self.hh(h)).chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outputs.append(h)
        return torch.stack(outputs)


class LSTMLanguageModel(nn.Module):
    def __init__(
        self, vocab: int, hidden: int, layers: int, layer: Callable[[int, int], nn.Module] = LSTMLayer
    ) -> None:
        """`layer(d_in, hidden)` builds each LSTM layer (the dynamic models use a step-wise one)."""
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(layer(hidden, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: Tensor) -> Tensor:  # (time, batch) -> (time, batch, vocab)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _lstm(size: str, batch: int, seq: int, hidden: int, layers: int) -> BenchCase:
    vocab = 256
    model = LSTMLanguageModel(vocab, hidden, layers)
    desc = f"{layers} layers, hidden {hidden}, seq {seq}, batch {batch}"

    def make_batch(device: Any) -> Batch:
        (ids,), labels = _token_batch(batch, seq, vocab)(device)
        return (ids.t().contiguous(),), labels.t().contiguous()  # time-major

    return BenchCase("lstm", size, model, make_batch, token_loss, desc)


# ------------------------------------------------------------------------------------------ registry

# The frontier's sizes (issue 17, `python -m dtr_compile.bench --frontier`), GPT-2 and Llama only: "small" is the
# CPU stand-in, "124m" GPT-2 124M's shape (12 x 768, seq 1024, batch 8, vocab 8192) for the GPU.
_FRONTIER_SIZES = {
    "small": {"batch": 4, "seq": 256, "width": 256, "layers": 8, "heads": 4, "vocab": 2048},
    "124m": {"batch": 8, "seq": 1024, "width": 768, "layers": 12, "heads": 12, "vocab": 8192},
}

# Sizes per model. "quick" keeps a one-thread CPU step around 30-70 ms so the --quick grid fits in minutes;
# "full" is about a second per step on one CPU thread (a few minutes per run with compiles).
_BUILDERS: dict[str, tuple[Callable[..., BenchCase], dict[str, dict[str, int]]]] = {
    "mlp": (_mlp, {
        "tiny": {"batch": 8, "width": 32, "depth": 2},
        "quick": {"batch": 1024, "width": 128, "depth": 4},
        "full": {"batch": 2048, "width": 256, "depth": 8},
    }),
    "resnet": (_resnet, {
        "tiny": {"batch": 2, "width": 4, "blocks_per_stage": 1, "image": 8},
        "quick": {"batch": 16, "width": 16, "blocks_per_stage": 2, "image": 32},
        "full": {"batch": 64, "width": 32, "blocks_per_stage": 3, "image": 32},
    }),
    "gpt2": (_gpt2, {
        "tiny": {"batch": 2, "seq": 8, "width": 16, "layers": 2, "heads": 2, "vocab": 64},
        "quick": {"batch": 8, "seq": 64, "width": 128, "layers": 4, "heads": 4, "vocab": 1024},
        "full": {"batch": 8, "seq": 256, "width": 256, "layers": 6, "heads": 4, "vocab": 8192},
        **_FRONTIER_SIZES,
    }),
    "llama": (_llama, {
        "tiny": {"batch": 2, "seq": 8, "width": 16, "layers": 2, "heads": 2, "vocab": 64},
        "quick": {"batch": 8, "seq": 64, "width": 128, "layers": 4, "heads": 4, "vocab": 1024},
        "full": {"batch": 8, "seq": 256, "width": 256, "layers": 6, "heads": 4, "vocab": 8192},
        **_FRONTIER_SIZES,
    }),
    "llama_lora": (_llama_lora, {
        "tiny": {"batch": 2, "seq": 8, "width": 16, "layers": 2, "heads": 2, "vocab": 64},
        "quick": {"batch": 8, "seq": 64, "width": 128, "layers": 4, "heads": 4, "vocab": 1024},
        "full": {"batch": 8, "seq": 256, "width": 256, "layers": 6, "heads": 4, "vocab": 8192},
        **_FRONTIER_SIZES,
    }),
    "bert": (_bert, {
        "tiny": {"batch": 2, "seq": 8, "width": 16, "layers": 2, "heads": 2, "vocab": 64},
        "quick": {"batch": 8, "seq": 64, "width": 128, "layers": 4, "heads": 4, "vocab": 1024},
        "full": {"batch": 8, "seq": 256, "width": 256, "layers": 6, "heads": 4, "vocab": 8192},
    }),
    "treelstm": (_treelstm, {
        "tiny": {"batch": 2, "leaves": 4, "hidden": 8},
        "quick": {"batch": 32, "leaves": 32, "hidden": 128},
        "full": {"batch": 64, "leaves": 128, "hidden": 256},
    }),
    "lstm": (_lstm, {
        "tiny": {"batch": 2, "seq": 4, "hidden": 8, "layers": 2},
        "quick": {"batch": 32, "seq": 32, "hidden": 128, "layers": 2},
        "full": {"batch": 32, "seq": 96, "hidden": 256, "layers": 3},
    }),
}  # fmt: skip

MODELS = tuple(_BUILDERS)


def build_model(name: str, size: str = "quick", seed: int = 0) -> BenchCase:
    """Build a benchmark case; the same (name, size, seed) gives the same weights in every process."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    sizes = _BUILDERS[name][1]
    if size not in sizes:
        raise ValueError(f"unknown size {size!r} for model {name!r}; expected one of {', '.join(SIZES)}")
    return build_model_shaped(name, size, seed=seed, **sizes[size])


def build_model_shaped(name: str, size: str = "custom", seed: int = 0, **shape: int) -> BenchCase:
    """A benchmark case at a shape of the caller's choosing (the keywords of the model's sizes above, e.g.
    `layers=12, width=384` for gpt2), named `size`: the runtime-overhead suite's 12-layer GPT-2."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
    torch.manual_seed(seed)
    case = _BUILDERS[name][0](size, **shape)
    case.model.train()
    return case
