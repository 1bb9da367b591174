"""Session setup shared by every test directory.

Triton decides at import whether its kernels run compiled or in its CPU interpreter, and importing
torch._dynamo imports triton when it is installed; so TRITON_INTERPRET=1 has to be in the environment before
any test module loads, for the kernel tests (tests/kernels) to run Triton kernels on CPU tensors. Without a
GPU it changes nothing else: Inductor's CPU code generator does not use Triton. An explicit TRITON_INTERPRET
in the environment is left as it is.

Every test starts and ends with no dtr_compile dispatch mode on the stack, and with no plan kept in memory by the
plan cache (passes/plan_cache.py), whose on-disk store is a fresh directory per test: every test plans afresh (a
plan and its measured peak kept by an earlier test would otherwise stand in for the compile a test checks).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("DTR_COMPILE_CACHE_DIR", tempfile.mkdtemp(prefix="dtr-plans-"))  # child processes too


@pytest.fixture(autouse=True)
def _no_plan_kept(tmp_path_factory):
    # Not through `monkeypatch`: a test's own monkeypatch (sys.modules entries among them) must be undone
    # before the fixtures below run their checks, and this fixture's would be undone after them.
    from dtr_compile.passes import plan_cache

    plan_cache.clear_memory()
    before = os.environ[plan_cache.ENV_DIR]
    os.environ[plan_cache.ENV_DIR] = str(tmp_path_factory.mktemp("plans"))
    yield
    os.environ[plan_cache.ENV_DIR] = before


@pytest.fixture(autouse=True)
def _no_runtime_left_active():
    yield
    from dtr_compile.runtime import finish_steps
    from dtr_compile.runtime.dispatch import DTRMode

    finish_steps()  # a compiled model's last step leaves its (inert) mode until the next optimizer step
    left = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, DTRMode)]
    assert not left, f"a dtr_compile dispatch mode is still active after the test: {left}"
