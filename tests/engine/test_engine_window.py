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


def test_the_peak_is_net_of_an_older_value_dropped_after_the_window_began_allocating() -> None:
    """The loss's log-softmax is made while the logits live, then the logits go, then its backward makes two more
    logits-sized buffers: the window's code holds two above its start at most, not three (counted three under torch
    2.11, GPT-2's plans measured one logits below their budget). A drop before any allocation is not credited: under
    torch 2.13 a first step's loss forward runs unseen, so the logits' drop comes first and the unseen log-softmax,
    made while they lived, is in no count."""
    engine = Engine(budget_bytes=None)
    x = engine.constant(0)
    logits = _op(engine, "model", [x], 100)
    window = engine.open_window()
    log_softmax = _op(engine, "log_softmax", [logits], 100)
    engine.drop_handle(logits)
    grad = _op(engine, "nll_loss_backward", [log_softmax], 100)
    _op(engine, "log_softmax_backward", [grad, log_softmax], 100)
    assert (window.peak, window.released, window.dropped) == (200, 100, 100)

    logits = _op(engine, "model", [x], 100)
    unseen_first = engine.open_window()
    engine.drop_handle(logits)  # nothing allocated in the window yet: its loss forward ran unseen
    grad = _op(engine, "nll_loss_backward", [x], 100)
    _op(engine, "log_softmax_backward", [grad], 100)
    assert (unseen_first.peak, unseen_first.released, unseen_first.dropped) == (200, 0, 100)


def test_an_older_value_is_dropped_once_however_often_a_recompute_brings_it_back() -> None:
    """A dead value comes back as the input of a recompute and is freed again after it: that free is no drop of the
    program's. Counted each time, GPT-2 run op by op far below its floor measured a tail of -647 MiB."""
    engine = Engine(budget_bytes=250)
    x = engine.constant(0)
    a = _op(engine, "a", [x], 100)
    window = engine.open_window()
    b = _op(engine, "b", [a], 100)
    engine.drop_handle(a)  # the program lets `a` go: one drop
    for _ in range(3):
        c = _op(engine, "c", [x], 200)  # evicts `b`
        assert not b.resident
        engine.drop_handle(c)
        engine.reserve([b], 0, "use")  # recomputes `b`, bringing `a` back and freeing it again
        engine.abandon([b])
        assert b.resident and not a.resident
    assert window.dropped == 100


def test_a_value_dead_before_the_window_opened_is_no_drop_when_a_recompute_brings_it_back() -> None:
    engine = Engine(budget_bytes=250)
    x = engine.constant(0)
    a = _op(engine, "a", [x], 100)
    b = _op(engine, "b", [a], 100)
    engine.drop_handle(a)
    window = engine.open_window()
    c = _op(engine, "c", [x], 200)  # evicts `b`
    engine.drop_handle(c)
    engine.reserve([b], 0, "use")  # `a` comes back for `b` and goes again
    engine.abandon([b])
    assert b.resident and not a.resident
    assert (window.dropped, window.released) == (0, 0)


def test_a_storage_released_once_the_step_is_over_joins_no_eviction_class() -> None:
    """At a step's end the runtime releases every storage it tracked (runtime.end_step): nothing will be evicted or
    recomputed any more, so they join no eviction class (a hundred of them took 12 ms a step). Released mid-step,
    a storage joins its evicted neighbours' class, as any eviction does."""
    engine = Engine(budget_bytes=None)
    x = engine.constant(0)
    a = _op(engine, "a", [x], 100)
    b = _op(engine, "b", [a], 100)
    engine.release(a)
    assert not a.resident and a.eq is not None and engine.memory == 100
    engine.release(b, step_over=True)
    assert not b.resident and b.eq is None and engine.memory == 0
