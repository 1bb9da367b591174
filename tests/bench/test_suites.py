"""The suites of `python -m dtr_compile.bench <suite>` (issue 18): listed by --help, strict about their flags,
and the cheapest ones run end to end at their smallest size."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dtr_compile.bench import cli
from dtr_compile.bench.suites import SUITES
from dtr_compile.bench.timing import interleaved, median, timed, warm_then_time


def test_help_lists_every_suite_with_one_line_each(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for name, suite in SUITES.items():
        lines = [line for line in text.splitlines() if line.startswith(f"  {name} ")]
        assert len(lines) == 1, (name, lines)
        assert suite.SUMMARY in lines[0]
    assert "--frontier" in text and "--quick" in text


# What a suite requires, so that the bad flag is the only thing wrong.
REQUIRED = {"simrd-reference": ["some.log", "--simrd", ".", "--ratios", "0.5"], "replay": ["some.log"]}


@pytest.mark.parametrize("name", SUITES)
def test_a_suite_rejects_a_bad_flag_with_status_2(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([name, *REQUIRED.get(name, []), "--no-such-flag"])
    assert exit_info.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err


@pytest.mark.parametrize("name", SUITES)
def test_a_suite_answers_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        SUITES[name].main(["--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_the_timing_loop_interleaves_and_takes_medians():
    order = "".join(interleaved(["a", "b", "c"], 2, rotate=True))
    assert order == "abcbca"
    assert "".join(interleaved(["a", "b"], 2, per_round=2)) == "aabbaabb"
    calls = []
    warmups, samples = warm_then_time(lambda: calls.append("step"), 1, 3, setup=lambda: calls.append("setup"))
    assert len(warmups) == 1 and len(samples) == 3 and calls == ["setup", "step"] * 4
    result, sample = timed(lambda: 7)
    assert result == 7 and sample.wall_s >= 0 and sample.cpu_s >= 0
    assert median([3.0, 1.0, 2.0]) == 2.0 and median([]) != median([])  # NaN for no samples


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dtr_compile.bench", *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)


def test_runtime_overhead_at_a_small_size_writes_its_tables(tmp_path):
    out = tmp_path / "runtime.md"
    # Small enough for seconds, large enough that 0.5 of the peak is a feasible budget for the runtime.
    proc = _run("runtime-overhead", "--layers", "4", "--width", "32", "--heads", "2", "--seq", "128", "--batch", "4",
                "--vocab", "64", "--steps", "2", "--threads", "1", "--skip-memory", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = out.read_text()
    assert "Command: `python -m dtr_compile.bench runtime-overhead --layers 4" in text
    rows = [line for line in text.splitlines() if line.startswith(("| runtime", "| plain eager"))]
    assert len(rows) == 3 and all(line.endswith("| yes |") for line in rows), rows  # losses equal to eager's


def test_kernels_structure_counts_launches_on_the_graphs():
    proc = _run("kernels", "--structure", "--layers", "2", "--dim", "64", "--heads", "4", "--seq", "32", "--batch", "4",
                "--budget", "0.7")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| fused / op by op |" in proc.stdout


@pytest.mark.slow
def test_handoff_on_one_model_and_budget(tmp_path):
    out = tmp_path / "handoff.md"
    proc = _run("handoff", "--models", "moe", "--size", "test", "--budgets", "0.5", "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| (")]
    assert len(rows) == 3 and all("| yes |" in line for line in rows), rows
