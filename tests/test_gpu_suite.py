"""The GPU suite (tests/gpu) imports and collects on a machine without CUDA, and skips every test, saying why.

Nothing else runs those files where there is no GPU: this keeps a renamed helper or a bad import from going
unnoticed until the suite meets a GPU. Where CUDA is present the suite itself runs (`pytest -m gpu tests/gpu`).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GPU_SUITE = Path(__file__).resolve().parent / "gpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the GPU suite runs for real: pytest -m gpu tests/gpu")
def test_gpu_suite_collects_and_skips_cleanly_without_cuda() -> None:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", str(GPU_SUITE), "-q", "-rs", "-p", "no:cacheprovider"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, cwd=GPU_SUITE.parents[1])
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    summary = re.search(r"(\d+) skipped", out)
    assert summary and int(summary.group(1)) >= 10, out[-3000:]
    assert not re.search(r"\d+ (passed|failed|errors?)\b", out), out[-3000:]
    reasons = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert reasons and all("needs a CUDA device" in line for line in reasons), reasons
