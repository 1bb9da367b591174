"""FX passes of the compiled path, in the order they run on AOTAutograd's joint graph:

1. `annotate_costs` (costs.py): `node.meta["dtr"]` = `NodeCost` on every node.
2. `plan_schedule` (planner.py): search over what the forward saves; each candidate is the schedule of
   schedule.py (recomputes right before first use) judged by its exact simulated peak.
3. `emit_plan` (rewrite.py): the plan as a new joint graph, recomputes placed before first use.
4. `schedule_peak` (peak.py): modelled peak of forward + backward + recomputes + gradients (for Inductor,
   with the pointwise ops it inlines allocating nothing and running where their reader needs them,
   inlining.py).
5. `fuse_recomputes` (fuse_recompute.py): one Triton kernel per region of recomputes (config.recompute_kernels;
   steps aside under Inductor and on CPU by default).
6. `split_joint` (partition.py): forward and backward graphs for AOTAutograd; for plans held by the exact
   memory model under Inductor, `pin_values_before_recomputes` (realize.py) then makes Inductor compute each
   value made before a recompute and read after it where the plan computes it.

`DTRPartitioner` runs them all as AOTAutograd's `partition_fn`. Under Inductor, fusion_guard.py keeps
Inductor's fusions from moving nodes away from their planned place, and verify.py measures the compiled
region once and plans again, tighter, if it exceeds the budget.
"""

from .costs import annotate_costs
from .fuse_recompute import FusionReport, fuse_recomputes
from .meta import DTR_META_KEY, NodeCost, cost_of
from .partition import DTRPartitioner, PlanReport, plan_joint, split_joint
from .peak import PeakModel, schedule_peak
from .planner import Plan, plan_schedule
from .rewrite import emit_plan

__all__ = [
    "DTR_META_KEY",
    "DTRPartitioner",
    "FusionReport",
    "NodeCost",
    "PeakModel",
    "Plan",
    "PlanReport",
    "annotate_costs",
    "cost_of",
    "emit_plan",
    "fuse_recomputes",
    "plan_joint",
    "plan_schedule",
    "schedule_peak",
    "split_joint",
]
