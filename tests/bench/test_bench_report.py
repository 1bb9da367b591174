"""Report outputs from rows, without running anything: CSV round trip, table, BENCHMARKS markers, plot."""

from __future__ import annotations

from dtr_compile.bench.plot import pareto_plot
from dtr_compile.bench.report import (
    COLUMNS,
    benchmarks_section,
    markdown_table,
    read_csv,
    update_between_markers,
    write_csv,
)

ROWS = [
    {"model": "mlp", "size": "tiny", "method": "eager", "budget": None, "status": "ok", "peak_bytes": 2**20,
     "peak_ratio": 1.0, "step_s": 0.01, "time_ratio": 1.0, "correct": True, "device": "cpu",
     "device_name": "Test CPU (2 cores)", "threads": 1, "steps": 5, "warmup": 2},
    {"model": "mlp", "size": "tiny", "method": "dtr_eager", "budget": 0.5, "budget_bytes": 2**19, "status": "ok",
     "peak_bytes": 2**19, "peak_ratio": 0.5, "within_budget": True, "step_s": 0.02, "time_ratio": 2.0,
     "correct": False, "grad_err": 0.5, "device": "cpu", "runtime_stats": {"evictions": 3}},
    {"model": "mlp", "size": "tiny", "method": "dtr_fx", "budget": 0.5, "status": "not built",
     "reason": "NotBuilt: dtr_compile.backend is missing", "device": "cpu"},
]  # fmt: skip


def test_csv_round_trip_keeps_types(tmp_path):
    write_csv(ROWS, tmp_path / "r.csv")
    rows = read_csv(tmp_path / "r.csv")
    assert list(rows[0]) == list(COLUMNS)
    assert rows[0]["budget"] is None and rows[1]["budget"] == 0.5 and rows[1]["correct"] is False
    assert rows[1]["runtime_stats"] == '{"evictions": 3}'
    assert rows[2]["status"] == "not built"


def test_table_shows_statuses_and_wrong_gradients():
    table = markdown_table(ROWS)
    assert "not built: NotBuilt: dtr_compile.backend is missing" in table
    assert "**NO**" in table and "0.5 (0.5 MiB, met)" in table


def test_section_goes_between_device_markers_and_is_replaced_on_regeneration(tmp_path):
    target = tmp_path / "BENCHMARKS.md"
    target.write_text("# Benchmarks\n\nintro\n")
    update_between_markers(target, benchmarks_section(ROWS, {"command": "cmd-one"}), "cpu")
    update_between_markers(target, "cuda table", "cuda")
    update_between_markers(target, benchmarks_section(ROWS, {"command": "cmd-two"}), "cpu")
    text = target.read_text()
    assert text.startswith("# Benchmarks\n\nintro\n")
    assert "cmd-two" in text and "cmd-one" not in text and "cuda table" in text
    assert text.index("bench:cpu:end") < text.index("bench:cuda:start")
    assert "Test CPU (2 cores)" in text


def test_plot_is_written(tmp_path):
    pareto_plot(ROWS, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
