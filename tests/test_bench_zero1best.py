"""DeepSpeed's ZeRO-1 at its best stage-1 settings (``zero1best``) and the passes each DeepSpeed method
makes, as the bench's bounds count them (docs/bench.md, "DeepSpeed's ZeRO-1: default and best")."""
import math

import pytest

from deepspeed_acco.bench.reporting import report
from deepspeed_acco.bench.workload.methods import (METHODS, comm_description, ds_config, gradient_passes,
                                                   parse_variant, resolve_methods)

COMMON = dict(world_size=2, micro_batch=4, grad_accum=2, lr=1e-3, total_updates=50, warmup=5)


def test_zero1best_config_holds_the_best_settings():
    best = ds_config("zero1best", bf16=True, **COMMON)
    assert best["zero_optimization"] == {"stage": 1, "use_multi_rank_bucket_allreduce": False,
                                         "reduce_bucket_size": 1_000_000}
    # gloo's reduce stays a reduce-scatter (plus the chunk to the root) up to 2 W MiB per call: the
    # bucket keeps every call under it at two ranks in fp32.
    assert best["zero_optimization"]["reduce_bucket_size"] * 4 <= 2 * 2 * 2**20
    # Everything else is the default ZeRO-1's: same optimizer, batches, schedule, precision.
    default = ds_config("zero1", bf16=True, **COMMON)
    assert {k: v for k, v in best.items() if k != "zero_optimization"} == {
        k: v for k, v in default.items() if k != "zero_optimization"}
    assert default["zero_optimization"] == {"stage": 1}
    # Modifiers merge on top and keep the setting.
    fp32comm = ds_config("zero1best+fp32comm", bf16=True, **COMMON)
    assert fp32comm["communication_data_type"] == "fp32"
    assert fp32comm["zero_optimization"]["use_multi_rank_bucket_allreduce"] is False
    spec = METHODS["zero1best"]
    assert not spec.ours and not spec.overlapped and spec.zero_stage == 1 and spec.label == "DeepSpeed ZeRO-1 (best)"
    assert "use_multi_rank_bucket_allreduce" in comm_description("zero1best")
    assert "all-reduced" in comm_description("zero1") and '{"stage": 1}' in comm_description("zero1")


def test_zero1best_parses_on_the_command_line():
    from deepspeed_acco.bench.__main__ import build_parser, check_args
    assert resolve_methods("zero1, zero1best,ZERO1BEST,zero1-best+fp32comm") == ["zero1", "zero1best",
                                                                                 "zero1best+fp32comm"]
    args = build_parser().parse_args(["--methods", "zero1,zero1best,acco", "--ranks-per-node", "2"])
    check_args(args, resolve_methods(args.methods))
    with pytest.raises(ValueError, match="only with ZeRO stage 3"):
        parse_variant("zero1best+q8")
    assert parse_variant("zero1best").label == "DeepSpeed ZeRO-1 (best)"


def test_passes_per_method():
    # (gradients, parameters) in passes of (W - 1) / W of the model sent per rank.
    assert parse_variant("zero1").comm_passes(2) == (2.0, 1.0)
    assert parse_variant("zero0").comm_passes(2) == (2.0, 0.0)
    assert parse_variant("acco").comm_passes(2) == (1.0, 1.0)
    assert parse_variant("sharded+bf16comm").comm_passes(3) == (1.0, 1.0)
    # gloo's reduce: a ring reduce-scatter of the whole tensor, then each chunk to the root; one reduce per
    # partition: (W + 1) / W passes. NCCL's pipelined reduce: one pass.
    assert parse_variant("zero1best").comm_passes(2) == (1.5, 1.0)
    assert parse_variant("zero1best").comm_passes(3) == pytest.approx((4 / 3, 1.0))
    assert parse_variant("zero1best").comm_passes(2, backend="nccl") == (1.0, 1.0)
    assert gradient_passes("reduce", 1) == 1.0
    with pytest.raises(ValueError, match="unknown gradient collective"):
        gradient_passes("broadcast", 2)


def test_bound_counts_each_deepspeed_methods_passes():
    n, link = 1_000_000, 1e9
    one_pass = report.comm_round_seconds(n, 2, link, 4, param_bytes=0, nodes=2)  # 1/2 x 4 MB x 8 bit / 1 Gbit/s
    assert math.isclose(one_pass, 0.016)
    cases = {"acco": 2, "sharded": 2, "zero0": 2, "zero1": 3, "zero1best": 2.5}
    for method, passes in cases.items():
        t_comm = report.method_comm_seconds(method, n, 2, link, "fp32", nodes=2)
        assert math.isclose(t_comm, passes * one_pass), method
        # The synchronous methods' bound is T_compute + their own T_comm.
        if not parse_variant(method).method.overlapped:
            assert math.isclose(report.bound_seconds(method, 0.1, t_comm), 0.1 + passes * one_pass)
    assert math.isclose(report.method_comm_seconds("zero1best", n, 2, link, "fp32", nodes=2, backend="nccl"),
                        2 * one_pass)
    # Three ranks on one shared loopback: (W - 1) P bytes per pass in all.
    assert math.isclose(report.method_comm_seconds("zero1best", n, 3, link, "bf16"),
                        (4 / 3 + 1) * report.comm_round_seconds(n, 3, link, 2, param_bytes=0))
    # The bf16 model reduced in fp32 (fp32comm): the passes apply to the gradients' 4 bytes.
    assert math.isclose(report.method_comm_seconds("zero1best+fp32comm", n, 2, link, "bf16", nodes=2),
                        (1.5 * 4 + 2) / 4 * one_pass)


def test_report_names_the_gradient_collective_and_the_calibration_config():
    assert report.comm_label("zero1", "bf16") == "bf16 all-reduce/bf16"
    assert report.comm_label("zero1best", "fp32") == "fp32 reduce/fp32"
    assert report.comm_label("zero1best+fp32comm", "bf16") == "fp32 reduce/bf16"
    probe = dict(all_reduce_s=0.3, all_gather_s=0.1)
    assert report.probe_round_seconds(probe, "zero1", "fp32") == pytest.approx(0.4)
    assert report.probe_round_seconds(probe, "zero1best", "fp32") is None  # the probe times no reduce
    from deepspeed_acco.bench.reporting.summary import _regime_lines
    auto = dict(bps=3e8, share=1 / 3, t_compute_s=0.4, probe_round_s=0.2, probe_bps=2e8, fixed_s=0.01,
                calibrated_on=comm_description("zero1"))
    text = "\n".join(_regime_lines([], auto, "300 Mbit/s"))
    assert 'zero_optimization {"stage": 1}: gradients all-reduced, then parameters all-gathered' in text


def test_deepspeed_accepts_the_best_settings():
    """DeepSpeed's own config model takes the keys (a misspelt key is refused, not ignored)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    zero = DeepSpeedZeroConfig(**ds_config("zero1best", **COMMON)["zero_optimization"])
    assert zero.stage == 1 and zero.use_multi_rank_bucket_allreduce is False and zero.reduce_bucket_size == 1_000_000
    # The rest stays at DeepSpeed's defaults: reduce each slice to its owner, from a contiguous bucket.
    assert zero.reduce_scatter is True and zero.contiguous_gradients is True and zero.overlap_comm is False
    with pytest.raises(Exception, match="use_multi_rank_bucket_allreduc"):
        DeepSpeedZeroConfig(stage=1, use_multi_rank_bucket_allreduc=False)
