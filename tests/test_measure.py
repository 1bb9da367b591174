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

from dtr_compile import DeviceError, DTRError
from dtr_compile.measure import (
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
