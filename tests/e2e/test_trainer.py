"""Hugging Face `Trainer` trains a model compiled with `backend="dtr"`, with Trainer's default arguments.

The recipe (README, "Recipes"): set `dtr_compile.config.memory_budget`, compile the model in place with
`model.compile(backend="dtr")`, and hand the model itself to `Trainer`. In-place compilation keeps the model's
`forward` signature, which Trainer reads to keep the batch's columns (`remove_unused_columns=True`, the
default); `torch.compile(model, ...)` returns a wrapper whose `forward(*args, **kwargs)` hides it, and Trainer
then drops every column. `TrainingArguments(torch_compile_backend="dtr")` cannot work with accelerate 1.x: its
`TorchDynamoPlugin` converts the name into the fixed `DynamoBackend` enum and raises for any other name.

Oracle: the measured peak of every training step after the first (which compiles) is within the budget, a
fraction of the peak the same Trainer run measures with no budget; the loss is finite; the runtime saw the
steps. Tiny GPT-2 from a config (2 layers x 32), codegen="fx", random tokens, a few steps.
"""

from __future__ import annotations

import math

import pytest
import torch

import dtr_compile
from dtr_compile.measure import measure_peak
from dtr_compile.runtime.implicit import implicit_runtime

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SEQ = 32
VOCAB = 128


class RandomTokens(torch.utils.data.Dataset):
    """A `datasets`-free dataset of dicts, as Trainer's default collator expects them."""

    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def _train(tmp_path, budget, **arguments) -> tuple[list[int], list[float], transformers.Trainer]:
    """Train with Trainer's defaults plus `arguments`; return the measured peak of each training step after the
    first (the first compiles), the logged losses, and the trainer."""
    torch._dynamo.reset()
    model = _model()
    peaks: list[int] = []
    with dtr_compile.config.patch(memory_budget=budget, codegen="fx"):
        model.compile(backend="dtr")
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), report_to="none", max_steps=4, logging_steps=1, save_strategy="no", **arguments
        )
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=RandomTokens(32, 0), eval_dataset=RandomTokens(8, 1)
        )
        original = trainer.training_step
        calls = [0]

        def measured_step(*a, **kw):
            calls[0] += 1
            if calls[0] == 1:
                return original(*a, **kw)
            result, measured = measure_peak(lambda: original(*a, **kw))
            peaks.append(measured.peak_bytes)
            return result

        trainer.training_step = measured_step
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return peaks, losses, trainer


@pytest.mark.parametrize(
    "arguments",
    [
        pytest.param({}, id="defaults"),
        pytest.param({"gradient_accumulation_steps": 2, "eval_strategy": "steps", "eval_steps": 2}, id="accum-eval"),
    ],
)
def test_trainer_with_defaults_holds_the_budget(tmp_path, arguments) -> None:
    reference, _, _ = _train(tmp_path / "none", None, **arguments)
    assert reference, "no training step was measured"
    budget = int(0.5 * max(reference))
    peaks, losses, trainer = _train(tmp_path / "budget", budget, **arguments)
    assert losses and all(math.isfinite(loss) for loss in losses), losses
    stats = implicit_runtime().stats()
    assert stats.budget_bytes == budget and stats.steps > 0, f"the budgeted dtr path did not run: {stats}"
    # Half the no-budget peak, measured: the budget changed the step (the compiled plans recompute; since they reserve
    # room for the loss run between the model's two regions, the runtime need not evict as well).
    assert max(peaks) <= budget, f"measured peaks {peaks} above the budget {budget} (no budget: {reference})"
    if "eval_strategy" in arguments:
        evals = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
        assert len(evals) == 2 and all(math.isfinite(loss) for loss in evals), trainer.state.log_history


# Out of CI (three more Trainer runs). Under Trainer's bf16 autocast on CPU (`bf16=True, use_cpu=True`) at 0.75 of
# the no-budget peak the steps measured up to 1.16x the budget with no error (1303628 against 1126089 bytes): at the
# end of a step, tensors the program holds (the loss, its scaled copies, the float32 logits the loss upcast) had been
# evicted in the backward and were restored with no budget, rerunning the compiled forward behind them. The restore
# now runs under the budget (Runtime._restore_outliving): this budget cannot hold the step, which raises a
# BudgetError naming 1454404 bytes (1.29x), and at that budget every step measured 1446080 (0.994x). Later the steps
# ran with no error at 1.04x (1172556 bytes): the bf16 matmuls' scratch on CPU (oneDNN packs their operands: 141056
# bytes in the LM head's backward) was counted nowhere; measured now (dtr_compile/matmul_scratch.py), every step
# measures 0.99x (1113152 to 1124352 bytes). Measured on the 2-core CPU development machine, torch 2.13.0,
# transformers 5.24.0, accelerate 1.15.0.
@pytest.mark.slow
def test_trainer_bf16_autocast_holds_the_budget_or_names_one_that_runs(tmp_path) -> None:
    reference, _, _ = _train(tmp_path / "none", None, bf16=True, use_cpu=True)
    budget = int(0.75 * max(reference))
    try:
        peaks, losses, _ = _train(tmp_path / "budget", budget, bf16=True, use_cpu=True)
    except dtr_compile.BudgetError as error:
        assert error.smallest_feasible_bytes > budget and not error.is_lower_bound, error
        budget = error.smallest_feasible_bytes
        peaks, losses, _ = _train(tmp_path / "named", budget, bf16=True, use_cpu=True)
    assert losses and all(math.isfinite(loss) for loss in losses), losses
    assert max(peaks) <= budget, f"measured peaks {peaks} above the budget {budget} (no budget: {reference})"
