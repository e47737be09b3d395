# deepspeed-acco developer entry points. A newcomer needs two: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
# torch 2.13.0 from the configured pip index; pick a build with its index, e.g.
# TORCH_INDEX=https://download.pytorch.org/whl/cpu (CPU only) or .../whl/cu128 (CUDA 12.8).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PIP = $(VENV)/bin/pip
PY = $(VENV)/bin/python
STAMP = $(VENV)/.installed

.PHONY: venv demo test kernels-bench clean

venv: $(STAMP)

$(STAMP): setup.py pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PIP) install --quiet -e ".[test]"
	touch $(STAMP)

demo: venv
	$(PY) -m deepspeed_acco.bench

# JIT-built ops (ours and DeepSpeed's) go to a folder of this checkout's venv unless the caller chose
# one: a build is tied to the venv's paths, and two checkouts sharing ~/.cache/torch_extensions
# rebuild each other's ops, so a test killed mid-build there could leave a lock the other waits on.
test: venv
	TORCH_EXTENSIONS_DIR="$${TORCH_EXTENSIONS_DIR:-$(CURDIR)/$(VENV)/torch_extensions}" $(PY) -m pytest -q tests

kernels-bench: venv
	$(PY) benchmarks/kernel_bench.py

clean:
	rm -rf $(VENV) build *.egg-info
