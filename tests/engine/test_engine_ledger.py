"""A fixed schedule counted by the engine (engine/ledger.py): the accounting the planner's graph model runs on.

passes/peak.py decides when each storage of an emitted plan comes and goes; the ledger hands those decisions to an
`Engine` without a budget, which counts the bytes as it counts the runtime's live step. These tests pin the rules
the planner relies on: an op runs with its fresh outputs and its workspace live, a storage already live is not
counted twice, a free is the drop of the schedule's handle, and bytes outside the schedule are counted beside."""

from __future__ import annotations

from dtr_compile.engine.ledger import ScheduleLedger


def test_an_op_runs_with_its_fresh_outputs_and_its_workspace_live() -> None:
    ledger = ScheduleLedger()
    assert ledger.allocate("a", [("a", 100)]) == 100
    # `b` makes two storages (one named twice) and needs 30 bytes of workspace while it runs.
    assert ledger.allocate("b", [("b0", 40), ("b1", 10), ("b0", 40)], workspace=30) == 180
    assert ledger.memory == 150  # the workspace is gone once it returns
    assert ledger.engine.room_peak == 180  # the engine's own count of the room `b` ran in
    assert ledger.allocate("again", [("a", 100)]) == 150  # live already: not counted twice
    assert set(ledger) == {"a", "b0", "b1"}


def test_a_free_drops_the_schedule_s_handle_and_the_engine_frees_the_bytes() -> None:
    ledger = ScheduleLedger()
    ledger.allocate("a", [("a", 100), ("a1", 20)])
    assert ledger.free("a") and ledger.memory == 20
    assert not ledger.free("a")  # no longer live
    assert "a" not in ledger and ledger.engine.stats().eager_evictions == 1


def test_bytes_outside_the_schedule_count_beside_its_storages() -> None:
    ledger = ScheduleLedger()
    ledger.allocate("saved", [("saved", 64)])
    ledger.outside -= 16  # a tail that dropped part of what the forward left (storage.Tail)
    assert ledger.memory == 48
    assert ledger.allocate("grad", [("grad", 32)], workspace=8) == 48 + 32 + 8
    assert ledger.engine.room_peak == 64 + 32 + 8  # the engine counts its storages only
