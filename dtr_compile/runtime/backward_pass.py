"""Is the autograd engine running a backward pass on this thread now?

The runtime records differently inside a backward (its ops are never rerun; gradient sums are accumulations, not
new values; a region's forward called from a backward is a recompute), and asks in many places. One function, so
that the private API it reads (`torch._C._current_graph_task_id`: -1 outside a backward pass, in every release from
2.11 to 2.15) is named once.
"""

from __future__ import annotations

import torch


def in_backward_pass() -> bool:
    return torch._C._current_graph_task_id() != -1
