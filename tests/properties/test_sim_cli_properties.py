"""Property test of `python -m dtr_compile.sim`'s flags (issue 16, class 8): any values given to its flags end
in a result (status 0) or in one line on stderr with status 2, never a traceback. `--min-evictable-fraction nan`
and `-3` were accepted where `config` refuses them; the command now shares config's validators."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from dtr_compile import config
from dtr_compile.errors import ConfigError
from dtr_compile.oplog.writer import LogWriter
from dtr_compile.sim.cli import main

_LOG = os.path.join(tempfile.mkdtemp(prefix="dtr-sim-cli-"), "step.log")
with LogWriter(_LOG) as _log:
    _log.constant("w", 64)
    _log.call("f", ["w"], ["a"], [128], [-1], 10)
    _log.call("g", ["a"], ["b"], [128], [-1], 10)
    _log.release("a")

TEXT = st.text(st.characters(codec="ascii", exclude_characters="\x00"), max_size=12)
VALUES = TEXT | st.sampled_from(["nan", "inf", "-3", "0", "1", "0.5", "1e400", "-0", "all", "sqrt", "2", "", " "])


def _config_accepts_fraction(text: str) -> bool:
    try:
        config.validate("min_evictable_fraction", float(text))
    except (ValueError, ConfigError):
        return False
    return True


FLAGS = st.sampled_from(
    ["--ratios", "--heuristic", "--sampling", "--min-evictable-fraction", "--views", "--seed", "--reference"]
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(FLAGS, VALUES), max_size=3))
def test_any_flag_values_give_a_result_or_one_line_and_status_2(flags) -> None:
    argv = [_LOG, "--jobs", "1", "--json"]
    for flag, value in flags:
        argv.append(f"{flag}={value}")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = main(argv)
        except SystemExit as exit:  # argparse's own checks exit from parse_args
            status = exit.code
    assert status in (0, 2), (argv, status)
    fractions = [value for flag, value in flags if flag == "--min-evictable-fraction"]
    if fractions and not _config_accepts_fraction(fractions[-1]):  # the last occurrence of a flag wins
        assert status == 2, f"{argv}: config refuses {fractions[-1]!r} as min_evictable_fraction, the command must too"
    if status == 2:
        lines = err.getvalue().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err.getvalue(), (argv, lines)
