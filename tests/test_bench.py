"""The bench harness: configs, bounds, reporting, the namespace code path, and an end-to-end smoke run."""
import csv
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from deepspeed_acco.bench import netns, report
from deepspeed_acco.bench.methods import METHODS, ds_config, warmup_decay_lr
from deepspeed_acco.bench.train import eval_updates, parse_slow_rank

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    return env


# ----------------------------------------------------------------------------------------------
# Units


@pytest.mark.parametrize("text,bps", [("1gbit", 1e9), ("300mbit", 3e8), ("300M", 3e8), ("2.5e8", 2.5e8),
                                      ("100 Mbit/s", 1e8), ("10mbps", 8e7), ("none", None), ("0", None)])
def test_parse_bandwidth(text, bps):
    assert netns.parse_bandwidth(text) == bps


def test_parse_bandwidth_rejects_garbage_and_formats():
    with pytest.raises(ValueError):
        netns.parse_bandwidth("fast")
    assert netns.format_bandwidth(1e9) == "1 Gbit/s"
    assert netns.format_bandwidth(3e8) == "300 Mbit/s"
    assert netns.format_bandwidth(None) == "unshaped"


def test_tbf_bucket_holds_loopback_packets():
    for bps in (1e6, 1e8, 1e9, 1e10):
        args = netns.tbf_args(bps)
        burst = int(args[args.index("burst") + 1])
        assert burst >= 4 * 65536  # a 64 KiB loopback packet always fits
        assert args[args.index("rate") + 1] == f"{int(bps)}bit"


def test_ds_config_per_method():
    common = dict(world_size=2, micro_batch=4, grad_accum=2, lr=1e-3, total_updates=50, warmup=5)
    for name, spec in METHODS.items():
        if spec.optimizer is None:
            with pytest.raises(ValueError):
                ds_config(name, **common)
            continue
        cfg = ds_config(name, local_steps=7, dynamic_accumulation=True, **common)
        assert cfg["train_batch_size"] == 16 and cfg["gradient_accumulation_steps"] == 2
        assert cfg["optimizer"]["type"] == spec.optimizer
        params = cfg["optimizer"]["params"]
        assert params["lr"] == 1e-3 and params["weight_decay"] == 0.1
        assert cfg["scheduler"]["params"]["total_num_steps"] == 50
        if spec.ours:
            assert "zero_optimization" not in cfg and params["overlap"] is True and "torch_adam" not in params
        else:
            assert cfg["zero_optimization"]["stage"] == spec.zero_stage and params["torch_adam"] is True
        assert ("dynamic_accumulation" in params) == (name == "acco")
        assert ("local_steps" in params) == (name == "co2")
    assert ds_config("co2", local_steps=7, **common)["optimizer"]["params"]["local_steps"] == 7


def test_co2_options_reach_the_config_and_bad_ones_are_refused(capsys):
    from deepspeed_acco.bench.__main__ import build_parser, worker_args
    from deepspeed_acco.bench.train import co2_options
    from deepspeed_acco.config import parse_config
    args = build_parser().parse_args(["--outer-lr", "0.7", "--outer-momentum", "0.2", "--gap-penalty", "2"])
    argv = worker_args(args, "co2", "/tmp/x")
    assert argv[argv.index("--outer-lr") + 1] == "0.7" and argv[argv.index("--gap-penalty") + 1] == "2.0"
    import argparse
    worker = argparse.Namespace(outer_lr=0.7, outer_momentum=0.2, gap_penalty="2.0")
    cfg = ds_config("co2", world_size=2, micro_batch=4, grad_accum=2, lr=1e-3, total_updates=30, warmup=5,
                    co2_options=co2_options(worker))
    params = cfg["optimizer"]["params"]
    assert (params["outer_lr"], params["outer_momentum"], params["gap_penalty"]) == (0.7, 0.2, 2.0)
    assert parse_config(cfg, world_size=2).optimizer.gap_penalty == 2.0  # a valid engine config
    assert "--outer-lr" not in worker_args(build_parser().parse_args([]), "co2", "/tmp/x")
    for bad in ("0", "-1", "fast"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--gap-penalty", bad])
        assert "expected 'adaptive' or a number > 0" in capsys.readouterr().err


def test_compute_only_lr_matches_deepspeed_warmup_decay():
    import torch
    from deepspeed.runtime.lr_schedules import WarmupDecayLR
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cfg = ds_config("zero1", world_size=2, micro_batch=4, grad_accum=2, lr=0.5, total_updates=30, warmup=5)
    sched = WarmupDecayLR(opt, **cfg["scheduler"]["params"])
    assert math.isclose(opt.param_groups[0]["lr"], warmup_decay_lr(0, 0.5, 5, 30))
    for step in range(1, 35):
        sched.step()
        assert math.isclose(opt.param_groups[0]["lr"], warmup_decay_lr(step, 0.5, 5, 30), abs_tol=1e-12), step


def test_bounds_and_comm_round():
    # 2 ranks, 1M fp32 values over 1 Gbit/s: 2 * 1 * 4 MB * 8 bit = 64 Mbit -> 64 ms.
    t_comm = report.comm_round_seconds(1_000_000, 2, 1e9)
    assert math.isclose(t_comm, 0.064)
    assert report.bound_seconds("acco", 0.1, t_comm, 12) == max(0.1, 2 * t_comm)
    assert report.bound_seconds("acco", 0.1, 0.2, 12) == 0.4
    assert report.bound_seconds("dpu", 0.1, 0.2, 12) == 0.2
    assert math.isclose(report.bound_seconds("co2", 0.1, 2.4, 12), 0.2)
    assert math.isclose(report.bound_seconds("zero1", 0.1, 0.2, 12), 0.3)
    assert report.bound_seconds("compute", 0.1, 0.2, 12) == 0.1


def test_eval_points_and_slow_rank():
    assert eval_updates(60, 6) == [0, 10, 20, 30, 40, 50, 60]
    assert eval_updates(5, 10) == [0, 1, 2, 3, 4, 5]
    assert parse_slow_rank("") is None
    assert parse_slow_rank("1:2.5") == (1, 2.5)
    for bad in ("1", "a:2", "1:0.5", "-1:2"):
        with pytest.raises(ValueError):
            parse_slow_rank(bad)


def test_package_import_is_light():
    code = ("import sys, deepspeed_acco.bench as b; assert callable(b.main); "
            "heavy = [m for m in ('torch', 'deepspeed', 'transformers', 'matplotlib') if m in sys.modules]; "
            "print(heavy); assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, env=_env())


# ----------------------------------------------------------------------------------------------
# The namespace code path (needs root and iproute2)

needs_netns = pytest.mark.skipif(not netns.supported()[0], reason=f"no shaped namespaces here: {netns.supported()[1]}")


def _our_namespaces():
    out = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("acco-")]


@needs_netns
def test_namespace_shapes_loopback_and_is_removed():
    with netns.Namespace(netns.parse_bandwidth("200mbit")) as ns:
        assert ns.name in _our_namespaces()
        assert "tbf" in ns.qdisc() and "200Mbit" in ns.qdisc()
        rate = netns.measure_rate(ns, seconds=0.5, env=_env())
        assert 0.8 * 200e6 < rate < 1.2 * 200e6, rate
    assert ns.name not in _our_namespaces()


# ----------------------------------------------------------------------------------------------
# End to end (real multi-rank jobs; tiny model, few updates)


def _run_bench(out, *extra, timeout=300):
    cmd = [sys.executable, "-m", "deepspeed_acco.bench", "--model", "tiny", "--ctx", "64", "--updates", "6",
           "--eval-points", "2", "--val-windows", "8", "--out", str(out), "--no-progress", *extra]
    return subprocess.run(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_bench_smoke_unshaped(tmp_path):
    """2 ranks, no shaping: the table, the CSVs, the PNGs, sane numbers."""
    methods = ["zero1", "zero0", "sharded", "dpu", "acco", "co2"]
    # torchrun here (the faster launcher); the namespace test below uses the default deepspeed launcher.
    res = _run_bench(tmp_path, "--bandwidth", "none", "--methods", ",".join(methods), "--local-steps", "2",
                     "--launcher", "torchrun")
    assert res.returncode == 0, res.stdout[-4000:]
    out = res.stdout
    assert "| method |" in out and "DeepSpeed ZeRO-1" in out
    for name in ("results.md", "steps.csv", "summary.csv", "results.json", "val_loss_vs_wallclock.png",
                 "loss_vs_samples.png"):
        assert (tmp_path / name).exists(), name
    for png in tmp_path.glob("*.png"):
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000

    summary = {r["method"]: r for r in csv.DictReader(open(tmp_path / "summary.csv"))}
    assert set(summary) == {"compute", *methods}
    assert float(summary["zero1"]["speedup_vs_zero1"]) == 1.0
    for name, row in summary.items():
        assert int(row["updates"]) == 6 and int(row["samples"]) == 6 * 16, (name, row)
        assert 0 < float(row["wall_s"]) < 120 and float(row["peak_rss_mib"]) > 50
        if name != "compute":
            val, train = float(row["val_loss"]), float(row["train_loss"])
            assert 1.0 < val < math.log(256) + 0.5 and 1.0 < train < math.log(256) + 0.5, (name, val, train)
            assert math.isclose(float(row["val_ppl"]), math.exp(val), rel_tol=1e-6)

    steps = list(csv.DictReader(open(tmp_path / "steps.csv")))
    for name in summary:
        rows = [r for r in steps if r["method"] == name and r["loss"]]
        assert len(rows) == 6 * 2, name  # every update, both ranks
        walls = [float(r["wall_s"]) for r in rows if r["rank"] == "0"]
        assert walls == sorted(walls)
    # Same initial weights for every method: identical validation loss at update 0.
    init = {r["method"]: float(r["val_loss"]) for r in steps if r["update"] == "0" and r["val_loss"]}
    assert len(init) == len(summary) and max(init.values()) - min(init.values()) < 1e-6
    # DeepSpeed's ZeRO-1 and stage 0 run the same math: same losses.
    z1 = [float(r["loss"]) for r in steps if r["method"] == "zero1" and r["loss"]]
    z0 = [float(r["loss"]) for r in steps if r["method"] == "zero0" and r["loss"]]
    assert max(abs(a - b) for a, b in zip(z1, z0)) < 1e-3
    meta = json.load(open(tmp_path / "results.json"))
    assert meta["n_params"] == 120192 and meta["table"]
    # --replot rebuilds the same table from the logs without running anything.
    before = (tmp_path / "results.md").read_text()
    (tmp_path / "loss_vs_samples.png").unlink()
    rep = subprocess.run([sys.executable, "-m", "deepspeed_acco.bench", "--replot", str(tmp_path)], env=_env(),
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert rep.returncode == 0, rep.stdout[-3000:]
    assert (tmp_path / "results.md").read_text() == before
    assert (tmp_path / "loss_vs_samples.png").read_bytes()[:8] == PNG_MAGIC


@needs_netns
@pytest.mark.slow
def test_bench_runs_inside_shaped_namespace(tmp_path):
    res = _run_bench(tmp_path, "--bandwidth", "500mbit", "--methods", "zero1", "--no-compute-only", "--no-plots")
    assert res.returncode == 0, res.stdout[-4000:]
    assert "shaped with tc tbf to 500 Mbit/s" in res.stdout
    meta = json.load(open(tmp_path / "results.json"))
    link = meta["link"]["500 Mbit/s"]
    assert "tbf" in link["qdisc"] and 0.8 * 500e6 < link["measured_bps"] < 1.2 * 500e6
    probe = link["probe"]  # the collectives of one round, timed on the shaped link
    assert probe["backend"] == "gloo" and 0 < probe["all_gather_s"] and 0 < probe["round_s"] < 10
    assert 0 < probe["engine_reduce_scatter_s"] and 0 < probe["engine_round_s"] < 10
    assert "comm probe (gloo" in res.stdout
    cmd = open(tmp_path / "runs" / "zero1" / "command.txt").read()
    assert cmd.startswith("ip netns exec acco-")
    assert not [n for n in _our_namespaces() if n.startswith("acco-")
                and not os.path.exists(f"/proc/{n.split('-')[1]}")], "stale namespace"


def _processes_mentioning(text):
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


@needs_netns
@pytest.mark.slow
def test_ctrl_c_removes_namespace_and_processes(tmp_path):
    out = tmp_path / "interrupted"
    cmd = [sys.executable, "-m", "deepspeed_acco.bench", "--model", "tiny", "--ctx", "64", "--updates", "100000",
           "--methods", "zero1", "--no-compute-only", "--bandwidth", "1gbit", "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rows = out / "runs" / "zero1" / "rank0.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (rows.exists() and rows.stat().st_size > 0):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    assert rows.exists(), "training never started"
    mine = [n for n in _our_namespaces() if n.startswith(f"acco-{proc.pid}-")]
    assert mine, "the run is not inside a namespace"
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode == 130
    assert not [n for n in _our_namespaces() if n.startswith(f"acco-{proc.pid}-")]
    time.sleep(0.5)
    assert _processes_mentioning(str(out)) == []


@needs_netns
def test_orphaned_namespaces_are_removed_and_live_ones_kept():
    from deepspeed_acco.bench import netns
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid now names no process (pids are not reused this quickly)
    orphan, live = f"acco-{dead.pid}-0", f"acco-{os.getpid()}-9999"
    for name in (orphan, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        removed = netns.remove_orphans()
        assert orphan in removed and live not in removed
        assert orphan not in _our_namespaces() and live in _our_namespaces()
    finally:
        for name in (orphan, live):
            subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL)
