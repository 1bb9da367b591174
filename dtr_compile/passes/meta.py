"""The one record every joint-graph node carries under `node.meta["dtr"]`, and how to read it.

The cost pass writes it, the planner and `explain` read it. PyTorch's own keys (`val`, `stack_trace`,
`partitioner_tag`) are only read, never overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import fx

DTR_META_KEY = "dtr"

Phase = Literal["input", "forward", "backward", "output"]


@dataclass(frozen=True)
class NodeCost:
    """Cost metadata of one node of the joint forward/backward graph."""

    phase: Phase  # which side of the joint graph the node sits on
    out_bytes: int  # bytes newly allocated by the node (0 for views, getitem and inputs)
    workspace_bytes: int  # temporaries the kernel allocates and frees while it runs (known ops only)
    flops: int  # floating-point operations (matmul/conv/attention by formula, 0 for memory-bound ops)
    bytes_moved: int  # bytes read and written (the cost model of memory-bound ops)
    estimated_s: float  # modelled run time in seconds
    measured_s: float | None  # measured run time on real tensors, when cost mode "measure" ran
    recomputable: bool  # may the planner run this node again instead of keeping its output
    why_not: str | None  # when not recomputable: the reason, for `explain`
    needs_rng_replay: bool  # a random op: recomputed only with its saved RNG state replayed
    source: str | None  # "file:line in function" of the user code that created the node

    @property
    def time_s(self) -> float:
        """The time the planner uses: measured when available, else estimated."""
        return self.measured_s if self.measured_s is not None else self.estimated_s


def cost_of(node: fx.Node) -> NodeCost:
    """The record of `node`; raises with the node when the cost pass has not run on it."""
    try:
        return node.meta[DTR_META_KEY]
    except KeyError:
        raise KeyError(
            f"node has no {DTR_META_KEY!r} record; run dtr_compile.passes.annotate_costs first: {node.format_node()}"
        ) from None
