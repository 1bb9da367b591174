"""The README's first command, `python -m dtr_compile.demo`, at its smallest settings; and its CLI errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dtr_compile import demo
from dtr_compile.measure import default_device


def test_demo_runs_and_prints_the_table():
    # The MLP needs no transformers (the test extra installs it, a bare install does not).
    cmd = [sys.executable, "-m", "dtr_compile.demo", "--model", "mlp", "--steps", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "peak MiB" in out and "peak/budget" in out and "median step" in out, out
    rows = {line.split("  ")[0]: line for line in out.splitlines()}
    assert "plain eager (no budget)" in rows, out
    runtime_row = rows.get("eager DTR runtime", "")
    assert runtime_row and "not run" not in runtime_row, out
    assert " ok " in runtime_row and "equal" in runtime_row, out  # measured peak within budget, same losses
    assert f"torch {torch.__version__}, {default_device()}" in out, out  # the default device, named


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budget", "-1"], "positive"),
        (["--budget", "12 parsecs"], "unknown unit"),
        (["--budget", "nan"], "positive finite"),
        (["--budget", "3"], "ambiguous"),
        (["--steps", "0"], "positive integer"),
        (["--steps", "two"], "positive integer"),
        (["--model", "vgg"], "invalid choice"),
        (["--threads", "0"], "positive integer"),
        (["--device", "tpu"], "expected cpu, cuda or cuda:N"),
    ],
)
def test_bad_arguments_fail_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_device_cuda_without_cuda_fails_before_any_work(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(demo, "run_eager", lambda *a: pytest.fail("the demo trained before checking --device"))
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--device", "cuda", "--model", "mlp"])
    assert exit_info.value.code == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_budget_argument_reads_fractions_and_bytes():
    assert demo.parse_budget_arg("0.5") == 0.5
    assert demo.parse_budget_arg("1") == 1.0
    assert demo.parse_budget_arg("300MB") == 300_000_000
    assert demo.parse_budget_arg("2000000B") == 2_000_000
