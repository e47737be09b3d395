"""Op builder of the fused CUDA kernels: op ``acco_cuda_ops``.

The architectures to compile for are read as torch reads ``TORCH_CUDA_ARCH_LIST`` when it builds an
extension (``torch.utils.cpp_extension``), not through DeepSpeed's parser: DeepSpeed 0.19.8 sorts the
entries with ``int()`` on each part, so an architecture-specific entry such as "9.0a" (a CUDA image
that sets it) fails the build with "invalid literal for int()". Here "9.0a" reaches nvcc as sm_90a.
"""
import contextlib
import os
import re
from typing import Iterator, List, Optional

from deepspeed.ops.op_builder.builder import (CUDAMismatchException, CUDAOpBuilder, MissingCUDAException,
                                              assert_no_cuda_mismatch, installed_cuda_version)

from .builder import AccoBuilderMixin

# nvcc flags torch adds to every extension build; the CI compile test passes them too so that the
# .cu files are checked under the same macros they meet in a real build.
TORCH_NVCC_DEFINES = [
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
]


ARCH_LIST_ENV = "TORCH_CUDA_ARCH_LIST"


@contextlib.contextmanager
def _arch_list_set_to(value: str) -> Iterator[None]:
    before = os.environ.get(ARCH_LIST_ENV)
    os.environ[ARCH_LIST_ENV] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ARCH_LIST_ENV, None)
        else:
            os.environ[ARCH_LIST_ENV] = before


def arch_flags(arch_list: Optional[str]) -> List[str]:
    """The nvcc flags torch derives from ``arch_list`` (a ``TORCH_CUDA_ARCH_LIST`` value).

    Entries separated by ";" or spaces: "8.6", "9.0a" (architecture-specific: sm_90a), "10.0a+PTX"
    (also the PTX), torch's names ("Hopper"). Empty or "native": the visible devices. Torch's own
    parser does the reading, so exactly the lists torch accepts are accepted; it raises
    ``ValueError`` naming an entry it does not know. The parser is a private function of
    ``torch.utils.cpp_extension``; tests/test_op_builders.py checks what it returns for the lists
    above, so a torch that changes it fails there rather than on a GPU machine.
    """
    from torch.utils import cpp_extension

    value = (arch_list or "").strip()
    if value in ("", "native"):
        import torch
        if torch.cuda.device_count() == 0:
            raise RuntimeError(f"acco_cuda_ops: no CUDA device is visible to compile for; set {ARCH_LIST_ENV} "
                               f"(e.g. \"9.0\" or \"9.0a\" for an H100/H200) to build without one")
    with _arch_list_set_to(value):
        try:
            return cpp_extension._get_cuda_arch_flags()
        except ValueError as error:
            raise ValueError(f"{ARCH_LIST_ENV}={arch_list!r}: {error}; torch accepts entries such as 8.6, 9.0a or "
                             f"10.0a+PTX, separated by ';' or spaces") from error


def deepspeed_arch_list(arch_list: Optional[str]) -> str:
    """``arch_list`` as DeepSpeed's own op builders (its FusedAdam) can read it: "X.Y[+PTX]" entries only.

    DeepSpeed 0.19.8 parses every entry with ``int()``, so architecture-specific entries ("9.0a")
    and torch's names ("Hopper") fail its builds; they become the generic architecture ("9.0"), whose
    code runs on the same devices without the architecture-specific instructions, which DeepSpeed's
    kernels do not use. Empty stays empty: DeepSpeed then compiles for the visible devices.
    """
    if not (arch_list or "").strip():
        return ""
    flags = arch_flags(arch_list)
    with_ptx = {int(match) for flag in flags for match in re.findall(r"code=compute_(\d+)", flag)}
    return ";".join(f"{capability // 10}.{capability % 10}" + ("+PTX" if capability in with_ptx else "")
                    for capability in sorted(set(_compute_capabilities(flags))))


def _compute_capabilities(flags: List[str]) -> List[int]:
    """The compute capabilities (90 for both compute_90 and compute_90a) that ``-gencode`` flags compile for."""
    return [int(match) for flag in flags for match in re.findall(r"arch=compute_(\d+)", flag)]


class AccoCUDAOpsBuilder(AccoBuilderMixin, CUDAOpBuilder):
    BUILD_VAR = "DS_BUILD_ACCO_CUDA_OPS"
    NAME = "acco_cuda_ops"

    def __init__(self):
        super().__init__(name=self.NAME)

    def csrc_sources(self):
        return ["cuda/acco_cuda_frontend.cpp", "cuda/acco_cuda_kernels.cu", "cuda/acco_cuda_quant_frontend.cpp",
                "cuda/acco_cuda_quant.cu"]

    def cxx_args(self):
        return super().cxx_args() + [self.digest_define()]

    def nvcc_args(self):
        if self.build_for_cpu:
            return []
        # Unlike DeepSpeed's default, no --use_fast_math: the kernels must round sqrt and division
        # like torch (IEEE), and flushing denormals would change small moments.
        threads = max(1, min(os.cpu_count() or 1, 8))
        return ["-O3", "-lineinfo", f"--threads={threads}"] + self.compute_capability_args()

    def compute_capability_args(self, cross_compile_archs=None):
        """nvcc ``-gencode`` flags for ``TORCH_CUDA_ARCH_LIST`` (any list torch accepts), else the default.

        Unset, a JIT build compiles for the visible devices (torch's rule, the newest with PTX), and an
        ahead-of-time build for ``cross_compile_archs`` or :meth:`_default_archs` (DeepSpeed's default
        for CUDA 13, "6.0;6.1;7.0", names architectures CUDA 13 no longer compiles for). The flags go
        into ``nvcc_args``, so torch adds none of its own and DeepSpeed's parser never sees the list.
        """
        listed = os.environ.get(ARCH_LIST_ENV, "").strip()
        if not listed and not self.jit_mode:
            listed = cross_compile_archs or self._default_archs()
        flags = arch_flags(listed)
        # DeepSpeed's builders read enable_bf16 (it adds -DBF16_AVAILABLE); bf16 needs sm_80 or newer.
        self.enable_bf16 = all(capability >= 80 for capability in _compute_capabilities(flags))
        return flags

    @staticmethod
    def _default_archs() -> str:
        cuda_major, cuda_minor = installed_cuda_version()
        if cuda_major >= 13:
            return "7.5;8.0;8.6;9.0;10.0;12.0+PTX"
        if (cuda_major, cuda_minor) >= (12, 8):
            return "7.0;7.5;8.0;8.6;9.0;10.0;12.0+PTX"
        if (cuda_major, cuda_minor) >= (11, 8):
            return "7.0;7.5;8.0;8.6;9.0+PTX"
        return "7.0;7.5;8.0+PTX"

    def is_compatible(self, verbose=False):
        import torch
        from torch.utils import cpp_extension

        if not self._sources_present():
            return self._incompatible(self._missing_sources_reason(), verbose)
        if getattr(torch.version, "hip", None):
            return self._incompatible(f"{self.NAME} has no ROCm port yet; torch {torch.__version__} is a ROCm build",
                                      verbose)
        if torch.version.cuda is None:
            return self._incompatible(
                f"{self.NAME} needs a CUDA build of torch; torch {torch.__version__} is CPU-only", verbose)
        nvcc = os.path.join(cpp_extension.CUDA_HOME or "", "bin", "nvcc")
        if cpp_extension.CUDA_HOME is None or not os.path.isfile(nvcc):
            return self._incompatible(
                f"{self.NAME} needs the CUDA toolkit's nvcc; none found (CUDA_HOME={cpp_extension.CUDA_HOME}). "
                "Install the toolkit matching torch's CUDA "
                f"{torch.version.cuda} and set CUDA_HOME", verbose)
        if not self._check_cxx(verbose):
            return False
        try:
            assert_no_cuda_mismatch(self.name)
        except (CUDAMismatchException, MissingCUDAException) as err:
            return self._incompatible(f"{self.NAME}: {err} (DS_SKIP_CUDA_CHECK=1 accepts the mismatch)", verbose)
        return super().is_compatible(verbose)
