"""Op builder of the fused CUDA kernels: op ``acco_cuda_ops``."""
import os

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
        # Ahead-of-time builds without TORCH_CUDA_ARCH_LIST get DeepSpeed's default list, which for
        # CUDA 13 is "6.0;6.1;7.0", architectures CUDA 13 no longer compiles for.
        if not self.jit_mode and cross_compile_archs is None and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            cross_compile_archs = self._default_archs()
        return super().compute_capability_args(cross_compile_archs)

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
