"""Run a grid: each (model, method, budget) in a fresh child process, a few at a time; one row per run.

A run waits for its model's baseline (budget bytes and reference gradients come from it); if the baseline
fails, the model's other runs become rows with status "error" and that reason, and nothing is started.
Runs planned from another run's result (a rerun at a named floor; a run at a peer's measured peak, paired in one
process with that peer) start before the planned runs still waiting, with the exact bytes they were planned for;
their rows follow the planned ones.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from .grid import Grid, split_model_key
from .methods import METHODS
from .spec import RESULT_KEY, RunSpec

Progress = Callable[[str], None]
Row = dict[str, Any]


def run_grid(
    grid: Grid,
    workdir: Path,
    progress: Progress | None = None,
    on_row: Callable[[list[Row]], None] | None = None,
) -> list[Row]:
    """Run every (model, method, budget) of the grid; returns one row per run, in plan order.

    `workdir` holds the baselines' reference gradients; `on_row(rows_so_far)` is called after each run.
    """
    return _Scheduler(grid, workdir, progress or ProgressLine(), on_row).run()


class _Scheduler:
    """Starts ready runs in plan order, at most `grid.jobs` at once, and collects their rows."""

    def __init__(self, grid: Grid, workdir: Path, progress: Progress, on_row: Callable | None) -> None:
        self.grid, self.workdir, self.progress, self.on_row = grid, workdir, progress, on_row
        self.plan = grid.plan()
        self.pending = list(range(len(self.plan)))
        self.running: list[_Child] = []
        self.rows: dict[int, Row] = {}
        self.baselines: dict[str, Row] = {}  # model -> its baseline's row
        self.floors: dict[int, int] = {}  # plan index of a rerun at a named floor -> that floor in bytes
        self.exact: dict[int, int] = {}  # plan index -> the exact budget bytes it runs at (floors, matched peaks)
        self.extra: dict[int, Row] = {}  # plan index -> fields its row gets (what it was planned to match)

    def run(self) -> list[Row]:
        try:
            while self.pending or self.running:
                self._start_ready()
                for child in list(self.running):
                    row = child.poll()
                    if row is not None:
                        self.running.remove(child)
                        self._finish(child.index, row)
                if self.running:
                    now = time.perf_counter()
                    running = (f"{_key(*self.plan[c.index])} {now - c.start:4.0f}s" for c in self.running)
                    self.progress("\r" + "  ".join(running))
                    time.sleep(0.2)
        finally:
            for child in self.running:  # interrupted (Ctrl-C): leave no orphan children behind
                child.kill()
        return [self.rows[i] for i in range(len(self.plan))]

    def _start_ready(self) -> None:
        # Runs planned from another run's result (equal-memory pairs, reruns at a named floor) start before the
        # planned runs still waiting: a frontier cut by its time limit (a GPU's lease) then loses a planned run, not
        # the pair whose peer it already paid for. Rows keep their plan order whatever order they ran in.
        for index in sorted(self.pending, key=lambda i: i not in self.exact):
            model, method, budget = self.plan[index]
            baseline = self.baselines.get(model)
            if method != self.grid.baseline and baseline is None:
                continue  # waits for its model's baseline
            spec = _spec(self.grid, model, method, budget, baseline, str(self.workdir / f"reference-{model}.pt"))
            if index in self.exact:  # the exact bytes: budget x peak could round below them
                spec = dataclasses.replace(spec, budget_bytes=self.exact[index])
            if "matched_to" in self.extra.get(index, {}):  # the peer runs beside it, in its process
                peer = self.extra[index]
                spec = dataclasses.replace(spec, peer=peer["matched_to"], peer_budget=peer["matched_budget"])
            if baseline is not None and baseline["status"] != "ok":
                self.pending.remove(index)
                failed = {"status": "error", "reason": f"baseline failed: {baseline.get('reason')}"}
                self._finish(index, _row(spec, failed))
                continue
            if len(self.running) >= self.grid.jobs:
                return
            self.pending.remove(index)
            cache = self.workdir / f"compile-cache-{index}" if self.grid.fresh_cache else None
            self.running.append(_Child(index, spec, self.grid.timeout_s, cache))

    def _finish(self, index: int, row: Row) -> None:
        model, method, _ = self.plan[index]
        if method == self.grid.baseline:
            self.baselines[model] = row
        if index in self.floors:
            row["at_named_floor"] = True
        row.update(self.extra.get(index, {}))
        self._retry_at_floor(index, row)
        _add_ratios(row, self.baselines.get(model), self.grid.clock)
        self.rows[index] = row
        _add_peer_ratio(row, self.grid.clock)
        self._match_peer(index, row)
        width = len(str(len(self.plan)))
        self.progress(f"[{len(self.rows):>{width}}/{len(self.plan)}] {_key(*self.plan[index])}  {_summary(row)}\n")
        if self.on_row is not None:
            self.on_row([self.rows[i] for i in sorted(self.rows)])

    def _retry_at_floor(self, index: int, row: Row) -> None:
        """Plan one more run at the floor an infeasible run named (once per model and method, the highest floor:
        every budget below it names the same one), after the planned runs (tables group rows by model)."""
        model, method, _ = self.plan[index]
        floor, baseline = row.get("floor_bytes"), self.baselines.get(model)
        if method not in self.grid.retry_at_floor or row.get("status") != "infeasible" or not floor:
            return
        if index in self.floors or baseline is None or not baseline.get("peak_bytes"):
            return  # a rerun at a floor that still fails is reported, not retried again
        if any(self.plan[i][:2] == (model, method) and f >= floor for i, f in self.floors.items()):
            return
        self.floors[self._append(model, method, floor / baseline["peak_bytes"], int(floor))] = int(floor)

    def _match_peer(self, index: int, row: Row) -> None:
        """After a peer's planned run: the matched method at its measured peak x each multiple, each in one process
        with the peer, their steps interleaved (child.py)."""
        model, method, budget = self.plan[index]
        multiples, baseline = self.grid.match_peers.get(method), self.baselines.get(model)
        if not multiples or self.grid.match_method is None or index in self.extra or row.get("status") != "ok":
            return
        if baseline is None or not baseline.get("peak_bytes"):
            return
        if row["peak_bytes"] > (1.0 - self.grid.match_min_saving) * baseline["peak_bytes"]:
            return  # this peer run is the baseline's memory level: nothing to match
        for multiple in multiples:
            target = int(row["peak_bytes"] * multiple)
            peer = {"matched_to": method, "matched_budget": budget, "matched_multiple": multiple}
            self._append(model, self.grid.match_method, target / baseline["peak_bytes"], target, peer)

    def _append(self, model: str, method: str, budget: float | None, exact: int | None, extra: Row | None = None) -> int:
        self.plan.append((model, method, budget))
        index = len(self.plan) - 1
        self.pending.append(index)
        if exact is not None:
            self.exact[index] = exact
        if extra:
            self.extra[index] = extra
        return index


def _key(model: str, method: str, budget: float | None) -> str:
    return f"{model}/{method}@{'-' if budget is None else f'{budget:g}'}"


def _spec(grid: Grid, model: str, method: str, budget: float | None, baseline: Row | None, ref: str) -> RunSpec:
    budget_bytes = None
    if budget is not None and baseline is not None and baseline.get("peak_bytes"):
        budget_bytes = max(1, int(budget * baseline["peak_bytes"]))
    name, autocast = split_model_key(model)
    return RunSpec(
        model=name, size=grid.size, method=method, budget=budget, budget_bytes=budget_bytes,
        device=grid.device, threads=grid.threads, warmup=grid.warmup, steps=grid.steps, seed=grid.seed,
        reference=ref, write_reference=(method == grid.baseline), autocast=autocast,
    )  # fmt: skip


class _Child:
    """One child process: `python -m dtr_compile.bench.child <spec>`, its output in temporary files."""

    def __init__(self, index: int, spec: RunSpec, timeout_s: float, cache_dir: Path | None = None) -> None:
        self.index, self.spec, self.timeout_s = index, spec, timeout_s
        env = dict(os.environ)
        # The child must import this very package, wherever the command was started from.
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        # A fixed thread count for every pool, not only torch's: OpenMP in ATen and in Inductor's C++ kernels.
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(spec.threads)
        if cache_dir is not None:  # a cold compile: nothing reused from earlier runs
            env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir / "inductor")
            env["TRITON_CACHE_DIR"] = str(cache_dir / "triton")
        # Files, not pipes: a chatty child (Inductor logs) cannot block on a full pipe. Closed in _close().
        self._out: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self._err: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115
        cmd = [sys.executable, "-m", "dtr_compile.bench.child", spec.to_json()]
        self.start = time.perf_counter()
        self._proc = subprocess.Popen(cmd, stdout=self._out, stderr=self._err, env=env, text=True)

    def poll(self) -> Row | None:
        """The run's row once the child has ended (or was killed for its timeout), else None."""
        wall = time.perf_counter() - self.start
        if self._proc.poll() is None:
            if wall <= self.timeout_s:
                return None
            self._proc.kill()
            self._proc.wait()
            self._close()
            return _row(self.spec, {"status": "timeout", "reason": f"killed after {self.timeout_s:g} s"}, wall)
        self._out.seek(0)
        self._err.seek(0)
        stdout, stderr = self._out.read(), self._err.read()
        self._close()
        result = _parse_result(stdout)
        if result is None:
            tail = " | ".join(stderr.strip().splitlines()[-3:])
            result = {"status": "error", "reason": f"child exited with code {self._proc.returncode}: {tail[-500:]}"}
        return _row(self.spec, result, wall)

    def kill(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._close()

    def _close(self) -> None:
        self._out.close()
        self._err.close()


def _parse_result(stdout: str) -> Row | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith('{"' + RESULT_KEY):
            try:
                return json.loads(line)[RESULT_KEY]
            except (json.JSONDecodeError, KeyError):
                return None
    return None


def _row(spec: RunSpec, result: Row, wall_s: float = 0.0) -> Row:
    row: Row = {
        "model": spec.model, "dtype": spec.autocast or "fp32", "size": spec.size, "method": spec.method,
        "budget": spec.budget,
        "budget_bytes": spec.budget_bytes, "device": spec.device, "threads": spec.threads,
        "warmup": spec.warmup, "steps": spec.steps, "wall_s": round(wall_s, 2),
    }  # fmt: skip
    row.update(result)
    return row


def _add_ratios(row: Row, baseline: Row | None, clock: str) -> None:
    if row.get("status") != "ok" or not baseline or baseline.get("status") != "ok":
        return
    row["baseline_peak_bytes"] = baseline["peak_bytes"]
    key = "step_cpu_s" if clock == "cpu" else "step_s"
    row["baseline_step_s"] = baseline[key]
    row["peak_ratio"] = row["peak_bytes"] / max(baseline["peak_bytes"], 1)
    row["time_ratio"] = row[key] / max(baseline[key], 1e-12)
    row["clock"] = clock
    if METHODS[row["method"]].compiles and row.get("first_step_s") is not None:
        row["compile_s"] = max(0.0, row["first_step_s"] - row["step_s"])  # the first step's excess
    if row.get("budget_bytes"):
        row["within_budget"] = row["peak_bytes"] <= row["budget_bytes"]


def _add_peer_ratio(row: Row, clock: str) -> None:
    """A paired run's step time and peak over its peer's, both measured in its process (child.py)."""
    if row.get("status") != "ok" or row.get("peer_peak_bytes") is None:
        return
    row["peer_step_s"] = row["peer_step_cpu_s"] if clock == "cpu" else row["peer_step_wall_s"]
    row["peer_time_ratio"] = row["step_cpu_s" if clock == "cpu" else "step_s"] / max(row["peer_step_s"], 1e-12)
    row["peer_peak_ratio"] = row["peak_bytes"] / max(row["peer_peak_bytes"], 1)


def _summary(row: Row) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {' '.join(str(row.get('reason', '')).split())[:100]}  ({row['wall_s']:.0f}s)"
    mark = "correct" if row.get("correct") else "WRONG"
    ratios = f"peak x{row.get('peak_ratio', 1.0):.2f}  time x{row.get('time_ratio', 1.0):.2f}"
    return f"ok  {ratios}  {mark}  ({row['wall_s']:.0f}s)"


class ProgressLine:
    """Progress on stderr. On a terminal the line of running children is rewritten in place; in a log only
    finished runs are written, one line each."""

    def __init__(self) -> None:
        self._tty = sys.stderr.isatty()

    def __call__(self, text: str) -> None:
        if text.startswith("\r"):
            if self._tty:
                sys.stderr.write(text[:150] + "\x1b[K")
                sys.stderr.flush()
            return
        sys.stderr.write(("\r\x1b[K" if self._tty else "") + text)
        sys.stderr.flush()
