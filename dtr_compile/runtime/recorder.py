"""Recording what the runtime runs as an operation log (the DTR authors' format, dtr_compile.sim's input).

    with dtr_compile.runtime.enable(memory_budget=None, log="step.log.gz"):
        model(x).sum().backward()
    # python -m dtr_compile.sim step.log.gz --ratios 0.3,0.5 --heuristic dtr_eq

Every handle (a tensor an op returned, or one autograd saved) is a log name; outside tensors (parameters, inputs) are
CONSTANTs; a call's results are fresh storages or aliases of an argument; an in-place write of a
runtime tensor is a MUTATE; a handle's death is a RELEASE; the first call made by the autograd engine
marks ANNOTATE BACKWARD. Times are the measured wall time of each op in ns.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import IO

from ..engine import Storage
from ..oplog.writer import LogWriter
from .backward_pass import in_backward_pass


class TraceRecorder:
    """Turns runtime events into log instructions. Owned by one Runtime."""

    def __init__(self, target: str | os.PathLike | IO[str]) -> None:
        self.writer = LogWriter(target)
        self._counter = 0
        self._constant_names: dict[int, str] = {}  # storage sid -> name
        self._in_backward = False

    def new_name(self) -> str:
        self._counter += 1
        return f"t{self._counter}"

    def begin_step(self) -> None:
        self._in_backward = False

    def constant_name(self, storage: Storage) -> str:
        name = self._constant_names.get(storage.sid)
        if name is None:
            name = self._constant_names[storage.sid] = f"c{storage.sid}"
            self.writer.constant(name, storage.nbytes)
        return name

    def call(
        self,
        op_name: str,
        arg_names: Sequence[str],
        result_names: Sequence[str],
        result_sizes: Sequence[int],
        result_aliases: Sequence[int],
        mutated: Sequence[int],
        seconds: float,
    ) -> None:
        self._mark_backward()
        time_ns = int(seconds * 1e9)
        if mutated:
            self.writer.mutate(op_name, arg_names, mutated, time_ns)
            time_ns = 0  # the mutation carried the op's time; its fresh results (if any) come for free
        if result_names or not mutated:
            self.writer.call(op_name, arg_names, result_names, result_sizes, result_aliases, time_ns)

    def copy(self, dst: str, src: str) -> None:
        """A new handle `dst` on the tensor `src` (a tensor autograd saved for the backward)."""
        self.writer.copy(dst, src)

    def release(self, name: str) -> None:
        self.writer.release(name)

    def close(self) -> None:
        self.writer.close()

    def _mark_backward(self) -> None:
        if not self._in_backward and in_backward_pass():
            self._in_backward = True
            self.writer.annotate_backward()
