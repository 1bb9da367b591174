"""Every private torch name the package references, and every name it imports from torch, resolves on this torch.

The private APIs whose presence varies across releases live in dtr_compile/compat.py and are looked up there
by feature (`hasattr`/`getattr` with a string, which this scan does not see). Every other private name is
written plainly (`torch._C._foo`, `from torch._inductor.x import y`) and must exist on every supported
release: run by the compatibility stages of .ci/run on torch 2.11 and 2.15, this test names any that does not,
before a test happens to reach the line that uses it.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest
import torch

import dtr_compile

pytestmark = pytest.mark.compat

PACKAGE = pathlib.Path(dtr_compile.__file__).parent


def _references() -> set[tuple[str, str | None, str]]:
    """(module or attribute chain, imported name or None, file) for each name imported from torch and each
    private torch attribute chain (`torch._C._foo`)."""
    found: set[tuple[str, str | None, str]] = set()
    for path in PACKAGE.rglob("*.py"):
        where = str(path.relative_to(PACKAGE.parent))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch"):
                found.update((node.module, alias.name, where) for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update((a.name, None, where) for a in node.names if a.name.startswith("torch") and "._" in a.name)
            elif isinstance(node, ast.Attribute):
                parts, base = [], node
                while isinstance(base, ast.Attribute):
                    parts.append(base.attr)
                    base = base.value
                if isinstance(base, ast.Name) and base.id == "torch" and any(p.startswith("_") for p in parts):
                    found.add((".".join(["torch", *reversed(parts)]), None, where))
    return found


def _resolves(name: str, imported: str | None) -> bool:
    try:
        if imported is not None:
            module = importlib.import_module(name)
            return hasattr(module, imported) or importlib.util.find_spec(f"{name}.{imported}") is not None
        parts = name.split(".")
        obj = torch
        for i, part in enumerate(parts[1:], start=1):
            obj = getattr(obj, part) if hasattr(obj, part) else importlib.import_module(".".join(parts[: i + 1]))
        return True
    except (ImportError, AttributeError):
        return False


def test_every_torch_name_the_package_imports_or_reaches_privately_exists_here() -> None:
    references = _references()
    assert len(references) > 50, "the scan found too few references: is it still reading the package?"
    missing = sorted(
        f"{where}: {name}{'.' + imported if imported else ''}"
        for name, imported, where in references
        if not _resolves(name, imported)
    )
    assert not missing, (
        f"torch {torch.__version__} lacks private names the package uses (route them through dtr_compile/compat.py, "
        f"chosen by feature): {missing}"
    )
