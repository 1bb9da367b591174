"""End to end: the bench command on a tiny grid writes a CSV whose runs are correct and well-formed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dtr_compile.bench.methods import FRONTIER_ONLY, METHODS
from dtr_compile.bench.report import COLUMNS, read_csv
from dtr_compile.bench.spec import STATUSES
from dtr_compile.measure import default_device


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [
        sys.executable, "-m", "dtr_compile.bench", "--size", "tiny", "--models", "mlp",
        "--methods", "eager", "checkpoint", "amb_aot_eager", "--budgets", "0.5",
        "--warmup", "1", "--steps", "5", "--jobs", "2", "--timeout", "160", "--out", str(out),
    ]  # fmt: skip
    # Generous timeouts: a loaded shared machine slows the three children down; quiet, this takes ~20 s.
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_writes_every_output(tiny_run):
    out, _ = tiny_run
    for name in ("results.csv", "results.md", "pareto.png", "section.md", "run.json"):
        assert (out / name).stat().st_size > 0, name


def test_csv_has_the_documented_columns_and_one_row_per_run(tiny_run):
    out, _ = tiny_run
    header = (out / "results.csv").read_text().splitlines()[0].split(",")
    assert tuple(header) == COLUMNS
    rows = read_csv(out / "results.csv")
    assert [(r["method"], r["budget"]) for r in rows] == [("eager", None), ("checkpoint", None), ("amb_aot_eager", 0.5)]


def test_runs_are_ok_and_correct(tiny_run):
    out, _ = tiny_run
    for row in read_csv(out / "results.csv"):
        assert row["status"] in STATUSES
        assert row["status"] == "ok", row
        assert row["correct"] is True, row
        assert row["peak_bytes"] > 0 and row["step_s"] > 0
        assert row["device"] == default_device() and row["threads"] == 1 and row["steps"] == 5


def test_baseline_ratios_are_one(tiny_run):
    out, _ = tiny_run
    baseline = read_csv(out / "results.csv")[0]
    assert baseline["peak_ratio"] == pytest.approx(1.0) and baseline["time_ratio"] == pytest.approx(1.0)


def test_section_names_the_machine(tiny_run):
    out, _ = tiny_run
    rows = read_csv(out / "results.csv")
    section = (out / "section.md").read_text()
    assert rows[0]["device_name"] in section
    assert "torch.utils.checkpoint per block" in section


@pytest.mark.slow
def test_quick_grid_runs_every_method_and_every_ok_run_is_correct(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dtr_compile.bench", "--quick", "--out", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_csv(tmp_path / "results.csv")
    assert {r["method"] for r in rows} == set(METHODS) - set(FRONTIER_ONLY)
    assert len({r["model"] for r in rows if r["status"] == "ok"}) >= 3
    assert all(r["status"] in STATUSES for r in rows)
    assert all(r["correct"] for r in rows if r["status"] == "ok"), [r for r in rows if r["correct"] is False]
