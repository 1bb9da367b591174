"""Record one training step as an operation log, then replay it offline under many budgets and heuristics.

    python examples/03_record_and_replay.py [--device cuda|cpu]   # default: cuda when a CUDA device is present

Step 1 runs a small residual MLP once under `dtr_compile.runtime.enable(memory_budget=None, log=...)`: no
rematerialization happens, but every aten call, its measured time and its output sizes are written in the
DTR authors' log format. Step 2 replays that log with `python -m dtr_compile.sim` (the same eviction engine
the runtime uses, without torch) at several fractions of the log's no-budget peak, once per heuristic.
Replay is deterministic and fast, so comparing policies on a recorded step costs no training time.
Runs on CPU in seconds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import dtr_compile
from dtr_compile.measure import add_device_argument, device_from_args

RATIOS = "0.3,0.4,0.5,0.7,1.0"
HEURISTICS = "dtr_eq,dtr_local,lru,size"


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def record(path: Path, device: torch.device) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), *[Block(256) for _ in range(6)], nn.Linear(256, 10)).to(device)
    x, y = torch.randn(512, 64).to(device), torch.randint(0, 10, (512,)).to(device)
    rt = dtr_compile.runtime.enable(memory_budget=None, log=str(path))
    with rt:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        loss_value = loss.item()
    # Runtime handles that outlive the step would log their release later; drop them before closing the log.
    del loss
    rt.close()  # finish (and flush) the compressed log
    print(f"recorded one step on {device} (loss {loss_value:.4f}) to {path} ({path.stat().st_size / 1024:.1f} KiB)")
    print(rt.stats())


def replay(path: Path) -> None:
    # The command line a user would type; the sim's Python API (dtr_compile.sim.replay) does the same.
    command = [sys.executable, "-m", "dtr_compile.sim", str(path), "--ratios", RATIOS, "--heuristic", HEURISTICS]
    print("\n$ " + " ".join(["python", *command[1:3], path.name, *command[4:]]))
    subprocess.run(command, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    device = device_from_args(parser, parser.parse_args().device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mlp-step.log.gz"
        record(path, device)
        replay(path)
    print("\nEach cell is the replay's overhead, (compute + recompute) / compute, at that fraction of the peak;")
    print("'oom' means nothing was left to evict, 'thrash' that recompute exceeded the original compute.")
    print("The replay's peak counts parameters and inputs (the log's CONSTANTs), as the DTR authors' simulator")
    print("does; the runtime's budget counts only what the step allocates, so the two peaks differ.")


if __name__ == "__main__":
    main()
