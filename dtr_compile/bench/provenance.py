"""Where and when a figure was taken: the machine, the code's revision, the load, the command that made it.

Every suite writes these into its Markdown beside its tables (BENCHMARKS.md says of each figure on what machine,
at what commit, under what load and by what command it was measured), so they are computed in one place.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

import torch

from ..measure import device_name

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout holding dtr_compile/, where git is asked


def command(suite: str, argv: Sequence[str]) -> str:
    """The command line that reruns a suite with these arguments."""
    return " ".join(["python -m dtr_compile.bench", suite, shlex.join(list(argv))]).strip()


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def load_average() -> tuple[float, float, float] | None:
    """The 1/5/15-minute load average (None where the platform has none): was the machine quiet?"""
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return None


def load_text() -> str:
    load = load_average()
    return "unknown" if load is None else " / ".join(f"{x:.2f}" for x in load)


def machine() -> str:
    """The CPU, torch, threads and Python of this process, and the load now."""
    return (
        f"{device_name('cpu')}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"Python {platform.python_version()}; load average (1/5/15 min) {load_text()}"
    )


def version() -> str:
    """dtr_compile's release, as installed (a source checkout that was never installed has none)."""
    try:
        return importlib.metadata.version("dtr_compile")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def revision() -> str:
    """The git commit the benchmark ran on, and whether dtr_compile/ had uncommitted changes."""
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "dtr_compile")
    except (OSError, subprocess.CalledProcessError):
        return "unknown revision"
    return head.strip() + (" + uncommitted changes in dtr_compile/" if dirty.strip() else "")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=PACKAGE_ROOT).stdout
