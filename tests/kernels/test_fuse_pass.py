"""The fusion pass on planned graphs: when it steps aside and why, what it leaves alone, its settings."""

from __future__ import annotations

import pytest
import torch
from kernel_harness import compiled_step, gpt2_blocks

from dtr_compile.errors import ConfigError
from dtr_compile.passes.fuse_recompute import fuse_recomputes
from dtr_compile.passes.rewrite import RECOMPUTE_META_KEY


@pytest.fixture(scope="module")
def planned():
    """A plan with recomputes (two GPT-2-style blocks with dropout at budget 0.5), made with kernels off."""
    model, x = gpt2_blocks(dropout=0.1)
    _, _, report = compiled_step(model, x, 0.5, "off")
    assert any(RECOMPUTE_META_KEY in n.meta for n in report.planned.graph.nodes)
    return report


def _fuse(report, **settings):
    return fuse_recomputes(
        report.planned, num_fwd_outputs=report.num_fwd_outputs, budget_bytes=report.budget_bytes, **settings
    )


def test_steps_aside_under_inductor_and_says_why(planned) -> None:
    fusion = _fuse(planned, codegen="inductor", mode="auto")
    assert not fusion.enabled and "Inductor" in fusion.reason
    assert fusion.graph is planned.planned and not fusion.regions
    with pytest.warns(UserWarning, match="codegen='fx'"):
        assert not _fuse(planned, codegen="inductor", mode="triton").enabled


def test_off_and_auto_on_cpu_leave_the_plan_alone(planned) -> None:
    for mode in ("off", "auto"):
        fusion = _fuse(planned, codegen="fx", mode=mode)
        assert not fusion.enabled and fusion.graph is planned.planned


def test_the_plan_is_not_modified_and_unsupported_recomputes_are_named(planned) -> None:
    before = planned.planned.code
    fusion = _fuse(planned, codegen="fx", mode="triton")
    assert planned.planned.code == before
    assert fusion.enabled and fusion.regions
    reasons = dict(fusion.unfused)
    assert any("aten.addmm" in why or "aten.mm" in why for why in reasons.values())
    replaced = {m for region in fusion.regions for m in region.members}
    remaining = {n.name for n in fusion.graph.graph.nodes}
    assert not replaced & remaining  # each fused member is gone, its readers read the kernel's outputs
    assert fusion.peak.peak_bytes <= planned.budget_bytes


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(planned, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        _fuse(planned, codegen="fx", mode="triton")


def test_kernel_sources_need_no_triton_import(planned) -> None:
    """The pass writes kernel sources without importing triton: each is a @triton.jit function of its program."""
    fusion = _fuse(planned, codegen="fx", mode="triton")
    source = fusion.regions[0].kernel.source()
    assert "@triton.jit" in source and "tl.store" in source
    assert torch.ops.aten.addmm.default not in {n.target for r in fusion.regions for n in r.unfused.graph.nodes}
