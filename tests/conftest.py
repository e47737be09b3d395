"""Build the JIT-compiled ops that the selected multi-process tests need, once, before they run.

Otherwise the first multi-rank test (or bench run) to need an op compiles it inside its own
timeout, and on a fresh machine under load the compile alone can take longer than that. Only
tests marked ``slow`` (multi-process or launcher tests, pyproject.toml) start processes with such a
timeout; an in-process test that needs an op builds it itself, without a time limit. So, after
collection (``-k``/``-m`` deselection included):

* our CPU op is built if a selected test is ``slow``;
* DeepSpeed's ``FusedAdamBuilder`` and ``ShareMemCommBuilder`` (its engine's optimizer and
  deepspeed.comm's shared-memory op) are built if a selected ``slow`` test is not marked
  ``without_deepspeed_ops``. On a CUDA machine DeepSpeed's FusedAdam is its CUDA kernel, whose
  compile takes minutes: tests that never run DeepSpeed's engine (tests/test_gpu_engine.py) carry
  the marker, so ``pytest tests/test_gpu_engine.py`` compiles nothing of DeepSpeed's.

The build runs in a subprocess without a time limit, which keeps this pytest process free of
deepspeed imports (some tests check what importing deepspeed_acco imports). A failed build is not
an error here: the tests that need the op report it. ``ACCO_TESTS_SKIP_PREBUILD=1`` builds nothing
(benchmarks/gpu_check.sh builds the ops in its own step).
"""
import os
import subprocess
import sys
from typing import Iterable, List

# The wire of DPU, ACCO and CO2 is chosen from measured timings by default (docs/wire.md, "The wire"),
# which would make the bitwise comparisons of this suite depend on how busy the machine is: every
# test runs on the uncompressed wire unless it sets the variable itself (tests/test_wire.py does).
os.environ.setdefault("DEEPSPEED_ACCO_WIRE", "uncompressed")

OUR_CPU_OPS = "acco_cpu"
DEEPSPEED_OPS = ("FusedAdamBuilder", "ShareMemCommBuilder")
WITHOUT_DEEPSPEED_OPS = "without_deepspeed_ops"

_BUILD = """
import sys
for name in sys.argv[1:]:
    if name == "acco_cpu":
        from deepspeed_acco.ops import _backend
        try:
            _backend.kernel_module("cpu")
        except Exception as error:
            print("deepspeed_acco CPU ops:", error, file=sys.stderr)
        continue
    from deepspeed.accelerator import get_accelerator
    try:
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible():
            builder.load()
    except Exception as error:
        print("DeepSpeed", name, error, file=sys.stderr)
"""


def ops_to_prebuild(items: Iterable) -> List[str]:
    """The ops the selected test items need built beforehand (module docstring), in build order."""
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    ops = [OUR_CPU_OPS] if slow else []
    if any(item.get_closest_marker(WITHOUT_DEEPSPEED_OPS) is None for item in slow):
        ops += list(DEEPSPEED_OPS)
    return ops


def pytest_configure(config):
    config.addinivalue_line(
        "markers", f"{WITHOUT_DEEPSPEED_OPS}: neither the test nor the processes it starts run DeepSpeed's engine, "
        "optimizers or deepspeed.comm, so selecting it does not prebuild DeepSpeed's ops (tests/conftest.py)")


def pytest_collection_finish(session):
    if os.environ.get("ACCO_TESTS_SKIP_PREBUILD") or session.config.option.collectonly:
        return
    ops = ops_to_prebuild(session.items)
    if not ops:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"prebuilding ops for the selected tests: {', '.join(ops)}")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    subprocess.run([sys.executable, "-c", _BUILD, *ops], env=env, cwd=repo, stdout=subprocess.DEVNULL, check=False)
