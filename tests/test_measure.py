"""The one peak meter and the device choice every command shares (dtr_compile.measure), checked on CPU.

The CUDA path of the meter is checked here against a stand-in allocator (torch.cuda's statistics functions
replaced by a fake whose peak we set), so a machine without a GPU still proves that the meter reads
`max_memory_allocated` minus the bytes allocated at step start, after resetting the peak; tests/gpu checks it
against the real allocator.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from dtr_compile import DeviceError, DTRError, MeasurementError, measure
from dtr_compile.measure import (
    PROBE_BYTES,
    add_device_argument,
    default_device,
    device_from_args,
    device_name,
    measure_peak,
    move_to,
    resolve_device,
    synchronize,
)


def _cuda_present(monkeypatch, present: bool, count: int = 1) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: present)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count if present else 0)


@pytest.mark.parametrize("present, expected", [(True, "cuda"), (False, "cpu")])
def test_default_device_is_cuda_when_present(monkeypatch, present, expected):
    _cuda_present(monkeypatch, present)
    assert default_device() == expected
    assert resolve_device(None) == torch.device(expected)


def test_cuda_without_cuda_says_to_use_cpu(monkeypatch):
    _cuda_present(monkeypatch, False)
    for requested in ("cuda", "cuda:0", torch.device("cuda")):
        with pytest.raises(DeviceError, match="no CUDA device.*use --device cpu"):
            resolve_device(requested)
    assert issubclass(DeviceError, DTRError)


@pytest.mark.parametrize("requested", ["tpu", "gpu", "cuda:x", "meta"])
def test_unknown_devices_are_refused_with_what_is_accepted(requested):
    with pytest.raises(DeviceError, match="expected cpu, cuda or cuda:N"):
        resolve_device(requested)


def test_cuda_index_beyond_the_machine_is_refused(monkeypatch):
    _cuda_present(monkeypatch, True, count=2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(DeviceError, match="2 CUDA device"):
        resolve_device("cuda:2")


def test_device_argument_defaults_and_errors(monkeypatch, capsys):
    parser = argparse.ArgumentParser(prog="demo")
    add_device_argument(parser)
    _cuda_present(monkeypatch, True)
    assert device_from_args(parser, parser.parse_args([]).device) == torch.device("cuda")
    _cuda_present(monkeypatch, False)
    assert device_from_args(parser, parser.parse_args([]).device) == torch.device("cpu")
    assert device_from_args(parser, parser.parse_args(["--device", "cpu"]).device) == torch.device("cpu")
    with pytest.raises(SystemExit) as exit_info:
        device_from_args(parser, parser.parse_args(["--device", "cuda"]).device)
    assert exit_info.value.code == 2
    assert "--device: device 'cuda': no CUDA device" in capsys.readouterr().err


class _FakeAllocator:
    """torch.cuda's statistics as a list of events, so the meter's arithmetic and call order can be checked."""

    def __init__(self, live: int) -> None:
        self.live, self.peak, self.calls = live, live, []

    def install(self, monkeypatch) -> None:
        _cuda_present(monkeypatch, True)
        for name in ("synchronize", "memory_allocated", "reset_peak_memory_stats", "max_memory_allocated"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def synchronize(self, device=None) -> None:
        self.calls.append("synchronize")

    def memory_allocated(self, device=None) -> int:
        self.calls.append("memory_allocated")
        return self.live

    def reset_peak_memory_stats(self, device=None) -> None:
        self.calls.append("reset")
        self.peak = self.live

    def max_memory_allocated(self, device=None) -> int:
        self.calls.append("max_memory_allocated")
        return self.peak

    def step(self) -> str:
        """Allocates 700 bytes, frees 500 (a peak of 700 above the start, 200 still live at the end)."""
        self.calls.append("step")
        self.live += 700
        self.peak = max(self.peak, self.live)
        self.live -= 500
        return "result"


def test_cuda_meter_reads_the_allocator_peak_above_the_step_start(monkeypatch):
    fake = _FakeAllocator(live=10_000)
    fake.peak = 50_000  # an earlier step's peak: the meter must reset it before the step
    fake.install(monkeypatch)
    result, measured = measure_peak(fake.step, "cuda")
    assert result == "result"
    assert measured.peak_bytes == 700 and measured.net_bytes == 200
    assert fake.calls.index("reset") < fake.calls.index("step") < fake.calls.index("max_memory_allocated")
    assert fake.calls.index("synchronize") < fake.calls.index("memory_allocated")  # queued work finished first


def test_cuda_meter_without_cuda_is_a_device_error(monkeypatch):
    _cuda_present(monkeypatch, False)
    with pytest.raises(DeviceError, match="use --device cpu"):
        measure_peak(lambda: None, "cuda")


def test_cpu_meter_sees_a_step_allocation():
    _, measured = measure_peak(lambda: torch.empty(1 << 20, dtype=torch.uint8).fill_(1).sum(), "cpu")
    assert measured.peak_bytes >= 1 << 20


BLOCK = 1 << 19


def _block() -> torch.Tensor:
    return torch.empty(BLOCK, dtype=torch.uint8)


def test_cpu_meter_is_exact_and_leaves_out_its_probe():
    """The probe is allocated and freed inside the profile before the step: it adds nothing to any figure."""
    _, nothing = measure_peak(lambda: None)
    assert (nothing.peak_bytes, nothing.allocated_bytes, nothing.net_bytes, nothing.events) == (0, 0, 0, 0)
    _, one = measure_peak(_block)
    assert (one.peak_bytes, one.allocated_bytes, one.net_bytes, one.events) == (BLOCK, BLOCK, BLOCK, 1)

    def two_then_free() -> None:
        a = _block()
        b = torch.empty(2 * BLOCK, dtype=torch.uint8)
        del a, b

    _, two = measure_peak(two_then_free)
    assert (two.peak_bytes, two.allocated_bytes, two.net_bytes, two.events) == (3 * BLOCK, 3 * BLOCK, 0, 4)


def test_cpu_meter_refuses_a_profile_without_its_probe(monkeypatch):
    """A profile that recorded no memory events (not even the probe's) raises instead of reporting 0 B."""
    ran = []
    monkeypatch.setattr(measure, "allocation_events_in_time_order", lambda prof: [])
    with pytest.raises(MeasurementError, match="recorded no memory events.*fresh process"):
        measure_peak(lambda: ran.append(_block()))
    assert ran, "the step ran: the error is about the profile, not the step"
    assert issubclass(MeasurementError, DTRError)


@pytest.mark.compat  # torch 2.11 raises where later releases return an empty profile
def test_cpu_meter_refuses_a_step_that_ends_its_profile():
    """A profiler session started and stopped inside the step ends the meter's own: torch then returns an empty
    profile (and logs "disableProfiler called but no active profiling session found"), which read as 0 B."""

    def step() -> torch.Tensor:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True):
            pass
        return _block()

    with pytest.raises(MeasurementError, match="no other profiler active"):
        measure_peak(step)
    _, measured = measure_peak(_block)  # the next measurement is unaffected
    assert measured.peak_bytes == BLOCK


def test_cpu_meter_counts_the_events_after_the_probe(monkeypatch):
    """Events up to the probe's free are not the step's; every event after it is, a step allocation at the
    probe's address included."""
    probe = 1000
    events = [(7, 10), (probe, PROBE_BYTES), (probe, -PROBE_BYTES), (8, -500), (probe, 300), (9, 900), (probe, -300)]
    monkeypatch.setattr(measure, "allocate_and_free_probe", lambda nbytes: probe)
    monkeypatch.setattr(measure, "allocation_events_in_time_order", lambda prof: events)
    _, measured = measure_peak(lambda: None)
    assert (measured.peak_bytes, measured.allocated_bytes, measured.net_bytes, measured.events) == (700, 1200, 400, 4)


def test_cpu_marks_say_the_bytes_live_there_and_the_peak_after():
    """A mark inside the step reads the running total at that point, and the peak from there on (verify.py marks
    where a region's backward begins)."""
    from dtr_compile.measure import mark

    def step():
        a = torch.empty(BLOCK, dtype=torch.uint8)
        b = torch.empty(2 * BLOCK, dtype=torch.uint8)
        del b  # the step's peak, 3 blocks, is before the mark
        mark()
        c = torch.empty(BLOCK, dtype=torch.uint8)  # 2 blocks: the peak after the mark
        del a, c
        mark()

    _, measured = measure_peak(step)
    assert measured.peak_bytes == 3 * BLOCK
    assert [(m.live_bytes, m.peak_after_bytes) for m in measured.marks] == [(BLOCK, 2 * BLOCK), (0, 0)]


def test_a_mark_outside_a_measurement_notes_nothing():
    from dtr_compile.measure import mark

    mark()  # no measurement running: nothing to note, nothing raised
    _, measured = measure_peak(lambda: None)
    assert measured.marks == ()


def test_synchronize_is_a_no_op_on_cpu(monkeypatch):
    def fail(device=None):
        raise AssertionError("torch.cuda.synchronize called for a CPU device")

    monkeypatch.setattr(torch.cuda, "synchronize", fail)
    synchronize("cpu")


def test_move_to_moves_every_tensor_in_nested_batches():
    batch = ((torch.ones(2), [torch.zeros(1), 3]), {"y": torch.ones(1)})
    moved = move_to(batch, "meta")
    assert moved[0][0].device.type == "meta" and moved[0][1][0].device.type == "meta" and moved[0][1][1] == 3
    assert moved[1]["y"].device.type == "meta" and isinstance(moved[0][1], list)


def test_device_name_names_the_cpu_and_its_cores():
    assert "cores)" in device_name("cpu")


class _FakeCudaAllocator:
    """torch.cuda's allocator statistics for a step that allocates by hand (`use`), on a machine with no GPU."""

    def __init__(self, monkeypatch) -> None:
        self.allocated = self.peak = 1000  # held before the step: not the step's
        for name, fake in {
            "is_available": lambda: True,
            "synchronize": lambda device=None: None,
            "memory_allocated": lambda device=None: self.allocated,
            "max_memory_allocated": lambda device=None: self.peak,
            "reset_peak_memory_stats": self._reset,
        }.items():
            monkeypatch.setattr(torch.cuda, name, fake)

    def _reset(self, device=None) -> None:
        self.peak = self.allocated

    def use(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)


def test_cuda_marks_split_the_allocator_peak_at_each_mark(monkeypatch):
    """On CUDA a mark reads the allocator and resets its peak: the step's peak is still the highest of every span,
    and each mark's peak after it the highest of the spans that follow it."""
    from dtr_compile.measure import mark

    fake = _FakeCudaAllocator(monkeypatch)

    def step():
        fake.use(300)
        fake.use(-200)  # the step's peak, 300, is before the first mark
        mark()  # 100 live
        fake.use(150)
        fake.use(-150)
        mark()  # 100 live, 250 the peak between the marks
        fake.use(50)

    _, measured = measure_peak(step, "cuda")
    assert measured.peak_bytes == 300 and measured.net_bytes == 150
    assert [(m.live_bytes, m.peak_after_bytes) for m in measured.marks] == [(100, 250), (100, 150)]
