"""What a benchmark runs: the grid of (model, method, budget) and how each run is set up.

Budget-independent methods (plain eager, per-block checkpoint) run once per model. The baseline (plain
eager) always runs, first for its model: its measured peak turns the budget fractions into bytes and its
loss and gradients are the correctness reference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .methods import BASELINE, METHODS

AUTOCAST = ("bf16",)  # what may follow "+" in a model key: "gpt2+bf16" is GPT-2 under bf16 autocast


def split_model_key(key: str) -> tuple[str, str | None]:
    """("gpt2", None) for "gpt2", ("gpt2", "bf16") for "gpt2+bf16": the model and its autocast dtype."""
    name, _, dtype = key.partition("+")
    if dtype and dtype not in AUTOCAST:
        raise ValueError(f"model key {key!r}: unknown autocast dtype {dtype!r}; expected one of {', '.join(AUTOCAST)}")
    return name, dtype or None


@dataclass(frozen=True)
class Grid:
    models: Sequence[str]  # model keys: a model name, optionally "+bf16" (autocast); each has its own baseline
    methods: Sequence[str]
    budgets: Sequence[float]  # fractions of plain eager's measured peak
    size: str = "quick"
    device: str = "cpu"
    threads: int = 1  # torch threads in every child
    warmup: int = 2  # untimed steps; the first includes any compile
    steps: int = 5  # timed steps; the median is reported
    seed: int = 0
    timeout_s: float = 600.0
    jobs: int = 1  # children running at once
    # Which step time the ratios use: "wall" (what a user waits for), or "cpu", this process's CPU time, which
    # other processes on a shared machine barely disturb (one thread only: with more it sums their times).
    clock: str = "wall"
    # True: every child compiles with empty Inductor/Triton caches, so compile_s is a cold compile. False: the
    # user's on-disk caches, warm from earlier runs (what a second run of a training script sees).
    fresh_cache: bool = False
    # Per-method restrictions (the --quick grid compiles Inductor only once or twice): the models a method
    # runs on, and the budgets it runs at. A method absent from a mapping runs on all of them.
    only_models: Mapping[str, Sequence[str]] = field(default_factory=dict)
    only_budgets: Mapping[str, Sequence[float | None]] = field(default_factory=dict)
    # The method every ratio, byte budget and gradient comparison refers to (the frontier uses "compile").
    baseline: str = BASELINE
    # Methods whose budget-infeasible runs are run once more at the floor their BudgetError named (the frontier:
    # "a budget below the floor names the floor, and that named floor runs"); such runs follow the planned ones.
    retry_at_floor: Sequence[str] = ()
    # Equal-memory comparisons (issue 17: "at checkpointing's measured peak, step time <= 1.00x checkpointing's"):
    # once a peer method's run ends, `match_method` runs at that run's measured peak times each multiple, in one
    # process with the peer, their steps interleaved, so the two step times are measured side by side. Peer
    # method -> multiples of its peak. A peer run that saves less than `match_min_saving` of the baseline's peak (a knob
    # value that recomputes nothing) gets no match: it is the baseline's point, not a memory level.
    match_method: str | None = None
    match_peers: Mapping[str, Sequence[float]] = field(default_factory=dict)
    match_min_saving: float = 0.02

    def runs_for(self, model: str) -> list[tuple[str, float | None]]:
        """(method, budget) pairs of one model, baseline first; budget-independent methods run once."""
        pairs: list[tuple[str, float | None]] = [(self.baseline, None)]
        name = split_model_key(model)[0]
        for method in self.methods:
            if method == self.baseline or name not in self.only_models.get(method, [name]):
                continue
            if METHODS[method].uses_budget:
                pairs.extend((method, b) for b in self.only_budgets.get(method, self.budgets))
            else:
                pairs.append((method, None))
        return pairs

    def plan(self) -> list[tuple[str, str, float | None]]:
        """Every run as (model, method, budget), in table order."""
        return [(model, method, budget) for model in self.models for method, budget in self.runs_for(model)]
