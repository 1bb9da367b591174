"""The parser: structure, names, and errors that name the line and what was expected."""

from __future__ import annotations

import gzip

import pytest

from dtr_compile.errors import LogFormatError
from dtr_compile.oplog.format import Call, Constant, Copy, CopyFrom, Mutate, Release, parse_lines, parse_log

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


def test_corrupt_gzip_body_is_a_log_format_error(tmp_path):
    """A gzip header over a damaged body gave a zlib traceback (issue 16, class 8)."""
    path = tmp_path / "bad.log.gz"
    data = gzip.compress((START + "\n" + '{"INSTRUCTION":"RELEASE","NAME":"x"}\n' * 500).encode())
    path.write_bytes(data[:20] + b"\xff" * 30 + data[50:])
    with pytest.raises(LogFormatError, match="bad.log.gz: cannot read the log"):
        parse_log(path)


@pytest.mark.parametrize("memory", [10**400, 2**50 + 1, '"' + "9" * 30 + '"'])
def test_a_memory_field_beyond_any_device_is_refused(memory):
    """A huge MEMORY reached the replay's int64 arrays as an OverflowError."""
    with pytest.raises(LogFormatError, match=r"t.log, line 3: MEMORY needs an integer MEMORY in \[0, 2\*\*50\]"):
        parse('{"INSTRUCTION":"CONSTANT","NAME":"w"}', f'{{"INSTRUCTION":"MEMORY","NAME":"w","MEMORY":{memory}}}')


def test_memory_fields_that_add_up_beyond_any_device_are_refused():
    lines = []
    for i in range(1025):
        lines += [
            f'{{"INSTRUCTION":"CONSTANT","NAME":"w{i}"}}',
            f'{{"INSTRUCTION":"MEMORY","NAME":"w{i}","MEMORY":{2**50}}}',
        ]
    with pytest.raises(LogFormatError, match="add up to more than 2"):
        parse(*lines)


@pytest.mark.parametrize("line", ["[" * 100_000 + "]" * 100_000, '{"INSTRUCTION":' + "1" * 5000 + "}"])
def test_a_line_json_cannot_read_is_a_log_format_error(line):
    """A deeply nested line raised RecursionError; a 5000-digit number raises ValueError in json."""
    with pytest.raises(LogFormatError, match="t.log, line 2: expected one flat JSON object per line"):
        parse(line)
