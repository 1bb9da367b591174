"""Every GPU test runs in full fp32 (TF32 would make CUDA results differ from the reference by ~1e-3), with
fresh Dynamo state and an empty CUDA cache, all restored afterwards. Without CUDA the tests are skipped by
their marks (gpu_helpers.GPU) before this runs."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _fp32_and_fresh_state():
    if not torch.cuda.is_available():
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    torch._dynamo.reset()
    torch.cuda.empty_cache()
