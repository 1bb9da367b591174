"""The engine and the config import no torch: the log replay and the planner's callers rely on it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A meta-path finder that fails any import of torch (or its submodules), then the modules under test.
PROBE = textwrap.dedent(
    """
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch imported: {name}")
            return None

    sys.meta_path.insert(0, NoTorch())
    import {module}
    {use}
    loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
    assert not loaded, loaded
    print("ok")
    """
)


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    "module, use",
    [
        (
            "dtr_compile.engine",
            (
                "e = dtr_compile.engine.Engine(100); x = e.constant(10); e.reserve([x], 10, 'f'); "
                "e.record('f', [x], [10], 1.0); e.stats()"
            ),
        ),
        ("dtr_compile.config", "dtr_compile.config.memory_budget = '1GB'; dtr_compile.config.heuristic = 'dtr'"),
        ("dtr_compile", "dtr_compile.config.patch(memory_budget=0.5)"),
    ],
)
def test_module_imports_and_runs_without_torch(module: str, use: str) -> None:
    code = PROBE.replace("{module}", module).replace("{use}", use)
    result = run_python(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_probe_detects_a_torch_import() -> None:
    """The probe itself can fail: importing torch under it raises."""
    code = PROBE.replace("{module}", "json").replace("{use}", "import torch")
    result = run_python(code)
    assert result.returncode != 0 and "torch imported" in result.stderr
