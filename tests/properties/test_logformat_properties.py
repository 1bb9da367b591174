"""Property tests of the operation-log parser and replay (issue 16): any sequence of lines, well-formed or
not, parses into a trace or raises `LogFormatError` naming the line, and a trace that parses replays under a
budget without another exception (a zlib traceback, OverflowError and RecursionError were seen)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from dtr_compile.errors import DTRError, LogFormatError
from dtr_compile.oplog.format import START, parse_lines
from dtr_compile.sim.replay import ReplayOptions, baseline, replay

NAMES = st.sampled_from(["a", "b", "c", "w", "x", ""]) | st.text(max_size=3)
NUMBERS = (
    st.integers(min_value=-2, max_value=300)
    | st.integers(min_value=2**49, max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.booleans()
    | st.none()
)
FIELD = NUMBERS | NUMBERS.map(str) | NAMES | st.lists(NAMES, max_size=3) | st.lists(NUMBERS, max_size=2)
KINDS = st.sampled_from(["CONSTANT", "MEMORY", "CALL", "ALIAS", "MUTATE", "COPY", "COPY_FROM", "RELEASE", "ANNOTATE"])


@st.composite
def records(draw) -> str:
    """A JSON line that is often plausible: a known INSTRUCTION with fields of the right names."""
    kind = draw(KINDS | st.text(max_size=4))
    keys = ["NAME", "ARGS", "RESULT", "TIME", "MEMORY", "ALIAS", "MUTATE", "DST", "SRC", "ANNOTATION"]
    record = {"INSTRUCTION": kind}
    for key in draw(st.lists(st.sampled_from(keys), max_size=5, unique=True)):
        record[key] = draw(FIELD | st.sampled_from(["BACKWARD", "START"]))
    return json.dumps(record)


LINES = records() | st.text(max_size=30) | st.sampled_from(["", "{}", "[]", "null", "[" * 5000, "{" * 3000])


def well_formed(draw_names: list[str]) -> list[str]:
    lines = [
        json.dumps(START),
        '{"INSTRUCTION":"CONSTANT","NAME":"w"}',
        '{"INSTRUCTION":"MEMORY","NAME":"w","MEMORY":64}',
    ]
    for i, name in enumerate(draw_names):
        arg = "w" if i == 0 else draw_names[i - 1]
        lines += [
            json.dumps({"INSTRUCTION": "CALL", "NAME": f"f{i}", "ARGS": [arg], "RESULT": [name], "TIME": str(i + 1)}),
            json.dumps({"INSTRUCTION": "MEMORY", "NAME": name, "MEMORY": str(32 * (i + 1))}),
            json.dumps({"INSTRUCTION": "ALIAS", "NAME": name, "ALIAS": "-1"}),
        ]
    return lines


def check(lines: list[str]) -> None:
    try:
        trace = parse_lines(lines, source="p.log")
    except LogFormatError as exc:
        assert str(exc).startswith("p.log")
        return
    base = baseline(trace)
    for ratio in (0.3, 1.0):
        try:
            replay(trace, ratio, ReplayOptions("dtr_eq_retain"), base)
        except DTRError:
            pass


@settings(max_examples=300, deadline=None)
@given(st.lists(LINES, max_size=8))
def test_any_lines_after_the_start_parse_or_raise_log_format_errors(lines: list[str]) -> None:
    check([json.dumps(START), *lines])


@settings(max_examples=300, deadline=None)
@given(
    names=st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=6, unique=True),
    edits=st.lists(st.tuples(st.integers(min_value=0, max_value=40), LINES | st.none()), max_size=3),
)
def test_a_valid_log_with_lines_changed_or_dropped_parses_or_raises_log_format_errors(names, edits) -> None:
    lines = well_formed(names)
    for position, line in edits:
        position %= len(lines)
        if line is None:
            del lines[position]
        else:
            lines[position] = line
        if not lines:
            break
    check(lines)
