"""The DTR authors' simulator results (shared/dtr-logs/reference-simrd.md), to print beside ours.

The file holds one block per model: a title line, a header `heur 0.1 0.2 ...`, then one row per
heuristic whose cells are an overhead, `OOM`, `thrash` or `-`. `manifest.json` beside it maps each log
file to its model title. More files of the same format can be given (benchmarks/reference-simrd-fine.md: the
same simulator at ratios between the published ones); their cells are merged by model, heuristic and ratio,
and a file with no manifest beside it uses the manifests of the others.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import LogFormatError

# Reference row name -> the name of the same heuristic here.
REFERENCE_NAMES = {
    "DTR": "dtr",
    "DTREqClass": "dtr_eq",
    "DTRLocal": "dtr_local",
    "MSPS": "msps",
    "LRU": "lru",
    "LargestStorage": "size",
}


@dataclass(frozen=True)
class ReferenceTable:
    """cells[model][heuristic][ratio] -> "1.332", "oom", "thrash" or "-"; logs maps a log file name to its model."""

    cells: dict[str, dict[str, dict[float, str]]]
    logs: dict[str, str]

    def row(self, log_name: str, reference_heuristic: str) -> dict[float, str] | None:
        model = self.logs.get(log_name)
        if model is None:
            return None
        return self.cells.get(model, {}).get(reference_heuristic)


def load_reference(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> ReferenceTable:
    """Read one or more reference files and the manifest.json beside each (see the module docstring)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    cells: dict[str, dict[str, dict[float, str]]] = {}
    logs: dict[str, str] = {}
    per_file: list[tuple[str, set[str]]] = []
    for path in map(os.fspath, paths):
        with open(path, encoding="utf-8") as f:
            parsed = parse_reference(f.read(), source=path)
        per_file.append((path, set(parsed)))
        for model, rows in parsed.items():
            for heuristic, row in rows.items():
                cells.setdefault(model, {}).setdefault(heuristic, {}).update(row)
        logs.update(manifest_beside(path))
    known = set(logs.values())
    for path, models in per_file:
        if models and not models & known:
            # Its rows would never be printed: say so rather than show a table without them.
            raise LogFormatError(
                f"{path}: none of its models ({', '.join(sorted(models))}) is named in a manifest.json beside "
                "any reference file given; give the shared reference-simrd.md (its folder has the manifest) too"
            )
    return ReferenceTable(cells, logs)


def manifest_beside(path: str | os.PathLike) -> dict[str, str]:
    """Log file name -> model title, from the manifest.json in the folder of `path` ({} when there is none)."""
    manifest_path = os.path.join(os.path.dirname(os.fspath(path)), "manifest.json")
    if not os.path.exists(manifest_path):
        return {}
    with open(manifest_path, encoding="utf-8") as f:
        return {model["log"]: model["name"] for model in json.load(f).get("models", [])}


def parse_reference(text: str, *, source: str = "<reference>") -> dict[str, dict[str, dict[float, str]]]:
    """Parse the fenced tables of reference-simrd.md (see the module docstring)."""
    cells: dict[str, dict[str, dict[float, str]]] = {}
    in_block = False
    model: str | None = None
    ratios: list[float] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            in_block, model = not in_block, None
            continue
        if not in_block or not line.strip():
            continue
        words = line.split()
        if not line.startswith(" "):
            model, ratios = line.strip(), []
            cells[model] = {}
        elif words[0] == "heur":
            ratios = [float(w) for w in words[1:]]
        elif model is not None and ratios:
            if len(words) != len(ratios) + 1:
                raise LogFormatError(f"{source}, line {lineno}: expected a heuristic and {len(ratios)} cells")
            cells[model][words[0]] = {r: _cell(w) for r, w in zip(ratios, words[1:])}
    return cells


def _cell(word: str) -> str:
    return word.lower() if word in ("OOM", "thrash") else word
