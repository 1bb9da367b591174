#!/bin/bash
# One prepared call for a lent GPU (issue 17's claims are GPU claims): the GPU test suite, then the full-size
# frontier one method at a time, so that its step times are side by side. Everything lands under $OUT (or ./gpu-out).
#
#   bash tools/gpu_check.sh                  # about 9.5 minutes on an H100 with cold caches: run it with timeout_s 600
#   FRONTIER_S=0 bash tools/gpu_check.sh     # the tests only
#   TESTS_S=0 FRONTIER_S=0 PAIR_PROFILE_S=150 bash tools/gpu_check.sh
#                                            # checkpointing, then selective checkpointing (PAIR_PEERS; "knob" for the
#                                            # knob at 0.5), each against backend="dtr" at its peak, profiled
#                                            # (tools/pair_profile.py: kernels against the runtime's Python)
#   TESTS_S=0 METHODS="compile hf_ckpt_compile dtr_inductor" FRONTIER_S=240 bash tools/gpu_check.sh
#                                            # checkpointing alone and backend="dtr" at its peak and twice it
#   TESTS_S=0 MODELS="llama_lora" METHODS="compile hf_ckpt_compile dtr_inductor" FRONTIER_S=300 bash tools/gpu_check.sh
#                                            # the same pair on Llama with LoRA adapters (MODELS: gpt2 by default;
#                                            # PAIR_MODEL likewise for the profiled pairs)
#   TESTS_S=0 FRONTIER_S=0 LIVE_S=200 bash tools/gpu_check.sh
#                                            # a tight plan's buffers under Triton against its model (LIVE_ARGS:
#                                            # tools/inductor_live.py's flags; Llama with LoRA at 0.3 by default)
#   TESTS_S=0 FRONTIER_S=0 LIVE_S=150 LIVE_ARGS="--model resnet --size full --fraction 0.6" bash tools/gpu_check.sh
#                                            # a CNN's plan: Inductor's channels-last copies of the batch and of the
#                                            # convolution weights, which no memory model counts yet (on the CPU
#                                            # stand-in 0.84 of 10 MiB: BENCHMARKS.md, stop 50), against the model
#
# The frontier runs torch.compile, per-block checkpointing, the knob at 0.5 and selective checkpointing (METHODS;
# the knob before selective checkpointing: its pair is one of issue 17's targets),
# each alone, then backend="dtr" with no budget (and at BUDGETS, fractions of torch.compile's peak, when set), and
# backend="dtr" at each peer's measured peak, in one process with that peer (the equal-memory pairs: their step-time
# ratio is issue 17's claim). Each pair starts as soon as its peer's run ends (bench/runner.py), so a frontier cut by
# FRONTIER_S loses the planned runs last in line (backend="dtr" with no budget: met in every GPU run so far), not a
# pair. On an H100 (2026-11-27) the tests took 83 s and each frontier run 43-51 s alone, 59-79 s
# as a pair: nine runs need about 490 s, and the 15 minutes of a session hold this call once, with about 4 minutes to
# spare for a second, shorter one (FRONTIER_S, --methods cut to what is missing).
#
# The second H100 session (04:35 UTC) saw a pair take 114 s (our first call 51.7 s of it) and the next one killed by
# the old 120 s limit per run: each run now gets 200 s.
# Lessons of the first GPU session: run the frontier with --jobs 1 (four runs at once shared the GPU and made every
# time ratio meaningless); torch.compile's first call took 20-56 s per process there; an infeasible budget is rerun
# at the floor its BudgetError names, so give the frontier room for one more run per model.
# The H200 session of 2026-11-28 15:55 UTC: tests 63 s; FRONTIER_S=470 held torch.compile, checkpointing, selective
# checkpointing and their three pairs; the knob and dtr with no budget were cut (hence the knob now runs earlier).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
start=$(date +%s)
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || echo "install failed: $OUT/install.log"
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
parallel=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")  # pytest-xdist, where installed
if [ "${TESTS_S:-90}" -gt 0 ]; then
  timeout "${TESTS_S:-90}" python3 -m pytest -m gpu tests/gpu tests/test_roofline_devices.py -q $parallel \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|^E " | head -40
fi
echo "tests done at $(( $(date +%s) - start )) s"
if [ "${FRONTIER_S:-490}" -gt 0 ]; then
  DTR_COMPILE_CACHE_DIR=$(mktemp -d) timeout "${FRONTIER_S:-490}" python3 -m dtr_compile.bench --frontier \
    --size full --models ${MODELS:-gpt2} --dtypes ${DTYPES:-fp32} --methods ${METHODS:-compile hf_ckpt_compile amb_inductor sac_compile dtr_inductor} \
    --knob 0.5 --dtr-budgets ${BUDGETS-} --steps 10 --jobs 1 --timeout 200 --out "$OUT/frontier" \
    2>&1 | tr '\r' '\n' | grep -v '^\s*$' | tee "$OUT/frontier.log" | grep -v "^|"
fi
# Where each equal-memory pair spends its time, kernel by kernel, at the frontier's full size: pair_profile.py takes
# the models' own size keys, where the frontier's "full" is "124m" ("full" there is a 6 x 256 model).
if [ "${PAIR_PROFILE_S:-0}" -gt 0 ]; then
  for peer in ${PAIR_PEERS:-checkpoint sac}; do  # PAIR_PROFILE_S each
    DTR_COMPILE_CACHE_DIR=$(mktemp -d) timeout "$PAIR_PROFILE_S" python3 tools/pair_profile.py --peer "$peer" \
      --model "${PAIR_MODEL:-gpt2}" --size 124m > "$OUT/pair_profile_$peer.log" 2>&1
    grep -E "'s peak|^median|^region" "$OUT/pair_profile_$peer.log"
  done
fi
if [ "${LIVE_S:-0}" -gt 0 ]; then  # Inductor's buffers at a tight plan's peak against the model's (tools/inductor_live.py)
  TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 DTR_COMPILE_CACHE_DIR=$(mktemp -d) timeout "$LIVE_S" python3 tools/inductor_live.py \
    ${LIVE_ARGS:---model llama_lora --size 124m --fraction 0.3} > "$OUT/inductor_live.log" 2>&1
  grep -E "budget|model|frame held" "$OUT/inductor_live.log"
fi
[ -f "$OUT/frontier/frontier.csv" ] && python3 -m dtr_compile.bench --frontier --report-only --out "$OUT/frontier" \
  > /dev/null 2>&1  # the tables and plot of the rows saved, also when the frontier was cut by its time limit
echo "all done at $(( $(date +%s) - start )) s"
