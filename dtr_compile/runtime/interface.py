"""`RuntimeInterface`: what the runtime's helpers use of the `Runtime` they serve.

A step is run by helpers the Runtime (runtime.py) hands itself to: the dispatch mode (dispatch.py), the
saved-tensor hooks (saved.py), the registration of an operation's outputs (operations.py), the memory of RNG
states (rng_memory.py) and compiled parts (compiled_ops.py). Naming the `Runtime` class in their annotations
would make each import runtime.py, which imports them: an import circle, even when the import stands under
`if TYPE_CHECKING:` (issue 18: a newcomer reading one file must not need the other first). This protocol names
what they read and update instead, one level below both: runtime.py imports the helpers, the helpers import
this, and a Runtime fits it without saying so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, Self

import torch

from ..engine import Engine, Storage
from .constants import ConstantRegistry
from .handles import HandleCell, StorageIndex
from .recipe import TorchExecutor
from .recorder import TraceRecorder
from .sizes import OutputSizer
from .tails import TailMeter


class RuntimeInterface(Protocol):
    """The state and services of one runtime that its helpers use (`Runtime` documents each)."""

    engine: Engine  # the torch-free engine that accounts, evicts and recomputes the step's storages
    index: StorageIndex  # torch storage -> its current engine version, and the handles on it
    constants: ConstantRegistry  # outside tensors (parameters, inputs) as pinned engine storages
    sizes: OutputSizer  # each call's predicted output bytes and workspace, cached by signature
    tails: TailMeter  # measures what each region's loss holds between its forward and backward
    executor: TorchExecutor  # reruns recipes; counts compiled-region reruns and parts run op by op
    recorder: TraceRecorder | None  # the operation log, when one is recorded
    measure_costs: bool  # an op's cost to the engine is its measured time (else the roofline estimate)
    compute_seconds: float  # the helpers add the wall time of each original op they run
    failed: bool  # set by a helper when an operation of the step raised
    in_backward: bool  # a backward pass has run in this step
    on_backward: Callable[[Self], None] | None  # told when a backward pass runs in a step

    @property
    def _mode(self) -> object:
        """The dispatch mode of the running step (None between steps). Private to the Runtime; the dispatch
        mode compares itself with it to tell its own step from an ended one that left it on a mode stack."""
        ...

    @property
    def active(self) -> bool: ...

    def backward_began(self) -> None: ...

    def ensure_resident(self, storages: Iterable[Storage]) -> None: ...

    def note_handle(self, tensor: torch.Tensor, cell: HandleCell) -> None: ...

    def cell_of(self, tensor: torch.Tensor) -> HandleCell | None: ...

    def log_name(self, tensor: torch.Tensor, storage: Storage) -> str: ...
