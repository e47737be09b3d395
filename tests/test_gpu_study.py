"""The prepared GPU study (benchmarks/gpu_study.sh, deepspeed_acco/bench/gpu_study/, docs/gpu_study.md).

Its analysis is pure arithmetic (test plan layer 1); its runner is exercised with a stand-in python
and nvidia-smi, as tests/test_gpu_plan.py does for the GPU check; and the whole study runs on the CPU
with the tiny model (``--dry-run``), so every step the GPU machine will run has run here first.
"""
import gzip
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepspeed_acco.bench.gpu_study import convergence, overlap
from test_gpu_plan import _kill_processes_mentioning, _stand_ins, _summary_lines

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_study.sh"
STEPS = ["install", "environment", "build", "overlap", "convergence"]
OUTPUTS = {"summary.txt", "steps.log", "environment.txt", "overlap.json", "trace_acco.json.gz", "convergence.json"}
PLAN_BUDGET_S = 480
DEVICE_CALL_LIMIT_S = 600
DEVICE_RETURNS_AT_MOST_FILES = 8


# ---- layer 1: the analysis ---------------------------------------------------------------------
def test_bounds_per_method_from_the_link_time_per_update():
    floor, link, tau = 40.0, 30.0, 4
    assert overlap.rounds_per_update("acco", tau) == 2 and overlap.rounds_per_update("co2", tau) == 0.25
    assert overlap.bound_ms("zero1", floor, link, tau) == pytest.approx(70.0)  # T_compute + T_comm
    assert overlap.bound_ms("sharded", floor, link, tau) == pytest.approx(70.0)
    assert overlap.bound_ms("dpu", floor, link, tau) == pytest.approx(40.0)  # max(T_compute, T_comm)
    assert overlap.bound_ms("dpu", floor, 50.0, tau) == pytest.approx(50.0)
    # ACCO's 30 ms per update are two rounds of 15: max(T_compute, 2 T_comm)
    assert overlap.bound_ms("acco", floor, link, tau) == pytest.approx(40.0)
    assert overlap.bound_ms("acco", floor, 60.0, tau) == pytest.approx(60.0)
    # CO2: a round every 4 updates, 4 x 30 = 120 ms; H = 1 inner step (its eager default) hides 40 of it,
    # and the other 80 are paid once per round of 4 updates: T_compute + max(0, T_round - H T_compute) / tau
    assert overlap.bound_ms("co2", floor, link, tau) == pytest.approx(60.0)
    assert overlap.bound_ms("co2", floor, 5.0, tau) == pytest.approx(40.0)  # a 20 ms round fits under one step


def test_hidden_and_communicating_shares():
    assert overlap.hidden_share(ms=50.0, no_link_ms=50.0, link_ms=30.0) == pytest.approx(1.0)
    assert overlap.hidden_share(ms=80.0, no_link_ms=50.0, link_ms=30.0) == pytest.approx(0.0)
    assert overlap.hidden_share(ms=60.0, no_link_ms=50.0, link_ms=40.0) == pytest.approx(0.75)
    assert overlap.hidden_share(ms=60.0, no_link_ms=50.0, link_ms=0.0) is None
    assert overlap.communicating_share(ms=100.0, no_link_ms=80.0) == pytest.approx(0.2)


def test_overlap_arguments_are_checked():
    with pytest.raises(SystemExit):
        overlap.parse_args(["--methods", "acco,zero1"])  # the shares are ZeRO-1's: it must run first
    with pytest.raises(SystemExit):
        overlap.parse_args(["--updates", "6", "--local-steps", "4"])  # CO2's windows must hold whole rounds
    with pytest.raises(SystemExit):
        overlap.parse_args(["--methods", "zero1,lamb"])
    args = overlap.parse_args(["--methods", "acco", "--rates-gbps", "100,50"])
    assert args.rates_bps == [100e9, 50e9] and args.shares == [None, None]


def test_cosine_schedule_and_evaluation_points():
    section = convergence.cosine_schedule(1500, 0.02, 2)
    assert section["type"] == "WarmupCosineLR"
    assert section["params"]["total_num_steps"] == 1500 and section["params"]["warmup_num_steps"] == 30
    assert section["params"]["cos_min_ratio"] == section["params"]["warmup_min_ratio"] == 0.1
    assert convergence.cosine_schedule(8, 0.02, 2)["params"]["warmup_num_steps"] == 2
    with pytest.raises(ValueError, match="--min-warmup"):
        convergence.cosine_schedule(4, 0.02, 10)
    assert convergence.eval_updates(1000, 4) == [0, 250, 500, 750, 1000]
    assert convergence.eval_updates(3, 20) == [0, 1, 2, 3]


def test_updates_are_sized_to_the_budget_within_bounds():
    # 150 s for two runs: 75 s each, less 5 s to build and 21 x 0.1 s of evaluations, at 25 ms/update
    assert convergence.choose_updates(150, 2, 25.0, 5.0, 0.1, 20, 1000, 3000) == 2716
    assert convergence.choose_updates(150, 2, 100.0, 5.0, 0.1, 20, 1000, 3000) == 1000  # at least the minimum
    assert convergence.choose_updates(150, 2, 5.0, 5.0, 0.1, 20, 1000, 3000) == 3000
    assert convergence.choose_updates(5, 2, 5.0, 5.0, 0.1, 20, 1000, 3000) == 1000
    assert convergence.gap(3.03, 3.0) == {"nats": pytest.approx(0.03), "relative": pytest.approx(0.01)}


def test_convergence_arguments_are_checked():
    with pytest.raises(SystemExit):
        convergence.parse_args(["--methods", "acco,sharded"])
    with pytest.raises(SystemExit):
        convergence.parse_args(["--grad-accum", "3"])


# ---- the runner, with stand-ins ----------------------------------------------------------------
def _plan():
    output = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, check=True).stdout
    rows = [line.split(None, 3) for line in output.splitlines() if line[:3].strip().rstrip(".").isdigit()]
    total = int(output.splitlines()[-1].split()[1])
    return rows, total


def test_scripts_are_valid_bash():
    for name in ("gpu_study.sh", "gpu_steps.sh"):
        subprocess.run(["bash", "-n", str(REPO / "benchmarks" / name)], check=True)


def test_plan_orders_steps_by_value_with_caps_within_the_budget():
    rows, total = _plan()
    assert [name for _, name, _, _ in rows] == STEPS
    assert [index for index, _, _, _ in rows] == [f"{i}." for i in range(1, len(STEPS) + 1)]
    caps = [int(cap) for _, _, cap, _ in rows]
    assert all(cap > 0 for cap in caps)
    assert sum(caps) == total <= PLAN_BUDGET_S < DEVICE_CALL_LIMIT_S
    assert all(len(basis) > 20 for _, _, _, basis in rows), "every step states the basis of its estimate"


def _echoing_stand_ins(tmp_path):
    """tests/test_gpu_plan.py's stand-ins, with a python that echoes all its arguments."""
    env = _stand_ins(tmp_path)
    Path(env["PYTHON"]).write_text('#!/bin/bash\necho "stand-in python: $*"\n')
    return env


def test_runner_runs_the_plan_in_order(tmp_path):
    env = _echoing_stand_ins(tmp_path)
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    out = tmp_path / "out"
    lines = _summary_lines(out)
    assert [line.split()[1] for line in lines if line.startswith("PASS")] == STEPS
    assert lines[-1] == "GPU STUDY PASSED"
    log = (out / "steps.log").read_text()
    assert [line.split()[1] for line in log.splitlines() if line.startswith("=== ")] == STEPS
    assert "--budget-s 170" in log, "the convergence study is sized to its step's limit (195 s) less 25 s"
    assert "Stand-in H200" in (out / "environment.txt").read_text()
    assert {p.name for p in out.iterdir()} <= OUTPUTS


def test_a_failed_build_leaves_the_studies_on_the_torch_kernels(tmp_path):
    env = _stand_ins(tmp_path)
    python = Path(env["PYTHON"])
    python.write_text('#!/bin/bash\ncase "$*" in *AccoCUDAOpsBuilder*) echo "nvcc failed" >&2; exit 1 ;; esac\n'
                      'echo "stand-in python: ${1:0:40} kernels=${DEEPSPEED_ACCO_KERNELS:-default}"\n')
    result = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, "a failed step fails the run"
    lines = _summary_lines(tmp_path / "out")
    assert [line.split()[1] for line in lines if line.startswith("PASS")] == ["install", "environment", "overlap",
                                                                               "convergence"]
    assert any(line.startswith("FAIL     build") for line in lines) and lines[-1] == "GPU STUDY FAILED"
    log = (tmp_path / "out" / "steps.log").read_text()
    overlap_part = log.split("=== overlap")[1]
    assert "kernels=torch" in overlap_part and "kernels=default" not in overlap_part


def test_a_killed_run_keeps_every_finished_step(tmp_path):
    env = _stand_ins(tmp_path, slow_on="gpu_study.convergence")
    process = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    summary = tmp_path / "out" / "summary.txt"
    try:
        deadline = time.monotonic() + 120
        while not (summary.exists() and "RUNNING  convergence" in summary.read_text()):
            assert time.monotonic() < deadline, "the study never reached its convergence step"
            assert process.poll() is None, "the study ended early"
            time.sleep(0.2)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # as a job scheduler kills a command past its time limit
        process.wait()
        _kill_processes_mentioning(str(tmp_path))
    lines = _summary_lines(tmp_path / "out")
    assert [line.split()[1] for line in lines if line.startswith("PASS")] == STEPS[:STEPS.index("convergence")]
    assert lines[-1].startswith("RUNNING  convergence")


def test_runner_rejects_unknown_arguments():
    for arguments in (["--plna"], ["--plan", "--dry-run"]):
        result = subprocess.run(["bash", str(SCRIPT), *arguments], capture_output=True, text=True)
        assert result.returncode == 3 and "usage" in result.stderr


# ---- the dry run: every step, on the CPU ---------------------------------------------------------
@pytest.mark.slow
def test_dry_run_runs_every_step_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(out), DEEPSPEED_ACCO_CACHE=str(tmp_path / "cache"))
    started = time.monotonic()
    result = subprocess.run(["bash", str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - started
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    lines = _summary_lines(out)
    assert [line.split()[1] for line in lines if line.startswith("PASS")] == STEPS
    assert lines[-1] == "GPU STUDY DRY RUN PASSED" and took < 240
    names = {p.name for p in out.iterdir()}
    assert names == OUTPUTS and len(names) <= DEVICE_RETURNS_AT_MOST_FILES
    assert all(p.is_file() for p in out.iterdir()), "no folders: the output folder is copied back as plain files"
    summary = "\n".join(lines)
    assert "### Link 1:" in summary and "| ACCO |" in summary and "### Convergence" in summary

    study = json.loads((out / "overlap.json").read_text())
    assert [m["method"] for m in study["methods"]] == ["zero1", "sharded", "dpu", "acco", "co2"]
    assert [link["share"] for link in study["links"]] == [0.2, 0.35, 0.5]
    rates = [link["rate_gbps"] for link in study["links"]]
    assert rates == sorted(rates, reverse=True) and study["floor"]["ms"] > 0
    # What crosses the emulated link per update, as each engine issues it at W = 8 ranks:
    calls = {m["method"]: m["traffic"]["calls"] for m in study["methods"]}
    bits = {m["method"]: m["traffic"]["bits"] for m in study["methods"]}
    model_bytes = 2 if study["precision"] == "bf16" else 4
    one_pass = 8 * 7 / 8 * study["parameters"] * model_bytes  # a reduce-scatter or all-gather of the model
    # DeepSpeed's ZeRO-1 all-reduces the gradients (two passes) and a small flag or two (the norm,
    # the overflow check), and gathers the parameters, which it skips alone at world size 1.
    assert calls["zero1"]["all_gather"] == 1 and calls["zero1"]["all_reduce"] >= 2
    assert bits["zero1"] == pytest.approx(3 * one_pass, rel=0.01)
    for method in ("sharded", "dpu"):
        assert calls[method] == {"reduce_scatter": 1, "all_reduce": 1, "all_gather": 1}
        assert bits[method] == pytest.approx(2 * one_pass, rel=0.01)
    assert calls["acco"] == {"reduce_scatter": 2, "all_reduce": 2, "all_gather": 2}  # estimate and commit
    assert bits["acco"] == pytest.approx(4 * one_pass, rel=0.01)
    # CO2 averages and gathers fp32 parameters once per round of --local-steps 2 inner steps.
    assert calls["co2"] == {"reduce_scatter": 0.5, "all_reduce": 0.5, "all_gather": 0.5}
    assert bits["co2"] == pytest.approx(one_pass * 4 / model_bytes, rel=0.01)
    for method in study["methods"]:
        assert len(method["points"]) == 3
        for point, link in zip(method["points"], study["links"]):
            traffic = method["traffic"]
            assert point["requested_link_ms"] == pytest.approx(
                1e3 * (traffic["messages"] * 5e-6 + traffic["bits"] / (link["rate_gbps"] * 1e9)))
            assert point["bound_ms"] > 0 and math.isfinite(point["over_bound"])
            # On the CPU a window can miss a job that its worker ran after the window's end (the
            # traffic above is counted between drained pipelines instead); on CUDA it cannot.
            assert point["link_ms"] >= 0 and (point["hidden"] is None or math.isfinite(point["hidden"]))
    with gzip.open(out / "trace_acco.json.gz", "rt") as handle:
        trace = json.load(handle)
    # On the CPU only the training thread is traced (ACCO's jobs run on a worker); on CUDA they run
    # inline, and the spins appear on the side stream.
    assert sum(str(event.get("name")).startswith("aten::") for event in trace["traceEvents"]) > 100

    learning = json.loads((out / "convergence.json").read_text())
    runs = {run["method"]: run for run in learning["methods"]}
    assert list(runs) == ["sharded", "acco", "co2"] and learning["updates"] == 8
    for run in runs.values():
        assert [e["update"] for e in run["evals"]] == [0, 2, 4, 6, 8]
        assert all(math.isfinite(e["val_loss"]) for e in run["evals"])
    assert runs["acco"]["evals"][0]["val_loss"] == runs["sharded"]["evals"][0]["val_loss"], "the same start"
    assert runs["acco"]["warmup_sync_updates"] == 8 // 6, "ACCO at its defaults: a sixth of the run synchronous"
    assert runs["acco"]["final_gap"]["nats"] == pytest.approx(runs["acco"]["evals"][-1]["val_loss"]
                                                              - runs["sharded"]["evals"][-1]["val_loss"])
    assert runs["sharded"]["evals"][-1]["val_loss"] < runs["sharded"]["evals"][0]["val_loss"], "it learns"
