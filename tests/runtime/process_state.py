"""A snapshot of the process state a training step may install, to check that every exit path restores it.

A step under the runtime (explicit `with rt:` or an implicit step of `backend="dtr"`) installs: the DTR
dispatch mode (and with it torch's Python dispatch key), saved-tensor hooks, a gc freeze, the thread's
current runtime, and the implicit runtime's open step. After the step, by any path (return, exception,
KeyboardInterrupt, BudgetError mid-backward, a forward with no backward, no_grad evaluation), all of them
must be as they were before it.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


@dataclass(frozen=True)
class ProcessState:
    mode_stack: tuple[str, ...]  # type names of the dispatch modes on this thread's stack
    python_key_included: bool  # torch's Python dispatch key enabled in this thread's TLS
    python_tls_key_included: bool  # PythonTLSSnapshot key
    saved_hooks_top: object  # the top saved-tensor hooks pair (None: none installed)
    gc_frozen: int  # gc.get_freeze_count()
    gc_enabled: bool
    current_step: object  # the Runtime whose step runs on this thread
    implicit_step_open: bool  # the implicit runtime's step is still marked active
    grad_enabled: bool


def snapshot() -> ProcessState:
    from dtr_compile.runtime.implicit import STEPS
    from dtr_compile.runtime.runtime import current_step

    keys = torch._C.DispatchKey
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return ProcessState(
        mode_stack=tuple(type(m).__name__ for m in _get_current_dispatch_mode_stack()),
        python_key_included=torch._C._dispatch_tls_is_dispatch_key_included(keys.Python),
        python_tls_key_included=torch._C._dispatch_tls_is_dispatch_key_included(keys.PythonTLSSnapshot),
        saved_hooks_top=None if top is None else tuple(id(h) for h in top),
        gc_frozen=gc.get_freeze_count(),
        gc_enabled=gc.isenabled(),
        current_step=current_step(),
        implicit_step_open=STEPS.running(),
        grad_enabled=torch.is_grad_enabled(),
    )


def assert_restored(before: ProcessState, what: str = "") -> None:
    """The process state now equals `before` (gc freeze count within a few objects: the count moves as
    unrelated objects are collected only when nothing is frozen, so it must be equal)."""
    after = snapshot()
    assert after == before, f"process state changed {what}:\n before {before}\n after  {after}"
    # A plain eager op must run (a dangling Python dispatch key makes it fail with an internal assert).
    x = torch.ones(3, requires_grad=True)
    (x * 2).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
