"""A compiled forward's output slices (runtime/slices.py): the room a recompute of one output reserves."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from dtr_compile.measure import measure_peak
from dtr_compile.runtime.slices import output_slices

N = 64 * 1024  # elements of each intermediate: 256 KiB in fp32


def _chain(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain of four intermediates, each read only by the next (one through a view), then the output: a
    slice as long as an attention block's, in miniature."""
    a = x * 2
    b = a.tanh().view(-1)
    c = b + w
    d = c.exp()
    return d * 3, x.sum()


def test_a_slice_reserves_what_its_intermediates_hold_at_once_not_their_sum() -> None:
    """Each intermediate is freed after its last reader (FX's generated code frees it), so at most two are live at
    once (the one read and the one made): 2 x 256 KiB, where their sum is 4 x 256 KiB. The sum overstated GPT-2's
    slice through an attention block 33.1 MiB against 12.8 (CPU stand-in, batch 12), and the runtime's first step
    then evicted values only a rerun of the whole forward brings back, and overran its budget."""
    x, w = torch.randn(N), torch.randn(N)
    gm = make_fx(_chain)(x, w)
    out_slice = output_slices(gm)[0]
    assert out_slice is not None
    nbytes = N * 4
    assert out_slice.workspace_bytes == 2 * nbytes

    # Still a bound: running the slice allocates no more than its workspace and its output.
    args = [x if kind == ("input", 0) else w for kind in out_slice.boundaries]
    assert out_slice.boundaries == (("input", 0), ("input", 1))
    (result,), measured = measure_peak(lambda: (out_slice.module(*args),))
    assert measured.peak_bytes <= out_slice.workspace_bytes + nbytes, measured
    torch.testing.assert_close(result, _chain(x, w)[0])
