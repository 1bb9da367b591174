"""Operation logs in the DTR authors' format: the instructions, and a parser that checks them.

A log is JSON lines, one instruction each, after `{"INSTRUCTION": "ANNOTATE", "ANNOTATION": "START"}`:

    CONSTANT NAME                      then  MEMORY NAME MEMORY          a pinned input or parameter
    CALL NAME ARGS RESULT TIME         then, per result, MEMORY and ALIAS (-1 = fresh storage, k = aliases ARGS[k])
    MUTATE NAME ARGS MUTATE TIME       in-place op on ARGS[i] for i in MUTATE
    COPY DST SRC                       a new handle DST to the tensor SRC
    COPY_FROM DST SRC                  handle DST now refers to SRC (its old tensor loses a handle)
    RELEASE NAME                       a handle dies
    ANNOTATE BACKWARD                  backward begins

Numbers may be JSON numbers or strings of digits (the published logs use strings). TIME is in ns.
The parser checks structure and names (a name is defined once, used only while alive), so the replay
never meets a malformed instruction; every error names the file, the line and what was expected.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

from ..errors import LogFormatError

START = {"INSTRUCTION": "ANNOTATE", "ANNOTATION": "START"}
# The largest number a field may hold (MEMORY bytes, TIME ns, indices): 2**50 is a pebibyte or 13 days in ns.
# Bounding fields, and the sum of all MEMORY fields, keeps the replay's int64 and float arithmetic exact.
MAX_FIELD = 2**50
MAX_TOTAL_BYTES = 2**60


@dataclass(frozen=True)
class Constant:
    line: int
    name: str
    nbytes: int


@dataclass(frozen=True)
class Call:
    line: int
    op: str
    args: tuple[str, ...]
    results: tuple[str, ...]
    sizes: tuple[int, ...]  # bytes of each result as logged (an alias's size is ignored: it owns no memory)
    aliases: tuple[int, ...]  # -1 = fresh storage, k = shares the storage of args[k]
    time: int


@dataclass(frozen=True)
class Mutate:
    line: int
    op: str
    args: tuple[str, ...]
    mutated: tuple[int, ...]
    time: int


@dataclass(frozen=True)
class Copy:
    line: int
    dst: str
    src: str


@dataclass(frozen=True)
class CopyFrom:
    line: int
    dst: str
    src: str


@dataclass(frozen=True)
class Release:
    line: int
    name: str


@dataclass(frozen=True)
class Backward:
    line: int


Instruction = Constant | Call | Mutate | Copy | CopyFrom | Release | Backward


@dataclass(frozen=True)
class Trace:
    """A parsed log: its instructions in order, and where it came from (for messages)."""

    source: str
    instructions: tuple[Instruction, ...]

    @property
    def name(self) -> str:
        return os.path.basename(self.source)


def open_log(path: str | os.PathLike) -> IO[str]:
    """Open a `.log` or `.log.gz` file for reading text."""
    path = os.fspath(path)
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def parse_log(path: str | os.PathLike) -> Trace:
    """Parse and check one log file. Raises LogFormatError naming the line and what was expected."""
    path = os.fspath(path)
    try:
        with open_log(path) as stream:
            return parse_lines(stream, source=path)
    except (EOFError, gzip.BadGzipFile, zlib.error, UnicodeDecodeError) as exc:
        raise LogFormatError(
            f"{path}: cannot read the log ({exc}); the file is truncated or not a (gzipped) JSON-lines log"
        ) from exc


def parse_lines(lines: Iterator[str] | list[str], *, source: str = "<log>") -> Trace:
    """Parse log lines (with or without trailing newlines) into a checked Trace."""
    return Trace(source, tuple(_Parser(source).run(lines)))


class _Parser:
    """Reads records one by one; MEMORY and ALIAS records are consumed by the instruction they follow."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.records: Iterator[tuple[int, dict]] = iter(())
        self.live: set[str] = set()
        self.defined: set[str] = set()
        self.total_bytes = 0  # sum of the MEMORY fields read so far

    def run(self, lines: Iterator[str] | list[str]) -> Iterator[Instruction]:
        self.records = self._records(lines)
        first = next(self.records, None)
        if first is None:
            raise LogFormatError(f"{self.source}: the log is empty; expected the START annotation {json.dumps(START)}")
        lineno, record = first
        if record.get("INSTRUCTION") != "ANNOTATE" or record.get("ANNOTATION") != "START":
            self._fail(lineno, f"expected the START annotation {json.dumps(START)} first, got {_show(record)}")
        for lineno, record in self.records:
            yield self._instruction(lineno, record)

    # ---------------------------------------------------------------------------------------- records

    def _records(self, lines: Iterator[str] | list[str]) -> Iterator[tuple[int, dict]]:
        for lineno, text in enumerate(lines, start=1):
            text = text.strip()
            if not text:
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                self._fail(lineno, f"expected one JSON object per line ({exc.msg} at column {exc.colno})")
            except (ValueError, RecursionError) as exc:  # an integer of thousands of digits, nesting too deep
                self._fail(lineno, f"expected one flat JSON object per line, got a value JSON cannot read ({exc})")
            if not isinstance(record, dict) or "INSTRUCTION" not in record:
                self._fail(lineno, f"expected a JSON object with an INSTRUCTION field, got {_show(record)}")
            yield lineno, record

    def _follow(self, lineno: int, kind: str, name: str, owner: str) -> tuple[int, dict]:
        """The record that must come next: `kind` (MEMORY or ALIAS) for `name`."""
        nxt = next(self.records, None)
        if nxt is None:
            self._fail(lineno, f"{owner} must be followed by {kind} for {name!r}, but the log ends here (truncated?)")
        at, record = nxt
        if record.get("INSTRUCTION") != kind or record.get("NAME") != name:
            self._fail(at, f"expected {kind} for {name!r} (following {owner} on line {lineno}), got {_show(record)}")
        return at, record

    # ------------------------------------------------------------------------------------ instructions

    def _instruction(self, lineno: int, r: dict) -> Instruction:
        kind = r["INSTRUCTION"]
        if kind == "CONSTANT":
            name = self._str(lineno, r, "NAME")
            at, memory = self._follow(lineno, "MEMORY", name, "CONSTANT")
            self._define(lineno, name)
            return Constant(lineno, name, self._int(at, memory, "MEMORY", minimum=0))
        if kind == "CALL":
            return self._call(lineno, r)
        if kind == "MUTATE":
            args = self._names(lineno, r, "ARGS")
            mutated = tuple(
                self._int(lineno, {"MUTATE": m}, "MUTATE", minimum=0) for m in self._list(lineno, r, "MUTATE")
            )
            for index in mutated:
                if index >= len(args):
                    self._fail(lineno, f"MUTATE index {index} is out of range for {len(args)} ARGS")
            self._use(lineno, args)
            return Mutate(lineno, self._str(lineno, r, "NAME"), args, mutated, self._int(lineno, r, "TIME", minimum=0))
        if kind == "COPY":
            dst, src = self._str(lineno, r, "DST"), self._str(lineno, r, "SRC")
            self._use(lineno, (src,))
            self._define(lineno, dst)
            return Copy(lineno, dst, src)
        if kind == "COPY_FROM":
            dst, src = self._str(lineno, r, "DST"), self._str(lineno, r, "SRC")
            self._use(lineno, (dst, src))
            return CopyFrom(lineno, dst, src)
        if kind == "RELEASE":
            name = self._str(lineno, r, "NAME")
            self._use(lineno, (name,))
            self.live.discard(name)
            return Release(lineno, name)
        if kind == "ANNOTATE":
            if r.get("ANNOTATION") == "BACKWARD":
                return Backward(lineno)
            self._fail(lineno, f"expected ANNOTATION 'BACKWARD' after the start, got {_show(r)}")
        if kind in ("MEMORY", "ALIAS"):
            self._fail(lineno, f"{kind} for {r.get('NAME')!r} does not follow a CONSTANT or CALL that declares it")
        self._fail(
            lineno,
            f"unknown INSTRUCTION {kind!r}; expected CONSTANT, MEMORY, CALL, ALIAS, MUTATE, COPY, COPY_FROM, "
            "RELEASE or ANNOTATE",
        )

    def _call(self, lineno: int, r: dict) -> Call:
        op = self._str(lineno, r, "NAME")
        args = self._names(lineno, r, "ARGS")
        results = self._names(lineno, r, "RESULT")
        time = self._int(lineno, r, "TIME", minimum=0)
        self._use(lineno, args)
        sizes, aliases = [], []
        for name in results:
            at, memory = self._follow(lineno, "MEMORY", name, f"CALL {op!r}")
            sizes.append(self._int(at, memory, "MEMORY", minimum=0))
            at, alias = self._follow(at, "ALIAS", name, f"CALL {op!r}")
            index = self._int(at, alias, "ALIAS", minimum=-1)
            if index >= len(args):
                self._fail(at, f"ALIAS {index} of {name!r} is out of range: CALL {op!r} has {len(args)} ARGS")
            aliases.append(index)
        for name in results:
            self._define(lineno, name)
        return Call(lineno, op, args, results, tuple(sizes), tuple(aliases), time)

    # ------------------------------------------------------------------------------------ fields, names

    def _str(self, lineno: int, r: dict, key: str) -> str:
        value = r.get(key)
        if not isinstance(value, str) or not value:
            self._fail(lineno, f"{r['INSTRUCTION']} needs a non-empty string {key}, got {_show(r)}")
        return value

    def _list(self, lineno: int, r: dict, key: str) -> list:
        value = r.get(key)
        if not isinstance(value, list):
            self._fail(lineno, f"{r['INSTRUCTION']} needs a list {key}, got {_show(r)}")
        return value

    def _names(self, lineno: int, r: dict, key: str) -> tuple[str, ...]:
        names = self._list(lineno, r, key)
        if not all(isinstance(n, str) and n for n in names):
            self._fail(lineno, f"{r['INSTRUCTION']} {key} must be a list of tensor names, got {_show(r)}")
        return tuple(names)

    def _int(self, lineno: int, r: dict, key: str, *, minimum: int) -> int:
        value = r.get(key)
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                value = None
        if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= MAX_FIELD:
            self._fail(
                lineno,
                f"{r.get('INSTRUCTION', key)} needs an integer {key} in [{minimum}, 2**50], got {_show(r)}",
            )
        if key == "MEMORY":
            self.total_bytes += value
            if self.total_bytes > MAX_TOTAL_BYTES:
                self._fail(lineno, "the MEMORY fields so far add up to more than 2**60 bytes: the log is corrupt")
        return value

    def _define(self, lineno: int, name: str) -> None:
        if name in self.defined:
            self._fail(
                lineno, f"tensor name {name!r} is defined twice; every CONSTANT, RESULT and COPY DST needs a new name"
            )
        self.defined.add(name)
        self.live.add(name)

    def _use(self, lineno: int, names: tuple[str, ...]) -> None:
        for name in names:
            if name not in self.live:
                state = "was released before" if name in self.defined else "was never defined"
                self._fail(lineno, f"tensor {name!r} is used here but {state}")

    def _fail(self, lineno: int, message: str):
        raise LogFormatError(f"{self.source}, line {lineno}: {message}")


def _show(record: object) -> str:
    try:
        text = json.dumps(record, sort_keys=True)
    except (ValueError, TypeError, RecursionError):  # keys of mixed types cannot be sorted; nesting too deep
        text = f"a {type(record).__name__} JSON cannot show"
    return text if len(text) <= 160 else text[:157] + "..."
