"""Reproduce, on CPU, the gap between a plan's compile-time measurement and its step (BENCHMARKS section 7, H200 of
2026-11-28): the frontier's GPT-2 stand-in (8 x 256, seq 256, vocab 2048, batch 4), the loss computed outside the
model as `cross_entropy(model(ids).logits, labels)`, Inductor, a budget in bytes. Prints the step's measured peak,
the plan (`measured X of Y` is verify.py's measurement), the tail the runtime learned and the one the plan used.

    python tools/tail_gap_probe.py 114286864                                   # torch 2.13
    PYTHONPATH=. /tmp/fresh/.venv-torch-2.11.0/bin/python tools/tail_gap_probe.py 114286864   # torch 2.11

(any torch 2.11 environment: CI's compatibility stage makes one in its clone). Under torch 2.11 (the lent GPUs'
release) the first step showed the loss whole, and the tail it learned counted the logits twice (24 MiB where the
loss holds 16 above the forward's end): the plan measured 107.19 MiB at compile time and the step 96.9-99.2, 0.89-0.91
of the budget, the gap the H200 showed at full size. The memory window's peak is now net of what the program dropped
(engine/window.py): 16 MiB learned under both releases, 0.942 (2.11) and 0.960 (2.13) of the budget.
"""

import sys

import torch
import torch.nn.functional as F
import transformers

import dtr_compile
from dtr_compile.measure import measure_peak
from dtr_compile.passes import running_plans
from dtr_compile.runtime.implicit import implicit_runtime

VOCAB, BATCH, SEQ = 2048, 4, 256


def main(budget: int) -> None:
    torch.set_num_threads(1)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=256, n_layer=8, n_head=4, n_positions=SEQ,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)

    def step(run: torch.nn.Module) -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(run(input_ids=ids).logits.reshape(-1, VOCAB), labels.reshape(-1)).backward()

    with dtr_compile.config.patch(memory_budget=budget, codegen="inductor"):
        compiled = torch.compile(model, backend="dtr")
        for _ in range(3):
            step(compiled)
        _, measured = measure_peak(lambda: step(compiled))
    print(f"torch {torch.__version__}: step {measured.peak_bytes / 2**20:.2f} MiB = {measured.peak_bytes / budget:.3f} "
          f"of the {budget / 2**20:.2f} MiB budget")  # fmt: skip
    print(running_plans.summary())
    print("learned tails:", implicit_runtime().tails.learned)
    for name, report in running_plans.running().items():
        print(f"{name}: planned with {report.tail}, outputs dropped before the backward: {report.loop_drops_outputs}")


if __name__ == "__main__":
    main(int(sys.argv[1]))
