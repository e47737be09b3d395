"""The GPU check's plan and runner (benchmarks/gpu_check.sh) and what pytest prebuilds (tests/conftest.py).

GPU time is scarce (docs/gpu_check.md): the check's steps run in order of value under
caps that sum to at most 480 s, each step's result is in the output folder as soon as it ends,
and pytest on a CUDA machine compiles none of DeepSpeed's ops for tests that do not run DeepSpeed.
The runner is exercised here with a stand-in python and nvidia-smi, so no GPU is needed.
"""
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import conftest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
STEPS = ["install", "environment", "build", "kernel_tests", "kernel_bench", "engine_tests", "e2e", "example"]
DEVICE_CALL_LIMIT_S = 600  # the device tool's limit for one command
PLAN_BUDGET_S = 480


def _plan():
    output = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, check=True).stdout
    rows = re.findall(r"^\s*(\d+)\. (\S+)\s+(\d+) s   (.+)$", output, re.M)
    total = int(re.search(r"^total (\d+) s", output, re.M).group(1))
    return rows, total


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    subprocess.run(["bash", "-n", str(REPO / "benchmarks" / "gpu_wheels.sh")], check=True)


def test_plan_orders_steps_by_value_with_caps_within_the_budget():
    rows, total = _plan()
    assert [name for _, name, _, _ in rows] == STEPS
    assert [int(index) for index, _, _, _ in rows] == list(range(1, len(STEPS) + 1))
    caps = [int(cap) for _, _, cap, _ in rows]
    assert all(cap > 0 for cap in caps)
    assert sum(caps) == total <= PLAN_BUDGET_S < DEVICE_CALL_LIMIT_S
    assert all(len(basis) > 20 for _, _, _, basis in rows), "every step states the basis of its estimate"


def _stand_ins(tmp_path, slow_on=None):
    """A python that succeeds at once (sleeping when its arguments contain ``slow_on``), and an nvidia-smi."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text("#!/bin/bash\n"
                      + (f'case "$*" in *{slow_on}*) sleep 60 ;; esac\n' if slow_on else "")
                      + 'echo "stand-in python: ${1:0:40}"\n')
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/bash\necho 'Stand-in H200, 143771 MiB'\n")
    for path in (python, smi):
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHON=str(python),
               OUT=str(tmp_path / "out"), TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    return env


def _summary_lines(out):
    return (out / "summary.txt").read_text().splitlines()


def test_runner_runs_the_plan_in_order_and_writes_the_output_folder(tmp_path):
    env = _stand_ins(tmp_path)
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    out = tmp_path / "out"
    lines = _summary_lines(out)
    assert [line.split()[1] for line in lines if line.startswith("PASS")] == STEPS
    assert lines[-1] == "GPU CHECK PASSED"
    log = (out / "steps.log").read_text()
    assert [m for m in re.findall(r"^=== (\S+) \(limit", log, re.M)] == STEPS
    assert "Stand-in H200" in (out / "environment.txt").read_text()
    assert {p.name for p in out.iterdir()} <= {"summary.txt", "steps.log", "environment.txt", "kernels.json",
                                                "e2e.json"}


def _kill_processes_mentioning(text):
    """SIGKILL the process group of every process whose command line contains ``text`` (the
    stand-ins under tmp_path, with the ``sleep`` they started)."""
    own = os.getpgid(0)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                if text.encode() not in handle.read():
                    continue
            group = os.getpgid(int(entry))
            if group != own:
                os.killpg(group, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def test_a_killed_run_keeps_every_finished_step(tmp_path):
    env = _stand_ins(tmp_path, slow_on="e2e_step_time.py")
    process = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    summary = tmp_path / "out" / "summary.txt"
    try:
        deadline = time.monotonic() + 120
        while not (summary.exists() and "RUNNING  e2e" in summary.read_text()):
            assert time.monotonic() < deadline, "the check never reached its e2e step"
            assert process.poll() is None, "the check ended early"
            time.sleep(0.2)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # as the device tool kills a command past its limit
        process.wait()
        _kill_processes_mentioning(str(tmp_path))  # `timeout` runs its step in a process group of its own
    lines = _summary_lines(tmp_path / "out")
    assert [line.split()[1] for line in lines if line.startswith("PASS")] == STEPS[:STEPS.index("e2e")]
    assert lines[-1].startswith("RUNNING  e2e")


def test_runner_rejects_unknown_arguments():
    result = subprocess.run(["bash", str(SCRIPT), "--plna"], capture_output=True, text=True)
    assert result.returncode == 3 and "usage" in result.stderr


# ---- the e2e step's script, on the CPU ------------------------------------------------------
@pytest.mark.slow
def test_e2e_step_runs_every_method_and_checks_memory_on_the_cpu(tmp_path):
    # The GPU run is the real use (compute-bound size, CUDA memory); here the tiny model on the CPU
    # checks that every kind of method runs, is timed and reported, and that our engines were freed.
    out = tmp_path / "e2e.json"
    methods = ["floor", "torch", "deepspeed", "ShardedAdamW", "ACCO", "CO2"]
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "e2e_step_time.py"), "--methods", ",".join(methods),
         "--precisions", "bf16", "--micro-batch", "2", "--ctx", "32", "--warmup", "1", "--updates", "1",
         "--repeats", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["update_kernels"] in ("cpu", "torch")
    assert report["micro_batch"]["by_precision"] == {"bf16": 2, "fp32": 2}, "a given micro-batch serves both"
    by_method = {r["method"]: r for r in report["results"]}
    assert sorted(by_method) == sorted(methods)
    for method, row in by_method.items():
        assert "error" not in row, f"{method}: {row.get('error')}"
        assert row["ms_per_update"] > 0 and row["tokens_per_s"] > 0 and row["left_after_gc_bytes"] == 0
    assert all(by_method[kind]["freed_without_gc"] for kind in ("ShardedAdamW", "ACCO", "CO2"))
    assert [t["target"].split()[0] for t in report["targets"]] == ["ShardedAdamW", "ACCO"]
    assert "| method | precision | micro-batch | ms/update" in result.stdout and "targets met:" in result.stdout


# ---- tests/conftest.py: which ops pytest builds before the selected tests ---------------------
class FakeItem:
    def __init__(self, *markers):
        self.markers = set(markers)

    def get_closest_marker(self, name):
        return SimpleNamespace(name=name) if name in self.markers else None


def test_prebuild_follows_the_selected_tests():
    gpu_engine = FakeItem("slow", conftest.WITHOUT_DEEPSPEED_OPS)
    parity = FakeItem("slow")
    kernels = FakeItem()
    assert conftest.ops_to_prebuild([]) == []
    assert conftest.ops_to_prebuild([kernels]) == [], "in-process tests build what they need themselves"
    assert conftest.ops_to_prebuild([kernels, gpu_engine]) == [conftest.OUR_CPU_OPS]
    assert conftest.ops_to_prebuild([gpu_engine, parity]) == [conftest.OUR_CPU_OPS, *conftest.DEEPSPEED_OPS]


def _collected(arguments, monkeypatch, skip_prebuild=False):
    """Collect with pytest in this process, as a session would; return the ops the hook would build."""
    builds = []
    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: builds.append(command[3:]))
    if skip_prebuild:
        monkeypatch.setenv("ACCO_TESTS_SKIP_PREBUILD", "1")
    else:
        monkeypatch.delenv("ACCO_TESTS_SKIP_PREBUILD", raising=False)

    class Stop:
        @pytest.hookimpl(trylast=True)
        def pytest_collection_finish(self, session):
            session.shouldstop = "collected"  # run no test

    code = pytest.main(["-q", "-p", "no:cacheprovider", *arguments], plugins=[Stop()])
    assert code in (pytest.ExitCode.OK, pytest.ExitCode.INTERRUPTED, pytest.ExitCode.NO_TESTS_COLLECTED), code
    assert len(builds) <= 1
    return builds[0] if builds else []


def test_gpu_engine_tests_on_a_cuda_machine_build_none_of_deepspeeds_ops(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # DeepSpeed would build its CUDA FusedAdam
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _collected([str(REPO / "tests" / "test_gpu_engine.py")], monkeypatch) == [conftest.OUR_CPU_OPS]


def test_selection_after_deselection_decides_what_is_built(tmp_path, monkeypatch):
    (tmp_path / "test_selection.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.slow\ndef test_deepspeed_parity():\n    pass\n\n"
        "@pytest.mark.slow\n@pytest.mark.without_deepspeed_ops\ndef test_our_engine_only():\n    pass\n\n"
        "def test_in_process_kernel():\n    pass\n")
    # tests/conftest.py as the plugin (tmp_path is outside tests/, where pytest would find it itself).
    base = [str(tmp_path / "test_selection.py"), "-p", "conftest", "-W", "ignore::pytest.PytestUnknownMarkWarning"]
    assert _collected(base, monkeypatch) == [conftest.OUR_CPU_OPS, *conftest.DEEPSPEED_OPS]
    assert _collected(base + ["-k", "our_engine or kernel"], monkeypatch) == [conftest.OUR_CPU_OPS]
    assert _collected(base + ["-k", "kernel"], monkeypatch) == []
    assert _collected(base + ["-m", "not slow"], monkeypatch) == []
    assert _collected(base, monkeypatch, skip_prebuild=True) == []
