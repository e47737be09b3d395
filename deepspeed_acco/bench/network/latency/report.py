"""The latency model's command line (``python -m deepspeed_acco.bench.network.latency``): run the sized probe
on two emulated nodes (:func:`measure`), and turn a probe and a bench report into the markdown of fits,
checks and predicted ms/update (:func:`report_markdown`). The model itself:
:mod:`deepspeed_acco.bench.network.latency`."""
import argparse
import json
import math
import os
import sys
from typing import List, Optional, Sequence, Tuple

from . import (BUCKET_MARGIN, comm_seconds, fit_probe, gloo_all_reduce_window_ok, link_bytes,
               measured_comm_seconds, messages_per_update, predict_ms_per_update, sequential_messages)

# ----------------------------------------------------------------------------------------------
# The command line: a bench report + a probe -> markdown

def _check_probe(probe: dict, path: str) -> None:
    if not probe.get("sizes"):
        raise SystemExit(f"{path}: no \"sizes\" in this probe; run python -m "
                         "deepspeed_acco.bench.reporting.commprobe with --sizes N1,N2,... on the emulated link first")


def _select_link(results: dict, probe_bps: Optional[float], wanted: Optional[str]) -> Tuple[str, dict]:
    links = results.get("link") or {}
    if not links:
        raise SystemExit("the bench report has no \"link\" section (a run without an emulated network?)")
    if wanted:
        if wanted not in links:
            raise SystemExit(f"--bandwidth {wanted!r}: the report's links are {', '.join(links)}")
        return wanted, links[wanted]
    if probe_bps:  # the link closest to the probe's rate
        label = min(links, key=lambda k: abs(math.log((links[k].get("measured_bps") or probe_bps) / probe_bps)))
        return label, links[label]
    label = next(iter(links))
    return label, links[label]


def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}" if seconds * 1e3 >= 100 else f"{seconds * 1e3:.1f}"


def _fmt_count(x: float) -> str:
    return f"{x:.0f}" if abs(x - round(x)) < 1e-9 else f"{x:.2f}"


def report_markdown(probe: dict, results: dict, latencies_ms: Sequence[float], *, probe_path: str = "",
                    report_path: str = "", bandwidth: Optional[str] = None, relative: bool = True,
                    bucket: bool = True) -> str:
    """The markdown the CLI prints: the fits, the per-method counts and the predicted table."""
    fits = fit_probe(probe, relative=relative, bucket=bucket)
    bucket_bytes = next(iter(fits.values()))["bucket_bytes"]
    probe_bps = (probe.get("link") or {}).get("measured_bps")
    label, link = _select_link(results, probe_bps, bandwidth)
    run_bps = link.get("measured_bps")
    beta_scale = probe_bps / run_bps if probe_bps and run_bps else 1.0
    args = results.get("args", {})
    world = int(args.get("nodes", 2)) * int(args.get("ranks_per_node", 1))
    if int(args.get("ranks_per_node", 1)) != 1:
        raise SystemExit("the model counts one rank per node; this report ran several ranks per node")
    precision = args.get("precision", "fp32")
    n_params = int(results["n_params"])
    local_steps = int(args.get("local_steps") or 4)
    rows = [r for r in results.get("table", []) if r.get("bandwidth") == label]
    compute = [r for r in rows if r["method"] == "compute"]
    if not compute:
        raise SystemExit(f"the report has no compute-only row at {label}: T_compute is needed (run the bench "
                         "without --no-compute-only)")
    t_compute = compute[0]["ms_per_update"] / 1e3
    lat_s = [L / 1e3 for L in latencies_ms]

    out = [f"# Latency model: {os.path.basename(os.path.normpath(report_path)) or 'report'} at {label}", ""]
    out.append(f"Probe: `{probe_path}` ({probe.get('backend')}, W = {probe.get('world_size')}, link "
               f"{(probe_bps or 0) / 1e6:.0f} Mbit/s measured, best of {probe.get('repeats', '?')} per size, "
               f"{len(probe['sizes'])} sizes {probe['sizes'][0]['numel']}..{probe['sizes'][-1]['numel']} fp32 "
               "values). Bench report: "
               f"`{report_path}` ({label}, {(run_bps or 0) / 1e6:.0f} Mbit/s measured, W = {world}, {precision}, "
               f"P = {n_params} parameters, T_compute = {t_compute * 1e3:.0f} ms/update from its compute-only run).")
    if abs(beta_scale - 1.0) > 1e-9:
        out.append(f"The per-byte costs are scaled by probe rate / run rate = {beta_scale:.3f}.")
    out += ["", "## Fitted alpha and beta (t = messages x alpha + link bytes x beta, least squares on relative "
            "residuals)" if relative else "## Fitted alpha and beta (plain least squares)", ""]
    if bucket_bytes:
        out += [f"The link's tbf bucket holds {bucket_bytes} bytes: calls whose bytes through the link fit in it "
                "count 0 throttled bytes (they pass at the veth's speed and measure alpha), calls of "
                f"{BUCKET_MARGIN} buckets or more count all their bytes (they measure beta), the sizes in between "
                "are left out.", ""]
    out += ["| collective | sequential messages | points | alpha (ms per message) | beta (ns per link byte) | "
            "rate 8/beta (Mbit/s) | r2 | max rel. residual |", "|---|---|---|---|---|---|---|---|"]
    for c, f in fits.items():
        out.append(f"| {c} | {f['messages']} | {f['points']} | {f['alpha_s'] * 1e3:.3f} | "
                   f"{f['beta_s_per_byte'] * 1e9:.2f} | {f['rate_bps'] / 1e6:.1f} | {f['r2']:.4f} | "
                   f"{f['max_rel_residual']:.2f} |")

    # The model against the bench's own probe at the model's size (where it timed the same thing).
    bench_probe = link.get("probe") or {}
    checks = []
    P = n_params - n_params % world
    for key, pieces in (("all_reduce_s", [("all_reduce", 4)]), ("all_gather_s", [("all_gather", 4)]),
                        ("engine_reduce_scatter_s", [("reduce_scatter", 4)]),
                        ("all_reduce_model_dtype_s", [("all_reduce", 2)]),
                        ("all_gather_model_dtype_s", [("all_gather", 2)]),
                        ("engine_round_bf16comm_s", [("reduce_scatter", 2), ("engine_all_gather", 2)]),
                        ("engine_round_s", [("reduce_scatter", 4), ("engine_all_gather", 4)])):
        if key in bench_probe:
            model = sum(max(fits[c]["alpha_s"], 0.0) * sequential_messages(c, world) + fits[c]["beta_s_per_byte"]
                        * beta_scale * link_bytes(c, P * b, world) for c, b in pieces)
            checks.append(f"| {key} | {bench_probe[key] * 1e3:.0f} | {model * 1e3:.0f} | "
                          f"{model / bench_probe[key]:.2f} |")
    if checks:
        out += ["", f"Check against the bench's own probe at P = {P} values on its link ({label}):", "",
                "| probe key | measured ms | model ms | model / measured |", "|---|---|---|---|"] + checks

    table = []
    zero1_pred = None
    for r in rows:
        if r["method"] == "compute":
            continue
        try:
            traffic = messages_per_update(r["method"], world, n_params, precision=precision, local_steps=local_steps)
        except ValueError as exc:
            out.append(f"\n(skipped {r['method']}: {exc})")
            continue
        t_fit = comm_seconds(traffic, fits, beta_scale=beta_scale)
        t_meas = measured_comm_seconds(traffic, bench_probe, fits, n_params, beta_scale=beta_scale)
        t_comm = t_meas if t_meas is not None else t_fit
        pred = predict_ms_per_update(traffic, t_compute_s=t_compute, t_comm_s=t_comm, latencies_s=lat_s,
                                     t_measured_s=r["ms_per_update"] / 1e3)
        table.append((r, traffic, (t_comm, "m" if t_meas is not None else "f", t_fit), pred))
        if r["method"] == "zero1":
            zero1_pred = pred
    heads = ["method", "messages per update", "MB per update (busiest link)", "measured ms/update",
             "T_comm ms/update (m: measured, f: fitted; fit)", "model ms/update at probe", "overhead ms"]
    heads += [f"predicted ms @ {L:g} ms" for L in latencies_ms]
    heads += [f"speedup vs ZeRO-1 @ {L:g} ms" for L in latencies_ms]
    out += ["", "## Predicted ms/update at one-way latency L", "", "| " + " | ".join(heads) + " |",
            "|" + "---|" * len(heads)]
    for r, traffic, t_comm, pred in table:
        cells = [r["method"], _fmt_count(traffic["messages"]), f"{traffic['link_bytes'] / 1e6:.2f}",
                 _fmt_ms(r["ms_per_update"] / 1e3), f"{_fmt_ms(t_comm[0])} {t_comm[1]} ({_fmt_ms(t_comm[2])})",
                 _fmt_ms(pred["model_s"]), _fmt_ms(pred["overhead_s"])]
        cells += [_fmt_ms(pred["predicted_s"][L]) for L in lat_s]
        cells += [f"{zero1_pred['predicted_s'][L] / pred['predicted_s'][L]:.2f}" if zero1_pred else "n/a"
                  for L in lat_s]
        out.append("| " + " | ".join(cells) + " |")
    out += ["", "Messages per update: sequential message steps (a ring of W ranks: W - 1 per reduce-scatter or "
            "all-gather, 2 (W - 1) per gloo all-reduce, 1 per all-to-all); CO2's outer job counts 1/local_steps "
            f"per update (local_steps {local_steps}). T_comm: communication per update at the run's link, from the "
            "bench's own probe at the model's size where it timed the method's large collectives (m), else from the "
            "fit (f); the fitted value in brackets. Model at the probe: T_compute and T_comm combined as the method "
            "overlaps them; overhead = measured - model (>= 0), kept at every latency. "
            "Prediction: every sequential message costs one more one-way latency L, on warm TCP connections "
            "whose window covers the bandwidth-delay product, without loss."]
    if any(not gloo_all_reduce_window_ok(L, run_bps or probe_bps or 1e9) for L in lat_s):
        out.append(f"At {', '.join(f'{L * 1e3:g} ms' for L in lat_s if not gloo_all_reduce_window_ok(L, run_bps or probe_bps or 1e9))} "
                   "gloo's ring all-reduce (two 1 MiB segments in flight) no longer streams at this link's rate, "
                   "so the large all-reduce (DeepSpeed's gradients) takes longer than predicted there.")
    out += ["", "Per-update collectives (W = %d):" % world, ""]
    for r, traffic, _, _ in table:
        parts = [f"{_fmt_count(c['count'])} x {c['what']} ({c['messages']} msg, {c['link_bytes'] / 1e6:.3g} MB)"
                 for c in traffic["calls"]]
        out.append(f"- {r['method']}: " + "; ".join(parts))
    return "\n".join(out) + "\n"


def parse_latencies(text: str) -> List[float]:
    try:
        values = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--latencies: expected comma-separated milliseconds (e.g. 0.1,2,20), got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise SystemExit(f"--latencies: expected one or more latencies >= 0 ms, got {text!r}")
    return values


DEFAULT_SIZES = "1000,5250,27600,145000,762000,4000000"
BENCH_MODEL_PARAMS = 3287552  # the bench's default model (its results.json n_params): the probe's --numel


def measure(rate: str, out_path: str, sizes: str = DEFAULT_SIZES, repeats: int = 5,
            numel: int = BENCH_MODEL_PARAMS, timeout_s: float = 1200.0) -> dict:
    """Run ``commprobe --sizes`` on a fresh emulated cluster of two nodes (one rank each) whose links
    are shaped to ``rate``, add the link as measured, and write the JSON to ``out_path``. The cluster
    is removed afterwards, whatever happens."""
    import tempfile
    import time
    from .. import netns
    from ..jobs import Placement, child_env, probe_comm
    ok, why = netns.supported()
    if not ok:
        raise SystemExit(f"--measure needs emulated nodes (network namespaces): {why}")
    bps = netns.parse_bandwidth(rate)
    if bps is None:
        raise SystemExit(f"--measure: give a link rate such as 100mbit, got {rate!r}")
    cluster = netns.Cluster(2, bps)
    probe_out = os.path.join(tempfile.mkdtemp(prefix="acco_latency_probe_"), "probe.json")
    try:
        cluster.create()
        link = netns.measure_cluster(cluster, 1.0, env=child_env(1))
        load_before, started = os.getloadavg()[0], time.time()
        probe = probe_comm(Placement(2, 1, cluster=cluster), numel, probe_out, 1, "bf16",
                           extra_args=["--repeats", str(repeats), "--sizes", sizes], timeout_s=timeout_s)
        if probe is None:
            with open(probe_out + ".log") as f:
                raise SystemExit(f"the probe failed (log {probe_out}.log):\n{f.read()[-3000:]}")
        probe.update(link=dict(topology="cluster", nodes=2, ranks_per_node=1, nominal_bps=bps,
                               measured_bps=link["one_way_bps"], duplex_bps=link["duplex_bps"], qdisc=cluster.qdisc()),
                     repeats=int(repeats), probe_wall_s=time.time() - started, loadavg_before=load_before,
                     loadavg_after=os.getloadavg()[0],
                     command=f"python -m deepspeed_acco.bench.network.latency --measure {rate} --out {out_path} "
                             f"--sizes {sizes} --repeats {repeats}")
    finally:
        cluster.delete()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(probe, f, indent=1)
    return probe


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m deepspeed_acco.bench.network.latency",
                                description="Predict each method's ms/update at added one-way latency from an "
                                "alpha-beta fit of commprobe --sizes and a bench report.")
    p.add_argument("--measure", metavar="RATE", default="",
                   help="first run the probe on two fresh emulated nodes with links of RATE (e.g. 100mbit) and "
                        "write it to --out (then --probe defaults to it)")
    p.add_argument("--out", default="", help="with --measure: where the probe's JSON goes")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="with --measure: element counts to time")
    p.add_argument("--repeats", type=int, default=5, help="with --measure: best of N per size")
    p.add_argument("--probe", default="", help="commprobe JSON with \"sizes\"")
    p.add_argument("--report", default="", help="a bench output folder (its results.json)")
    p.add_argument("--latencies", default="0.1,2,20", help="one-way latencies in ms (default 0.1,2,20)")
    p.add_argument("--bandwidth", default=None,
                   help="which of the report's links (e.g. '100 Mbit/s'); default: the one closest to the probe's")
    p.add_argument("--plain-least-squares", action="store_true",
                   help="fit with unweighted least squares instead of relative residuals")
    p.add_argument("--no-bucket", action="store_true",
                   help="fit on all sizes with their full link bytes, ignoring the emulated link's tbf bucket")
    args = p.parse_args(argv)
    if args.measure:
        if not args.out:
            raise SystemExit("--measure needs --out FILE.json (where the probe's timings go)")
        measure(args.measure, args.out, args.sizes, args.repeats)
        print(f"probe written to {args.out}", file=sys.stderr)
        args.probe = args.probe or args.out
        if not args.report:
            return 0
    if not args.probe or not args.report:
        raise SystemExit("give --probe FILE.json (or --measure RATE --out FILE.json) and --report BENCH_OUT")
    with open(args.probe) as f:
        probe = json.load(f)
    _check_probe(probe, args.probe)
    results_path = os.path.join(args.report, "results.json") if os.path.isdir(args.report) else args.report
    with open(results_path) as f:
        results = json.load(f)
    sys.stdout.write(report_markdown(probe, results, parse_latencies(args.latencies), probe_path=args.probe,
                                     report_path=args.report, bandwidth=args.bandwidth,
                                     relative=not args.plain_least_squares, bucket=not args.no_bucket))
    return 0
