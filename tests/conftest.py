"""Session setup shared by every test directory.

Triton decides at import whether its kernels run compiled or in its CPU interpreter, and importing
torch._dynamo imports triton when it is installed; so TRITON_INTERPRET=1 has to be in the environment before
any test module loads, for the kernel tests (tests/kernels) to run Triton kernels on CPU tensors. Without a
GPU it changes nothing else: Inductor's CPU code generator does not use Triton. An explicit TRITON_INTERPRET
in the environment is left as it is.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
