"""A memory window counts what is allocated after it opened, apart from what was before (engine/window.py).

The runtime measures a region's tail with one (runtime/tails.py): under a budget the engine evicts the region's
older storages to make room for the tail, so the step's memory stays flat while the tail grows; the window must
see the tail's bytes all the same, and tell an eviction (not the program's doing) from a drop (the program let
an older value go)."""

from __future__ import annotations

from dtr_compile.engine import Engine


def _op(engine: Engine, name: str, inputs: list, nbytes: int):
    engine.reserve(inputs, nbytes, name)
    return engine.record(name, inputs, [nbytes], 1.0).outputs[0]


def test_a_window_counts_what_is_born_in_it_and_not_what_is_evicted_for_it() -> None:
    engine = Engine(budget_bytes=300)
    x = engine.constant(0)
    saved = _op(engine, "saved", [x], 200)  # the region's saved value, older than the window
    window = engine.open_window()
    tail = _op(engine, "loss", [x], 150)  # does not fit beside `saved`: the engine evicts it
    assert not saved.resident and engine.memory == 150
    assert (window.memory, window.peak, window.dropped) == (150, 150, 0)
    engine.drop_handle(tail)
    assert (window.memory, window.peak) == (0, 150)
    engine.close_window(window)
    assert engine.windows == []


def test_a_window_counts_a_dropped_older_value_and_an_operation_s_transient_room() -> None:
    engine = Engine(budget_bytes=None)
    x = engine.constant(0)
    output = _op(engine, "output", [x], 64)
    window = engine.open_window()
    engine.reserve([x], 500, "transient")  # room for an operation's outputs and workspace, before it runs
    assert window.peak == 500
    engine.abandon([x])
    engine.drop_handle(output)  # the program let the region's output go
    assert window.dropped == 64 and window.memory == 0


def test_nested_windows_each_see_their_own_stretch() -> None:
    engine = Engine(budget_bytes=None)
    x = engine.constant(0)
    outer = engine.open_window()
    first = _op(engine, "a", [x], 10)
    inner = engine.open_window()
    _op(engine, "b", [x], 20)
    engine.drop_handle(first)
    assert (inner.memory, inner.dropped) == (20, 10)
    assert (outer.memory, outer.peak, outer.dropped) == (20, 30, 0)
