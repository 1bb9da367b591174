"""FSDP2 (`fully_shard` on each block, then the root, then `torch.compile(..., backend="dtr")`) on 2 gloo ranks.

FSDP2 runs on CPU with gloo in torch 2.13 (an `init_device_mesh("cpu", ...)` mesh). Under a memory budget it is
refused with `dtr_compile.distributed.UnsupportedWrapperError`, which says what to change: FSDP2 frees and
regathers parameters by resizing storages the runtime cannot see, and a rematerialized block read freed
parameters (NaN gradients measured at 0.6; dtr_compile/distributed.py has the figures). What is tested: with no
budget the compiled FSDP2 model's gradients equal eager FSDP2's on each rank, and a budgeted step raises that
error on each rank and leaves no runtime mode or Python dispatch key behind. One 2-rank run, about 25 s.
"""

from __future__ import annotations

import pytest
import torch

from .ranks import run_ranks
from .workers import Spec, fsdp2_under_dtr

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")


def test_fsdp2_without_budget_matches_eager_and_is_refused_under_one() -> None:
    results = run_ranks(fsdp2_under_dtr, Spec(wrapper="fsdp2", model="mlp", budgets=(0.5,)))
    for rank, result in enumerate(results):
        assert result["grad_diff"] <= 1e-5 * max(result["grad_scale"], 1e-3), f"rank {rank}: {result}"
        assert "fully_shard" in result["error"] and "memory_budget = None" in result["error"], (rank, result)
        assert result["modes_left"] == 0 and not result["python_key"], f"rank {rank} left runtime state: {result}"
