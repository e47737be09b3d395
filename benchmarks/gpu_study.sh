#!/usr/bin/env bash
# The GPU study: one prepared run on a machine with a GPU (sized for one H200), in order of value (docs/gpu_study.md):
#   (a) overlap: the 125M model against an emulated slow link (deepspeed_acco/bench/network/linkemu.py) at
#       three rates, DeepSpeed ZeRO-1, ShardedAdamW, DPU, ACCO and CO2 against their bounds;
#   (b) convergence: ShardedAdamW against ACCO (and CO2 if time allows) at 125M over 1,000 or more
#       updates on the Python standard library's sources.
# Each step runs under its own time cap; summary.txt is rewritten before and after every step, so a
# run killed at any point still returns everything before it. `--plan` prints the steps, their
# caps and the basis of each estimate; `--dry-run` runs every step on the CPU with the tiny model
# (well under a minute; tests/test_gpu_study.py runs it).
#
#   bash benchmarks/gpu_study.sh --plan       # the plan only (no GPU, no python needed)
#   bash benchmarks/gpu_study.sh              # the study, with CUDA torch
#   bash benchmarks/gpu_study.sh --dry-run    # the same steps on the CPU, tiny model
#   MICRO_BATCH=32 bash benchmarks/gpu_study.sh   # another micro-batch for both studies (default 16)
#
# On a GPU machine without a package index: run `bash benchmarks/gpu_wheels.sh` where pip reaches
# one first (deepspeed and its dependencies as wheels, into .whl/) and copy .whl/ into the checkout
# on the GPU machine.
#
# Output folder: $OUT when set, else build/gpu_study/<date-time>. At most six files, none in a
# subfolder:
#   summary.txt         one line per step (PASS / FAIL / NOT RUN / RUNNING), then the key tables
#   steps.log           every step's output, appended while it runs
#   environment.txt     GPU, driver, nvcc, python, torch (CUDA, NCCL), deepspeed, our modules
#   overlap.json        study (a): the floor, the links, every method's ms/update, bound and hidden share
#   trace_acco.json.gz  study (a): a Chrome/Perfetto trace of two ACCO updates on the slowest link
#   convergence.json    study (b): validation loss curves and the final gaps
# Exit status: 0 every step passed, 1 a step failed, 2 a step did not run (budget spent).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

# The plan, in order of value: name|cap in seconds|basis of the estimate. The caps sum to 480 s,
# so the whole study fits in 8 minutes. Nothing of this has run on a GPU yet: the bases are gpu_check.sh's
# estimates, measurements on this project's CPU machines, and arithmetic on the H200's speed, with a
# margin.
PLAN=(
    "install|25|pip installs the 6 wheels copied in (.whl/, benchmarks/gpu_wheels.sh) from local files, no index and no compile, as gpu_check.sh does; skipped if deepspeed imports"
    "environment|20|nvidia-smi, nvcc --version, and one python that imports torch, deepspeed and deepspeed_acco: about 10 s"
    "build|90|our CUDA op only, for the device's architecture (JIT, TORCH_CUDA_ARCH_LIST): its two .cu files compile for sm_90 in 5-6 s each and its two C++ frontends in 30-60 s each on 2 busy cores here, in parallel on the 16 cores there; if it fails, the studies run on the torch reference kernels and say so"
    "overlap|150|imports and CUDA start 15-20 s; the spin's calibration 2 s; the floor and 5 engines of 87M parameters (build 3-6 s each), each timed without a link and at 3 links: 4 x (3 + 3 x 12) updates of 20-50 ms; 2 traced ACCO updates: about 90 s"
    "convergence|195|imports, corpus and an 8-update probe 25-30 s; then ShardedAdamW and ACCO sized to the budget left (--budget-s: the step's limit less 25 s), about 8,192 tokens per update at 25-50 ms, 1,000 updates at least; CO2 only if the time left holds it"
)
BUDGET_S=480
TITLE="GPU study"
# shellcheck source=benchmarks/gpu_steps.sh
source benchmarks/gpu_steps.sh

DRY_RUN=0
if [ "${1:-}" = "--plan" ] && [ $# -eq 1 ]; then
    print_plan
    exit 0
elif [ "${1:-}" = "--dry-run" ] && [ $# -eq 1 ]; then
    DRY_RUN=1
elif [ $# -gt 0 ]; then
    echo "usage: bash benchmarks/gpu_study.sh [--plan | --dry-run]" >&2
    exit 3
fi

REPO=$PWD
PY=${PYTHON:-python3}
MICRO_BATCH=${MICRO_BATCH:-16}
OUT=${OUT:-$REPO/build/gpu_study/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
: >"$OUT/steps.log"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$REPO/build/torch_extensions}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
if [ "$DRY_RUN" -eq 1 ]; then
    TITLE="GPU study dry run"
    # No compiler run on the CPU: the torch reference kernels, chosen explicitly (docs/kernels.md).
    export DEEPSPEED_ACCO_KERNELS=torch
    export CUDA_VISIBLE_DEVICES=""
fi

key_results() {  # the studies' tables, from the log
    sed -n '/^### Link 1:/,/^=== /p' "$OUT/steps.log" | grep -v '^=== '
    sed -n '/^### Convergence/,/^=== /p' "$OUT/steps.log" | grep -v '^=== '
}

export -f install_wheels
export PY
step install bash -c install_wheels || finish

ENVIRONMENT_PY='
import os, sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda)
if os.environ.get("DEEPSPEED_ACCO_KERNELS") == "torch" and not torch.cuda.is_available():
    print("dry run on the CPU:", os.cpu_count(), "cores")
else:
    assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
    print("device", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability(),
          "| count", torch.cuda.device_count(), "| NCCL", torch.cuda.nccl.version())
import deepspeed, transformers
print("deepspeed", deepspeed.__version__, "| transformers", transformers.__version__)
import deepspeed_acco
print("deepspeed_acco", deepspeed_acco.__file__)
'
environment() {
    if [ "$DRY_RUN" -eq 0 ]; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader || return 1
        if command -v nvcc >/dev/null; then nvcc --version | tail -n 2; else echo "nvcc not on PATH"; fi
    fi
    "$PY" -c "$ENVIRONMENT_PY"
}
export -f environment
export ENVIRONMENT_PY DRY_RUN
step environment bash -c 'environment 2>&1 | tee "$0"; exit "${PIPESTATUS[0]}"' "$OUT/environment.txt" || finish

# build: our CUDA op, once, into TORCH_EXTENSIONS_DIR, where the studies load it from. A failed
# build does not end the run: the studies then use the torch reference kernels, explicitly.
BUILD_PY='
import os, time
from deepspeed_acco.op_builder import AccoCUDAOpsBuilder
from deepspeed_acco import ops
if os.environ.get("DEEPSPEED_ACCO_KERNELS") == "torch":
    print("dry run: nothing to build; the update kernels are the torch reference:", ops.backend())
else:
    builder = AccoCUDAOpsBuilder()
    assert builder.is_compatible(verbose=True), builder.error_log
    start = time.time()
    module = builder.load(verbose=False)
    print(f"{builder.absolute_name()} loaded from {module.__file__} in {time.time() - start:.1f} s", flush=True)
'
if ! step build "$PY" -c "$BUILD_PY"; then
    echo "the CUDA op did not build: the studies run on the torch reference kernels (DEEPSPEED_ACCO_KERNELS=torch)" \
        | tee -a "$OUT/steps.log"
    export DEEPSPEED_ACCO_KERNELS=torch
fi

if [ "$DRY_RUN" -eq 1 ]; then
    OVERLAP_ARGS=(--ctx 64 --updates 2 --local-steps 2 --repeats 1 --warmup 1 --latency-us 5)
    CONVERGENCE_ARGS=(--ctx 64 --updates 8 --eval-points 4 --val-windows 8)
else
    OVERLAP_ARGS=(--model 125m --ctx 256 --micro-batch "$MICRO_BATCH" --updates 12 --repeats 3 --warmup 3)
    CONVERGENCE_ARGS=(--model 125m --ctx 256 --micro-batch "$MICRO_BATCH")
fi

# (a) overlap: the links are chosen from DeepSpeed ZeRO-1's own update time, so it runs first.
step overlap "$PY" -m deepspeed_acco.bench.gpu_study.overlap "${OVERLAP_ARGS[@]}" --grad-accum 2 --world-size 8 \
    --shares 0.2,0.35,0.5 --json "$OUT/overlap.json" --trace "$OUT/trace_acco.json.gz" --trace-method acco

# (b) convergence: sized to what is left of its own limit (STEP_LIMIT_S, set by step).
export CONVERGENCE_ARGS_TEXT="${CONVERGENCE_ARGS[*]}"
step convergence bash -c '"$PY" -m deepspeed_acco.bench.gpu_study.convergence $CONVERGENCE_ARGS_TEXT --grad-accum 2 \
    --methods sharded,acco,co2 --budget-s $((STEP_LIMIT_S - 25)) --json "$0/convergence.json"' "$OUT"
finish
