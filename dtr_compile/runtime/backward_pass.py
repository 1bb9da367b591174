"""Is the autograd engine running a backward pass on this thread now, and does that pass keep its graph?

The runtime records differently inside a backward (its ops are never rerun; gradient sums are accumulations, not
new values; a region's forward called from a backward is a recompute), and asks in many places. One function each,
so that the private APIs they read (`torch._C._current_graph_task_id`: -1 outside a backward pass;
`torch._C._autograd._get_current_graph_task_keep_graph`: the pass's `retain_graph`; both in every release from 2.11
to 2.15) are named once.
"""

from __future__ import annotations

import torch


def in_backward_pass() -> bool:
    return torch._C._current_graph_task_id() != -1


def backward_keeps_graph() -> bool:
    """Does the backward pass running on this thread keep its graph (`retain_graph=True`, or `create_graph=True`)?
    Its saved values then outlive it: a compiled backward frees none of them as it goes. False outside a pass."""
    return in_backward_pass() and torch._C._autograd._get_current_graph_task_keep_graph()
