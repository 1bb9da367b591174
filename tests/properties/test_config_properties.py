"""Property tests of the configuration (issue 16): every value given to any flag, to `parse_budget` or to
`runtime.enable` yields a normalized value or a `ConfigError`, never another exception (OverflowError,
TypeError from an unhashable value, ValueError from int() of a long string were all seen)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from dtr_compile import config
from dtr_compile.errors import ConfigError

NUMBER_TEXT = st.from_regex(
    r"\s*-?[0-9]{0,30}(\.[0-9]{0,8})?([eE][+-]?[0-9]{1,4})?\s*([KMGT]i?B|B|bits|)?\s*", fullmatch=True
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**60, max_value=10**500)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | NUMBER_TEXT
    | st.binary(max_size=8)
    | st.complex_numbers()
    | st.sampled_from(["sqrt", "all", "fx", "inductor", "runtime", "plan_only", "estimate", "measure", "auto", "off"])
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=4,
)
FLAGS = sorted(config.snapshot())


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(FLAGS), value=VALUES)
def test_every_flag_value_is_accepted_or_a_config_error(name: str, value) -> None:
    try:
        config.validate(name, value)
    except ConfigError as exc:
        assert name in str(exc) and len(str(exc)) < 1000


@settings(max_examples=400, deadline=None)
@given(value=VALUES | NUMBER_TEXT)
def test_a_budget_is_none_bytes_a_fraction_or_auto_and_parsing_is_idempotent(value) -> None:
    try:
        budget = config.parse_budget(value)
    except ConfigError:
        return
    if isinstance(budget, float):
        assert 0 < budget <= 1 and math.isfinite(budget)
    elif isinstance(budget, str):
        assert budget == "auto"  # the device's free memory at each step (auto_budget.py)
    elif budget is not None:
        assert type(budget) is int and 1 <= budget <= config.MAX_BYTES
    assert config.parse_budget(budget) == budget


@settings(max_examples=100, deadline=None)
@given(reference=VALUES, log=st.none() | VALUES)
def test_runtime_enable_options_are_accepted_or_a_config_error(reference, log) -> None:
    from dtr_compile import runtime

    if isinstance(log, (str, bytes)):
        log = None  # a string is a path: do not write files named by the generator
    try:
        runtime.enable(memory_budget=None, reference_peak_bytes=reference, log=log).close()
    except ConfigError:
        pass
