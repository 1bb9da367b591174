"""The parser: structure, names, and errors that name the line and what was expected."""

from __future__ import annotations

import gzip

import pytest

from dtr_compile.errors import LogFormatError
from dtr_compile.sim.logformat import Call, Constant, Copy, CopyFrom, Mutate, Release, parse_lines, parse_log

START = '{"INSTRUCTION":"ANNOTATE","ANNOTATION":"START"}'


def parse(*lines: str):
    return parse_lines([START, *lines], source="t.log").instructions


def test_parses_every_instruction_with_string_or_int_numbers():
    ins = parse(
        '{"INSTRUCTION":"CONSTANT","NAME":"w"}',
        '{"INSTRUCTION":"MEMORY","NAME":"w","MEMORY":"64"}',
        '{"INSTRUCTION":"CALL","NAME":"split","ARGS":["w"],"RESULT":["a","b"],"TIME":"7"}',
        '{"INSTRUCTION":"MEMORY","NAME":"a","MEMORY":32}',
        '{"INSTRUCTION":"ALIAS","NAME":"a","ALIAS":"-1"}',
        '{"INSTRUCTION":"MEMORY","NAME":"b","MEMORY":"64"}',
        '{"INSTRUCTION":"ALIAS","NAME":"b","ALIAS":"0"}',
        '{"INSTRUCTION":"COPY","DST":"c","SRC":"a"}',
        '{"INSTRUCTION":"MUTATE","NAME":"add_","ARGS":["c","b"],"MUTATE":[0],"TIME":"3"}',
        '{"INSTRUCTION":"COPY_FROM","DST":"c","SRC":"b"}',
        '{"INSTRUCTION":"ANNOTATE","ANNOTATION":"BACKWARD"}',
        '{"INSTRUCTION":"RELEASE","NAME":"a"}',
    )
    assert ins[0] == Constant(2, "w", 64)
    assert ins[1] == Call(4, "split", ("w",), ("a", "b"), (32, 64), (-1, 0), 7)
    assert ins[2] == Copy(9, "c", "a")
    assert ins[3] == Mutate(10, "add_", ("c", "b"), (0,), 3)
    assert ins[4] == CopyFrom(11, "c", "b")
    assert ins[6] == Release(13, "a")


@pytest.mark.parametrize(
    "lines, expected",
    [
        ([], "the log is empty"),
        (['{"INSTRUCTION":"CONSTANT","NAME":"w"}'], "line 1: expected the START annotation"),
        ([START, '{"INSTRUCTION":"CONSTANT","NAME":"w"'], "line 2: expected one JSON object per line"),
        ([START, '{"INSTRUCTION":"CONSTANT","NAME":"w"}'], "line 2: CONSTANT must be followed by MEMORY for 'w'"),
        (
            [START, '{"INSTRUCTION":"CONSTANT","NAME":"w"}', '{"INSTRUCTION":"MEMORY","NAME":"v","MEMORY":"1"}'],
            "line 3: expected MEMORY for 'w'",
        ),
        ([START, '{"INSTRUCTION":"RELEASE","NAME":"w"}'], "line 2: tensor 'w' is used here but was never defined"),
        ([START, '{"INSTRUCTION":"FOO"}'], "line 2: unknown INSTRUCTION 'FOO'"),
        ([START, '{"INSTRUCTION":"MEMORY","NAME":"w","MEMORY":"1"}'], "line 2: MEMORY for 'w' does not follow"),
    ],
)
def test_malformed_logs_name_the_line_and_what_was_expected(lines, expected):
    with pytest.raises(LogFormatError, match=expected):
        parse_lines(lines, source="t.log")


def test_truncated_call_says_the_log_ends():
    lines = [
        '{"INSTRUCTION":"CONSTANT","NAME":"w"}',
        '{"INSTRUCTION":"MEMORY","NAME":"w","MEMORY":"8"}',
        '{"INSTRUCTION":"CALL","NAME":"mm","ARGS":["w"],"RESULT":["y"],"TIME":"1"}',
        '{"INSTRUCTION":"MEMORY","NAME":"y","MEMORY":"8"}',
    ]
    with pytest.raises(
        LogFormatError,
        match=r"t.log, line 5: CALL 'mm' must be followed by ALIAS for 'y', but the log "
        r"ends here \(truncated\?\)",
    ):
        parse_lines([START, *lines], source="t.log")


def test_use_after_release_and_bad_alias_index():
    constant = ['{"INSTRUCTION":"CONSTANT","NAME":"w"}', '{"INSTRUCTION":"MEMORY","NAME":"w","MEMORY":"8"}']
    with pytest.raises(LogFormatError, match="line 5: tensor 'w' is used here but was released before"):
        parse(*constant, '{"INSTRUCTION":"RELEASE","NAME":"w"}', '{"INSTRUCTION":"COPY","DST":"v","SRC":"w"}')
    call = '{"INSTRUCTION":"CALL","NAME":"view","ARGS":["w"],"RESULT":["v"],"TIME":"1"}'
    memory = '{"INSTRUCTION":"MEMORY","NAME":"v","MEMORY":"8"}'
    with pytest.raises(LogFormatError, match="line 6: ALIAS 1 of 'v' is out of range: CALL 'view' has 1 ARGS"):
        parse(*constant, call, memory, '{"INSTRUCTION":"ALIAS","NAME":"v","ALIAS":"1"}')


def test_truncated_gzip_file(tmp_path):
    path = tmp_path / "cut.log.gz"
    records = [
        f'{{"INSTRUCTION":"CONSTANT","NAME":"w{i}"}}\n{{"INSTRUCTION":"MEMORY","NAME":"w{i}","MEMORY":"8"}}'
        for i in range(2000)
    ]
    body = "\n".join([START, *records])
    data = gzip.compress(body.encode())
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(LogFormatError, match="cut.log.gz: cannot read the log"):
        parse_log(path)
