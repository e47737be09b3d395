"""The bench harness: configs, modifiers, bounds, reporting, the namespace code path, and end-to-end
smoke runs on one loopback (the multi-node emulation is in test_bench_nodes.py)."""
import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from deepspeed_acco.bench.reporting import report
from deepspeed_acco.bench.network import netns
from deepspeed_acco.bench.workload.methods import METHODS, ds_config, parse_variant, resolve_methods, warmup_decay_lr
from deepspeed_acco.bench.running.train import is_eval_update, parse_slow_rank
from link_checks import assert_full_duplex

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


def test_tbf_bucket_holds_the_largest_packet_and_more():
    for bps in (1e6, 1e8, 1e9, 1e10):
        for packet in (65536, netns.packet_size(bps)):
            args = netns.tbf_args(bps, packet)
            burst = int(args[args.index("burst") + 1])
            assert burst >= packet + 65536  # the largest packet always fits, with room for a late timer
            assert burst >= 0.004 * bps / 8 and burst <= max(packet + 66560, 0.004 * bps / 8) + 1
            assert args[args.index("rate") + 1] == f"{int(bps)}bit"
    # Packets of four 64 KiB frames where one takes the link at most 10 ms, 64 KiB below.
    assert netns.packet_size(None) == netns.packet_size(1e9) == netns.packet_size(400e6) == 4 * 65536
    assert netns.packet_size(200e6) == netns.packet_size(30e6) == 65536


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


def test_method_modifiers_merge_into_the_config():
    common = dict(world_size=2, micro_batch=4, grad_accum=2, lr=1e-3, total_updates=50, warmup=5, bf16=True)
    plain, bf16comm = ds_config("acco", **common), ds_config("acco+bf16comm", **common)
    assert "communication_data_type" not in plain and bf16comm["communication_data_type"] == "bf16"
    assert {k: v for k, v in bf16comm.items() if k != "communication_data_type"} == plain
    q8 = ds_config("acco+q8", **common)["zero_optimization"]
    assert q8 == {"zero_quantized_gradients": True, "zero_quantized_weights": True}
    assert ds_config("zero1+bf16comm", **common)["zero_optimization"] == {"stage": 1}
    from deepspeed_acco.bench.workload.methods import _merge  # nested sections merge key by key, inputs untouched
    base = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}
    assert _merge(base, {"zero_optimization": {"zero_quantized_gradients": True}}) == {
        "zero_optimization": {"stage": 1, "zero_quantized_gradients": True}, "bf16": {"enabled": True}}
    assert base == {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}
    assert resolve_methods("zero1, ACCO+BF16COMM,acco+bf16comm,co2") == ["zero1", "acco+bf16comm", "co2"]
    v = parse_variant("acco+bf16comm")
    assert v.label == "ACCO + bf16 comm" and v.method.name == "acco"
    # Bytes per value of (gradient reduce-scatter, parameter all-gather): DeepSpeed and our engine reduce
    # gradients in the model's dtype by default; CO2's round averages parameters in fp32.
    assert parse_variant("zero1").comm_bytes("bf16") == (2, 2) and parse_variant("zero1").comm_bytes("fp32") == (4, 4)
    assert parse_variant("acco").comm_bytes("bf16") == (2, 2) and v.comm_bytes("bf16") == (2, 2)
    # CO2 averages fp32 parameters and gathers its fp32 anchor; bf16comm changes only the averaging.
    assert parse_variant("co2").comm_bytes("bf16") == (4, 4) and parse_variant("co2+bf16comm").comm_bytes("bf16") == (2, 4)
    assert parse_variant("zero1+fp32comm").comm_bytes("bf16") == (4, 2)
    assert report.comm_label("acco", "bf16") == "bf16/bf16" and report.comm_label("co2", "bf16") == "fp32/fp32" and report.comm_label("zero0", "bf16") == "bf16 all-reduce"
    # Compressed wires by name; a wire chosen from the link shows where the run changed to it.
    assert report.comm_label("co2+q8", "bf16") == "int8/int8" and report.comm_label("acco+q4", "bf16") == "int4/int4"
    switched = {"start": "bf16", "wire": "int4", "from_update": 2, "reason": "r"}
    assert report.comm_label("acco", "bf16", switched) == "bf16/bf16 for 2 updates, then int4/int4"
    probed = {"start": "fp32", "wire": "int8", "from_update": 4, "before_first_job": True}
    assert report.comm_label("co2", "bf16", probed) == "int8/int8 (chosen)"
    assert report.comm_label("acco", "bf16", dict(switched, wire="bf16")) == "bf16/bf16"  # kept
    assert report.comm_label("acco", "bf16", {"start": "bf16", "wire": "bf16", "from_update": None}) == "bf16/bf16"
    for bad, words in (("acco+fast", "unknown modifier 'fast'"), ("adam", "unknown method 'adam'"),
                       ("acco+bf16comm+bf16comm", "given twice"), ("zero1+q8", "only with ZeRO stage 3")):
        with pytest.raises(ValueError, match=words):
            parse_variant(bad)
    with pytest.raises(SystemExit, match="--methods"):
        resolve_methods("acco+fast")


def test_engine_refusal_of_a_modifier_is_reported_before_any_job(monkeypatch):
    """A modifier our engine does not support (here fp16 communication) is refused by the engine's own
    config parser, with its message, before any job starts; DeepSpeed's own methods are not checked."""
    from deepspeed_acco.bench.workload import methods
    from deepspeed_acco.bench.__main__ import build_parser, check_args, refused_by_engine
    monkeypatch.setitem(methods.MODIFIERS, "fp16comm", methods.Modifier("fp16comm", "fp16 comm",
                                                                         {"communication_data_type": "fp16"}))
    methods.parse_variant.cache_clear()
    try:
        args = build_parser().parse_args(["--methods", "zero1,zero1+fp16comm,acco,acco+fp16comm,co2",
                                          "--ranks-per-node", "2"])
        names = resolve_methods(args.methods)
        check_args(args, names)
        refused = refused_by_engine(args, names)
    finally:
        methods.parse_variant.cache_clear()
    assert list(refused) == ["acco+fp16comm"]
    assert "communication_data_type" in refused["acco+fp16comm"]


@pytest.mark.parametrize("argv,words", [
    (["--methods", "acco,dpu"], "--target-loss auto"),
    (["--updates", "10", "--max-updates", "5"], "--max-updates"),
    (["--grad-accum", "3", "--methods", "zero1,acco"], "--grad-accum"),
    (["--slow-rank", "4:2"], "rank 4 does not exist"),
])
def test_inconsistent_options_are_refused_with_the_flag_named(argv, words):
    from deepspeed_acco.bench.__main__ import build_parser, check_args
    args = build_parser().parse_args(argv)
    with pytest.raises(SystemExit, match=words):
        check_args(args, resolve_methods(args.methods))


@pytest.mark.parametrize("argv,words", [(["--seeds", "0,x"], "comma-separated seeds"),
                                        (["--target-loss", "low"], "'auto', 'none' or a loss"),
                                        (["--nodes", "0"], "integer >= 1")])
def test_bad_values_are_refused_by_the_parser(capsys, argv, words):
    from deepspeed_acco.bench.__main__ import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert words in capsys.readouterr().err


def test_defaults_derive_eval_interval_and_max_updates():
    from deepspeed_acco.bench.__main__ import build_parser, check_args
    args = build_parser().parse_args([])
    check_args(args, resolve_methods(args.methods))
    assert (args.target_loss, args.eval_every, args.max_updates, args.precision_requested) == ("auto", 5, 150, "auto")
    assert args.precision in ("bf16", "fp32") and args.precision_why.startswith(args.precision)
    assert (args.bandwidth, args.local_steps, args.warmup_sync_updates) == ("auto", None, None)
    assert resolve_methods(args.methods) == ["zero1", "zero1best", "sharded", "acco", "co2", "dpu"]
    assert (args.nodes, args.ranks_per_node, args.seeds) == (2, 1, [0])
    args = build_parser().parse_args(["--target-loss", "none", "--updates", "30"])
    check_args(args, resolve_methods(args.methods))
    assert args.max_updates == 30 and args.eval_every == 3


def _peer_wait_ranks(rank, world_size):
    import torch.distributed as dist
    from deepspeed_acco.bench.running.train import peer_wait_split
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    # Rank 0 launched the job 0.3 s before rank 1 and drained 0.7 s; rank 1 drained 0.4 s.
    shared = peer_wait_split([0.7, 0.4][rank], shared=True)
    alone = peer_wait_split(0.25, shared=False)
    return shared, alone


def test_an_evaluation_leaves_the_wait_for_a_peer_on_the_clock_and_gives_every_rank_one_deadline():
    """docs/bench.md, "The clock": a rank whose drain began by waiting for a later peer keeps that wait
    on its clock, and both ranks carry the job's own remaining seconds (the shortest drain) as the
    deadline after the pause, so they resume in step."""
    from distributed_utils import run_distributed
    results = run_distributed(_peer_wait_ranks, 2, timeout_s=120)
    (wait0, due0), alone = results[0]
    (wait1, due1), _ = results[1]
    assert due0 == due1 == pytest.approx(0.4)
    assert wait0 == pytest.approx(0.3) and wait1 == 0.0
    assert alone == (0.0, 0.25)


def test_co2_options_reach_the_config_and_bad_ones_are_refused(capsys):
    from deepspeed_acco.bench.__main__ import build_parser, check_args, worker_args
    from deepspeed_acco.bench.running.train import co2_options
    from deepspeed_acco.bench.running.train import parse_args as worker_parse
    from deepspeed_acco.runtime.config import parse_config
    args = build_parser().parse_args(["--outer-lr", "0.7", "--outer-momentum", "0.2", "--gap-penalty", "2",
                                      "--ranks-per-node", "2", "--eval-every", "3", "--precision", "bf16"])
    check_args(args, ["zero1", "co2"])
    argv = worker_args(args, "co2", "/tmp/x", seed=3, target_loss=2.5)
    assert argv[argv.index("--outer-lr") + 1] == "0.7" and argv[argv.index("--gap-penalty") + 1] == "2.0"
    assert argv[argv.index("--seed") + 1] == "3" and argv[argv.index("--target-loss") + 1] == "2.5"
    worker = worker_parse(argv)  # the worker accepts what the bench passes
    assert worker.group_size == 2 and worker.precision == "bf16" and worker.eval_every == 3
    cfg = ds_config("co2", world_size=4, micro_batch=4, grad_accum=2, lr=1e-3, total_updates=30, warmup=5,
                    co2_options=co2_options(worker))
    params = cfg["optimizer"]["params"]
    assert (params["outer_lr"], params["outer_momentum"], params["gap_penalty"]) == (0.7, 0.2, 2.0)
    assert params["group_size"] == 2  # CO2 averages gradients inside each node (ranks_per_node)
    parsed = parse_config(cfg, world_size=4).params  # a valid engine config
    assert parsed.gap_penalty == 2.0 and parsed.group_size == 2
    defaults = build_parser().parse_args([])
    check_args(defaults, ["zero1", "co2"])
    plain = worker_args(defaults, "co2", "/tmp/x")
    assert "--outer-lr" not in plain and "--group-size" not in plain and "--target-loss" not in plain
    # Denormals are flushed in every rank unless the bench is told to keep them.
    assert "--keep-denormals" not in argv and not worker.keep_denormals
    args.keep_denormals = True
    assert worker_parse(worker_args(args, "zero1", "/tmp/x")).keep_denormals
    assert "--group-size" not in worker_args(args, "acco", "/tmp/x")
    for bad in ("0", "-1", "fast"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--gap-penalty", bad])
        assert "expected 'adaptive' or a number > 0" in capsys.readouterr().err


def test_compute_only_lr_matches_deepspeed_schedulers():
    # Both --lr-schedule values: the config names DeepSpeed's scheduler, and the compute-only
    # baseline's own lr (warmup_decay_lr) follows that scheduler step by step.
    import torch
    from deepspeed.runtime import lr_schedules
    from deepspeed_acco.bench.__main__ import build_parser, worker_args
    for schedule, name in (("decay", "WarmupDecayLR"), ("constant", "WarmupLR")):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        cfg = ds_config("zero1", world_size=2, micro_batch=4, grad_accum=2, lr=0.5, total_updates=30, warmup=5,
                        lr_schedule=schedule)
        assert cfg["scheduler"]["type"] == name
        sched = getattr(lr_schedules, name)(opt, **cfg["scheduler"]["params"])
        assert math.isclose(opt.param_groups[0]["lr"], warmup_decay_lr(0, 0.5, 5, 30, schedule))
        lrs = []
        for step in range(1, 35):
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
            assert math.isclose(lrs[-1], warmup_decay_lr(step, 0.5, 5, 30, schedule), abs_tol=1e-12), (schedule, step)
        if schedule == "constant":
            assert lrs[5:] == [0.5] * len(lrs[5:])  # no decay after the warm-up
        else:
            assert math.isclose(lrs[30], 0.05, abs_tol=1e-12)  # decayed to lr/10 at the horizon
    with pytest.raises(ValueError, match="--lr-schedule: expected one of decay, constant, got 'cosine'"):
        ds_config("zero1", world_size=2, micro_batch=4, grad_accum=2, lr=0.5, total_updates=30, warmup=5,
                  lr_schedule="cosine")
    # The option reaches every worker's command line, and the default stays the decay.
    assert build_parser().parse_args([]).lr_schedule == "decay"
    args = build_parser().parse_args(["--lr-schedule", "constant"])
    cmd = worker_args(args, "acco", "/tmp/x")
    assert cmd[cmd.index("--lr-schedule") + 1] == "constant"


def test_beta1_reaches_every_method_and_the_lone_replica(capsys):
    # --beta1 sets AdamW's beta1 of DeepSpeed's config and of the compute-only baseline alike;
    # the default keeps the bench's 0.9, and a value outside [0, 1) is refused naming the flag.
    from deepspeed_acco.bench.__main__ import build_parser, worker_args
    from deepspeed_acco.bench.running.train import parse_args as train_args
    assert build_parser().parse_args([]).beta1 == 0.9
    args = build_parser().parse_args(["--beta1", "0.5"])
    cmd = worker_args(args, "dpu", "/tmp/x")
    assert cmd[cmd.index("--beta1") + 1] == "0.5"
    worker = ["--method", "dpu", "--run-dir", "/tmp/x"]
    assert train_args(worker + ["--beta1", "0.5"]).beta1 == 0.5 and train_args(worker).beta1 == 0.9
    import torch
    from deepspeed_acco.bench.running.train import _ComputeOnly
    lone = _ComputeOnly(torch.nn.Linear(2, 2), train_args(worker + ["--beta1", "0.5", "--precision", "fp32"]), 1)
    assert lone.opt.param_groups[0]["betas"] == (0.5, 0.95)
    for method in ("zero1", "dpu", "acco", "co2"):
        cfg = ds_config(method, world_size=2, micro_batch=4, grad_accum=2, lr=1e-3, total_updates=30, warmup=5,
                        betas=(0.5, 0.95))
        assert cfg["optimizer"]["params"]["betas"] == [0.5, 0.95], method
    for bad in ("1", "1.2", "-0.1", "high"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--beta1", bad])
        assert "--beta1: expected a number in [0, 1)" in capsys.readouterr().err


def test_bounds_and_comm_round():
    # 2 ranks, 1M fp32 values over one shared 1 Gbit/s loopback: 2 * 1 * 4 MB * 8 bit = 64 Mbit -> 64 ms.
    t_comm = report.comm_round_seconds(1_000_000, 2, 1e9)
    assert math.isclose(t_comm, 0.064)
    # Two nodes with full-duplex links: each node sends (W-1)/W of (gradients + parameters), at once.
    assert math.isclose(report.comm_round_seconds(1_000_000, 2, 1e9, nodes=2), 0.032)
    # 2 nodes x 2 ranks: a ring over 4 ranks leaves each node once: 3/4 x 8 MB = 48 Mbit.
    assert math.isclose(report.comm_round_seconds(1_000_000, 4, 1e9, nodes=2), 0.048)
    assert math.isclose(report.comm_round_seconds(1_000_000, 2, 1e9, 4, param_bytes=2, nodes=2), 0.024)
    assert math.isclose(report.method_comm_seconds("acco", 1_000_000, 2, 1e9, "bf16", nodes=2), 0.016)
    assert math.isclose(report.method_comm_seconds("acco+fp32comm", 1_000_000, 2, 1e9, "bf16", nodes=2), 0.024)
    assert math.isclose(report.method_comm_seconds("zero0", 1_000_000, 2, 1e9, "fp32", nodes=2), 0.032)
    probe = dict(all_reduce_s=0.3, all_gather_s=0.1, all_reduce_model_dtype_s=0.15, all_gather_model_dtype_s=0.05,
                 engine_round_s=0.2, engine_round_model_dtype_s=0.15, engine_round_bf16comm_s=0.1)
    assert report.probe_round_seconds(probe, "zero1", "bf16") == 0.2
    assert report.probe_round_seconds(probe, "zero1", "fp32") == 0.4
    assert report.probe_round_seconds(probe, "zero0", "bf16") == 0.15
    assert report.probe_round_seconds(probe, "acco", "bf16") == 0.1
    assert report.probe_round_seconds(probe, "acco+fp32comm", "bf16") == 0.15
    assert report.probe_round_seconds(probe, "dpu+bf16comm", "bf16") == 0.1
    assert report.probe_round_seconds(probe, "acco+q8", "bf16") is None
    assert report.bound_seconds("acco", 0.1, t_comm, 12) == max(0.1, 2 * t_comm)
    assert report.bound_seconds("acco", 0.1, 0.2, 12) == 0.4
    assert report.bound_seconds("dpu", 0.1, 0.2, 12) == 0.2
    assert math.isclose(report.bound_seconds("co2+paper", 0.1, 2.4, 12), 0.2)
    assert math.isclose(report.bound_seconds("zero1", 0.1, 0.2, 12), 0.3)
    assert report.bound_seconds("compute", 0.1, 0.2, 12) == 0.1
    assert report.bound_seconds("acco+bf16comm", 0.1, 0.2, 12) == 0.4


def _fake_run(method, seed, val, wall_at_updates, reached=None, updates=4, target=None):
    """A RunResult as load_run builds it, for report tests without processes."""
    summary = dict(rank=0, updates=updates, final_update=max(val), samples=updates * 16, wall_s=wall_at_updates,
                   target_loss=target, reached_update=None if reached is None else reached[0],
                   reached_wall_s=None if reached is None else reached[1], peak_rss_mib=100.0, init_s=1.0)
    rows = [dict(update=u, samples=u * 16, wall_s=wall_at_updates * u / updates, loss=4.0)
            for u in range(1, max(val) + 1)]
    return report.RunResult(method=method, bandwidth="1 Gbit/s", bps=1e9, rows={0: rows}, summaries={0: summary},
                            val=dict(val), seed=seed)


def test_time_to_target_and_seed_tables():
    base0 = _fake_run("zero1", 0, {0: 5.0, 2: 3.0, 4: 2.0}, 8.0)
    base1 = _fake_run("zero1", 1, {0: 5.0, 2: 3.1, 4: 2.2}, 8.0)
    acco0 = _fake_run("acco", 0, {0: 5.0, 2: 3.0, 4: 2.02, 6: 1.99}, 5.0, reached=(6, 6.0), target=2.0)
    acco1 = _fake_run("acco", 1, {0: 5.0, 2: 3.0, 4: 2.31, 6: 2.25, 8: 2.21, 10: 2.19}, 5.0, reached=(10, 10.0),
                      target=2.2)
    co2 = _fake_run("co2", 0, {0: 5.0, 4: 2.5, 12: 2.1}, 4.0, target=2.0)
    for r in (base0, base1):
        r.defines_target = True  # --target-loss auto: ZeRO-1's loss after --updates is the target
    rows = report.table_rows([base0, acco0, co2], "bf16")
    by = {r["method"]: r for r in rows}
    assert by["zero1"]["updates_to_target"] == 4 and by["zero1"]["time_to_target_s"] == 8.0
    assert by["acco"]["updates_to_target"] == 6 and math.isclose(by["acco"]["ttt_speedup_vs_zero1"], 8.0 / 6.0)
    assert by["co2"]["updates_to_target"] is None and by["co2"]["final_update"] == 12
    assert math.isclose(by["acco"]["val_gap_vs_zero1"], 2.02 / 2.0 - 1)  # equal samples: at --updates
    table = report.ttt_table(rows, 2, 12)
    assert "| ACCO | 6 | 6.0 | 1.33x | 1.9900 |" in table
    assert "| CO2 | not reached in 12 |  | not reached | 2.1000 |" in table
    srows = {r["method"]: r for r in report.seed_rows([base0, base1, acco0, acco1], [0, 1])}
    gaps = [2.02 / 2.0 - 1, 2.31 / 2.2 - 1]
    a = srows["acco"]
    assert a["seeds"] == 2 and math.isclose(a["gap_mean"], sum(gaps) / 2)
    assert math.isclose(a["gap_min"], min(gaps)) and math.isclose(a["gap_max"], max(gaps))
    assert math.isclose(a["ttt_speedup_mean"], (8 / 6 + 8 / 10) / 2) and a["reached"] == 2
    assert srows["zero1"]["gap_mean"] == 0.0
    text = report.seeds_table(list(srows.values()))
    assert f"{100 * sum(gaps) / 2:+.2f}%" in text and f"{100 * min(gaps):+.2f}% .. {100 * max(gaps):+.2f}%" in text


def test_eval_points_and_slow_rank():
    assert [u for u in range(0, 13) if is_eval_update(u, 5, 12)] == [0, 5, 10, 12]
    assert [u for u in range(0, 7) if is_eval_update(u, 2, 6)] == [0, 2, 4, 6]
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
# What the bench needs of the machine (docs/bench.md, "What it needs"), with a fake machine


def _failing(message):
    def build():
        raise RuntimeError(message)
    return build


@pytest.mark.parametrize("host, words", [
    (dict(platform="darwin"), ["need Linux", "Linux machine"]),
    (dict(euid=lambda: 1000), ["needs root", "sudo .venv/bin/python -m deepspeed_acco.bench", "--privileged"]),
    (dict(which=lambda tool: None if tool == "tc" else "/usr/sbin/" + tool), ["'tc' (iproute2)",
                                                                             "apt-get install iproute2"]),
    (dict(try_cluster=_failing("ip netns add acco-9-0-sw failed: mount --make-shared /run/netns failed: "
                               "Operation not permitted")), ["cannot create network namespaces", "--privileged",
                                                             "Operation not permitted"]),
    (dict(try_cluster=_failing("ip -n acco-9-0-n0 link add a9n0 type veth peer name a9s0 netns acco-9-0-sw failed: "
                               "Error: Unknown device type.")), ["veth pairs", "modprobe veth"]),
    (dict(try_cluster=_failing("tc -n acco-9-0-n0 qdisc add dev a9n0 root tbf rate 1000000000bit burst 500000 latency "
                               "50ms failed: Error: Specified qdisc kind is unknown.")), ["no tbf qdisc",
                                                                                        "modprobe sch_tbf"]),
])
def test_the_bench_stops_with_the_fix_when_it_cannot_shape_links(host, words):
    from deepspeed_acco.bench.__main__ import parse_command, require_network
    fake = netns.Host(**{"try_cluster": lambda: None, "euid": lambda: 0, "platform": "linux",
                         "which": lambda tool: "/usr/sbin/" + tool, **host})
    for argv in ([], ["--bandwidth", "300mbit"], ["--sweep-bandwidth", "100mbit,1gbit"],
                 ["--bandwidth", "none", "--sweep-bandwidth", "1gbit"],
                 ["--bandwidth", "none", "--fault", "link-down@2", "--methods", "acco", "--updates", "4"]):
        args, _ = parse_command(argv)
        with pytest.raises(SystemExit) as stopped:
            require_network(args, fake)
        for word in words + ["--bandwidth none to run without the emulated network"]:
            assert word in str(stopped.value), (argv, str(stopped.value))
    # Only an explicit --bandwidth none runs on, unshaped.
    for argv in (["--bandwidth", "none"], ["--bandwidth", "none", "--nodes", "1", "--ranks-per-node", "2"]):
        assert require_network(parse_command(argv)[0], fake) is False


def test_the_bench_runs_where_a_trial_cluster_builds():
    from deepspeed_acco.bench.__main__ import parse_command, require_network
    built = []
    fake = netns.Host(platform="linux", euid=lambda: 0, which=lambda tool: "/usr/sbin/" + tool,
                      try_cluster=lambda: built.append(True))
    assert require_network(parse_command([])[0], fake) is True and built == [True]
    assert netns.shaping_problem(netns.Host(platform="linux", euid=lambda: 1000, which=lambda tool: None,
                                            try_cluster=lambda: built.append(False))).startswith("creating network")
    assert built == [True], "the trial cluster is built only after root and the tools are found"


# ----------------------------------------------------------------------------------------------
# The namespace code path (needs root and iproute2)

needs_netns = pytest.mark.skipif(not netns.supported()[0], reason=f"no shaped namespaces here: {netns.supported()[1]}")


def _all_namespaces():
    out = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.split()]


def _our_namespaces():
    return [n for n in _all_namespaces() if n.startswith("acco-")]


@needs_netns
def test_the_trial_cluster_of_the_check_leaves_nothing():
    before = _our_namespaces()
    assert netns.shaping_problem() is None
    assert _our_namespaces() == before


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
           "--eval-every", "3", "--val-windows", "8", "--out", str(out), "--no-progress", *extra]
    return subprocess.run(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_bench_smoke_unshaped(tmp_path):
    """2 ranks on the host's loopback (--nodes 1, no shaping), bf16 (the default), equal samples only:
    the table, the CSVs, the PNGs, sane numbers."""
    methods = ["zero1", "zero0", "sharded", "dpu", "acco", "co2"]
    # torchrun here (the faster launcher); the namespace test below uses the default deepspeed launcher.
    res = _run_bench(tmp_path, "--nodes", "1", "--ranks-per-node", "2", "--bandwidth", "none", "--methods",
                     ",".join(methods), "--local-steps", "2", "--launcher", "torchrun", "--target-loss", "none")
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
    # Same initial weights for every method: identical validation loss at update 0 (the compute-only
    # run evaluates its rank 0 replica, which starts there too).
    init = {r["method"]: float(r["val_loss"]) for r in steps if r["update"] == "0" and r["val_loss"]}
    assert set(init) == {"compute", *methods} and max(init.values()) - min(init.values()) < 1e-6
    # DeepSpeed's ZeRO-1 and stage 0 run the same math, through different bf16 code paths (stage 0 uses
    # DeepSpeed's BF16_Optimizer): the same losses to bf16 precision (measured 0.02 here, about 0.4%).
    z1 = [float(r["loss"]) for r in steps if r["method"] == "zero1" and r["loss"]]
    z0 = [float(r["loss"]) for r in steps if r["method"] == "zero0" and r["loss"]]
    assert max(abs(a - b) for a, b in zip(z1, z0)) < 0.05
    meta = json.load(open(tmp_path / "results.json"))
    assert meta["n_params"] == 120192 and meta["table"] and meta["args"]["precision"] == "bf16"
    assert "Time to target" not in out  # --target-loss none: the equal-samples table only
    assert json.load(open(tmp_path / "runs" / "acco" / "ds_config.json"))["bf16"] == {"enabled": True}
    # both: the model's dtype; DeepSpeed's ZeRO-1 all-reduces its gradients
    assert summary["acco"]["comm"] == "bf16/bf16" and summary["zero1"]["comm"] == "bf16 all-reduce/bf16"
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
    """--nodes 1: today's single namespace with a shaped loopback (what results before 2026-12-01 used)."""
    res = _run_bench(tmp_path, "--nodes", "1", "--ranks-per-node", "2", "--bandwidth", "500mbit", "--methods", "zero1",
                     "--no-compute-only", "--no-plots")
    assert res.returncode == 0, res.stdout[-4000:]
    assert "loopback shaped with tc tbf to 500 Mbit/s" in res.stdout
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
def test_ctrl_c_removes_namespace_and_processes_and_keeps_the_finished_runs(tmp_path):
    """Ctrl-C during the second run of a two-node bench (the default): every namespace and every
    process of the job goes, and the report of the run that finished is written, marked as partial."""
    out = tmp_path / "interrupted"
    cmd = [sys.executable, "-m", "deepspeed_acco.bench", "--model", "tiny", "--ctx", "64", "--updates", "400",
           "--eval-every", "100", "--val-windows", "8", "--methods", "zero1,sharded", "--no-compute-only",
           "--target-loss", "none", "--bandwidth", "1gbit", "--out", str(out), "--no-progress", "--no-comm-probe",
           "--no-plots"]
    # A test run started in the background of a non-interactive shell inherits SIGINT ignored (POSIX),
    # and Python keeps an ignored SIGINT ignored: give the bench the terminal's default, as a user has.
    proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = out / "runs" / "zero1" / "rank0.summary.json"
        rows = out / "runs" / "sharded" / "rank0.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline and not (first.exists() and rows.exists() and rows.stat().st_size > 0):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.2)
        assert first.exists() and rows.exists(), "the second run never started"
        mine = [n for n in _our_namespaces() if n.startswith(f"acco-{proc.pid}-")]
        assert len(mine) == 3, f"expected two node namespaces and a switch, got {mine}"
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:  # failed above: the bench's own SIGTERM handler still cleans up
            proc.terminate()
            proc.wait(timeout=60)
    printed = proc.stdout.read()
    assert proc.returncode == 130, printed[-3000:]
    assert not [n for n in _our_namespaces() if n.startswith(f"acco-{proc.pid}-")]
    time.sleep(0.5)
    assert _processes_mentioning(str(out)) == []
    assert "covers the 1 run(s) that finished" in printed, printed[-3000:]
    report = (out / "results.md").read_text()
    assert "INTERRUPTED" in report and "DeepSpeed ZeRO-1" in report and "ShardedAdamW" not in report
    assert [r["method"] for r in csv.DictReader(open(out / "summary.csv"))] == ["zero1"]
    assert json.load(open(out / "results.json"))["interrupted"] is True


@needs_netns
def test_orphaned_namespaces_are_removed_with_their_processes_and_live_ones_kept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid now names no process (pids are not reused this quickly)
    orphans = [f"acco-{dead.pid}-0", f"acco-{dead.pid}-1-sw", f"acco-{dead.pid}-1-n0"]
    live, other = f"acco-{os.getpid()}-9999-n0", f"accox-{dead.pid}-0"
    for name in orphans + [live, other]:
        subprocess.run(["ip", "netns", "add", name], check=True)
    # A rank left running in a dead bench's node namespace (its jobs outlive a SIGKILL).
    stray = subprocess.Popen(["ip", "netns", "exec", orphans[2], "sleep", "300"], start_new_session=True)
    try:
        deadline = time.time() + 10
        while not netns.namespace_pids(orphans[2]) and time.time() < deadline:
            time.sleep(0.05)
        assert netns.namespace_pids(orphans[2]), "the stray process never entered the namespace"
        removed = netns.remove_orphans()
        assert sorted(removed) == sorted(orphans)
        assert stray.wait(timeout=10) == -signal.SIGKILL
        left = set(_our_namespaces()) | set(_all_namespaces())
        assert not left & set(orphans) and live in left and other in left
    finally:
        if stray.poll() is None:
            stray.kill()
        for name in orphans + [live, other]:
            subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL)


@needs_netns
def test_cluster_links_are_full_duplex_per_node_and_removed():
    with netns.Cluster(2, netns.parse_bandwidth("200mbit")) as c:
        names = [c.switch] + c.nodes
        assert set(names) <= set(_our_namespaces())
        assert all(n.startswith(f"acco-{os.getpid()}-") for n in names)
        text = c.qdisc()  # shaped on the node's egress and on the switch port toward it
        assert text.count("tbf") == 2 and text.count("200Mbit") == 2
        host_links = subprocess.run(["ip", "-o", "link"], stdout=subprocess.PIPE, text=True).stdout
        assert f"a{os.getpid()}" not in host_links  # created inside the namespaces only
        routes = subprocess.run(["ip", "-n", c.nodes[0], "route"], stdout=subprocess.PIPE, text=True).stdout
        assert "default" not in routes and "198.18.0.0/24" in routes
        m = netns.measure_cluster(c, seconds=0.5, env=_env())
        assert_full_duplex(200e6, m["one_way_bps"], m["duplex_bps"], m)
        # The machine's CPU during the duplex transfer, per MB: moving bytes over TCP costs the kernel
        # something (docs/bench.md: about 1 ms per MB at 400 Mbit/s on 2 cores), and far less than a
        # core's whole span.
        cpu = m["duplex_cpu_ms_per_mb"]
        assert set(cpu) == {"user", "system", "irq", "softirq"} and min(cpu.values()) >= 0.0, cpu
        assert 0.0 < cpu["system"] + cpu["softirq"] + cpu["irq"] < 1e3 / (2 * 200 / 8), cpu
    assert not set(names) & set(_our_namespaces())
    from deepspeed_acco.bench.reporting.summary import network_cpu_lines
    line, = network_cpu_lines(dict(duplex_cpu_ms_per_mb=dict(user=0.1, system=1.1, irq=0.0, softirq=0.6)))
    assert "1.80 ms per MB delivered, 1.70 of it in the kernel" in line and "floor" not in line, line
    line, = network_cpu_lines(dict(duplex_cpu_ms_per_mb=dict(user=0.1, system=0.5, irq=0.0, softirq=0.2),
                                   loopback_cpu_ms_per_mb=dict(user=0.05, system=0.25, irq=0.0, softirq=0.1)))
    assert "0.80 ms per MB delivered, 0.70 of it in the kernel" in line, line
    assert "floor any TCP cluster pays, 0.40 ms per MB (2.0x)" in line, line
    assert network_cpu_lines(dict(measured_bps=1e8)) == []


def _link_json(namespace, dev):
    out = subprocess.run(["ip", "-n", namespace, "-d", "-j", "link", "show", "dev", dev], stdout=subprocess.PIPE,
                         text=True, check=True).stdout
    return json.loads(out)[0]


def _tbf_json(namespace, dev):
    out = subprocess.run(["tc", "-n", namespace, "-j", "qdisc", "show", "dev", dev], stdout=subprocess.PIPE,
                         text=True, check=True).stdout
    return json.loads(out)[0]


@needs_netns
def test_cluster_links_are_built_for_little_cpu_per_byte():
    """What keeps the emulated network's CPU per MB low (docs/bench.md, "The emulated network's CPU"):
    64 KiB frames on every veth end and the bridge, packets of four of them where the link is fast
    (the veths' GSO size, where the kernel takes it), the veths' segmentation offloads left on, and
    tbf buckets that hold the largest packet and more, at exactly the configured rate."""
    for rate in ("30mbit", "1gbit"):
        bps = netns.parse_bandwidth(rate)
        packet = netns.packet_size(bps)
        with netns.Cluster(2, bps) as c:
            ends = [(c.nodes[k], c.node_ifname(k)) for k in range(2)] + [(c.switch, c.port_ifname(k)) for k in range(2)]
            assert c.gso_size in ((65536,) if packet == 65536 else (65536, packet)), c.gso_size
            for namespace, dev in ends + [(c.switch, c.bridge)]:
                assert _link_json(namespace, dev)["mtu"] == netns.LINK_MTU == 65535, (namespace, dev)
            for namespace, dev in ends:
                assert _link_json(namespace, dev)["gso_max_size"] == c.gso_size, (namespace, dev)
                tbf = _tbf_json(namespace, dev)
                assert tbf["kind"] == "tbf", tbf
                assert tbf["options"]["rate"] == bps / 8, tbf  # bytes per second in tc's JSON
                # tc reports the bucket it keeps, rounded to its time unit at the rate.
                burst = tbf["options"]["burst"]
                assert burst >= packet + 65536 and burst >= 0.004 * bps / 8 - bps / 8e6, tbf
                assert burst <= max(packet + 66560, 0.004 * bps / 8) + bps / 8e6, tbf
                if shutil.which("ethtool"):
                    features = subprocess.run(["ip", "netns", "exec", namespace, "ethtool", "-k", dev],
                                              stdout=subprocess.PIPE, text=True, check=True).stdout
                    for feature in ("tcp-segmentation-offload", "generic-segmentation-offload", "scatter-gather"):
                        assert f"{feature}: on" in features, (dev, feature, features)
            m = netns.measure_cluster(c, seconds=0.5, env=_env())
        # The rate is measured past the bucket (netns.SETTLE_BYTES): within 2% of the configured one.
        assert 0.9 * bps < m["one_way_bps"] < 1.02 * bps, (rate, m)
        assert all(0.6 * bps < x < 1.02 * bps for x in m["duplex_bps"]) and sum(m["duplex_bps"]) > 1.3 * bps, m


def test_transfer_cpu_spans_every_transfer_and_counts_both_directions():
    cpu = lambda user, system: dict(user=user, system=system, irq=0.0, softirq=0.1 * system, steal=0.01)
    mark = lambda t, user, system, own: dict(t=t, cpu=cpu(user, system), own=own)
    results = [dict(received_bytes=100e6, start=mark(10.0, 1.0, 2.0, 5.0), end=mark(12.0, 1.05, 2.1, 5.04)),
               dict(received_bytes=100e6, start=mark(10.1, 1.01, 2.01, 7.0), end=mark(12.5, 1.06, 2.2, 7.06))]
    out = netns.transfer_cpu(results)
    # From the first start (t=10.0) to the last end (t=12.5), per 200 MB.
    assert out["megabytes"] == 200 and out["span_s"] == 2.5
    m = out["machine_ms_per_mb"]
    assert m["user"] == pytest.approx(0.3) and m["system"] == pytest.approx(1.0) and m["softirq"] == pytest.approx(0.1)
    assert out["processes_ms_per_mb"] == pytest.approx(0.5)
    assert netns.transfer_cpu([dict(received_bytes=1e6, start=None, end=None)]) is None


@needs_netns
def test_loopback_floor_is_measured_in_a_namespace_that_is_removed():
    before = set(_our_namespaces())
    m = netns.measure_loopback(50, env=_env())
    assert set(_our_namespaces()) == before
    assert m["megabytes"] == pytest.approx(100) and all(x > 100e6 for x in m["duplex_bps"]), m
    assert 0.0 < sum(m["machine_ms_per_mb"].values()) and 0.0 < m["processes_ms_per_mb"], m


def test_report_names_the_update_kernels_our_engines_ran():
    from types import SimpleNamespace
    from deepspeed_acco.bench.reporting.summary import update_kernels_line
    run = lambda *backends: SimpleNamespace(summaries={k: {"update_backend": b} for k, b in enumerate(backends)})
    assert update_kernels_line([run(None, None)]) == ""  # DeepSpeed's engine or the compute-only loop
    fused = "Update kernels of our engines: cpu, the fused C++ kernels"
    assert update_kernels_line([run(None), run("cpu", "cpu")]) == fused + "."
    line = update_kernels_line([run("cpu"), run("torch")])  # a fallback on one run is not hidden by the other
    assert line.startswith(fused + "; torch, the torch reference"), line


def test_co2_eager_modifier_and_synchronous_warmup_reach_the_config_and_the_bound():
    from deepspeed_acco.bench.workload.methods import ds_config, parse_variant
    from deepspeed_acco.bench.reporting.report import bound_seconds
    common = dict(world_size=2, micro_batch=4, grad_accum=2, lr=1e-3, total_updates=30, warmup=5)
    cfg = ds_config("co2+eager", **common, warmup_sync_updates=6)
    assert cfg["optimizer"]["params"]["anchor_merge_steps"] == 1
    assert cfg["optimizer"]["params"]["warmup_sync_updates"] == 6
    assert "warmup_sync_updates" not in ds_config("zero1", **common, warmup_sync_updates=6)["optimizer"]["params"]
    assert ds_config("dpu", **common, warmup_sync_updates=6)["optimizer"]["params"]["warmup_sync_updates"] == 6
    # --sync-after-updates (a synchronous cool-down) reaches DPU and ACCO only, and the workers.
    assert ds_config("acco", **common, sync_after_updates=20)["optimizer"]["params"]["sync_after_updates"] == 20
    assert ds_config("dpu", **common, sync_after_updates=20)["optimizer"]["params"]["sync_after_updates"] == 20
    for method in ("zero1", "sharded", "co2"):
        assert "sync_after_updates" not in ds_config(method, **common, sync_after_updates=20)["optimizer"]["params"]
    assert "sync_after_updates" not in ds_config("acco", **common)["optimizer"]["params"]
    from deepspeed_acco.bench.__main__ import build_parser, worker_args
    cmd = worker_args(build_parser().parse_args(["--sync-after-updates", "20"]), "acco", "/tmp/x")
    assert cmd[cmd.index("--sync-after-updates") + 1] == "20"
    with pytest.raises(ValueError, match="applies to co2 only"):
        parse_variant("acco+eager")
    # CO2 under the paper's rule hides its averaging under a round of 12 inner steps, eager CO2 under
    # one inner step; plain CO2 follows the engine's default anchor_merge_steps.
    assert bound_seconds("co2+paper", 1.0, 6.0, 12) == 1.0
    assert bound_seconds("co2+eager", 1.0, 6.0, 12) == pytest.approx(1.0 + (6.0 - 1.0) / 12)  # once per round
    from deepspeed_acco.bench.workload.methods import co2_overlap_steps
    from deepspeed_acco.runtime.optimizers.co2 import CO2Params
    default_merge = CO2Params.__dataclass_fields__["anchor_merge_steps"].default
    assert co2_overlap_steps("co2", 12) == (default_merge or 12)
    # An adaptive gap penalty without an explicit anchor_merge_steps selects the paper's rule, as in the engine.
    assert co2_overlap_steps("co2", 12, "adaptive") == 12 and co2_overlap_steps("co2", 12, 2.0) == 1
    assert ds_config("co2+paper", **common)["optimizer"]["params"]["anchor_merge_steps"] == 0
    # Unset, --local-steps and --warmup-sync-updates leave the engine's defaults alone; 'auto' passes through.
    for method in ("dpu", "acco", "co2"):
        params = ds_config(method, **common)["optimizer"]["params"]
        assert "warmup_sync_updates" not in params and "local_steps" not in params
        assert ds_config(method, **common, warmup_sync_updates="auto")["optimizer"]["params"][
            "warmup_sync_updates"] == "auto"
    assert ds_config("acco", **common, warmup_sync_updates=0)["optimizer"]["params"]["warmup_sync_updates"] == 0
    cmd = worker_args(build_parser().parse_args([]), "co2", "/tmp/x")
    assert "--local-steps" not in cmd and "--warmup-sync-updates" not in cmd
    cmd = worker_args(build_parser().parse_args(["--warmup-sync-updates", "auto", "--local-steps", "4"]), "co2", "/x")
    assert cmd[cmd.index("--warmup-sync-updates") + 1] == "auto" and cmd[cmd.index("--local-steps") + 1] == "4"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--warmup-sync-updates", "-1"])


def test_precision_auto_follows_native_bf16():
    from deepspeed_acco.bench.workload.precision import choose_precision
    no = lambda: False  # noqa: E731
    # A CPU with AVX512-BF16 or AMX: bf16, and the reason names the flag.
    prec, why = choose_precision("auto", cuda_available=False, flags=lambda: {"avx2", "avx512f", "avx512_bf16"},
                                 onednn_bf16=no)
    assert prec == "bf16" and "avx512_bf16" in why
    prec, why = choose_precision("auto", cuda_available=False, flags=lambda: {"avx2", "amx_bf16"}, onednn_bf16=no)
    assert prec == "bf16" and "amx_bf16" in why
    # AVX2 only (oneDNN's check may say yes for AVX-512 without BF16, emulated; the flags decide): fp32.
    for onednn in (no, lambda: True):
        prec, why = choose_precision("auto", cuda_available=False, flags=lambda: {"avx2", "avx512f"},
                                     onednn_bf16=onednn)
        assert prec == "fp32" and "no native bf16" in why
    # Flags unreadable: oneDNN decides.
    assert choose_precision("auto", cuda_available=False, flags=set, onednn_bf16=lambda: True)[0] == "bf16"
    assert choose_precision("auto", cuda_available=False, flags=set, onednn_bf16=no)[0] == "fp32"
    # CUDA: bf16 where the device supports it.
    assert choose_precision("auto", cuda_available=True, cuda_bf16=lambda: True)[0] == "bf16"
    assert choose_precision("auto", cuda_available=True, cuda_bf16=no)[0] == "fp32"
    # Explicit choices stay, whatever the machine.
    assert choose_precision("bf16", cuda_available=False, flags=set, onednn_bf16=no)[0] == "bf16"
    assert choose_precision("fp32", cuda_available=True, cuda_bf16=lambda: True)[0] == "fp32"


def test_auto_bandwidth_solves_for_the_share():
    from deepspeed_acco.bench.reporting.commprobe import rate_for_share
    bits, t_compute = 8e6, 0.6
    # No fixed part: a third of the update is T_comm = T_compute / 2 = 0.3 s, so 8 Mbit / 0.3 s.
    rate, fixed = rate_for_share(1 / 3, t_compute, bits, 1e8, bits / 1e8)
    assert fixed == 0.0 and rate == pytest.approx(bits / 0.3)
    # A fixed part of 0.1 s leaves 0.2 s for the bytes, and the share then holds at that rate.
    rate, fixed = rate_for_share(1 / 3, t_compute, bits, 1e8, bits / 1e8 + 0.1)
    assert fixed == pytest.approx(0.1) and rate == pytest.approx(bits / 0.2)
    t_comm = fixed + bits / rate
    assert t_comm / (t_compute + t_comm) == pytest.approx(1 / 3)
    # A fixed part above the share: no rate gets there.
    assert rate_for_share(1 / 3, t_compute, bits, 1e8, bits / 1e8 + 0.5)[0] is None
    with pytest.raises(ValueError):
        rate_for_share(1.0, t_compute, bits, 1e8, 0.1)


def test_auto_bandwidth_counts_what_the_probe_moves():
    """DeepSpeed's round on gloo is an all-reduce (twice a reduce-scatter's volume) plus an
    all-gather, 1.5x the ideal round at two ranks; the rate must count that volume, or its extra
    half passes for a fixed part that does not shrink with the rate. The figures are a bf16 demo's
    (compute-only 432 ms/update; the probe's round 384 ms at 243.726 Mbit/s)."""
    from deepspeed_acco.bench.reporting import report
    from deepspeed_acco.bench.reporting.commprobe import rate_for_share
    n, world, nodes = 3_287_552, 2, 2
    ideal = report.comm_round_seconds(n, world, 1.0, 2, nodes=nodes)  # one reduce-scatter + one all-gather
    probe = report.probe_round_bits("zero1", n, world, "bf16", nodes)
    assert probe == pytest.approx(1.5 * ideal)
    # ZeRO-1's own T_comm counts the same three passes.
    assert report.method_comm_seconds("zero1", n, world, 1.0, "bf16", nodes) == pytest.approx(probe)
    assert report.probe_round_bits("zero0", n, world, "bf16", nodes) == pytest.approx(ideal)
    assert report.probe_round_bits("acco", n, world, "bf16", nodes) == pytest.approx(ideal)
    rate, fixed = rate_for_share(1 / 3, 0.432, probe, 243.726e6, 0.384)
    old_rate, old_fixed = rate_for_share(1 / 3, 0.432, ideal, 243.726e6, 0.384)
    # The old fixed part was the all-reduce's extra half at the probe's rate, plus the true one.
    assert old_fixed - fixed == pytest.approx(0.5 * ideal / 243.726e6)
    assert old_fixed == pytest.approx(0.168, abs=0.001) and fixed == pytest.approx(0.060, abs=0.001)
    # At the chosen rate the probe's round is predicted at the share: T_comm = T_compute / 2.
    assert fixed + probe / rate == pytest.approx(0.216)
    assert 480e6 < rate < 520e6 and old_rate > 2 * rate


def test_time_estimate_warns_naming_the_flags(capsys):
    from types import SimpleNamespace

    from deepspeed_acco.bench.__main__ import _Estimate, build_parser, check_args
    args = build_parser().parse_args(["--seeds", "0,1"])
    check_args(args, resolve_methods(args.methods))
    est = _Estimate(args, resolve_methods(args.methods), [1e9], started=0.0)
    est.baseline = SimpleNamespace(job={"job_s": 120.0}, wall_s=100.0, updates=50, summaries={0: {"init_s": 5}})
    est.report(now=200.0)  # 6 methods x 2 seeds = 12 jobs, 11 left of 120 s after 200 s: 25 min
    out = capsys.readouterr().out
    assert "about 25 min" in out and "11 more job(s)" in out
    assert "WARNING" in out and "--updates" in out and "--methods" in out and "--max-updates" in out
    assert "--seeds" in out
    est = _Estimate(args, ["zero1"], [1e9], started=0.0)
    est.baseline = SimpleNamespace(job={"job_s": 60.0}, wall_s=50.0, updates=50, summaries={0: {"init_s": 5}})
    est.report(now=100.0)
    out = capsys.readouterr().out
    assert "time estimate" in out and "WARNING" not in out


def test_help_renders():
    """``python -m deepspeed_acco.bench --help`` prints every option (a bare % in a help string
    makes argparse raise instead)."""
    from deepspeed_acco.bench.__main__ import build_parser
    text = build_parser().format_help()
    assert "--bandwidth" in text and "spends 33% of its update" in text and "--comm-share" in text


def test_job_timeout_follows_the_measured_baseline():
    """Before any job: 120 s + 20 s per update; once ZeRO-1 has run, at least three times its time
    per update (uncompressed ACCO on a slow link takes about twice ZeRO-1's); --run-timeout wins."""
    from deepspeed_acco.bench.__main__ import job_timeout_s
    assert job_timeout_s(0, 150, 150) == 120 + 20 * 150
    assert job_timeout_s(0, 4, 4, baseline_s_per_update=0.5) == 120 + 20 * 4  # a fast baseline keeps the bound
    # A 125M model at 100 Mbit/s: ZeRO-1 took 27 s per update; 4 updates of ACCO need about 2 x 27 x 4.
    assert job_timeout_s(0, 4, 4, baseline_s_per_update=27.0) == pytest.approx(120 + 3 * 27 * 4)
    assert job_timeout_s(0, 4, 4, baseline_s_per_update=27.0) > 2 * 27 * 4 + 60
    assert job_timeout_s(900, 4, 4, baseline_s_per_update=27.0) == 900


@pytest.mark.slow
def test_checkpoint_and_resume_continue_the_run_exactly(tmp_path):
    """The bench's --save-every / --resume (what --fault node-kill --recover relaunches with): a run
    that saves every 2 updates, and a second run resumed from its newest checkpoint (update 2:
    none is saved at the last update), give the same losses and validation losses, bitwise, for
    ACCO at one rank, whose checkpoint holds a job in flight."""
    common = ["--method", "acco", "--model", "tiny", "--ctx", "64", "--micro-batch", "2", "--grad-accum", "2",
              "--updates", "4", "--eval-every", "2", "--val-windows", "8", "--warmup", "1"]
    env = dict(_env(), OMP_NUM_THREADS="1")

    def train(name, *extra):
        subprocess.run([sys.executable, "-m", "deepspeed_acco.bench.running.train", "--run-dir", str(tmp_path / name),
                        *common, *extra], check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL, timeout=300)
        rows = [json.loads(line) for line in open(tmp_path / name / "rank0.jsonl")]
        return rows, json.load(open(tmp_path / name / "rank0.summary.json"))

    rows, summary = train("first", "--save-every", "2")
    assert summary["checkpoints"] == [2] and summary["resumed_from_update"] is None
    assert open(tmp_path / "first" / "checkpoints" / "latest").read().strip() == "update2"
    resumed_rows, resumed = train("resumed", "--resume", str(tmp_path / "first" / "checkpoints"))
    assert resumed["resumed_from_update"] == 2 and resumed["checkpoints"] == []
    assert [r["update"] for r in resumed_rows] == [3, 4]
    assert [(r["loss"], r["samples"], r["lr"]) for r in resumed_rows] == \
        [(r["loss"], r["samples"], r["lr"]) for r in rows[2:]]
    assert resumed["val"] == {k: v for k, v in summary["val"].items() if k in ("2", "4")}
    with pytest.raises(subprocess.CalledProcessError):  # nothing to resume from: an error, not a fresh run
        subprocess.run([sys.executable, "-m", "deepspeed_acco.bench.running.train", "--run-dir", str(tmp_path / "none"),
                        *common, "--resume", str(tmp_path / "empty")], check=True, env=env, cwd=REPO,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    assert "--resume" in open(tmp_path / "none" / "failure_rank0.txt").read()
