"""Run a function on 2 ranks of a gloo process group on CPU, each in its own spawned process.

`run_ranks(fn, *args)` starts `world` processes (torch.multiprocessing, "spawn": a fresh interpreter, so no
TorchDynamo or dtr_compile state leaks in from the test process), initializes `torch.distributed` with gloo on a
free local port, calls `fn(rank, world, *args)` in each, and returns what each returned, by rank. A rank that
raises sends back its traceback, and `run_ranks` raises `RankFailed` with it (the test then shows where a rank
failed, not a hang). `fn` must be importable by name (a module-level function) and return picklable values.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


class RankFailed(AssertionError):
    """A rank raised; the message holds its traceback."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # 2 ranks share the 2 cores of the CI machine
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        try:
            queue.put((rank, True, fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - any failure goes back to the test as a traceback
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], *args: Any, world: int = 2, timeout: float = 600.0) -> list[Any]:
    """`[fn(0, world, *args), fn(1, world, *args), ...]`, each run on its own rank of a gloo process group."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_entry, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in processes:
            rank, ok, value = queue.get(timeout=timeout)
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank} raised:\n{value}")
                break  # the other rank may wait forever in a collective
    finally:
        for process in processes:
            process.join(timeout=5 if failures else timeout)
            if process.is_alive():
                process.kill()
                process.join()
    if failures:
        raise RankFailed("\n".join(failures))
    return [results[r] for r in range(world)]
