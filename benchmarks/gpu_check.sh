#!/usr/bin/env bash
# GPU check of the fused kernels, prepared for a lent GPU machine (an H200 in this project):
# build the CUDA op, run the GPU kernel and engine tests, benchmark 100M+ parameter shards against the
# device's measured copy bandwidth (target: adamw_step and adamw_peek >= 85% of it), and print a
# summary. Exits non-zero if any step fails or a target is missed.
#
#   bash benchmarks/gpu_check.sh                 # from the repository root, with CUDA torch
#   SIZES=128M,512M bash benchmarks/gpu_check.sh # other shard sizes
#
# Needs torch with CUDA, deepspeed, ninja, pytest and nvcc (CUDA_HOME) on the machine. Results
# (logs, benchmark JSON) go to $OUT, or to a temporary directory when OUT is unset. The JIT build
# is cached under build/torch_extensions, so a rerun on the same machine skips it.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
SIZES=${SIZES:-128M,256M}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/build/torch_extensions}
export DEEPSPEED_ACCO_KERNELS=cuda  # a build failure must fail the check, not fall back to torch

declare -a SUMMARY=()
FAILED=0

step() {  # step NAME TIMEOUT_S CMD...: runs CMD, logs to $OUT/NAME.log, records pass/fail
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    local took=$((SECONDS - start))
    if [ "$rc" -eq 0 ]; then
        SUMMARY+=("PASS  $name (${took}s)")
    else
        SUMMARY+=("FAIL  $name (rc=$rc, ${took}s, log: $OUT/$name.log)")
        FAILED=1
    fi
    return "$rc"
}

step environment 120 bash -c "
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || exit 1
    command -v nvcc >/dev/null && nvcc --version | tail -n 2
    $PY - <<'EOF'
import sys
import torch
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)
assert torch.cuda.is_available(), 'torch.cuda.is_available() is False'
print('device', torch.cuda.get_device_name(), 'capability', torch.cuda.get_device_capability())
from torch.utils.cpp_extension import CUDA_HOME, verify_ninja_availability
verify_ninja_availability()
print('CUDA_HOME', CUDA_HOME)
import deepspeed, pytest
print('deepspeed', deepspeed.__version__, 'pytest', pytest.__version__)
EOF
" || { printf '%s\n' "${SUMMARY[@]}"; echo "environment not usable; stopping"; exit 1; }

step build_cuda_op 900 "$PY" - <<'EOF'
import time
from deepspeed_acco.op_builder import AccoCUDAOpsBuilder

builder = AccoCUDAOpsBuilder()
assert builder.is_compatible(verbose=True), builder.error_log
start = time.time()
module = builder.load(verbose=True)
print(f"acco_cuda_ops loaded from {module.__file__} in {time.time() - start:.1f} s")
EOF

if [ "$FAILED" -eq 0 ]; then
    step gpu_tests 600 "$PY" -m pytest -q -rs tests/test_ops_kernels.py -k "cuda or nvcc"
    # The engine on CUDA (one rank): side-stream jobs, CUDA events, the fused CUDA kernels.
    step gpu_engine_tests 600 "$PY" -m pytest -q -rs tests/test_gpu_engine.py
    step gpu_benchmark 900 "$PY" benchmarks/kernels.py --device cuda --sizes "$SIZES" \
        --json "$OUT/gpu_benchmark.json" --strict
fi

echo
echo "=== summary (logs and benchmark JSON in $OUT)"
printf '%s\n' "${SUMMARY[@]}"
if [ -f "$OUT/gpu_benchmark.log" ]; then
    sed -n '/^### targets/,$p' "$OUT/gpu_benchmark.log"
fi
if [ "$FAILED" -ne 0 ]; then
    echo "GPU CHECK FAILED"
    exit 1
fi
echo "GPU CHECK PASSED"
