"""deepspeed-acco: communication-overlapped sharded optimizers (ACCO, DPU, CO2) for DeepSpeed."""
from setuptools import find_packages, setup

setup(
    name="deepspeed-acco",
    version="0.1.0",
    description="Communication-overlapped ZeRO-1 optimizers (ACCO, DPU, CO2) as a DeepSpeed extension",
    packages=find_packages(include=["deepspeed_acco", "deepspeed_acco.*"]),
    python_requires=">=3.9",
    install_requires=[
        "torch>=2.1",
        "deepspeed>=0.14",
        "numpy",
    ],
    extras_require={
        "bench": ["transformers>=4.40", "matplotlib", "tqdm"],
        "test": ["pytest", "transformers>=4.40", "matplotlib", "tqdm", "ninja"],
    },
    entry_points={"console_scripts": ["deepspeed-acco-bench=deepspeed_acco.bench:main"]},
)
