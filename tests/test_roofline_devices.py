"""Roofline rates per device (issue 17: "costs for the device it runs on").

CPU estimates must stay exactly what they were (every CPU plan, and the tests that pin them, were made with
those constants). CUDA rates are measured on the device; here the measurement is replaced by H200-like rates
(`measure_cuda_rates` monkeypatched), so the tests run on CPU and check how the rates are used: per dtype,
with TF32 as the program sets it, measured once per device. One test measures a real GPU and runs only there.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

from dtr_compile import roofline
from dtr_compile.roofline import CPU_RATES, FALLBACK_CUDA_RATES, DeviceRates, estimate_call, estimate_seconds, rates_for

# About what an H200 measures (torch 2.11): fp32 without TF32, TF32, bf16 on tensor cores, HBM3e.
H200_LIKE = DeviceRates(
    fp32_flops_per_s=5e13,
    tf32_flops_per_s=4e14,
    half_flops_per_s=8e14,
    bytes_per_s=4e12,
    overhead_s=5e-6,
    fused_overhead_s=1e-6,
)

N = 1024
MATMUL_FLOPS = 2 * N**3
MATMUL_BYTES = 3 * N * N * 4  # two fp32 operands read, one result written
POINTWISE_BYTES = 2 * N * N * 4  # a relu of the result: read once, written once


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA rates without a GPU: a fresh cache, and a measurement that returns H200_LIKE and counts its calls."""
    calls = []

    def measure(index: int) -> DeviceRates:
        calls.append(index)
        return H200_LIKE

    monkeypatch.setattr(roofline, "_cuda_rates", {})
    monkeypatch.setattr(roofline, "measure_cuda_rates", measure)
    monkeypatch.setattr(roofline, "_capturing_cuda_graph", lambda: False)
    return calls


@pytest.fixture
def tf32_setting():
    """Restores the program's TF32 setting after a test that changes it."""
    legacy, cuda_matmul, mkldnn_matmul = _matmul_settings()
    yield
    torch.set_float32_matmul_precision(legacy)
    torch.backends.cuda.matmul.fp32_precision = cuda_matmul
    torch.backends.mkldnn.matmul.fp32_precision = mkldnn_matmul


def _matmul_over_pointwise(device: str, dtype: torch.dtype = torch.float32) -> float:
    matmul = estimate_seconds(MATMUL_FLOPS, MATMUL_BYTES, device=device, dtype=dtype, fused=True)
    pointwise = estimate_seconds(0, POINTWISE_BYTES, device=device, dtype=dtype, fused=True)
    return matmul / pointwise


def test_cpu_rates_are_the_constants_cpu_plans_were_made_with():
    assert CPU_RATES == DeviceRates(1e11, 1e11, 1e11, 4e10, 2e-6, 1e-6)
    assert rates_for(None) is CPU_RATES and rates_for("cpu") is CPU_RATES
    for flops, moved in [(0, 0), (MATMUL_FLOPS, MATMUL_BYTES), (0, POINTWISE_BYTES), (10**6, 10**9)]:
        old = max(flops / 1e11, moved / 4e10)
        assert estimate_seconds(flops, moved) == old + 2e-6  # the callers that pass nothing
        assert estimate_seconds(flops, moved, 1e-6) == old + 1e-6
        for dtype in (None, torch.float32, torch.bfloat16, torch.float16, torch.float64):
            assert estimate_seconds(flops, moved, device="cpu", dtype=dtype, fused=True) == old + 1e-6


def test_cpu_estimate_call_is_unchanged_for_every_dtype(tf32_setting):
    torch.backends.cuda.matmul.allow_tf32 = True  # a CUDA setting: no effect on CPU costs
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.ones(64, 32, dtype=dtype)
        b = torch.ones(32, 16, dtype=dtype)
        out = torch.mm(a, b)
        moved = a.nbytes + b.nbytes + out.nbytes
        expected = max(2 * 64 * 32 * 16 / 1e11, moved / 4e10) + 2e-6
        assert estimate_call(torch.ops.aten.mm.default, (a, b), {}, out) == expected


def test_meta_tensors_and_other_device_types_count_as_cpu(fake_cuda):
    meta = torch.empty(4, 4, device="meta")
    assert roofline.device_of([meta, 3]) == torch.device("cpu")
    assert roofline.device_of([meta, torch.empty(4, 4)]) == torch.device("cpu")
    assert rates_for("mps") is CPU_RATES
    assert fake_cuda == []


def test_cuda_prices_matmuls_against_pointwise_ops_unlike_a_cpu(fake_cuda):
    # A GPU's flop rate outgrows its bandwidth far more than a CPU's (H200 fp32: 12 FLOP per byte, bf16: 200;
    # this CPU: 2.5), so next to a matmul a pointwise op weighs much more than at CPU rates: a plan made at
    # CPU rates recomputes the wrong ops on a GPU.
    cpu, cuda = _matmul_over_pointwise("cpu"), _matmul_over_pointwise("cuda")
    assert cpu > 5 * cuda
    assert cpu > 50 * _matmul_over_pointwise("cuda", torch.bfloat16)
    # and both are far faster than at CPU rates (the 57.9 s modelled GPT-2 step)
    assert (
        estimate_seconds(MATMUL_FLOPS, MATMUL_BYTES, device="cuda") < estimate_seconds(MATMUL_FLOPS, MATMUL_BYTES) / 100
    )


def test_cuda_16_bit_matmuls_are_cheaper_than_fp32(fake_cuda):
    def matmul(dtype: torch.dtype) -> float:
        return estimate_seconds(MATMUL_FLOPS, 0, 0.0, device="cuda", dtype=dtype)

    for dtype in (torch.bfloat16, torch.float16):
        assert matmul(dtype) < matmul(torch.float32) / 10
    assert matmul(torch.float64) == matmul(torch.float32)  # what no tensor core runs: the fp32 rate


def test_cuda_fp32_matmuls_follow_the_tf32_setting(fake_cuda, tf32_setting):
    def fp32_matmul() -> float:
        return estimate_seconds(MATMUL_FLOPS, 0, 0.0, device="cuda", dtype=torch.float32)

    torch.backends.cuda.matmul.allow_tf32 = False
    assert not roofline.tf32_enabled()
    full = fp32_matmul()
    assert full == pytest.approx(MATMUL_FLOPS / H200_LIKE.fp32_flops_per_s)
    torch.backends.cuda.matmul.allow_tf32 = True
    assert fp32_matmul() == pytest.approx(MATMUL_FLOPS / H200_LIKE.tf32_flops_per_s)
    torch.backends.cuda.matmul.allow_tf32 = False
    for precision, tf32 in [("high", True), ("medium", True), ("highest", False)]:
        torch.set_float32_matmul_precision(precision)
        assert roofline.tf32_enabled() is tf32
        assert (fp32_matmul() < full / 5) is tf32
    # a bf16 matmul does not depend on it
    assert estimate_seconds(MATMUL_FLOPS, 0, 0.0, device="cuda", dtype=torch.bfloat16) < full / 10


def test_cuda_rates_are_measured_once_per_device(fake_cuda):
    for _ in range(3):
        assert rates_for("cuda:0") is H200_LIKE
        estimate_seconds(MATMUL_FLOPS, MATMUL_BYTES, device=torch.device("cuda", 0))
    assert fake_cuda == [0]
    rates_for("cuda:1")
    rates_for("cuda:1")
    assert fake_cuda == [0, 1]


def test_no_measurement_while_a_cuda_graph_is_captured(fake_cuda, monkeypatch):
    monkeypatch.setattr(roofline, "_capturing_cuda_graph", lambda: True)
    assert rates_for("cuda:0") is FALLBACK_CUDA_RATES
    assert fake_cuda == []  # and nothing cached: the next call outside the capture measures
    monkeypatch.setattr(roofline, "_capturing_cuda_graph", lambda: False)
    assert rates_for("cuda:0") is H200_LIKE


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback where CUDA cannot be measured")
def test_a_failed_measurement_falls_back_to_the_documented_rates():
    assert roofline.measure_cuda_rates(0) is FALLBACK_CUDA_RATES
    fallback = FALLBACK_CUDA_RATES
    assert fallback.fp32_flops_per_s < fallback.tf32_flops_per_s < fallback.half_flops_per_s
    cpu_balance = CPU_RATES.fp32_flops_per_s / CPU_RATES.bytes_per_s  # FLOPs per byte moved
    assert fallback.fp32_flops_per_s / fallback.bytes_per_s > 2 * cpu_balance
    assert fallback.half_flops_per_s / fallback.bytes_per_s > 20 * cpu_balance


def _matmul_settings() -> tuple[str, ...]:
    return (
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.fp32_precision,
        torch.backends.mkldnn.matmul.fp32_precision,
    )


def test_measuring_restores_the_tf32_setting(tf32_setting):
    for precision in ("highest", "high", "medium"):
        torch.set_float32_matmul_precision(precision)
        before = _matmul_settings()
        for enabled in (False, True):
            with roofline._cuda_tf32(enabled):
                assert roofline.tf32_enabled() is enabled
            assert _matmul_settings() == before


def test_measuring_restores_a_tf32_setting_made_through_the_new_api_alone(tf32_setting):
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # the legacy precision now reads as an error
    for enabled in (False, True):
        with roofline._cuda_tf32(enabled):
            assert roofline.tf32_enabled() is enabled
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
    torch.backends.cuda.matmul.fp32_precision = "ieee"


def _fake_cuda_tensors(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32):
    from torch._subclasses import FakeTensorMode

    mode = FakeTensorMode()
    try:
        with mode:
            return mode, [torch.empty(shape, device="cuda", dtype=dtype) for shape in shapes]
    except Exception as error:  # noqa: BLE001 - this torch makes no CUDA fake tensors without a GPU
        pytest.skip(f"no fake CUDA tensors here: {error}")


def test_estimate_call_prices_fake_cuda_tensors_at_cuda_rates(fake_cuda):
    mode, (a, b) = _fake_cuda_tensors((N, N), (N, N), dtype=torch.bfloat16)
    with mode:
        out = torch.mm(a, b)
    seconds = estimate_call(torch.ops.aten.mm.default, (a, b), {}, out)
    assert seconds == pytest.approx(MATMUL_FLOPS / H200_LIKE.half_flops_per_s + H200_LIKE.overhead_s)
    assert fake_cuda == [0]


def test_cost_annotation_uses_the_device_of_the_nodes_values(fake_cuda):
    from dtr_compile.passes.costs import annotate_costs
    from dtr_compile.passes.meta import DTR_META_KEY

    mode, (x, w) = _fake_cuda_tensors((N, N), (N, N))
    graph = fx.Graph()
    x_node, w_node = graph.placeholder("primals_1"), graph.placeholder("primals_2")
    mm = graph.call_function(torch.ops.aten.mm.default, (x_node, w_node))
    relu = graph.call_function(torch.ops.aten.relu.default, (mm,))
    graph.output((relu,))
    with mode:
        x_node.meta["val"], w_node.meta["val"] = x, w
        mm.meta["val"] = torch.mm(x, w)
        relu.meta["val"] = torch.relu(mm.meta["val"])
    gm = fx.GraphModule(torch.nn.Module(), graph)
    annotate_costs(gm, codegen="inductor")
    mm_cost, relu_cost = mm.meta[DTR_META_KEY].estimated_s, relu.meta[DTR_META_KEY].estimated_s
    assert mm_cost == pytest.approx(
        estimate_seconds(MATMUL_FLOPS, MATMUL_BYTES, device="cuda", dtype=torch.float32, fused=True)
    )
    assert relu_cost == pytest.approx(POINTWISE_BYTES / H200_LIKE.bytes_per_s + H200_LIKE.fused_overhead_s)
    assert mm_cost / relu_cost < _matmul_over_pointwise("cpu") / 5
    # The FX code generator runs the matmul as an eager call (a launch of its own); the relu, which the recompute
    # kernels fuse when it is recomputed, keeps the fused cost.
    annotate_costs(gm, codegen="fx")
    assert mm.meta[DTR_META_KEY].estimated_s == pytest.approx(
        mm_cost - H200_LIKE.fused_overhead_s + H200_LIKE.overhead_s
    )
    assert relu.meta[DTR_META_KEY].estimated_s == pytest.approx(relu_cost)


def test_cuda_dropout_needs_no_workspace_unlike_cpu_dropout(fake_cuda):
    """aten's CPU dropout makes a float copy of its mask (measured); its CUDA kernels write output and mask."""
    import operator

    from torch._subclasses import FakeTensorMode

    from dtr_compile.passes.costs import annotate_costs
    from dtr_compile.passes.meta import DTR_META_KEY

    def dropout_workspaces(x: torch.Tensor, mode) -> list[int]:
        graph = fx.Graph()
        x_node = graph.placeholder("primals_1")
        dropout = graph.call_function(torch.ops.aten.native_dropout.default, (x_node, 0.2, True))
        mask = graph.call_function(operator.getitem, (dropout, 1))
        backward = graph.call_function(torch.ops.aten.native_dropout_backward.default, (x_node, mask, 1.25))
        graph.output((backward,))
        with mode:
            x_node.meta["val"] = x
            dropout.meta["val"] = torch.ops.aten.native_dropout.default(x, 0.2, True)
            mask.meta["val"] = dropout.meta["val"][1]
            backward.meta["val"] = torch.empty_like(x)
        annotate_costs(fx.GraphModule(torch.nn.Module(), graph))
        return [dropout.meta[DTR_META_KEY].workspace_bytes, backward.meta[DTR_META_KEY].workspace_bytes]

    cpu_mode = FakeTensorMode()
    with cpu_mode:
        cpu = torch.empty(N, N)
    assert dropout_workspaces(cpu, cpu_mode) == [cpu.nbytes, cpu.nbytes]
    mode, (x,) = _fake_cuda_tensors((N, N))
    assert dropout_workspaces(x, mode) == [0, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a real CUDA device")
def test_measured_cuda_rates_are_plausible(monkeypatch):
    monkeypatch.setattr(roofline, "_cuda_rates", {})
    settings = _matmul_settings()
    rng = torch.cuda.get_rng_state()
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")  # cuBLAS's workspace, kept by any matmul
    allocated = torch.cuda.memory_allocated()
    rates = rates_for(torch.device("cuda"))
    assert rates is not FALLBACK_CUDA_RATES, "the measurement failed"
    for rate in (rates.fp32_flops_per_s, rates.tf32_flops_per_s, rates.half_flops_per_s):
        assert 1e12 <= rate <= 1e16
    assert 1e11 <= rates.bytes_per_s <= 1e13
    assert rates.half_flops_per_s > rates.fp32_flops_per_s
    assert rates.tf32_flops_per_s >= 0.8 * rates.fp32_flops_per_s  # equal where no TF32 units exist
    # the program's state is as it was: TF32 setting, random stream, allocated bytes
    assert _matmul_settings() == settings
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    assert torch.cuda.memory_allocated() == allocated
    assert rates_for("cuda") is rates  # cached
