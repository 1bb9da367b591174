"""What the parent asks of a child run, and the statuses a run can end with.

The parent serializes a `RunSpec` to JSON on the child's command line; the child prints one JSON line,
`{"dtr_bench_result": {...}}`, with the fields of `RESULT_FIELDS` it could fill.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

RESULT_KEY = "dtr_bench_result"

# How a run ended. "not built": the method's code is missing from the tree. "infeasible": the method said the
# budget cannot be met (BudgetError) or would thrash (ThrashError). "timeout": killed after --timeout seconds.
STATUSES = ("ok", "not built", "infeasible", "error", "timeout")


@dataclass(frozen=True)
class RunSpec:
    model: str
    size: str
    method: str
    budget: float | None  # nominal fraction of the grid; None for budget-independent methods
    budget_bytes: int | None  # budget x the baseline's measured peak; None for the baseline itself
    device: str
    threads: int
    warmup: int  # steps before timing; the first one includes any compile
    steps: int  # timed steps; the median is reported
    seed: int
    reference: str  # file with the baseline's loss and gradients
    write_reference: bool  # True for the baseline run, which writes that file
    autocast: str | None = None  # "bf16": every step under torch.autocast(device type, torch.bfloat16)
    # A side-by-side pair: the peer method (at its own budget fraction) runs in the same process on a second copy
    # of the model, its steps interleaved with this method's, so the step-time ratio escapes the differences
    # between processes (10-30% on a shared CPU, in CPU time too).
    peer: str | None = None
    peer_budget: float | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls(**json.loads(text))

    @property
    def key(self) -> str:
        budget = "-" if self.budget is None else f"{self.budget:g}"
        dtype = f"+{self.autocast}" if self.autocast else ""
        return f"{self.model}{dtype}/{self.method}@{budget}"
