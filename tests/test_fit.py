"""`python -m dtr_compile.fit` (issue 19): the largest batch that trains within a limit, per method, by measurement.

A small MLP whose activations grow with the batch, compiled with aot_eager / codegen="fx" (seconds, not
Inductor's tens): every method's largest batch is measured within the limit, and the next batch is not;
`backend="dtr"` fits a larger batch than no rematerialization; bad arguments end in one clear error.
"""

from __future__ import annotations

import pytest
import torch

from dtr_compile import fit as fit_module
from dtr_compile.errors import ConfigError
from dtr_compile.fit import fit, main, model_from_spec, parse_overrides

WIDTH, DEPTH = 64, 8


class DeepMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def build() -> tuple[torch.nn.Module, object]:
    """The `module:function` form: (model, make_batch)."""
    torch.manual_seed(0)

    def make_batch(batch: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(batch, WIDTH, generator=torch.Generator().manual_seed(batch))}

    return DeepMLP(), make_batch


def test_dtr_fits_a_larger_batch_than_no_remat_and_every_peak_is_within_the_limit() -> None:
    model, make_batch = build()
    # Gradients of the parameters take 133 KB whatever the batch; each row adds about 2 x DEPTH x WIDTH floats of
    # activations (4 KB) without rematerialization.
    limit = 400_000
    results = {r.method: r for r in fit(model, make_batch, limit, methods=("none", "dtr"), max_batch=1024)}
    none, dtr = results["none"], results["dtr"]
    assert 0 < none.largest_batch < dtr.largest_batch, (none, dtr)
    for result in (none, dtr):
        assert result.peak_bytes is not None and result.peak_bytes <= limit, result
        assert result.samples_per_s and result.samples_per_s > 0, result
        largest = [t for t in result.trials if t.batch == result.largest_batch]
        assert largest and largest[-1].fits
        # The search stopped at a batch that did not fit: measured above the limit, or refused.
        over = [t for t in result.trials if not t.fits]
        assert over and all(t.batch > result.largest_batch for t in over), result.trials
        assert all(t.peak_bytes is None or t.peak_bytes > limit or t.error for t in over), over


@pytest.mark.parametrize(("resolution", "largest", "untried"), [(0.0, 21, None), (0.1, 20, 21)])
def test_the_search_finds_the_exact_largest_batch_unless_told_a_resolution(
    monkeypatch: pytest.MonkeyPatch, resolution: float, largest: int, untried: int | None
) -> None:
    """Doubling to 32, then bisection: 24 and 22 fail, 20 fits. By default 21 is tried too (it fits); at a 10%
    resolution it is left untried and the result says so. The search once stopped at 10% on its own: GPT-2's fit with
    Inductor reported 20 for dtr where 21 fits (CPU stand-in). Trials stand in for the steps: nothing is compiled."""
    tried: list[int] = []

    def trial(method, model, make_batch, batch, limit, compiler, device) -> fit_module.Trial:
        tried.append(batch)
        return fit_module.Trial(batch, batch <= 21, 1000 * batch if batch <= 21 else None)

    monkeypatch.setattr(fit_module, "try_batch", trial)
    result = fit_module.largest_batch("dtr", None, None, 10**6, "fx", torch.device("cpu"), 4096, resolution)
    assert result.largest_batch == largest and result.peak_bytes == 1000 * largest, result
    assert tried[:6] == [1, 2, 4, 8, 16, 32] and (21 in tried) == (untried is None), tried
    assert (f"{untried} untried" in result.note) if untried else not result.note, result.note


def test_a_resolution_outside_zero_to_one_is_refused() -> None:
    model, make_batch = build()
    with pytest.raises(ConfigError, match="--resolution"):
        fit(model, make_batch, 400_000, methods=("none",), resolution=1.5)


def test_the_table_names_every_method_and_the_ratio_to_no_remat() -> None:
    none = fit_module.MethodResult("none", largest_batch=8, peak_bytes=100, samples_per_s=80.0)
    dtr = fit_module.MethodResult("dtr", largest_batch=24, peak_bytes=99, samples_per_s=72.0)
    text = fit_module.table([none, dtr], 100, "cpu")
    assert "| no rematerialization | 8 | 1.00 |" in text
    assert '| backend="dtr" (budget = limit) | 24 | 3.00 | 99 | 72.0 | 0.90 |' in text


def test_overrides_are_typed() -> None:
    assert parse_overrides(["n_layer=2", "resid_pdrop=0.0", "tie_word_embeddings=false", "act=gelu"]) == {
        "n_layer": 2,
        "resid_pdrop": 0.0,
        "tie_word_embeddings": False,
        "act": "gelu",
    }
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["n_layer"])


def test_a_module_function_spec_loads_and_a_bad_one_says_what_is_wrong() -> None:
    model, make_batch = model_from_spec("tests.test_fit:build", {}, seq=0)
    assert isinstance(model, DeepMLP) and make_batch(3)["x"].shape == (3, WIDTH)
    with pytest.raises(ConfigError, match="cannot load"):
        model_from_spec("tests.test_fit:no_such_function", {}, seq=0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["tests.test_fit:build", "--limit", "0.5"], "not a fraction"),
        (["tests.test_fit:build", "--limit", "0"], "must be positive"),
        (["tests.test_fit:build", "--limit", "1MB", "--methods", "none,bogus"], "bogus"),
        (["tests.test_fit:build", "--limit", "1MB", "--max-batch", "0"], "max-batch"),
    ],
)
def test_bad_arguments_end_in_one_error_line(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--device", "cpu"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_transformers_model_trains_without_its_key_value_cache_unless_asked() -> None:
    """Checkpointing turns the cache off; every method must train the same model (a cache left on is returned and held
    through the loss, where the runtime evicts saved activations to make room for it)."""
    pytest.importorskip("transformers")
    small = {"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 64}
    model, _ = model_from_spec("gpt2", small, seq=8)
    assert model.config.use_cache is False
    model, _ = model_from_spec("gpt2", {**small, "use_cache": True}, seq=8)
    assert model.config.use_cache is True


@pytest.mark.slow
def test_gpt2_fits_every_batch_between_two_that_fit() -> None:
    """The CPU stand-in's GPT-2 (4 x 128, vocab 2048, seq 128) at 48 MB, FX code generator: batches 11 and 13 fit, and
    12's first step raised a BudgetError (47.49 MiB needed). Its loss, a second region after a graph break, holds two
    logits' worth where the forward's plan left room for one; the runtime evicted saved values to make the rest, and
    bringing one back reserved its slice's intermediates summed (33.1 MiB), which evicted outputs only a rerun of the
    whole forward brings back (runtime/slices.py now reserves what the slice holds at once)."""
    pytest.importorskip("transformers")
    overrides = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 2048}
    overrides |= {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    model, make_batch = model_from_spec("gpt2", overrides, seq=128)
    trial = fit_module.try_batch("dtr", model.train(), make_batch, 12, 48_000_000, "aot_eager", torch.device("cpu"))
    assert trial.fits and trial.peak_bytes <= 48_000_000, trial
