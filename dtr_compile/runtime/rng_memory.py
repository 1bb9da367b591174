"""The memory a random operation's saved RNG state takes, counted against the budget like any tensor.

A recompute of a random op (dropout) replays the generator state the op started from, so the state is saved
with the op's recipe for as long as the op may be recomputed. On CPU that state is the Mersenne Twister's
5,056-byte tensor, allocated in the step's own memory: uncounted, 13 dropouts held 64 KiB the runtime did not
see and a small transformer measured 1.41x its budget (issue 16, class 3). A CUDA generator's state is a
16-byte CPU tensor, outside the device memory a CUDA budget bounds, so it is not counted there.

- Before a random op runs, room is made for its state and for the two transient states a recompute's replay
  makes (the current state saved, then the op's installed and the saved one restored): `rng_workspace_bytes`.
- Once captured, the state is a pinned, counted engine storage, released when the state tensor dies (with the
  op's recipe): `hold_rng_state`.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..engine import Engine, Storage
    from .interface import RuntimeInterface
    from .recipe import RngState

_CPU_STATE_BYTES: int | None = None


def cpu_state_bytes() -> int:
    """Bytes of the CPU generator's state tensor (5,056 with torch's Mersenne Twister)."""
    global _CPU_STATE_BYTES
    if _CPU_STATE_BYTES is None:
        _CPU_STATE_BYTES = torch.get_rng_state().untyped_storage().nbytes()
    return _CPU_STATE_BYTES


def rng_workspace_bytes(device: torch.device) -> int:
    """Room a random op on `device` needs beyond its outputs for RNG states: its own saved state, and a
    recompute's two transient ones (`RngState.replay` saves the current state, and restoring it saves another)."""
    return 2 * cpu_state_bytes() if device.type == "cpu" else 0


def hold_rng_state(rt: RuntimeInterface, rng: RngState | None) -> None:
    """Count `rng`'s state tensor in the engine's memory until the tensor dies (the op's recipe with it)."""
    if rng is None or rng.device.type != "cpu" or rng.state.device.type != "cpu":
        return
    engine = rt.engine
    storage = engine.constant(rng.state.untyped_storage().nbytes(), counted=True)
    weakref.finalize(rng.state, _release, weakref.ref(engine), storage)


def _release(engine_ref: weakref.ref[Engine], storage: Storage) -> None:
    engine = engine_ref()
    if engine is not None and storage.resident:
        engine.release(storage)
