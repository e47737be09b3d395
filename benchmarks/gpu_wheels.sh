#!/usr/bin/env bash
# Wheels that a GPU machine without a package index lacks, for benchmarks/gpu_check.sh. Its image (python 3.12,
# torch with CUDA, transformers, pytest, ninja, numpy, psutil, py-cpuinfo, msgpack, einops) has no
# deepspeed and none of deepspeed's pydantic and hjson, and nothing can be installed there from a
# registry. Run this here, where pip reaches an index; it fills .whl/ (git-ignored) with:
#
#   deepspeed  built from its source distribution without ops (DS_BUILD_OPS=0: pure Python; our
#              op builders JIT-compile on the GPU machine), at the version this project is tested with
#   pydantic, pydantic-core, annotated-types, typing-inspection, hjson   for CPython 3.12 x86-64
#
# then copy .whl/ into the checkout on the GPU machine and run bash benchmarks/gpu_check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=.whl  # ignored by .gitignore; copy it to the GPU machine with the checkout
mkdir -p "$DEST"

version_of() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
DS_VERSION=${DS_VERSION:-$(version_of deepspeed)}
PYDANTIC=$(version_of pydantic)
PYDANTIC_CORE=$(version_of pydantic_core)

rm -f "$DEST"/*.whl
DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$DEST" "deepspeed==$DS_VERSION"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "pydantic==$PYDANTIC" "pydantic-core==$PYDANTIC_CORE" "annotated-types==$(version_of annotated-types)" \
    "typing-inspection==$(version_of typing-inspection)" "hjson==$(version_of hjson)"
ls -la "$DEST"
for wheel in "$DEST"/deepspeed-*.whl; do
    case "$wheel" in
        *-py3-none-any.whl) ;;
        *) echo "unexpected: $wheel is not a pure-Python wheel" >&2; exit 1 ;;
    esac
done
du -sh "$DEST"
