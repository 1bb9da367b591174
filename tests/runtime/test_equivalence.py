"""Values and gradients under the eager runtime equal plain eager PyTorch, at several budgets, and the
measured peak stays within 1.05 x the budget."""

from __future__ import annotations

import pytest

from . import models
from .helpers import check_budgets

CASES = {
    "mlp": (models.mlp, models.mlp_step, (1.0, 0.7, 0.6)),
    "cnn_batchnorm": (models.cnn, models.cnn_step, (1.0, 0.7, 0.55)),
    "transformer_dropout": (models.TransformerWithDropout, models.transformer_step, (1.0, 0.7, 0.5)),
    "lstm_loop": (models.LSTMLoop, models.lstm_step, (1.0, 0.7, 0.5)),
    "data_dependent": (models.DataDependent, models.data_dependent_step, (1.0, 0.7, 0.5)),
    "gpt2_transformers": (models.gpt2, models.gpt2_step, (1.0, 0.6, 0.4)),
    "views_inplace": (models.ViewsAndInPlace, models.views_step, (1.0, 0.7, 0.5)),
}


# The compatibility stages of .ci/run run the cases that reach the most of torch (transformers' GPT-2, dropout,
# BatchNorm's in-place running statistics, views and in-place writes).
COMPAT = ("cnn_batchnorm", "gpt2_transformers", "transformer_dropout", "views_inplace")


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.compat) if c in COMPAT else c for c in sorted(CASES)])
def test_matches_eager_within_budget(case: str) -> None:
    make_model, step, fractions = CASES[case]
    check_budgets(make_model, step, fractions)
