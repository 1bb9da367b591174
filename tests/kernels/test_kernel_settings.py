"""Settings and messages of the recompute kernels that hold with or without triton installed (no kernel runs)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dtr_compile import config
from dtr_compile.errors import ConfigError
from dtr_compile.kernels import RecomputeKernel, import_triton
from dtr_compile.kernels.lower_fx import lower_nodes


def test_flag_values_are_validated() -> None:
    assert config.recompute_kernels == "auto"  # the default: kernels only where they pay off (fx codegen, CUDA)
    with pytest.raises(ConfigError, match="'auto', 'triton' or 'off'"):
        config.recompute_kernels = "always"
    with config.patch(recompute_kernels="off"):
        assert config.recompute_kernels == "off"
    assert config.recompute_kernels == "auto"


def test_asking_for_triton_without_triton_says_how_to_fix_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match=r"1\. pip install"):
        config.patch(recompute_kernels="triton")
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now fails as if it were not installed
    with pytest.raises(ImportError, match="recompute_kernels = 'off'"):
        import_triton()


def test_kernel_source_is_generated_without_running_anything() -> None:
    x = torch.randn(4, 16)
    gm = make_fx(lambda x: (torch.softmax(x * 2, -1),), tracing_mode="fake")(x)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    program, inputs, _ = lower_nodes(nodes, [nodes[-1]])
    source = RecomputeKernel(program).source()
    assert [n.name for n in inputs] == ["x_1"]
    assert "@triton.jit" in source and "tl.max" in source and "tl.sum" in source and source.count("tl.store") == 1
