"""A lower bound on the budget any eviction policy needs to replay a trace.

Constants are pinned from their creation to the end; each operation needs its inputs and its fresh
outputs resident at once; the outputs still alive at the end are pinned together. So no policy, online
or planned, can run under

    max( max over ops of (constants so far + the op's distinct non-constant inputs + its outputs),
         all constants + the distinct outputs alive at the end ).

A budget below this bound fails for every heuristic: the table marks such cells as infeasible.
"""

from __future__ import annotations

from itertools import accumulate

from .schedule import Schedule


def lower_bound_bytes(sched: Schedule) -> int:
    """The bound above, in bytes."""
    constant_prefix = [0, *accumulate(size if const else 0 for size, const in zip(sched.sizes, sched.constant))]
    bound = 0
    for op in sched.ops:
        inputs = sum(sched.sizes[k] for k in set(op.inputs) if not sched.constant[k])
        outputs = sum(sched.sizes[k] for k in op.outputs)
        bound = max(bound, constant_prefix[op.created_before] + inputs + outputs)
    live_end = sum(sched.sizes[k] for k in sched.final_live if not sched.constant[k])
    return max(bound, constant_prefix[-1] + live_end)
