"""Writing operation logs in the format `oplog.format.parse_log` reads (and the DTR authors' simulator reads).

The torch runtime records a trace with it, so a user can run a model once and evaluate budgets and
heuristics offline with `python -m dtr_compile.sim`:

    with LogWriter("step.log.gz") as log:
        log.constant("w", 4096)
        log.call("mm", ["x", "w"], ["y"], [4096], [-1], time_ns=1200)
        log.release("x")

Numbers are written as strings of digits, like the published logs. The writer does not check names
(it sits on the runtime's hot path); the parser does, and names the offending line.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Sequence
from typing import IO, Self

from ..errors import ConfigError
from .format import START


class LogWriter:
    """Appends one JSON line per instruction, the START annotation first. Use as a context manager."""

    def __init__(self, target: str | os.PathLike | IO[str]) -> None:
        """`target`: a path (`.gz` means gzip) or an open text stream (left open by `close`)."""
        if not isinstance(target, (str, os.PathLike)) and not callable(getattr(target, "write", None)):
            raise ConfigError(
                f"log={target!r:.60} ({type(target).__name__}): expected a file path (str or os.PathLike; "
                "'.gz' compresses) or an open text stream with write()"
            )
        if isinstance(target, (io.RawIOBase, io.BufferedIOBase)):
            raise ConfigError("log= is a binary stream; open the file in text mode ('w') or pass its path")
        if isinstance(target, (str, os.PathLike)):
            path = os.fspath(target)
            # The writer outlives this call (it is the context manager): it closes the file in close().
            if path.endswith(".gz"):
                self._stream: IO[str] = gzip.open(path, "wt", encoding="utf-8")  # noqa: SIM115
            else:
                self._stream = open(path, "w", encoding="utf-8")  # noqa: SIM115
            self._owned = True
        else:
            self._stream = target
            self._owned = False
        self._closed = False
        self._emit(START)

    # ---------------------------------------------------------------------------------- instructions

    def constant(self, name: str, nbytes: int) -> None:
        """A pinned input, parameter or buffer of `nbytes` bytes."""
        self._emit({"INSTRUCTION": "CONSTANT", "NAME": name})
        self._emit({"INSTRUCTION": "MEMORY", "NAME": name, "MEMORY": str(int(nbytes))})

    def call(
        self,
        op_name: str,
        arg_names: Sequence[str],
        result_names: Sequence[str],
        result_sizes: Sequence[int],
        result_aliases: Sequence[int],
        time_ns: int,
    ) -> None:
        """An op that read `arg_names` and produced `result_names`; alias -1 = fresh storage, k = view of arg k."""
        if not len(result_names) == len(result_sizes) == len(result_aliases):
            raise ValueError(
                f"call {op_name!r}: {len(result_names)} result names, {len(result_sizes)} sizes and "
                f"{len(result_aliases)} aliases; give one size and one alias per result"
            )
        self._emit(
            {
                "INSTRUCTION": "CALL",
                "NAME": op_name,
                "ARGS": list(arg_names),
                "RESULT": list(result_names),
                "TIME": str(int(time_ns)),
            }
        )
        for name, size, alias in zip(result_names, result_sizes, result_aliases):
            self._emit({"INSTRUCTION": "MEMORY", "NAME": name, "MEMORY": str(int(size))})
            self._emit({"INSTRUCTION": "ALIAS", "NAME": name, "ALIAS": str(int(alias))})

    def mutate(self, op_name: str, arg_names: Sequence[str], mutated_indices: Sequence[int], time_ns: int) -> None:
        """An in-place op that wrote `arg_names[i]` for every i in `mutated_indices`."""
        self._emit(
            {
                "INSTRUCTION": "MUTATE",
                "NAME": op_name,
                "ARGS": list(arg_names),
                "MUTATE": [int(i) for i in mutated_indices],
                "TIME": str(int(time_ns)),
            }
        )

    def copy(self, dst: str, src: str) -> None:
        """A new handle `dst` to the tensor `src`."""
        self._emit({"INSTRUCTION": "COPY", "DST": dst, "SRC": src})

    def copy_from(self, dst: str, src: str) -> None:
        """The existing handle `dst` now refers to the tensor `src`."""
        self._emit({"INSTRUCTION": "COPY_FROM", "DST": dst, "SRC": src})

    def release(self, name: str) -> None:
        """The handle `name` died."""
        self._emit({"INSTRUCTION": "RELEASE", "NAME": name})

    def annotate_backward(self) -> None:
        """Backward begins."""
        self._emit({"INSTRUCTION": "ANNOTATE", "ANNOTATION": "BACKWARD"})

    # --------------------------------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Flush; close the file if the writer opened it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owned:
            self._stream.close()
        else:
            self._stream.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _emit(self, record: dict) -> None:
        if self._closed:
            raise ValueError("LogWriter is closed; create a new one to record another log")
        self._stream.write(json.dumps(record, sort_keys=True, separators=(",", ":")))
        self._stream.write("\n")
