"""The bench's parts without child processes: models, methods, statuses, the grid, the command line."""

from __future__ import annotations

import sys

import pytest
import torch

from dtr_compile.bench import child
from dtr_compile.bench.child import classify
from dtr_compile.bench.cli import parse_grid
from dtr_compile.bench.grid import Grid
from dtr_compile.bench.methods import FRONTIER_ONLY, METHODS, Budget, NotBuilt, get_method
from dtr_compile.bench.models import MODELS, build_model
from dtr_compile.bench.spec import RunSpec
from dtr_compile.errors import BudgetError, ThrashError


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MODELS)
def test_tiny_models_train_deterministically_and_expose_blocks(name):
    losses, grads = [], []
    for _ in range(2):  # two builds with the same seed: same weights, same batch, same gradients
        model, make_batch, loss_fn = build_model(name, "tiny")
        inputs, target = make_batch("cpu")
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        losses.append(loss.item())
        grads.append(_grads(model))
        assert len(model.blocks) >= 1 and all(isinstance(b, torch.nn.Module) for b in model.blocks)
    assert losses[0] == losses[1]
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for key in grads[0]:
        assert torch.equal(grads[0][key], grads[1][key]), key


def test_the_lora_model_trains_its_adapters_alone():
    model, make_batch, loss_fn = build_model("llama_lora", "tiny")
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    adapters = {name for name in trained if name.endswith((".down.weight", ".up.weight"))}
    assert trained == adapters and len(adapters) == 2 * 7 * len(model.blocks)  # 7 linear layers a Llama block
    inputs, target = make_batch("cpu")
    loss_fn(model(*inputs), target).backward()
    assert set(_grads(model)) == trained


@pytest.mark.parametrize("name", ["resnet", "gpt2", "treelstm"])  # mlp: in the end-to-end test
def test_checkpoint_method_gives_eager_gradients(name):
    reference = build_model(name, "tiny")
    ref_batch = reference.make_batch("cpu")
    get_method("eager").prepare(reference, Budget(None, None), ref_batch)()
    case = build_model(name, "tiny")
    loss = get_method("checkpoint").prepare(case, Budget(None, None), case.make_batch("cpu"))()
    assert loss == pytest.approx(reference.loss_fn(reference.model(*ref_batch[0]), ref_batch[1]).item())
    expected, got = _grads(reference.model), _grads(case.model)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-7)


def test_unknown_names_list_what_is_accepted():
    with pytest.raises(ValueError, match="mlp, resnet"):
        build_model("vgg")
    with pytest.raises(ValueError, match="tiny, quick, full"):
        build_model("mlp", "huge")
    with pytest.raises(ValueError, match="dtr_eager"):
        get_method("offload")


def test_failures_map_to_statuses():
    assert classify(BudgetError("too small"))[0] == "infeasible"
    assert classify(ThrashError("thrash"))[0] == "infeasible"
    assert classify(NotBuilt("missing"))[0] == "not built"
    assert classify(ModuleNotFoundError("no module", name="dtr_compile.passes.plan"))[0] == "not built"
    assert classify(RuntimeError("boom")) == ("error", "RuntimeError: boom")
    # torch.compile wraps backend errors; the status comes from the cause.
    wrapped = RuntimeError("backend failed")
    wrapped.__cause__ = BudgetError("too small")
    assert classify(wrapped)[0] == "infeasible"


def test_grid_runs_baseline_first_and_budget_free_methods_once():
    grid = Grid(models=["mlp"], methods=["checkpoint", "dtr_eager", "eager"], budgets=[0.8, 0.5])
    assert grid.plan() == [
        ("mlp", "eager", None),
        ("mlp", "checkpoint", None),
        ("mlp", "dtr_eager", 0.8),
        ("mlp", "dtr_eager", 0.5),
    ]


def test_quick_grid_covers_three_models_three_budgets_every_method():
    grid, _ = parse_grid(["--quick"])
    plan = grid.plan()
    assert len({m for m, _, _ in plan}) >= 3
    assert len({b for _, _, b in plan if b is not None}) >= 3
    assert {meth for _, meth, _ in plan} == set(METHODS) - set(FRONTIER_ONLY)
    assert grid.size == "quick" and grid.steps >= 5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--models", "vgg"], "accepted: mlp"),
        (["--methods", "offload"], "accepted: eager"),
        (["--budgets", "0"], "fraction in"),
        (["--budgets", "abc"], "fraction in"),
        (["--steps", "2"], ">= 5"),
        (["--device", "tpu"], "expected cpu, cuda or cuda:N"),
    ],
)
def test_bad_command_lines_fail_with_what_is_accepted(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_grid(argv)
    assert message in capsys.readouterr().err


def test_device_defaults_to_cuda_when_present_and_cuda_without_it_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    grid, _ = parse_grid(["--quick"])
    assert grid.device == "cuda" and grid.clock == "wall"  # CPU time would miss the GPU's work
    assert grid.jobs == 1  # two runs sharing one GPU would time each other's kernels
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    grid, _ = parse_grid(["--quick"])
    assert grid.device == "cpu" and grid.clock == "cpu"
    with pytest.raises(SystemExit):
        parse_grid(["--device", "cuda"])
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "use --device cpu" in err


def _spec(tmp_path, method: str, budget_bytes: int | None = None) -> RunSpec:
    return RunSpec(
        model="mlp", size="tiny", method=method, budget=None if budget_bytes is None else 0.5,
        budget_bytes=budget_bytes, device="cpu", threads=1, warmup=1, steps=5, seed=0,
        reference=str(tmp_path / "ref.pt"), write_reference=(method == "eager"),
    )  # fmt: skip


def test_child_measures_the_baseline_and_compares_against_it(tmp_path):
    baseline = child.run(_spec(tmp_path, "eager"))
    assert baseline["status"] == "ok" and baseline["peak_bytes"] > 0 and len(baseline["step_times_s"]) == 5
    again = child.run(_spec(tmp_path, "checkpoint"))
    assert again["status"] == "ok" and again["correct"] is True and again["grad_err"] <= child.GRAD_RTOL


@pytest.mark.parametrize("method, missing", [("dtr_eager", "dtr_compile.runtime"), ("dtr_fx", "dtr_compile.backend")])
def test_a_method_whose_code_is_missing_is_not_built(tmp_path, monkeypatch, method, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # makes `import missing` raise ImportError
    result = child.run(_spec(tmp_path, method, budget_bytes=10**6))
    assert result["status"] == "not built" and missing in result["reason"]


def test_correctness_check_tolerates_rounding_noise_and_flags_real_differences(tmp_path):
    ref = str(tmp_path / "ref.pt")
    big, zero = torch.tensor([1.0, -2.0]), torch.tensor([5e-13, 0.0])  # `zero`: a gradient that is 0 in exact math
    child._save_reference(ref, 1.5, {"w": big, "key_bias": zero})
    assert child._compare(ref, 1.5, {"w": big * (1 + 1e-6), "key_bias": torch.tensor([-3e-13, 1e-13])})["correct"]
    wrong = child._compare(ref, 1.5, {"w": big * 1.01, "key_bias": zero})
    assert not wrong["correct"] and "w" in wrong["reason"]
    assert not child._compare(ref, 1.5, {"w": big * float("nan"), "key_bias": zero})["correct"]
    assert not child._compare(ref, 1.6, {"w": big, "key_bias": zero})["correct"]
    assert not child._compare(ref, 1.5, {"w": big, "key_bias": None})["correct"]


def test_explicit_models_lift_the_quick_restrictions():
    grid, _ = parse_grid(["--quick", "--models", "resnet", "--methods", "eager", "amb_inductor"])
    assert ("resnet", "amb_inductor", 0.5) in grid.plan()


def test_a_failing_run_is_an_error_row_with_its_traceback(tmp_path):
    result = child.run(_spec(tmp_path, "checkpoint"))  # no baseline was written: comparing fails
    assert result["status"] == "error" and "FileNotFoundError" in result["reason"]
    assert "Traceback" in result["traceback"]


def test_quick_times_with_the_cpu_clock_and_full_runs_with_the_wall_clock():
    assert parse_grid(["--quick"])[0].clock == "cpu"
    assert parse_grid([])[0].clock == "wall"
    assert parse_grid(["--quick", "--clock", "wall"])[0].clock == "wall"


def test_plan_summary_says_what_each_region_recomputes():
    """A frontier row carries backend="dtr"'s plan (passes/running_plans.summary), so a figure that misses its target says from
    the row alone what the plan recomputed (the FX code generator: compiled as fast as it plans)."""
    import dtr_compile
    from dtr_compile.passes import running_plans

    case = build_model("gpt2", "small", seed=0)
    (inputs, target), earlier = case.make_batch("cpu"), running_plans.summary()
    torch._dynamo.reset()
    with dtr_compile.config.patch(memory_budget=0.8, codegen="fx", plan_cache=False):
        compiled = torch.compile(case.model, backend="dtr")
        for _ in range(3):  # the first step calibrates the fraction
            case.model.zero_grad(set_to_none=True)
            case.loss_fn(compiled(*inputs), target).backward()
    summary = running_plans.summary()
    new = [part for part in summary.split(" | ") if part not in earlier.split(" | ")]
    assert len(new) == 1 and new[0].startswith("region"), summary
    assert "ms modelled" in new[0] and "planned" in new[0] and "recomputes " in new[0], new[0]
    assert "model held to 1.000 of it" in new[0], new[0]  # the FX model is exact: held to the budget itself
