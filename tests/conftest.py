"""Shared test setup: every test starts and ends with no dtr_compile dispatch mode on the stack."""

from __future__ import annotations

import pytest
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


@pytest.fixture(autouse=True)
def _no_runtime_left_active():
    yield
    from dtr_compile.runtime import finish_steps
    from dtr_compile.runtime.dispatch import DTRMode

    finish_steps()  # a compiled model's last step leaves its (inert) mode until the next optimizer step
    left = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, DTRMode)]
    assert not left, f"a dtr_compile dispatch mode is still active after the test: {left}"
