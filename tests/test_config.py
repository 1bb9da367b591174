"""dtr_compile.config: budget parsing, validation on assignment, and patch() scoping."""

from __future__ import annotations

import math

import pytest

import dtr_compile
from dtr_compile import config
from dtr_compile.engine import HEURISTICS

DEFAULT_HEURISTIC = config.heuristic  # the shipped default, whatever it is
from dtr_compile.errors import ConfigError, DTRError


@pytest.fixture(autouse=True)
def restore_config():
    """Every test leaves the flags as it found them, even when it fails halfway."""
    before = config.snapshot()
    yield
    for name, value in before.items():
        setattr(config, name, value)


# ------------------------------------------------------------------------------ budget parsing


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1.5GB", 1_500_000_000),
        ("512MiB", 512 * 2**20),
        ("800 MB", 800_000_000),
        ("1e9", 1_000_000_000),
        ("2.5e3 KB", 2_500_000),
        ("  4 gib ", 4 * 2**30),
        ("1TiB", 2**40),
        ("1TB", 10**12),
        ("64KiB", 65536),
        ("123", 123),
        ("123 B", 123),
        (".5 KB", 500),
    ],
)
def test_budget_strings_are_parsed_to_bytes(text: str, expected: int) -> None:
    parsed = config.parse_budget(text)
    assert parsed == expected and type(parsed) is int


def test_int_budgets_are_bytes() -> None:
    assert config.parse_budget(2_000_000_000) == 2_000_000_000
    assert config.parse_budget(1) == 1


@pytest.mark.parametrize("fraction", [0.5, 1.0, 1e-6, 0.3])
def test_floats_in_the_unit_interval_are_fractions(fraction: float) -> None:
    parsed = config.parse_budget(fraction)
    assert parsed == fraction and type(parsed) is float


def test_integral_floats_above_one_are_bytes() -> None:
    parsed = config.parse_budget(8e9)
    assert parsed == 8_000_000_000 and type(parsed) is int


def test_none_means_no_rematerialization() -> None:
    assert config.parse_budget(None) is None
    config.memory_budget = "1GB"
    config.memory_budget = None
    assert config.memory_budget is None


@pytest.mark.parametrize(
    "value, fragment",
    [
        (0, "must be positive"),
        (-5, "must be positive"),
        (0.0, "positive finite"),
        (-0.5, "positive finite"),
        (math.nan, "positive finite"),
        (math.inf, "positive finite"),
        (-math.inf, "positive finite"),
        (True, "bool"),
        (False, "bool"),
        (1.5, "fraction in (0, 1]"),
        (2.25e9 + 0.5, "fraction in (0, 1]"),
        ("1.5XB", "unknown unit 'XB'"),
        ("12 bits", "unknown unit"),
        ("lots", "cannot be parsed"),
        ("", "cannot be parsed"),
        ("-1GB", "cannot be parsed"),
        ("1.5 G B", "cannot be parsed"),
        ("nan", "cannot be parsed"),
        ("0 GB", "must be positive"),
        ("0.0000001 B", "must be positive"),
        ([1], "has type list"),
        (b"1GB", "has type bytes"),
    ],
)
def test_invalid_budgets_raise_at_once(value, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        config.parse_budget(value)
    assert fragment in str(info.value)
    assert "memory_budget" in str(info.value)
    with pytest.raises(ConfigError):
        config.memory_budget = value
    assert config.memory_budget is None, "a rejected value changes nothing"


def test_budget_errors_say_what_is_accepted() -> None:
    with pytest.raises(ConfigError, match="'512MiB'"):
        config.parse_budget("lots")
    with pytest.raises(ConfigError, match=r"'1\.5B'"):  # the float message suggests the bytes string
        config.parse_budget(1.5)


def test_config_errors_are_dtr_errors_and_value_errors() -> None:
    with pytest.raises(DTRError):
        config.memory_budget = -1
    with pytest.raises(ValueError):
        config.memory_budget = -1
    assert dtr_compile.ConfigError is ConfigError


# ------------------------------------------------------------------------------ assignment and validation


def test_assignment_validates_and_normalizes() -> None:
    config.memory_budget = "1.5GB"
    assert config.memory_budget == 1_500_000_000
    config.thrash_limit = 2
    assert config.thrash_limit == 2.0 and type(config.thrash_limit) is float
    config.min_evictable_fraction = 0
    assert type(config.min_evictable_fraction) is float


def test_unknown_flags_raise_with_a_did_you_mean_hint() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'memory_budget'"):
        config.memory_budgt = "1GB"
    assert not hasattr(config, "memory_budgt")
    with pytest.raises(ConfigError, match="unknown dtr_compile.config flag 'zzz'") as info:
        config.zzz = 1
    assert "Did you mean" not in str(info.value) and "memory_budget" in str(info.value)


@pytest.mark.parametrize("name", sorted(HEURISTICS))
def test_every_engine_heuristic_is_a_valid_flag(name: str) -> None:
    config.heuristic = name
    assert config.heuristic == name


def test_default_heuristic_is_known_to_the_engine() -> None:
    assert config.heuristic in HEURISTICS


@pytest.mark.parametrize(
    "name, value",
    [
        ("heuristic", "belady"),
        ("heuristic", "DTR"),
        ("heuristic", None),
        ("candidate_sampling", "half"),
        ("candidate_sampling", 0),
        ("candidate_sampling", -3),
        ("candidate_sampling", True),
        ("candidate_sampling", 2.0),
        ("min_evictable_fraction", -0.1),
        ("min_evictable_fraction", 1.0),
        ("min_evictable_fraction", 2),
        ("min_evictable_fraction", True),
        ("min_evictable_fraction", "0.1"),
        ("min_evictable_bytes", -1),
        ("min_evictable_bytes", 1.5),
        ("min_evictable_bytes", True),
        ("random_seed", -1),
        ("random_seed", "1"),
        ("thrash_limit", 0),
        ("thrash_limit", -1.0),
        ("thrash_limit", math.inf),
        ("thrash_limit", math.nan),
        ("thrash_limit", True),
        ("thrash_limit", "2"),
        ("codegen", "triton"),
        ("codegen", None),
    ],
)
def test_invalid_flag_values_raise_and_change_nothing(name: str, value) -> None:
    before = getattr(config, name)
    with pytest.raises(ConfigError, match=name):
        setattr(config, name, value)
    assert getattr(config, name) == before


def test_unknown_heuristic_error_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="dtr_eq"):
        config.heuristic = "belady"


@pytest.mark.parametrize(
    "name, value",
    [
        ("candidate_sampling", "sqrt"),
        ("candidate_sampling", "all"),
        ("candidate_sampling", 7),
        ("min_evictable_fraction", 0.0),
        ("min_evictable_fraction", 0.99),
        ("min_evictable_bytes", 0),
        ("min_evictable_bytes", 1 << 20),
        ("random_seed", 0),
        ("thrash_limit", None),
        ("thrash_limit", 0.5),
        ("codegen", "fx"),
        ("codegen", "inductor"),
    ],
)
def test_valid_flag_values_are_accepted(name: str, value) -> None:
    setattr(config, name, value)
    assert getattr(config, name) == value


# ------------------------------------------------------------------------------ patch()


def test_patch_as_a_context_manager_restores_old_values() -> None:
    config.memory_budget = "1GB"
    with config.patch(memory_budget=0.3, heuristic="lru"):
        assert config.memory_budget == 0.3 and config.heuristic == "lru"
    assert config.memory_budget == 1_000_000_000 and config.heuristic == DEFAULT_HEURISTIC


def test_patch_validates_and_normalizes_values() -> None:
    with config.patch(memory_budget="512MiB"):
        assert config.memory_budget == 512 * 2**20


def test_patch_restores_even_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), config.patch(memory_budget=0.5):
        raise RuntimeError("boom")
    assert config.memory_budget is None


def test_patch_as_a_decorator_restores_after_each_call_and_on_exceptions() -> None:
    seen = []

    @config.patch(memory_budget="2GB", codegen="fx")
    def step(fail: bool) -> None:
        seen.append((config.memory_budget, config.codegen))
        if fail:
            raise KeyError("fail")

    step(False)
    assert config.memory_budget is None and config.codegen == "inductor"
    with pytest.raises(KeyError):
        step(True)
    assert config.memory_budget is None and config.codegen == "inductor"
    assert seen == [(2_000_000_000, "fx")] * 2


def test_nested_patches_restore_in_order() -> None:
    with config.patch(memory_budget=0.5, heuristic="lru"):
        with config.patch(memory_budget=0.25):
            assert config.memory_budget == 0.25 and config.heuristic == "lru"
        assert config.memory_budget == 0.5 and config.heuristic == "lru"
    assert config.memory_budget is None and config.heuristic == DEFAULT_HEURISTIC


def test_one_patch_object_can_be_reentered() -> None:
    half = config.patch(memory_budget=0.5)
    with half:
        config.memory_budget = 0.75  # assigned inside: restored to the value before the *inner* enter
        with half:
            assert config.memory_budget == 0.5
        assert config.memory_budget == 0.75
    assert config.memory_budget is None


def test_patch_with_a_typo_raises_before_anything_changes() -> None:
    before = config.snapshot()
    with pytest.raises(ConfigError, match="Did you mean 'heuristic'"):
        config.patch(memory_budget=0.5, heuristc="lru")
    assert config.snapshot() == before
    with pytest.raises(ConfigError, match="memory_budget"):
        config.patch(heuristic="lru", memory_budget=-1)
    assert config.snapshot() == before


def test_snapshot_lists_every_flag() -> None:
    assert set(config.snapshot()) == {
        "memory_budget",
        "heuristic",
        "candidate_sampling",
        "min_evictable_fraction",
        "min_evictable_bytes",
        "thrash_limit",
        "random_seed",
        "codegen",
        "cost_mode",
        "recompute_kernels",
        "compiled_steps",
        "plan_cache",
    }


def test_compiled_steps_accepts_its_two_modes_only() -> None:
    with config.patch(compiled_steps="plan_only"):
        assert config.compiled_steps == "plan_only"
    with pytest.raises(ConfigError, match="'runtime' or 'plan_only'"):
        config.compiled_steps = "eager"


@pytest.mark.parametrize(
    "name, value",
    [
        ("memory_budget", "1e400"),  # 10.0 ** 400 overflows
        ("memory_budget", "9" * 400),  # int(round(inf))
        ("thrash_limit", 10**400),  # float(huge int)
        ("heuristic", ["dtr"]),  # unhashable: `value in HEURISTICS` raises TypeError
    ],
)
def test_absurd_values_raise_config_errors(name: str, value) -> None:
    with pytest.raises(ConfigError):
        config.validate(name, value)


# ------------------------------------------------------------------------------ numbers read from argv or env


@pytest.mark.parametrize(
    "text, expected",
    [("0.5", 0.5), (" 0.3 ", 0.3), ("1", 1.0), ("1.0", 1.0), ("5e-1", 0.5), (".25", 0.25)],
)
def test_a_bare_number_string_in_the_unit_interval_is_a_fraction(text: str, expected: float) -> None:
    """`memory_budget=os.environ["BUDGET"]` with "0.5" means what 0.5 means (issue 16, class 8)."""
    parsed = config.parse_budget(text)
    assert parsed == expected and type(parsed) is float
    config.memory_budget = text
    assert config.memory_budget == expected


def test_a_bare_number_string_above_one_is_whole_bytes_or_refused() -> None:
    assert config.parse_budget("2000000") == 2_000_000
    with pytest.raises(ConfigError, match=r"'1\.5MB'"):  # the message shows how to write bytes
        config.parse_budget("1.5")


@pytest.mark.parametrize("value", [10**400, 2**62 + 1, 1e300, "1e30GB", "9" * 30, 10.0**19])
def test_byte_counts_beyond_any_device_raise_at_once(value) -> None:
    """10**400 was accepted and failed later at compile with OverflowError."""
    with pytest.raises(ConfigError, match="larger than any device"):
        config.memory_budget = value
    assert config.parse_budget(2**62) == 2**62


def test_messages_about_huge_values_stay_short() -> None:
    with pytest.raises(ConfigError) as info:
        config.parse_budget("x" * 10_000)
    assert len(str(info.value)) < 600


# ------------------------------------------------------------------------------ runtime.enable() options


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"reference_peak_bytes": True}, "reference_peak_bytes=True"),
        ({"reference_peak_bytes": 0}, "positive int"),
        ({"reference_peak_bytes": 1.5e6}, "positive int"),
        ({"reference_peak_bytes": 10**400}, "larger than any device"),
        ({"log": 123}, "log=123"),
        ({"log": b"step.log"}, "file path"),
        ({"heuristic": "belady"}, "heuristic='belady' is unknown"),
        ({"memory_budget": 10**400}, "larger than any device"),
        ({"budget": 0.5}, "unknown option(s) ['budget']"),
    ],
)
def test_runtime_enable_refuses_bad_options_with_config_errors(options: dict, fragment: str) -> None:
    from dtr_compile import runtime

    with pytest.raises(ConfigError) as info:
        runtime.enable(**options)
    assert fragment in str(info.value)


def test_runtime_enable_refuses_a_binary_log_stream() -> None:
    import io

    from dtr_compile import runtime

    with pytest.raises(ConfigError, match="text mode"):
        runtime.enable(log=io.BytesIO())


def test_runtime_enable_takes_a_fraction_string() -> None:
    from dtr_compile import runtime

    assert runtime.enable(memory_budget="0.5", reference_peak_bytes=1000).budget_bytes == 500


def test_config_names_every_heuristic_of_the_engine() -> None:
    """config.HEURISTIC_NAMES (what `heuristic=` accepts) and the engine's registry name the same heuristics."""
    from dtr_compile.config import HEURISTIC_NAMES
    from dtr_compile.engine import HEURISTICS

    assert sorted(HEURISTIC_NAMES) == sorted(HEURISTICS)
