#!/usr/bin/env bash
# The GPU check, prepared for a lent GPU machine (one H200 in this project), bounded to BUDGET_S
# seconds (default 540, under the device tool's 10-minute limit per command):
#
#   1. environment   versions of the driver, nvcc, python, torch (CUDA, NCCL), deepspeed; installs
#                    carried wheels (.whl/, made by benchmarks/gpu_wheels.sh) if deepspeed is missing
#   2. build         the CUDA op (forced: a build failure fails the check) and the CPU op
#   3. kernel_tests  CUDA kernels against the torch reference, the controlled (device-side) entry
#                    points, nvcc compile checks, the lane's CUDA tests (tests/test_lane.py)
#   4. engine_tests  tests/test_gpu_engine.py: the full pipeline at world size 1 over a real NCCL
#                    group, every type, overlap on/off bitwise, CPU within tolerance, no host
#                    synchronisation in steady state, a user all-reduce between steps
#   5. e2e           benchmarks/e2e_step_time.py: ms/update of the example's GPT-Neo 125M for
#                    ShardedAdamW, DPU, ACCO, CO2 with overlap on and off
#   6. kernel_bench  benchmarks/kernels.py on 128M/256M shards against the measured device copy
#                    bandwidth (target: adamw_step and adamw_peek >= 85% of it)
#   7. example       examples/train_gpt.py for a few updates (tiny model), as a user runs it
#
# Each step gets at most its own cap and what is left of the budget; a step the budget cannot
# start is reported NOT RUN. Exit status: 0 all passed, 1 a step failed, 2 a step did not run.
#
#   bash benchmarks/gpu_check.sh                   # from anywhere, with CUDA torch
#   BUDGET_S=900 SIZES=128M bash benchmarks/gpu_check.sh
#
# Through the device tool: run `bash benchmarks/gpu_wheels.sh` here first, then
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=600)
# Results go to $OUT (the device tool's folder) or a temporary directory: summary.txt,
# steps.log (every step's output), e2e.json, gpu_benchmark.json (4 files).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
REPO=$PWD
STARTED=$SECONDS
BUDGET_S=${BUDGET_S:-540}
PY=${PYTHON:-python3}
SIZES=${SIZES:-128M,256M}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
: >"$OUT/steps.log"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$REPO/build/torch_extensions}
export ACCO_GPU_CHECK=1  # tests/test_gpu_engine.py then insists on the fused CUDA kernels
# The check's own NCCL settings are the engine's defaults; show what NCCL decides.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

declare -a SUMMARY=()
FAILED=0
NOT_RUN=0

remaining() { echo $((BUDGET_S - (SECONDS - STARTED))); }

step() {  # step NAME CAP_S CMD...: runs CMD with a timeout of min(CAP_S, budget left), logs, records
    local name=$1 cap=$2
    shift 2
    local left
    left=$(remaining)
    if [ "$left" -lt 20 ]; then
        SUMMARY+=("NOT RUN  $name (time budget spent)")
        NOT_RUN=1
        return 2
    fi
    local limit=$((cap < left ? cap : left))
    local shown="$*"
    echo "=== $name (limit ${limit}s, $((SECONDS - STARTED))s into the check): ${shown:0:200}" | tee -a "$OUT/steps.log"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT/steps.log"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - start))
    if [ "$rc" -eq 0 ]; then
        SUMMARY+=("PASS     $name (${took}s)")
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        SUMMARY+=("FAIL     $name (timed out after ${took}s)")
        FAILED=1
    else
        SUMMARY+=("FAIL     $name (rc=$rc, ${took}s)")
        FAILED=1
    fi
    return "$rc"
}

finish() {
    {
        echo
        echo "=== summary ($((SECONDS - STARTED))s of ${BUDGET_S}s; logs in $OUT)"
        printf '%s\n' "${SUMMARY[@]}"
        if [ -f "$OUT/e2e.json" ]; then
            sed -n '/^| type | overlap on/,/^$/p' "$OUT/steps.log"
        fi
        sed -n '/^### targets/,/targets met/p' "$OUT/steps.log"
        if [ "$FAILED" -ne 0 ]; then echo "GPU CHECK FAILED"
        elif [ "$NOT_RUN" -ne 0 ]; then echo "GPU CHECK INCOMPLETE"
        else echo "GPU CHECK PASSED"; fi
    } | tee "$OUT/summary.txt"
    [ "$FAILED" -ne 0 ] && exit 1
    [ "$NOT_RUN" -ne 0 ] && exit 2
    exit 0
}

# deepspeed is not in the GPU image: install the carried wheels (benchmarks/gpu_wheels.sh).
if ! "$PY" -c "import deepspeed" >/dev/null 2>&1 && compgen -G ".whl/*.whl" >/dev/null; then
    echo "=== installing carried wheels: $(ls .whl | tr '\n' ' ')" | tee -a "$OUT/steps.log"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/acco_site \
        .whl/*.whl 2>&1 | tee -a "$OUT/steps.log"
    export PYTHONPATH="$PYTHONPATH:/tmp/acco_site"
fi

step environment 90 bash -c "
    set -e
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader
    if command -v nvcc >/dev/null; then nvcc --version | tail -n 2; else echo 'nvcc not on PATH'; fi
    $PY - <<'EOF'
import os, sys
import torch
print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda,
      '| NCCL', torch.cuda.nccl.version() if torch.cuda.is_available() else None)
assert torch.cuda.is_available(), 'torch.cuda.is_available() is False'
print('device', torch.cuda.get_device_name(), 'capability', torch.cuda.get_device_capability(),
      'count', torch.cuda.device_count())
from torch.utils.cpp_extension import CUDA_HOME, verify_ninja_availability
verify_ninja_availability()
print('CUDA_HOME', CUDA_HOME)
import deepspeed, pytest, transformers
print('deepspeed', deepspeed.__version__, '| pytest', pytest.__version__, '| transformers', transformers.__version__)
import deepspeed_acco
from deepspeed_acco.runtime import comm
print('deepspeed_acco', deepspeed_acco.__file__, '| NCCL orders communicators by host order once the engine '
      'sets', comm.NCCL_LAUNCH_ORDER_ENV, ':', comm.nccl_version() >= comm.NCCL_LAUNCH_ORDER_MIN_VERSION)
EOF
" || finish

step build 360 env DEEPSPEED_ACCO_KERNELS=cuda "$PY" - <<'EOF' || finish
import time
from deepspeed_acco.op_builder import AccoCPUOpsBuilder, AccoCUDAOpsBuilder

for builder in (AccoCUDAOpsBuilder(), AccoCPUOpsBuilder()):
    assert builder.is_compatible(verbose=True), builder.error_log
    start = time.time()
    module = builder.load(verbose=False)
    print(f"{builder.absolute_name()} loaded from {module.__file__} in {time.time() - start:.1f} s", flush=True)
EOF

step kernel_tests 180 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_ops_kernels.py -k "cuda or nvcc" \
    tests/test_lane.py
step engine_tests 300 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gpu_engine.py
step e2e 240 "$PY" benchmarks/e2e_step_time.py --json "$OUT/e2e.json"
step kernel_bench 180 "$PY" benchmarks/kernels.py --device cuda --sizes "$SIZES" --json "$OUT/gpu_benchmark.json" \
    --strict
step example 120 "$PY" examples/train_gpt.py --deepspeed_config examples/configs/acco.json --model tiny --ctx 64 \
    --steps 6 --log-every 2 --val-windows 8
finish
