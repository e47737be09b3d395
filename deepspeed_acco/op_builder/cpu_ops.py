"""Op builder of the fused CPU kernels (C++, OpenMP + SIMD): op ``acco_cpu_ops``."""
import os
import platform
import subprocess
import tempfile

from deepspeed.ops.op_builder.builder import OpBuilder

from .builder import AccoBuilderMixin

# Build flags that change results, not just speed; tests/test_ops_kernels.py compiles the kernel
# file with them to check its vectorisation.
#   -ffp-contract=off: a * b + c must stay two roundings, as in torch's separate kernels.
#   -fno-math-errno: lets sqrtf vectorise; it only stops errno from being set.
NUMERIC_FLAGS = ["-ffp-contract=off", "-fno-math-errno"]

# Overrides -march=native, e.g. "-march=x86-64-v3" for an ahead-of-time build that must run on
# other machines than the one it is built on.
CPU_ARCH_ENV = "DEEPSPEED_ACCO_CPU_ARCH"


def cpu_arch_flags():
    """ISA flags: the build machine's own ISA unless DEEPSPEED_ACCO_CPU_ARCH says otherwise."""
    override = os.environ.get(CPU_ARCH_ENV, "").strip()
    if override:
        return override.split()
    # DeepSpeed's cpu_arch() asks py-cpuinfo, which costs a second per process; the answer is
    # -march=native everywhere except POWER, where gcc spells it -mcpu.
    if platform.machine().lower().startswith("ppc"):
        return ["-mcpu=native"]
    return ["-march=native"]


class AccoCPUOpsBuilder(AccoBuilderMixin, OpBuilder):
    BUILD_VAR = "DS_BUILD_ACCO_CPU_OPS"
    NAME = "acco_cpu_ops"
    _openmp_probe_results = {}  # compiler -> bool: the probe runs once per process and compiler

    def __init__(self):
        super().__init__(name=self.NAME)

    def csrc_sources(self):
        return ["cpu/acco_cpu_frontend.cpp", "cpu/acco_cpu_kernels.cpp", "cpu/acco_cpu_quant_frontend.cpp",
                "cpu/acco_cpu_quant.cpp"]

    def cxx_args(self):
        args = ["-O3", "-fopenmp", "-Wno-reorder"] + cpu_arch_flags() + NUMERIC_FLAGS
        return args + [self.digest_define()]

    def extra_ldflags(self):
        # Links libgomp by soname, so the process keeps using the copy torch already loaded.
        return ["-fopenmp"]

    def is_compatible(self, verbose=False):
        if not self._sources_present():
            return self._incompatible(self._missing_sources_reason(), verbose)
        if not self._check_cxx(verbose):
            return False
        if not self._compiler_has_openmp():
            return self._incompatible(
                f"{self.NAME} needs OpenMP: '{self._cxx_compiler()} -fopenmp' cannot compile '#include <omp.h>' "
                "(install the compiler's OpenMP runtime, e.g. libgomp)", verbose)
        return super().is_compatible(verbose)

    def _compiler_has_openmp(self) -> bool:
        compiler = self._cxx_compiler()
        if compiler not in self._openmp_probe_results:
            self._openmp_probe_results[compiler] = self._probe_openmp(compiler)
        return self._openmp_probe_results[compiler]

    @staticmethod
    def _probe_openmp(compiler: str) -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            source = os.path.join(tmp, "omp_probe.cpp")
            with open(source, "w") as f:
                f.write("#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
            try:
                result = subprocess.run([compiler, "-fopenmp", source, "-o", os.path.join(tmp, "probe")],
                                        capture_output=True, timeout=60)
            except (OSError, subprocess.SubprocessError):
                return False
            return result.returncode == 0
