"""Argument types the suites share: each rejects a bad value with argparse's exit status 2 and a message."""

from __future__ import annotations

import argparse


def fractions(text: str) -> list[float]:
    """Comma-separated fractions in (0, 1], e.g. 0.7,0.5."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions such as 0.7,0.5, got {text!r}") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"every fraction must be in (0, 1], got {text!r}")
    return values


def fraction(text: str) -> float:
    """One fraction in (0, 1]."""
    values = fractions(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one fraction in (0, 1], got {text!r}")
    return values[0]


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def non_negative(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)
