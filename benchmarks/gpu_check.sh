#!/usr/bin/env bash
# The GPU check: one prepared run on a machine with a GPU (sized for one H200: 480 s in all), its
# steps in order of value, each under its own time cap. What a step produces is in the output folder as soon as the step ends, and summary.txt
# is rewritten before and after every step, so a run killed at any point still returns everything
# before it. `--plan` prints the steps, their caps and the basis of each estimate.
#
#   bash benchmarks/gpu_check.sh --plan      # the plan only (no GPU, no python needed)
#   bash benchmarks/gpu_check.sh             # the check, with CUDA torch
#   SIZES=128M bash benchmarks/gpu_check.sh  # the kernel benchmark at one size
#
# On a GPU machine without a package index: run `bash benchmarks/gpu_wheels.sh` where pip reaches
# one first (deepspeed and its dependencies as wheels, into .whl/) and copy .whl/ into the checkout
# on the GPU machine.
#
# Output folder: $OUT when set, else build/gpu_check/<date-time>. At most five files, none in a
# subfolder, described in docs/gpu_check.md ("Output"):
#   summary.txt      one line per step (PASS / FAIL / NOT RUN / RUNNING), rewritten at every step
#   steps.log        every step's output, appended while it runs
#   environment.txt  GPU, driver, nvcc, python, torch (CUDA, NCCL), deepspeed, TORCH_CUDA_ARCH_LIST
#   kernels.json     benchmarks/kernel_bench.py on the GPU: every kernel against the device copy
#   e2e.json         benchmarks/e2e_step_time.py: the floor, torch, DeepSpeed ZeRO-1 and our types per precision
# Exit status: 0 every step passed, 1 a step failed, 2 a step did not run (budget spent).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

# The plan, in order of value: name|cap in seconds|basis of the estimate. The caps sum to 480 s,
# so the whole check fits in 8 minutes. The bases: the first run on an H200 (2026-12-04, docs/gpu_check.md:
# install 7 s, environment 11 s, build 41 s, the whole check 273 s) and estimates where a step changed.
PLAN=(
    "install|20|pip installs the 6 wheels copied in (.whl/, benchmarks/gpu_wheels.sh, 4.8 MB) from local files, no index and no compile: 7 s on the H200 on 2026-12-04; skipped if deepspeed imports"
    "environment|20|nvidia-smi, nvcc --version, and one python that imports torch, deepspeed and deepspeed_acco: 11 s on 2026-12-04"
    "build|100|our CUDA op (under the image's TORCH_CUDA_ARCH_LIST) and CPU op: 41 s on 2026-12-04; DeepSpeed's FusedAdam for the e2e step at the same time (one .cu file and its frontend, not yet timed: about the size of one of ours)"
    "kernel_tests|45|197 CUDA kernel and lane tests (tests/test_ops_kernels.py, test_quantize_kernels.py, test_lane.py, 'cuda' selection, no compile): sizes up to 1M, under a millisecond each on the GPU; pytest start and CUDA context 10-15 s"
    "kernel_bench|45|benchmarks/kernel_bench.py at 128M and 256M: about 20 cases x 2 sizes x 3 rounds x 0.25 s = 30 s, plus allocation; the copy moves about 4.3 TB/s, so one 256M AdamW pass takes about 2 ms"
    "engine_tests|90|tests/test_gpu_engine.py: 5 spawned processes (4 parity runs over every type, 1 without host synchronisation over every type), each about 10 s of imports and NCCL set-up plus seconds of TinyNet steps"
    "e2e|140|benchmarks/e2e_step_time.py: the floor measured at micro-batches 8, 16, ... until it grows with them (about 3 s each), then 7 methods x 2 precisions x 7 updates; at a bf16 micro-batch of 256 (131k tokens per update) a 125m update takes about 0.2 s (its FLOPs at 40% of the H200's bf16 peak), fp32 at a quarter of that size about 0.25 s (7%), model builds about 2 s each; not yet timed"
    "example|20|examples/train_gpt.py with the tiny model for 6 updates, as a user runs it: imports and start-up dominate"
)
BUDGET_S=480

TITLE="GPU check"
# shellcheck source=benchmarks/gpu_steps.sh
source benchmarks/gpu_steps.sh

if [ "${1:-}" = "--plan" ]; then
    print_plan
    exit 0
elif [ $# -gt 0 ]; then
    echo "usage: bash benchmarks/gpu_check.sh [--plan]" >&2
    exit 3
fi

REPO=$PWD
PY=${PYTHON:-python3}
SIZES=${SIZES:-128M,256M}
OUT=${OUT:-$REPO/build/gpu_check/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
: >"$OUT/steps.log"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$REPO/build/torch_extensions}
export ACCO_GPU_CHECK=1  # tests/test_gpu_engine.py then insists on the fused CUDA kernels
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

key_results() {  # the e2e step's table and its targets, under the summary
    sed -n '/^| method | precision | micro-batch/,/^$/p' "$OUT/steps.log"
    sed -n '/^### targets/,/targets met/p' "$OUT/steps.log"
}

# 1. install: deepspeed and its pydantic/hjson are not in the GPU image; the wheels copied in (.whl/) are
# (install_wheels, benchmarks/gpu_steps.sh).
export PYTHONPATH="$PYTHONPATH:/tmp/acco_site"
export -f install_wheels
export PY
step install bash -c install_wheels || finish

# 2. environment: what ran where, also in environment.txt.
ENVIRONMENT_PY='
import os
import sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda)
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print("device", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability(),
      "| count", torch.cuda.device_count(), "| NCCL", torch.cuda.nccl.version())
print("TORCH_CUDA_ARCH_LIST", repr(os.environ.get("TORCH_CUDA_ARCH_LIST")))
from torch.utils.cpp_extension import CUDA_HOME, verify_ninja_availability
verify_ninja_availability()
print("CUDA_HOME", CUDA_HOME)
import deepspeed, pytest, transformers
print("deepspeed", deepspeed.__version__, "| pytest", pytest.__version__, "| transformers", transformers.__version__)
import deepspeed_acco
from deepspeed_acco.runtime import comm
print("deepspeed_acco", deepspeed_acco.__file__)
print("NCCL orders communicators by host order once", comm.NCCL_LAUNCH_ORDER_ENV, "is 1:",
      comm.nccl_version() >= comm.NCCL_LAUNCH_ORDER_MIN_VERSION)
'
environment() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader || return 1
    if command -v nvcc >/dev/null; then nvcc --version | tail -n 2; else echo "nvcc not on PATH"; fi
    "$PY" -c "$ENVIRONMENT_PY"
}
export -f environment
export ENVIRONMENT_PY
step environment bash -c 'environment 2>&1 | tee "$0"; exit "${PIPESTATUS[0]}"' "$OUT/environment.txt" || finish

# 3. build: our CUDA op under the image's TORCH_CUDA_ARCH_LIST as it is (a failure fails the check:
# the engine would refuse to train without it) and our CPU op; meanwhile DeepSpeed's FusedAdam for
# the e2e step's ZeRO-1, under the list DeepSpeed's parser reads (9.0a as 9.0). Its failure is
# printed here and fails the e2e step's DeepSpeed run, not the check.
BUILD_PY='
import time
from deepspeed_acco import ops
from deepspeed_acco.op_builder import AccoCPUOpsBuilder, AccoCUDAOpsBuilder
for builder in (AccoCUDAOpsBuilder(), AccoCPUOpsBuilder()):
    assert builder.is_compatible(verbose=True), builder.error_log
    start = time.time()
    module = builder.load(verbose=False)
    print(f"{builder.absolute_name()} loaded from {module.__file__} in {time.time() - start:.1f} s", flush=True)
print("update kernels for CUDA tensors:", ops.backend("cuda"), "| for CPU tensors:", ops.backend("cpu"), flush=True)
'
DEEPSPEED_BUILD_PY='
import os, time
from deepspeed_acco.op_builder.cuda_ops import ARCH_LIST_ENV, deepspeed_arch_list
listed = os.environ.get(ARCH_LIST_ENV)
if listed:
    os.environ[ARCH_LIST_ENV] = deepspeed_arch_list(listed)
    print(f"DeepSpeed FusedAdam: {ARCH_LIST_ENV}={listed!r} read as {os.environ[ARCH_LIST_ENV]!r}", flush=True)
from deepspeed.accelerator import get_accelerator
start = time.time()
get_accelerator().create_op_builder("FusedAdamBuilder").load(verbose=False)
print(f"DeepSpeed FusedAdam built in {time.time() - start:.1f} s", flush=True)
'
build() {
    local log=/tmp/acco_deepspeed_build.log ours deepspeed_rc
    "$PY" -c "$DEEPSPEED_BUILD_PY" >"$log" 2>&1 &
    local deepspeed_pid=$!
    "$PY" -c "$BUILD_PY"
    ours=$?
    wait "$deepspeed_pid"
    deepspeed_rc=$?
    tail -n 20 "$log"
    [ "$deepspeed_rc" -eq 0 ] || echo "DeepSpeed's FusedAdam did not build (rc=$deepspeed_rc): the e2e step's deepspeed run will fail"
    return "$ours"
}
export -f build
export BUILD_PY DEEPSPEED_BUILD_PY
step build bash -c build || finish

# 4. kernel_tests: the CUDA kernels against the torch reference, the controlled entry points, the
# lane's CUDA tests. No compile: the nvcc checks duplicate the build step, and no test selected
# here is multi-process, so tests/conftest.py prebuilds nothing.
step kernel_tests "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_ops_kernels.py tests/test_quantize_kernels.py \
    tests/test_lane.py -k "cuda and not nvcc and not compiles"

# 5. kernel_bench: every kernel's bandwidth against the device copy measured in the same run.
step kernel_bench "$PY" benchmarks/kernel_bench.py --device cuda --sizes "$SIZES" --json "$OUT/kernels.json" --strict

# 6. engine_tests: world size 1 over a real NCCL group: parity with the CPU engine and between
# overlap on and off, and no host synchronisation in steady state. The tests carry
# without_deepspeed_ops, so pytest builds none of DeepSpeed's ops (its CUDA FusedAdam).
step engine_tests "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gpu_engine.py

# 7. e2e: at a compute-bound micro-batch (measured), the forward-backward floor, a plain PyTorch loop,
# DeepSpeed ZeRO-1 and our four types, bf16 then fp32: ms/update, tokens/s, MFU, peak memory, and
# every engine of ours freed by destroy() and del without the garbage collector.
step e2e "$PY" benchmarks/e2e_step_time.py --warmup 1 --updates 3 --repeats 2 --json "$OUT/e2e.json"

# 8. example: the example script as a user runs it.
step example "$PY" examples/train_gpt.py --deepspeed_config examples/configs/acco.json --model tiny --ctx 64 \
    --steps 6 --log-every 2 --val-windows 8
finish
