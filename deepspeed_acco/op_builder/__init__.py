"""DeepSpeed-style op builders of deepspeed-acco's fused kernels (sources in ``csrc/``).

``AccoCPUOpsBuilder().load()`` and ``AccoCUDAOpsBuilder().load()`` return the compiled op module,
JIT-building it with ninja on first use; ``setup.py`` builds them ahead of time when
``DS_BUILD_ACCO_OPS=1``. Users do not call these directly: :mod:`deepspeed_acco.ops` picks and
loads the right one. Importing this package imports DeepSpeed (for its ``OpBuilder`` classes).
"""
from .cpu_ops import AccoCPUOpsBuilder
from .cuda_ops import AccoCUDAOpsBuilder

ALL_OPS = {builder.NAME: builder for builder in (AccoCPUOpsBuilder, AccoCUDAOpsBuilder)}

__all__ = ["AccoCPUOpsBuilder", "AccoCUDAOpsBuilder", "ALL_OPS"]
