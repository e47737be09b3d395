"""The op builders, the build checks and the backend dispatcher of :mod:`deepspeed_acco.ops`.

Which kernels a device's tensors get (``DEEPSPEED_ACCO_KERNELS``, the CPU's fallback), how the
builders follow DeepSpeed's pattern and explain what is missing, and compile checks of the sources
(nvcc, the CUDA frontend against torch's headers, the CPU loops' vectorisation). The kernels'
results are tests/test_ops_kernels.py.
"""
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import deepspeed_acco.ops as ops
from deepspeed_acco.ops import _backend, reference
from test_ops_kernels import EXAGGERATED, STANDARD, adamw_state, assert_bitwise, random_grad

CSRC = Path(__file__).resolve().parent.parent / "csrc"


# ---------------------------------------------------------------------------------------------
# Dispatcher
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_backend(monkeypatch):
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    _backend.reset()
    yield monkeypatch
    _backend.reset()


def test_forced_torch_backend_uses_the_reference(fresh_backend):
    fresh_backend.setenv(_backend.ENV_VAR, "torch")
    assert ops.backend() == "torch"
    assert ops.backend("cpu") == "torch"


def test_unknown_backend_name_is_a_value_error(fresh_backend):
    fresh_backend.setenv(_backend.ENV_VAR, "gpu")
    with pytest.raises(ValueError, match="DEEPSPEED_ACCO_KERNELS"):
        ops.backend()


def test_forced_backend_refuses_tensors_of_another_device(fresh_backend):
    fresh_backend.setenv(_backend.ENV_VAR, "cuda")
    param = torch.zeros(4)
    with pytest.raises(ValueError, match="cannot update cpu tensors"):
        ops.adamw_step(param, param.clone(), param.clone(), param.clone(), step=1, **STANDARD)


def test_auto_backend_builds_the_cpu_kernels(fresh_backend):
    assert ops.backend("cpu") == "cpu"
    if not torch.cuda.is_available():
        assert ops.backend() == "cpu"


def test_unavailable_kernels_fall_back_with_one_warning(fresh_backend, caplog):

    def no_compiler(device_type):
        raise RuntimeError("acco_cpu_ops needs a C++ compiler: 'c++' was not found on PATH")

    fresh_backend.setattr(_backend, "_load", no_compiler)
    numel = 33
    param, exp_avg, exp_avg_sq = adamw_state(numel, "cpu")
    expected = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    with caplog.at_level(logging.WARNING, logger="deepspeed_acco.ops"):
        for step in (1, 2):
            grad = random_grad(numel, "cpu", step)
            ops.adamw_step(param, grad, exp_avg, exp_avg_sq, step=step, **EXAGGERATED)
            reference.adamw_step(expected[0], grad, expected[1], expected[2], step=step, **EXAGGERATED)
        assert ops.backend("cpu") == "torch"
    warnings = [r for r in caplog.records if r.name == "deepspeed_acco.ops"]
    assert len(warnings) == 1 and "C++ compiler" in warnings[0].getMessage()
    for actual, want in zip((param, exp_avg, exp_avg_sq), expected):
        assert_bitwise(actual, want)


def test_forced_backend_raises_when_it_cannot_build(fresh_backend):
    fresh_backend.setenv(_backend.ENV_VAR, "cpu")

    def broken(device_type):
        raise RuntimeError("compiler exploded")

    fresh_backend.setattr(_backend, "_load", broken)
    with pytest.raises(RuntimeError, match="compiler exploded"):
        ops.backend("cpu")


def _cuda_build_fails(fresh_backend):
    def broken(device_type):
        if device_type == "cuda":
            raise RuntimeError("nvcc fatal : Unsupported gpu architecture 'compute_90b'")
        raise AssertionError(f"only the CUDA kernels should be loaded, not {device_type}'s")

    fresh_backend.setattr(_backend, "_load", broken)


def test_cuda_kernels_that_cannot_build_raise_and_name_the_opt_in(fresh_backend):
    # The first GPU run trained on the reference after a failed build, with one line in the log.
    _cuda_build_fails(fresh_backend)
    with pytest.raises(RuntimeError) as raised:
        ops.backend("cuda")
    message = str(raised.value)
    assert "Unsupported gpu architecture 'compute_90b'" in message, "the build's error must be shown"
    assert f"{_backend.ENV_VAR}=torch" in message, "the explicit opt-in must be named"
    fresh_backend.setenv(_backend.ENV_VAR, "torch")
    _backend.reset()
    assert ops.backend("cuda") == "torch"


def test_initialize_decides_the_cuda_kernels_before_it_builds_anything(fresh_backend):
    import deepspeed_acco
    from deepspeed_acco.runtime import initialize as initialize_module

    _cuda_build_fails(fresh_backend)
    # A CUDA rank as initialize sees it, without a GPU: its device, and a process group of one.
    fresh_backend.setattr(initialize_module, "device_for_backend", lambda: torch.device("cuda", 0))
    fresh_backend.setattr(initialize_module, "init_distributed", lambda timeout_s: None)
    fresh_backend.setattr(initialize_module.dist, "get_world_size", lambda group=None: 1)
    built = []
    fresh_backend.setattr(initialize_module, "AccoEngine", lambda **kwargs: built.append(kwargs))
    model = torch.nn.Linear(4, 2)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "ACCO", "params": {"lr": 1e-3}}}
    with pytest.raises(RuntimeError, match=f"{_backend.ENV_VAR}=torch"):
        deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert not built, "the engine (and its process groups) must not be built on the way to the error"


# ---------------------------------------------------------------------------------------------
# Op builders and build checks
# ---------------------------------------------------------------------------------------------


def test_builders_follow_the_deepspeed_pattern():
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder

    from deepspeed_acco.op_builder import ALL_OPS, AccoCPUOpsBuilder, AccoCUDAOpsBuilder

    assert issubclass(AccoCPUOpsBuilder, OpBuilder) and issubclass(AccoCUDAOpsBuilder, CUDAOpBuilder)
    for name, builder_class in ALL_OPS.items():
        builder = builder_class()
        assert name.startswith("acco_") and builder.name == name
        assert builder.absolute_name() == f"deepspeed_acco.ops.{name}_op"
        assert builder_class.BUILD_VAR.startswith("DS_BUILD_ACCO_")
        for path in builder.sources() + builder.include_paths():
            assert os.path.isabs(path) and os.path.exists(path), path


def test_cpu_builder_explains_a_missing_compiler(monkeypatch):
    from deepspeed_acco.op_builder import AccoCPUOpsBuilder

    monkeypatch.setenv("CXX", "/nonexistent/c++")
    builder = AccoCPUOpsBuilder()
    assert not builder.is_compatible()
    assert "CXX" in builder.error_log and "/nonexistent/c++" in builder.error_log


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the message on a CPU-only torch")
def test_cuda_builder_explains_a_cpu_only_torch():
    from deepspeed_acco.op_builder import AccoCUDAOpsBuilder

    builder = AccoCUDAOpsBuilder()
    assert not builder.is_compatible()
    assert "CPU-only" in builder.error_log


def test_stale_prebuilt_op_is_not_used(monkeypatch):
    import importlib
    import types

    from deepspeed_acco.op_builder import AccoCPUOpsBuilder

    stale = types.ModuleType("deepspeed_acco.ops.acco_cpu_ops_op")
    stale.source_digest = "d0000000000000000"
    monkeypatch.setattr(importlib, "import_module", lambda name: stale)
    builder = AccoCPUOpsBuilder()
    assert builder._load_prebuilt() is None
    stale.source_digest = builder.source_digest()
    assert builder._load_prebuilt() is stale


def _nvcc():
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                    if os.environ.get("CUDA_HOME") else None)
    if nvcc is None or not os.path.exists(nvcc):
        pytest.skip("nvcc not found (not on PATH, no CUDA_HOME): cannot compile-check the CUDA sources")
    return nvcc


# (TORCH_CUDA_ARCH_LIST, the -gencode flags torch derives from it). "9.0a" is what the lent H200's
# image sets; DeepSpeed 0.19.8's own parser fails on it with "invalid literal for int()".
ARCH_LISTS = [
    ("9.0a", ["-gencode=arch=compute_90a,code=sm_90a"]),
    ("9.0;10.0a+PTX", ["-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_100a,code=sm_100a",
                       "-gencode=arch=compute_100a,code=compute_100a"]),
    ("8.0 8.6", ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_86,code=sm_86"]),
]


@pytest.mark.parametrize("jit_mode", [True, False], ids=["jit", "ahead-of-time"])
@pytest.mark.parametrize("arch_list, expected", ARCH_LISTS, ids=[a for a, _ in ARCH_LISTS])
def test_cuda_builder_reads_the_arch_list_as_torch_does(monkeypatch, arch_list, expected, jit_mode):
    from torch.utils import cpp_extension

    from deepspeed_acco.op_builder import AccoCUDAOpsBuilder

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
    builder = AccoCUDAOpsBuilder()
    builder.jit_mode = jit_mode
    args = builder.nvcc_args()
    assert sorted(arg for arg in args if "arch=" in arg) == sorted(expected)
    assert builder.enable_bf16, "every architecture listed is sm_80 or newer"
    # torch adds no architecture of its own to a build whose nvcc flags already name one, and the
    # variable is left as the user set it.
    assert cpp_extension._get_cuda_arch_flags(args) == []
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == arch_list


def test_cuda_builder_refuses_an_arch_list_torch_refuses(monkeypatch):
    from deepspeed_acco.op_builder import AccoCUDAOpsBuilder

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0;9.0b")
    with pytest.raises(ValueError, match=r"TORCH_CUDA_ARCH_LIST='9.0;9.0b'.*9\.0b"):
        AccoCUDAOpsBuilder().nvcc_args()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "7.5 8.0")
    builder = AccoCUDAOpsBuilder()
    builder.nvcc_args()
    assert not builder.enable_bf16, "sm_75 has no bf16 arithmetic"


@pytest.mark.parametrize("arch_list, for_deepspeed", [
    ("9.0a", "9.0"), ("9.0;10.0a+PTX", "9.0;10.0+PTX"), ("8.0 8.6", "8.0;8.6"), ("Hopper", "9.0+PTX"), ("", "")])
def test_arch_list_for_deepspeeds_own_builders(monkeypatch, arch_list, for_deepspeed):
    # benchmarks/gpu_check.sh builds DeepSpeed's FusedAdam for the e2e step under the image's list.
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    from deepspeed_acco.op_builder.cuda_ops import deepspeed_arch_list

    assert deepspeed_arch_list(arch_list) == for_deepspeed
    if for_deepspeed:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", for_deepspeed)
        builder = FusedAdamBuilder()
        builder.jit_mode = False
        assert builder.compute_capability_args(), "DeepSpeed's parser reads the list"


def test_nvcc_compiles_every_cu_file_with_the_builders_flags(tmp_path, monkeypatch):
    # The builder's own nvcc arguments, for sm_90 and the architecture-specific sm_90a at once.
    nvcc = _nvcc()
    from deepspeed_acco.op_builder import AccoCUDAOpsBuilder
    from deepspeed_acco.op_builder.cuda_ops import TORCH_NVCC_DEFINES

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0;9.0a")
    flags = AccoCUDAOpsBuilder().nvcc_args()
    cu_files = sorted(CSRC.rglob("*.cu"))
    assert cu_files, "no .cu files found under csrc/"
    for cu in cu_files:
        cmd = [nvcc, *flags, "--resource-usage", "-std=c++17", "-I", str(CSRC / "includes"), *TORCH_NVCC_DEFINES,
               "-c", str(cu), "-o", str(tmp_path / (cu.stem + ".o"))]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout}\n{result.stderr}"
        assert "warning" not in result.stderr.lower(), result.stderr
        for arch in ("sm_90", "sm_90a"):
            assert f"for '{arch}'" in result.stdout + result.stderr, f"{cu.name} was not compiled for {arch}"


def test_cuda_frontend_compiles_against_torch_and_cuda_headers(tmp_path):
    # The CUDA op's pybind frontend is host C++ that only the GPU machine's JIT build compiles; a
    # syntax-only pass here, against this torch's headers and the toolkit's, catches binding errors
    # (e.g. in the controlled entry points) before a GPU session does.
    import sysconfig

    from torch.utils.cpp_extension import include_paths
    nvcc = _nvcc()
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler")
    dry_run = subprocess.run([nvcc, "-E", "-x", "cu", "-", "-o", os.devnull, "-v"], input="", capture_output=True,
                             text=True, timeout=120)
    cuda_includes = re.findall(r'-I"?([^"\s]+)', "\n".join(line for line in dry_run.stderr.splitlines()
                                                             if "INCLUDES=" in line))
    assert cuda_includes, f"could not read nvcc's include directories:\n{dry_run.stderr}"
    stub = tmp_path / "stub"
    macros = "c10/cuda/impl/cuda_cmake_macros.h"
    if not any((Path(p) / macros).exists() for p in include_paths()):
        # Generated at torch's build; CPU-only wheels ship the c10/cuda headers without it.
        (stub / macros).parent.mkdir(parents=True)
        (stub / macros).write_text("#pragma once\n")
    cmd = [compiler, "-std=c++17", "-fsyntax-only", *(f"-I{p}" for p in include_paths()), f"-I{stub}",
           f"-I{sysconfig.get_paths()['include']}", *(f"-I{p}" for p in cuda_includes), f"-I{CSRC / 'includes'}",
           "-DTORCH_EXTENSION_NAME=acco_cuda_ops", str(CSRC / "cuda" / "acco_cuda_frontend.cpp")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-4000:]}"


def test_cpu_kernel_loops_are_vectorised(tmp_path):
    from deepspeed_acco.op_builder import AccoCPUOpsBuilder

    builder = AccoCPUOpsBuilder()
    compiler = builder._cxx_compiler()
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler})")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    if "Free Software Foundation" not in version:
        pytest.skip("the vectorisation report is read in GCC's -fopt-info format")
    source = CSRC / "cpu" / "acco_cpu_kernels.cpp"
    simd_loops = _simd_loop_line_ranges(source.read_text().splitlines())
    assert len(simd_loops) == 2  # the AdamW loop (step and peek) and the CO2 loop
    cmd = [compiler, *builder.strip_empty_entries(builder.cxx_args()), "-I", str(CSRC / "includes"),
           "-fopt-info-vec-optimized", "-c", str(source), "-o", str(tmp_path / "kernels.o")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    vectorised = [int(m.group(1)) for m in re.finditer(r"acco_cpu_kernels\.cpp:(\d+):\d+: optimized: loop vectorized",
                                                       result.stderr)]
    for first, last in simd_loops:
        # GCC reports a vectorised loop at a statement of its body.
        assert any(first <= line <= last for line in vectorised), \
            f"loop at lines {first}-{last} not vectorised:\n{result.stderr}"


def _simd_loop_line_ranges(lines):
    """1-based (first, last) line of every loop that follows a `#pragma omp simd`."""
    ranges = []
    for index, line in enumerate(lines):
        if line.strip() != "#pragma omp simd":
            continue
        depth, end = 0, index + 1
        for end in range(index + 1, len(lines)):
            depth += lines[end].count("{") - lines[end].count("}")
            if depth == 0 and "}" in lines[end]:
                break
        ranges.append((index + 2, end + 1))
    return ranges
