"""The writer the runtime records with, round-tripped through the parser and the replay; the command line."""

from __future__ import annotations

import json
import os

import pytest

from dtr_compile.errors import ConfigError
from dtr_compile.oplog.format import Call, Constant, Mutate, Release, parse_log
from dtr_compile.oplog.writer import LogWriter
from dtr_compile.sim.cli import main
from dtr_compile.sim.replay import ReplayOptions, baseline, replay

LOGS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "dtr-logs")
RESNET = os.path.join(LOGS, "resnet32-56-9000000000.0-2020-10-1-13-3-30-default.log.gz")


def record(path) -> None:
    with LogWriter(path) as log:
        log.constant("w", 10)
        log.call("fa", ["w"], ["a"], [100], [-1], 100)
        log.call("fb", ["w"], ["b"], [100], [-1], 1)
        log.call("view", ["b"], ["bv"], [100], [0], 0)
        log.call("fc", ["w"], ["c"], [100], [-1], 100)
        log.call("fd", ["w"], ["d"], [100], [-1], 100)
        log.release("d")
        log.mutate("relu_", ["c"], [0], 5)
        log.annotate_backward()
        log.call("fe", ["bv"], ["e"], [100], [-1], 10)
        for name in ("a", "b", "bv", "c", "w"):
            log.release(name)


@pytest.mark.compat
@pytest.mark.parametrize("suffix", [".log", ".log.gz"])
def test_writer_parser_replay_round_trip(tmp_path, suffix):
    path = tmp_path / f"step{suffix}"
    record(path)
    trace = parse_log(path)
    assert trace.instructions[0] == Constant(2, "w", 10)
    assert trace.instructions[3] == Call(10, "view", ("b",), ("bv",), (100,), (0,), 0)
    assert Mutate(20, "relu_", ("c",), (0,), 5) in trace.instructions
    assert trace.instructions[-1] == Release(29, "w")
    base = baseline(trace)
    assert (base.peak_bytes, base.compute) == (410, 316)  # w a b c d; later w a b c c' during relu_
    result = replay(trace, 320 / 410, ReplayOptions("dtr_eq"), base)
    # Before fd: b (cost 1) goes; fe brings b back, re-runs the view bv that b's eviction discarded (cost 0,
    # the second recompute) and, for e, evicts a (stalest) rather than c' (fresh).
    assert (result.status, result.evictions, result.remats) == ("ok", 2, 2)
    assert result.overhead == pytest.approx(317 / 316)


def test_writer_rejects_mismatched_results():
    with pytest.raises(ValueError, match="one size and one alias per result"):
        LogWriter(os.devnull).call("f", [], ["a", "b"], [1], [-1], 1)


@pytest.mark.compat
def test_cli_json_lines(tmp_path, capsys):
    path = tmp_path / "step.log"
    record(path)
    assert main([str(path), "--ratios", "0.9,0.1", "--heuristic", "dtr_eq,dtr_eq_dead", "--json", "--jobs", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["heuristic"], r["ratio"], r["status"]) for r in rows] == [
        ("dtr_eq", 0.9, "ok"),
        ("dtr_eq", 0.1, "oom"),
        ("dtr_eq_dead", 0.9, "ok"),
        ("dtr_eq_dead", 0.1, "oom"),
    ]
    keys = {"log", "ratio", "heuristic", "status", "overhead", "budget_bytes", "peak_bytes", "evictions", "remats"}
    assert keys <= set(rows[0])
    assert rows[0]["budget_bytes"] == int(410 * 0.9) and rows[0]["peak_bytes"] <= rows[0]["budget_bytes"]
    # The bounds of each cell: 0.1 is below the memory bound (210 B); at 0.9, a (never read again) can go for free.
    assert rows[1]["proven_infeasible"] and rows[1]["min_recompute"] is None
    assert rows[0]["proven_infeasible"] is False and rows[0]["min_recompute"] == 0.0
    assert rows[0]["infeasible_below"] == pytest.approx(210 / 410)


def test_cli_table_and_errors(tmp_path, capsys):
    path = tmp_path / "step.log"
    record(path)
    assert main([str(path), "--ratios", "0.1,1.0", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "memory lower bound 210 B = 0.512 x peak" in out
    assert "memory and recompute bounds: every ratio below 0.5121 is infeasible" in out
    assert out.splitlines()[-1].split() == ["bound", "infeasible", ">=1.000"]
    broken = tmp_path / "broken.log"
    broken.write_text(path.read_text().replace('"ALIAS":"0"', '"ALIAS":"7"'))
    assert main([str(broken), "--jobs", "1"]) == 2
    assert "broken.log, line 12: ALIAS 7 of 'bv' is out of range" in capsys.readouterr().err
    assert main([str(path), "--heuristic", "nope"]) == 2
    assert "--heuristic 'nope' is unknown" in capsys.readouterr().err


def test_cli_views_free_charges_no_view_rerun(tmp_path, capsys):
    path = tmp_path / "step.log"
    record(path)
    args = [str(path), "--ratios", str(320 / 410), "--heuristic", "dtr_eq", "--json", "--jobs", "1"]
    assert main(args) == 0 and main([*args, "--views", "free"]) == 0
    rerun, free = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert (rerun["remats"], free["remats"]) == (2, 1)  # b, and its view bv only when views are re-run


@pytest.mark.skipif(not os.path.exists(RESNET), reason="the shared DTR logs are not checked out beside the repo")
def test_resnet_log_reproduces_the_reference_and_the_default_beats_it():
    # reference-simrd.md: DTREqClass reaches 1.332 on ResNet-32 at ratio 0.2 and 1.107 at 0.5.
    trace = parse_log(RESNET)
    base = baseline(trace)
    for ratio, expected in ((0.2, 1.332), (0.5, 1.107)):
        result = replay(trace, ratio, ReplayOptions("dtr_eq"), base)
        assert result.status == "ok" and round(result.overhead, 3) == expected
        assert result.peak_bytes <= result.budget_bytes
    ours = replay(trace, 0.2, ReplayOptions("dtr_eq_retain"), base)
    assert ours.status == "ok" and ours.overhead < 1.332


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--min-evictable-fraction", "nan"], "--min-evictable-fraction: min_evictable_fraction=nan; expected"),
        (["--min-evictable-fraction=-3"], "--min-evictable-fraction: min_evictable_fraction=-3.0; expected"),
        (["--min-evictable-fraction", "lots"], "expected a float in [0, 1)"),
        (["--seed", "-1"], "--seed: random_seed=-1; expected a non-negative int"),
        (["--seed", "x"], "invalid int value: 'x'"),
        (["--ratios", "nan"], "every ratio must be in (0, 1]"),
        (["--views", "all"], "invalid choice"),
    ],
)
def test_cli_refuses_bad_flags_with_one_line_and_status_2(tmp_path, capsys, args, fragment):
    """The command takes the same values config takes (one validator), and says so in one line (class 8)."""
    path = tmp_path / "step.log"
    record(path)
    try:
        status = main([str(path), "--jobs", "1", *args])
    except SystemExit as exit:  # argparse's own checks (types, choices) exit from inside parse_args
        status = exit.code
    assert status == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_a_corrupt_log_is_one_line_and_status_2(tmp_path, capsys):
    path = tmp_path / "bad.log.gz"
    path.write_bytes(b"\x1f\x8b\x08\x00" + b"\xff" * 64)
    assert main([str(path), "--jobs", "1"]) == 2
    err = capsys.readouterr().err
    assert "bad.log.gz: cannot read the log" in err and len(err.strip().splitlines()) == 1


def test_writer_refuses_a_target_it_cannot_write():
    with pytest.raises(ConfigError, match="log=123"):
        LogWriter(123)
