"""The reference tables printed beside ours: several files merged, and the claim the fine one supports."""

from __future__ import annotations

import json
import os

import pytest

from dtr_compile.errors import LogFormatError
from dtr_compile.oplog.format import parse_log
from dtr_compile.sim.reference import load_reference
from dtr_compile.sim.replay import ReplayOptions, baseline, replay

LOGS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "dtr-logs")
FINE = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "reference-simrd-fine.md")

PUBLISHED = """\
```
ResNet-32 (56)
  heur               0.1    0.2
  DTREqClass         OOM  1.332
  DTR             thrash  1.371
```
"""
FINER = """\
Some prose before the table.

```
ResNet-32 (56)
  heur          0.14   0.15
  DTREqClass  thrash  1.432
```
"""


def write_reference(folder, text: str, *, manifest: bool) -> str:
    folder.mkdir(exist_ok=True)
    if manifest:
        models = [{"name": "ResNet-32 (56)", "log": "resnet.log.gz"}]
        (folder / "manifest.json").write_text(json.dumps({"models": models}))
    path = folder / "reference.md"
    path.write_text(text)
    return str(path)


def test_reference_files_merge_by_model_heuristic_and_ratio(tmp_path):
    published = write_reference(tmp_path / "shared", PUBLISHED, manifest=True)
    finer = write_reference(tmp_path / "bench", FINER, manifest=False)  # uses the other file's manifest
    table = load_reference([published, finer])
    assert table.row("resnet.log.gz", "DTREqClass") == {0.1: "oom", 0.2: "1.332", 0.14: "thrash", 0.15: "1.432"}
    assert table.row("resnet.log.gz", "DTR") == {0.1: "thrash", 0.2: "1.371"}
    assert table.row("other.log.gz", "DTREqClass") is None


def test_a_reference_file_no_manifest_maps_to_a_log_is_an_error(tmp_path):
    finer = write_reference(tmp_path / "bench", FINER, manifest=False)
    with pytest.raises(LogFormatError, match="ResNet-32 \\(56\\).*manifest.json"):
        load_reference(finer)


@pytest.mark.skipif(not os.path.isdir(LOGS), reason="the shared DTR logs are not checked out beside the repo")
@pytest.mark.parametrize(
    "model, ratio",
    [("resnet32", 0.14), ("transformer", 0.15), ("tv_densenet121", 0.15)],
)
def test_the_default_succeeds_where_the_reference_fails_between_the_published_ratios(model, ratio):
    # BENCHMARKS.md section 2: on these three logs the published table has the reference failing only at 0.1, and
    # us too; at these ratios the authors' simulator (benchmarks/reference-simrd-fine.md) fails and we do not.
    [log] = [name for name in os.listdir(LOGS) if name.startswith(model)]
    reference = load_reference([os.path.join(LOGS, "reference-simrd.md"), FINE])
    assert reference.row(log, "DTREqClass")[ratio] in ("oom", "thrash")

    trace = parse_log(os.path.join(LOGS, log))
    result = replay(trace, ratio, ReplayOptions("dtr_eq_retain"), baseline(trace))
    assert result.status == "ok" and result.overhead < 2.0
    assert result.peak_bytes <= result.budget_bytes


def test_the_command_prints_merged_reference_rows_and_drops_rows_with_no_cell_here(tmp_path, capsys):
    from dtr_compile.oplog.writer import LogWriter
    from dtr_compile.sim.cli import main

    shared = tmp_path / "shared"
    published = write_reference(shared, PUBLISHED, manifest=True)
    finer = write_reference(tmp_path / "bench", FINER, manifest=False)
    with LogWriter(shared / "resnet.log.gz") as log:  # the log the manifest names
        log.constant("w", 10)
        log.call("f", ["w"], ["a"], [100], [-1], 10)
    args = [str(shared / "resnet.log.gz"), "--ratios", "0.14,0.15", "--heuristic", "dtr_eq", "--jobs", "1"]
    assert main([*args, "--reference", published, "--reference", finer]) == 0
    out = capsys.readouterr().out
    assert [line.split()[1:] for line in out.splitlines() if "reference" in line] == [["DTREqClass", "thrash", "1.432"]]
