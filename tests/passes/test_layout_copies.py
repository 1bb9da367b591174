"""The channels-last copies Inductor's code makes of a convolution network's inputs, in the Inductor memory models.

Oracle: which placeholders Inductor's rule names (the batch and each 2-D convolution's weight: kernel/conv.py's
`require_channels_last`; not a batch norm's or a Linear's parameters), none where its layout optimization is off; and
the two Inductor models (peak.py over an emitted plan, schedule.simulate over the planner's trace) agreeing byte for
byte with the copies counted, which hold exactly their bytes more than the same models without them.
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import decomposed_joint, trace_as_plan
from torch import nn

from dtr_compile.passes import emit_plan, schedule_peak
from dtr_compile.passes.costs import annotate_costs
from dtr_compile.passes.inlining import FUSED_RECOMPUTE
from dtr_compile.passes.layout_copies import layout_copied_inputs
from dtr_compile.passes.schedule import JointFacts, build_trace, simulate
from dtr_compile.tensor_bytes import tensor_nbytes

pytestmark = pytest.mark.compat  # GraphLowering.decide_layout_opt: a private Inductor name, read on every release


def _conv_net() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    return model, torch.randn(4, 3, 16, 16)


def _forward_and_inputs(joint):
    return [n for n in joint.graph.nodes if n.meta.get("partitioner_tag") != "is_backward" and n.op != "output"]


def _copied_names(joint) -> list[tuple[tuple[int, ...], str]]:
    return [(tuple(n.meta["val"].shape), n.name) for n in layout_copied_inputs(_forward_and_inputs(joint))]


def test_the_batch_and_each_convolution_weight_are_copied() -> None:
    joint, _ = decomposed_joint(*_conv_net())
    shapes = [shape for shape, _ in _copied_names(joint)]
    assert sorted(shapes) == sorted([(16, 3, 3, 3), (4, 3, 16, 16), (16, 16, 3, 3)]), shapes


def test_nothing_is_copied_without_layout_optimization() -> None:
    joint, _ = decomposed_joint(*_conv_net())
    with torch._inductor.config.patch(layout_optimization=False):
        assert layout_copied_inputs(_forward_and_inputs(joint)) == []


def test_an_input_already_channels_last_is_not_copied() -> None:
    model, batch = _conv_net()
    model = model.to(memory_format=torch.channels_last)
    joint, _ = decomposed_joint(model, batch.contiguous(memory_format=torch.channels_last))
    assert _copied_names(joint) == []


@pytest.mark.parametrize("inductor", [True, FUSED_RECOMPUTE])
def test_both_inductor_models_count_the_copies_alike(inductor: bool | str) -> None:
    joint, n_out = decomposed_joint(*_conv_net())
    annotate_costs(joint, codegen="inductor")
    facts = JointFacts(joint, n_out)
    copy_bytes = sum(tensor_nbytes(n.meta["val"]) for n in layout_copied_inputs(_forward_and_inputs(joint)))
    assert copy_bytes > 0
    rng = random.Random(0)
    for trial in range(4):
        dropped = {n for n in facts.candidates if rng.random() < trial / 4}
        trace = build_trace(facts, dropped)
        planned = emit_plan(joint, trace_as_plan(trace), num_fwd_outputs=n_out)
        modelled = schedule_peak(planned, num_fwd_outputs=n_out, inductor=inductor)
        assert simulate(facts, trace, inductor=inductor).peak == modelled.peak_bytes, trial
        if trial == 0:  # everything saved: the peak is in the backward's first op, every copy still read after it
            with torch._inductor.config.patch(layout_optimization=False):
                without = schedule_peak(planned, num_fwd_outputs=n_out, inductor=inductor)
                assert simulate(JointFacts(joint, n_out), trace, inductor=inductor).peak == without.peak_bytes
            assert modelled.peak_bytes - without.peak_bytes == copy_bytes
