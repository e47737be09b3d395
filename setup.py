"""deepspeed-acco: communication-overlapped sharded optimizers (ACCO, DPU, CO2) for DeepSpeed."""
import os
import shutil
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL_SOURCE_SUFFIXES = (".cpp", ".cu", ".h", ".cuh")


class BuildPyWithKernelSources(build_py):
    """Copies csrc/ into the built package as deepspeed_acco/_csrc, so that an installed wheel can
    JIT-build the fused kernels (DeepSpeed ships its csrc/ inside its package the same way)."""

    def run(self):
        super().run()
        source_root = os.path.join(HERE, "csrc")
        target_root = os.path.join(self.build_lib, "deepspeed_acco", "_csrc")
        for directory, _, files in os.walk(source_root):
            for name in files:
                if name.endswith(KERNEL_SOURCE_SUFFIXES):
                    relative = os.path.relpath(os.path.join(directory, name), source_root)
                    destination = os.path.join(target_root, relative)
                    os.makedirs(os.path.dirname(destination), exist_ok=True)
                    shutil.copyfile(os.path.join(directory, name), destination)


def acco_ops_extensions():
    """Ahead-of-time builds of the fused kernels (docs/kernels.md), the DeepSpeed way.

    DS_BUILD_ACCO_OPS=1 builds every op this machine can build; DS_BUILD_ACCO_CPU_OPS and
    DS_BUILD_ACCO_CUDA_OPS (1 or 0) require or skip one op. Needs torch and deepspeed at build
    time: ``DS_BUILD_ACCO_OPS=1 pip install --no-build-isolation .``. Without it the ops are
    JIT-built on first use.
    """
    build_all = os.environ.get("DS_BUILD_ACCO_OPS", "0") == "1"
    op_vars = ("DS_BUILD_ACCO_CPU_OPS", "DS_BUILD_ACCO_CUDA_OPS")
    if not build_all and not any(os.environ.get(var) == "1" for var in op_vars):
        return [], {}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from torch.utils.cpp_extension import BuildExtension

    from deepspeed_acco.op_builder import ALL_OPS

    extensions = []
    for builder_class in ALL_OPS.values():
        requested = os.environ.get(builder_class.BUILD_VAR, "1" if build_all else "0")
        if requested != "1":
            continue
        builder = builder_class()
        if builder.is_compatible(verbose=False):
            extensions.append(builder.builder())
        elif os.environ.get(builder_class.BUILD_VAR) == "1":
            raise RuntimeError(f"{builder_class.BUILD_VAR}=1 but {builder.NAME} cannot be built: {builder.error_log}")
        else:
            print(f"deepspeed-acco: skipping {builder.NAME}: {builder.error_log}")
    return extensions, {"build_ext": BuildExtension}


ext_modules, cmdclass = acco_ops_extensions()
cmdclass["build_py"] = BuildPyWithKernelSources

setup(
    name="deepspeed-acco",
    version="0.1.0",
    description="Communication-overlapped ZeRO-1 optimizers (ACCO, DPU, CO2) as a DeepSpeed extension",
    packages=find_packages(include=["deepspeed_acco", "deepspeed_acco.*"]),
    python_requires=">=3.10",  # dataclass(kw_only=True)
    install_requires=[
        "torch>=2.1",
        "deepspeed>=0.14",
        "numpy",
    ],
    extras_require={
        "bench": ["transformers>=4.40", "matplotlib", "tqdm"],
        "test": ["pytest", "transformers>=4.40", "accelerate>=1.15", "matplotlib", "tqdm", "ninja"],
    },
    entry_points={"console_scripts": ["deepspeed-acco-bench=deepspeed_acco.bench:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
