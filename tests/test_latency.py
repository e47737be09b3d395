"""The latency model (deepspeed_acco.bench.network.latency) and its command line
(deepspeed_acco.bench.network.latency.report): fit, message counts, prediction. No processes, no network."""
import json
import math

import pytest

from deepspeed_acco.bench.network import latency
from deepspeed_acco.bench.network.latency import report as latency_report
from deepspeed_acco.bench.network.latency import (comm_seconds, fit_alpha_beta, link_bytes, messages_per_update,
                                          predict_ms_per_update, sequential_messages)

P = 3_287_552  # the bench's 3m model


def test_fit_recovers_alpha_and_beta():
    alpha, beta, messages = 0.4e-3, 8.2e-8, 2  # 0.4 ms per message, ~97.6 Mbit/s
    sizes = [4e3, 2.1e4, 1.1e5, 5.8e5, 3.0e6, 1.6e7]
    points = [(x, messages * alpha + beta * x) for x in sizes]
    for relative in (True, False):
        fit = fit_alpha_beta(points, messages, relative=relative)
        assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-9)
        assert fit["beta_s_per_byte"] == pytest.approx(beta, rel=1e-9)
        assert fit["intercept_s"] == pytest.approx(messages * alpha, rel=1e-9)
        assert fit["r2"] == pytest.approx(1.0)
        assert fit["rate_bps"] == pytest.approx(8 / beta)


def test_relative_fit_keeps_a_small_intercept_under_noise_on_large_transfers():
    alpha, beta = 0.5e-3, 8e-8
    sizes = [4e3, 2.1e4, 1.1e5, 5.8e5, 3.0e6, 1.6e7]
    # +-1 % on every point: a few ms on the largest, microseconds on the smallest.
    points = [(x, (alpha + beta * x) * (1.01 if i % 2 else 0.99)) for i, x in enumerate(sizes)]
    fit = fit_alpha_beta(points, 1)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=0.05)
    assert fit["beta_s_per_byte"] == pytest.approx(beta, rel=0.03)


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="--sizes"):
        fit_alpha_beta([(1e3, 1e-3)], 1)
    with pytest.raises(ValueError, match="distinct"):
        fit_alpha_beta([(1e3, 1e-3), (1e3, 2e-3)], 1)
    with pytest.raises(ValueError, match="times > 0"):
        fit_alpha_beta([(1e3, 0.0), (1e4, 2e-3)], 1)
    with pytest.raises(ValueError, match="messages"):
        fit_alpha_beta([(1e3, 1e-3), (1e4, 2e-3)], 0)


def test_sequential_messages():
    for W in (2, 4):
        assert sequential_messages("reduce_scatter", W) == W - 1
        assert sequential_messages("all_gather", W) == W - 1
        assert sequential_messages("engine_all_gather", W) == W - 1
        assert sequential_messages("all_reduce", W) == 2 * (W - 1)
        assert sequential_messages("all_to_all", W) == 1
    assert sequential_messages("all_reduce", 1) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        sequential_messages("broadcast", 2)
    with pytest.raises(ValueError):
        sequential_messages("all_reduce", 0)


def test_link_bytes():
    assert link_bytes("reduce_scatter", 1000, 2) == 500
    assert link_bytes("all_to_all", 1000, 4) == 750
    assert link_bytes("all_reduce", 1000, 4) == 1500


@pytest.mark.parametrize("W", [2, 4])
def test_messages_per_update(W):
    ring, ar = W - 1, 2 * (W - 1)
    expect = {
        # gradient all-reduce (one bucket), overflow flag, gradient norm, parameter all-gather (bf16)
        ("zero1", "bf16"): ar + ar + ar + ring,
        ("zero1", "fp32"): ar + ar + ring,  # no overflow check in fp32
        # our jobs: reduce-scatter, statistics all-gathered and summed (runtime.comm), all-gather
        ("sharded", "bf16"): 3 * ring,
        ("dpu", "bf16"): 3 * ring,
        ("acco", "bf16"): 2 * 3 * ring,
        ("acco+q8", "bf16"): 2 * (1 + ring + ring),
        ("co2", "bf16"): 3 * ring / 4,  # one outer job per 4 inner steps; inner steps send nothing
    }
    for (method, precision), messages in expect.items():
        traffic = messages_per_update(method, W, P, precision=precision)
        assert traffic["messages"] == pytest.approx(messages), (method, precision)
    share = (W - 1) / W
    assert messages_per_update("zero1", W, P, precision="bf16")["link_bytes"] == pytest.approx(
        share * (2 * 2 * P + 2 * P + 2 * 1 + 2 * 4))
    assert messages_per_update("acco", W, P, precision="bf16")["link_bytes"] == pytest.approx(
        2 * share * (2 * P + 2 * P + 16 * W))
    assert messages_per_update("acco+q8", W, P, precision="bf16")["link_bytes"] == pytest.approx(
        2 * share * (2 * P * (1 + 4 / 128) + 16 * W))
    # CO2 moves fp32 displacements and an fp32 anchor, once per round.
    assert messages_per_update("co2", W, P, precision="bf16")["link_bytes"] == pytest.approx(
        share * (4 * P + 4 * P + W * (W + 2) * 8) / 4)
    assert messages_per_update("co2", W, P, precision="bf16", local_steps=2)["messages"] == pytest.approx(
        3 * ring / 2)


def test_deepspeed_buckets_and_co2_groups():
    # 1.2e9 parameters: three all-reduce buckets of <= 5e8 elements, still one all-gather.
    big = messages_per_update("zero1", 2, 1_200_000_000, precision="fp32")
    assert big["messages"] == 3 * 2 + 2 + 1  # DeepSpeed's own small all-reduces stay gloo's ring
    # CO2 with groups of 2 on 4 ranks: every inner step is a ShardedAdamW job among 2 ranks.
    grouped = messages_per_update("co2", 4, P, group_size=2)
    assert grouped["messages"] == pytest.approx((3 + 3 + 3) / 4 + (1 + 1 + 1))
    with pytest.raises(ValueError, match="not modelled"):
        messages_per_update("zero0", 2, P)
    with pytest.raises(ValueError, match="group_size"):
        messages_per_update("co2", 4, P, group_size=3)


def _fits(alpha=0.5e-3, beta=8e-8):
    return {c: dict(alpha_s=alpha, beta_s_per_byte=beta) for c in latency.COLLECTIVES}


def test_comm_seconds_sums_the_calls():
    traffic = messages_per_update("dpu", 2, P, precision="bf16")
    expected = 3 * 0.5e-3 + 8e-8 * traffic["link_bytes"]
    assert comm_seconds(traffic, _fits()) == pytest.approx(expected)
    assert comm_seconds(traffic, _fits(), beta_scale=0.5) == pytest.approx(3 * 0.5e-3 + 4e-8 * traffic["link_bytes"])


def test_non_overlapped_adds_latency_linearly():
    traffic = messages_per_update("zero1", 2, P, precision="bf16")  # 7 messages
    out = predict_ms_per_update(traffic, t_compute_s=0.4, t_comm_s=0.3, latencies_s=[0.0, 0.01, 0.02],
                                t_measured_s=0.75)
    assert out["model_s"] == pytest.approx(0.7)
    assert out["overhead_s"] == pytest.approx(0.05)
    for L in (0.0, 0.01, 0.02):
        assert out["predicted_s"][L] == pytest.approx(0.75 + 7 * L)


def test_overlapped_hides_latency_until_comm_exceeds_compute():
    traffic = messages_per_update("dpu", 2, P, precision="bf16")  # 3 messages
    out = predict_ms_per_update(traffic, t_compute_s=0.4, t_comm_s=0.3, latencies_s=[0.0, 0.02, 0.025, 0.05])
    assert out["overhead_s"] == 0.0
    assert out["predicted_s"][0.0] == pytest.approx(0.4)
    assert out["predicted_s"][0.02] == pytest.approx(0.4)   # 0.3 + 3 x 0.02 = 0.36: still hidden
    assert out["predicted_s"][0.025] == pytest.approx(0.4)  # 0.375: still hidden
    assert out["predicted_s"][0.05] == pytest.approx(0.45)  # 0.3 + 0.15 > 0.4: communication-bound
    # A measured time below the model gives no negative overhead.
    assert predict_ms_per_update(traffic, t_compute_s=0.4, t_comm_s=0.3, latencies_s=[0.0],
                                 t_measured_s=0.35)["overhead_s"] == 0.0


def test_co2_waits_only_for_what_exceeds_the_merge_window():
    traffic = messages_per_update("co2", 2, P, precision="bf16")  # 3 messages per round, local_steps 4
    # Outer job 0.3 s per round (0.075 s per update): hidden behind H = 1 inner step of 0.4 s...
    out = predict_ms_per_update(traffic, t_compute_s=0.4, t_comm_s=0.075, latencies_s=[0.0, 0.02, 0.05])
    assert out["predicted_s"][0.0] == pytest.approx(0.4)
    assert out["predicted_s"][0.02] == pytest.approx(0.4)  # 0.3 + 3 x 0.02 = 0.36 < 0.4
    # ...until it exceeds it: at 50 ms the round takes 0.45 s, 0.05 s waited once per 4 updates.
    assert out["predicted_s"][0.05] == pytest.approx(0.4 + 0.05 / 4)
    # The paper's rule (merge_steps None) gives the job the whole round of 4 inner steps.
    paper = predict_ms_per_update(traffic, t_compute_s=0.4, t_comm_s=0.075, latencies_s=[0.05], merge_steps=None)
    assert paper["predicted_s"][0.05] == pytest.approx(0.4)


def test_prediction_rejects_bad_input():
    traffic = messages_per_update("dpu", 2, P)
    with pytest.raises(ValueError):
        predict_ms_per_update(traffic, t_compute_s=0.0, t_comm_s=0.1, latencies_s=[0.0])
    with pytest.raises(ValueError):
        predict_ms_per_update(traffic, t_compute_s=0.4, t_comm_s=0.1, latencies_s=[-1.0])


def test_gloo_window():
    assert latency.gloo_all_reduce_window_ok(0.02, 100e6)
    assert not latency.gloo_all_reduce_window_ok(0.02, 1e9)


def _synthetic_probe(alpha=0.4e-3, bps=97e6):
    beta = 8 / bps
    sizes = []
    for numel in (1000, 5250, 27600, 145000, 762000, 4000000):
        entry = dict(numel=numel, bytes=4 * numel)
        for c, key in latency.PROBE_KEYS.items():
            entry[key] = sequential_messages(c, 2) * alpha + beta * link_bytes(c, 4 * numel, 2)
        sizes.append(entry)
    return dict(backend="gloo", world_size=2, numel=P, repeats=3, sizes=sizes, link=dict(measured_bps=bps))


def test_cli_prints_the_table(tmp_path, capsys):
    probe = _synthetic_probe()
    report = tmp_path / "bench"
    report.mkdir()
    label = "100 Mbit/s"
    rows = [dict(method="compute", bandwidth=label, ms_per_update=440.0),
            dict(method="zero1", bandwidth=label, ms_per_update=1400.0),
            dict(method="acco", bandwidth=label, ms_per_update=1770.0),
            dict(method="co2", bandwidth=label, ms_per_update=780.0)]
    results = dict(n_params=P, args=dict(nodes=2, ranks_per_node=1, precision="bf16", local_steps=None),
                   link={label: dict(measured_bps=97e6)}, table=rows)
    (report / "results.json").write_text(json.dumps(results))
    probe_path = tmp_path / "probe.json"
    probe_path.write_text(json.dumps(probe))
    assert latency_report.main(["--probe", str(probe_path), "--report", str(report), "--latencies", "0.1,20"]) == 0
    text = capsys.readouterr().out
    assert "| reduce_scatter | 1 | 6 | 0.400 |" in text  # the synthetic alpha comes back
    assert "predicted ms @ 20 ms" in text and "speedup vs ZeRO-1 @ 0.1 ms" in text
    zero1 = next(line for line in text.splitlines() if line.startswith("| zero1 |"))
    # 7 messages; measured 1400 ms; +7 x 20 ms at 20 ms; speedup 1.00 against itself.
    cells = [c.strip() for c in zero1.strip("|").split("|")]
    assert cells[1] == "7" and cells[3] == "1400"
    assert cells[4].startswith(cells[4].split(" ")[0] + " f (")  # no bench probe: the fitted time
    assert float(cells[8]) == pytest.approx(1400 + 7 * 20, abs=1)
    assert cells[-1] == "1.00"


def test_cli_needs_sizes(tmp_path):
    probe_path = tmp_path / "probe.json"
    probe_path.write_text(json.dumps(dict(backend="gloo", world_size=2, numel=P)))
    with pytest.raises(SystemExit, match="--sizes"):
        latency_report.main(["--probe", str(probe_path), "--report", str(tmp_path)])
    with pytest.raises(SystemExit, match="--out"):
        latency_report.main(["--measure", "100mbit"])
    with pytest.raises(SystemExit, match="--report"):
        latency_report.main(["--probe", str(probe_path)])
    assert math.isfinite(latency_report.parse_latencies("0.1,2,20")[2])
    with pytest.raises(SystemExit):
        latency_report.parse_latencies("a,b")


def test_bucket_points_and_fit_on_an_emulated_link():
    # On the tbf link a call that fits in the bucket costs alpha only; a large one alpha + beta x bytes.
    alpha, bps = 0.4e-3, 97e6
    link = dict(nominal_bps=100e6, qdisc="node 0 egress (a1n0): qdisc tbf 8250: root refcnt 3 rate 100Mbit burst 256Kb "
                                          "lat 50ms; switch port toward node 0 (a1s0): ...")
    bucket = latency.shaper_bucket_bytes(dict(link=link))
    assert bucket == 262144  # as the probe's link recorded it
    # Without a record, the bucket netns.tbf_args sets at that rate (one 64 KiB packet and 64 KiB more).
    assert latency.shaper_bucket_bytes(dict(link=dict(nominal_bps=100e6))) == 2 * 65536 + 1024
    assert latency.shaper_bucket_bytes(dict(link=dict(link, qdisc="... burst 262100b lat 50ms"))) == 262100
    sizes = []
    for numel in (1000, 5250, 27600, 145000, 762000, 4000000):
        entry = dict(numel=numel, bytes=4 * numel)
        for c, key in latency.PROBE_KEYS.items():
            x = link_bytes(c, 4 * numel, 2)
            entry[key] = sequential_messages(c, 2) * alpha + (8 / bps * x if x > bucket else 0.0)
        sizes.append(entry)
    probe = dict(world_size=2, sizes=sizes, link=link)
    points = latency.probe_points(probe, "all_gather", bucket)
    assert [x for x, _ in points] == [0.0, 0.0, 0.0, 1524000.0, 8000000.0]  # 290 kB: between regimes, left out
    fits = latency.fit_probe(probe)
    for c, fit in fits.items():
        assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-6), c
        assert fit["rate_bps"] == pytest.approx(bps, rel=1e-6), c
    # Without the bucket treatment the small calls pull the line off.
    assert latency.fit_probe(probe, bucket=False)["all_gather"]["rate_bps"] > 1.5 * bps


def test_measured_comm_prefers_the_bench_probe():
    fits = _fits()
    bench_probe = dict(all_reduce_model_dtype_s=0.54, all_gather_model_dtype_s=0.28, engine_round_bf16comm_s=0.9,
                       engine_round_s=1.6)
    zero1 = messages_per_update("zero1", 2, P, precision="bf16")
    # the big all-reduce and all-gather measured; the flag and norm all-reduces from the fit (2 msg each)
    assert latency.measured_comm_seconds(zero1, bench_probe, fits, P) == pytest.approx(
        0.54 + 0.28 + 2 * 2 * 0.5e-3 + 8e-8 * (1 + 4), rel=1e-6)
    acco = messages_per_update("acco", 2, P, precision="bf16")
    assert latency.measured_comm_seconds(acco, bench_probe, fits, P) == pytest.approx(
        2 * (0.9 + 0.5e-3 + 8e-8 * 16), rel=1e-6)
    co2 = messages_per_update("co2", 2, P, precision="bf16")  # fp32 displacements and anchor
    assert latency.measured_comm_seconds(co2, bench_probe, fits, P) == pytest.approx(
        (1.6 + 0.5e-3 + 8e-8 * 32) / 4, rel=1e-6)
    assert latency.measured_comm_seconds(messages_per_update("acco+q8", 2, P, precision="bf16"), bench_probe,
                                         fits, P) is None  # the int8 collectives were not timed at P
