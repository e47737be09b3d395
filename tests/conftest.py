"""Build the JIT-compiled ops (ours and DeepSpeed's CPU FusedAdam and shared-memory comm op) once,
before any test runs, in a subprocess without a time limit.

Otherwise the first multi-rank test (or bench run) to need an op compiles it inside its own
timeout, and on a fresh machine under load the compile alone can take longer than that. The
subprocess keeps this pytest process free of deepspeed imports (some tests check what importing
deepspeed_acco imports). A failed build is not an error here: the tests that need the op report it.
"""
import os
import subprocess
import sys

_BUILD = """
import sys
from deepspeed_acco.ops import _backend
try:
    _backend.kernel_module("cpu")
except Exception as error:
    print("deepspeed_acco CPU ops:", error, file=sys.stderr)
from deepspeed.accelerator import get_accelerator
for name in ("FusedAdamBuilder", "ShareMemCommBuilder"):
    try:
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible():
            builder.load()
    except Exception as error:
        print("DeepSpeed", name, error, file=sys.stderr)
"""


def pytest_sessionstart(session):
    if os.environ.get("ACCO_TESTS_SKIP_PREBUILD"):
        return
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    subprocess.run([sys.executable, "-c", _BUILD], env=env, cwd=repo, stdout=subprocess.DEVNULL, check=False)
