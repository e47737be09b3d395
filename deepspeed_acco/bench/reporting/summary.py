"""The bench's report: the tables (equal samples, time to target, seeds), the where-the-time-goes
lines, CSVs, JSON, Markdown and plots of a finished set of runs (:func:`finish`), and
:func:`replot`, which rebuilds them from a run folder's logs without running anything."""
import argparse
import json
import os
import sys
from typing import List, Optional

from ..network import netns
from .breakdown import breakdown_lines
from .report import TARGET_RESOLUTION
from ..workload.methods import BASELINE, co2_overlap_steps, parse_variant, resolve_methods


def normalize_args(args):
    """Fill in the options an output folder of an older bench lacks (for --replot): one shaped
    loopback, fp32 unless --bf16, one seed, no target."""
    d = vars(args)
    if "nodes" not in d:  # before 2026-12-01: all ranks on one loopback
        d["nodes"], d["ranks_per_node"] = 1, d.get("world_size", 2)
    d.setdefault("precision", "bf16" if d.get("bf16") else "fp32")
    if "seeds" not in d:
        d["seeds"] = [d.get("seed", 0)]
    d.setdefault("target_loss", None)
    d.setdefault("max_updates", d["updates"])
    d.setdefault("eval_every", 0)
    d.setdefault("keep_denormals", True)  # before 2026-12-06 20:00 UTC every rank kept them
    return args


def replot(out: str) -> int:
    """Rebuild results.md, the CSVs and the plots of an earlier run folder from its per-rank logs."""
    from . import report
    with open(os.path.join(out, "results.json")) as f:
        meta = json.load(f)
    args = normalize_args(argparse.Namespace(**meta["args"]))
    args.no_plots = False
    rates = [netns.parse_bandwidth(b) for b in args.sweep_bandwidth.split(",") if b.strip()] \
        if args.sweep_bandwidth else [netns.parse_bandwidth(args.bandwidth)]
    labels = list(meta.get("link", {})) or [netns.format_bandwidth(r) for r in rates]
    rates = [next((r for r in rates if netns.format_bandwidth(r) == label), None) for label in labels]
    results, failed, by_key = [], [], {}

    def collect(run_dir, method, label, bps, seed):
        try:
            r = report.load_run(run_dir, method, label, bps, seed=seed)
        except FileNotFoundError:
            failed.append(f"{method}@{label}")
            return
        report.add_run(results, by_key, r)

    if meta.get("runs"):  # the bench lists every run it collected
        for run in meta["runs"]:
            collect(os.path.join(out, run["dir"]), run["method"], run["bandwidth"], run["bps"], run["seed"])
    else:  # older folders: derive the folders from the options
        reps = [""] if max(1, getattr(args, "repeat", 1)) <= 1 else [f"rep{i}" for i in range(args.repeat)]
        seed = args.seeds[0]
        for tag in reps:
            if not args.no_compute_only:
                collect(os.path.join(out, "runs", "compute", tag), "compute", "no communication", None, seed)
        for label, bps in zip(labels, rates):
            for method in resolve_methods(args.methods):
                sub = method if len(labels) == 1 else os.path.join(label.replace(" ", "").replace("/", "p"), method)
                if os.path.isdir(os.path.join(out, "runs", sub)):
                    for tag in reps:
                        collect(os.path.join(out, "runs", sub, tag), method, label, bps, seed)
    finish(args, out, results, failed, meta, rates)
    return 0


def _link_heading(label: str, link: dict) -> str:
    measured = link.get("measured_bps")
    if not measured or label == "unshaped":
        return f"## Link: {label}"
    if link.get("topology") == "cluster":
        return (f"## Link: {label} per node and direction ({link['nodes']} nodes x {link['ranks_per_node']} "
                f"rank(s); measured {measured / 1e6:.0f} Mbit/s one way, "
                f"{'/'.join(f'{x / 1e6:.0f}' for x in link.get('duplex_bps', []))} both ways at once)")
    return f"## Link: {label} (one shaped loopback; measured {measured / 1e6:.0f} Mbit/s)"


KERNEL_BACKENDS = {"cpu": "the fused C++ kernels", "cuda": "the fused CUDA kernels",
                   "torch": "the torch reference (DEEPSPEED_ACCO_KERNELS=torch, or no compiled kernels on this CPU)"}


def update_kernels_line(results) -> str:
    """Which update kernels our engines ran, from the ranks' summaries ('' when none of ours ran)."""
    used = sorted({s.get("update_backend") for r in results for s in r.summaries.values()} - {None})
    if not used:
        return ""
    described = "; ".join(f"{name}, {KERNEL_BACKENDS.get(name, name)}" for name in used)
    return f"Update kernels of our engines: {described}."


def network_cpu_lines(link: dict) -> List[str]:
    """The emulated network's own CPU per MB, when the link measurement read it, and the loopback
    floor measured beside it (docs/bench.md)."""
    cpu = link.get("duplex_cpu_ms_per_mb")
    if not cpu:
        return []
    kernel = cpu.get("system", 0.0) + cpu.get("softirq", 0.0) + cpu.get("irq", 0.0)
    total = sum(cpu.values())
    floor = link.get("loopback_cpu_ms_per_mb")
    floor_text = ""
    if floor and sum(floor.values()) > 0:
        floor_text = (f"; a plain TCP transfer between two processes over a loopback, the floor any TCP cluster pays, "
                      f"{sum(floor.values()):.2f} ms per MB ({total / sum(floor.values()):.1f}x)")
    return [f"The emulated network's own CPU (the bulk transfer both ways at once, the whole machine from "
            f"/proc/stat): {total:.2f} ms per MB delivered, {kernel:.2f} of it in the kernel (TCP, the "
            f"nodes' and the switch's veth, bridge and tbf){floor_text}. It runs on the ranks' cores: a method that "
            f"computes while it communicates pays it in its compute (docs/bench.md, \"The emulated network's CPU\")."]


def _schedule_note(args) -> str:
    """Nothing for the default schedule (linear warm-up, then linear decay to lr/10 at --updates)."""
    note = ""
    if getattr(args, "lr_schedule", "decay") == "constant":
        note = f" (constant after {args.warmup} warm-up updates: --lr-schedule constant)"
    if getattr(args, "beta1", 0.9) != 0.9:
        note += f"; AdamW beta1 {args.beta1:g} (--beta1)"
    return note


def finish(args, out, results, failed, meta, rates) -> None:
    from . import report
    args = normalize_args(args)
    nodes = args.nodes if any(v.get("topology") == "cluster" for v in meta.get("link", {}).values()) else 1
    world = args.nodes * args.ranks_per_node
    compute = next((r for r in results if r.method == "compute"), None)
    for r in results:
        r.defines_target = args.target_loss == "auto" and r.method == BASELINE
    first_seed = args.seeds[0]
    n_params = meta["n_params"]
    all_rows, sweep_points, md, seed_tables = [], [], [], {}
    md.append(f"# deepspeed-acco bench, {meta['date_utc']} UTC\n")
    md.append(f"`{meta['command']}`\n")
    mi = meta["machine"]
    md.append(f"Machine: {mi['cpu']}, {mi['cores']} cores, {mi['mem_gib']} GiB; {mi['os']}; Python {mi['python']}, "
              f"torch {mi['torch']}, deepspeed {mi['deepspeed']}, transformers {mi['transformers']}; "
              f"{args.threads} thread(s) per rank, {args.nodes} node(s) x {args.ranks_per_node} rank(s), launcher "
              f"{args.launcher}; denormals "
              f"{'kept' if getattr(args, 'keep_denormals', False) else 'flushed to zero'} in "
              f"every rank.\n")
    md.append(f"Model: GPT-Neo '{args.model}' ({n_params:,} parameters), ctx {args.ctx}, {args.precision}; "
              f"micro-batch {args.micro_batch} x accumulation {args.grad_accum} x {world} ranks; {args.updates} "
              f"updates; lr {args.lr:g}{_schedule_note(args)}; seeds {', '.join(map(str, args.seeds))}; data: {meta['corpus']}.\n")
    if meta.get("precision_why"):
        md.append(f"Precision: {meta['precision_why']}.\n")
    kernels = update_kernels_line(results)
    if kernels:
        md.append(kernels + "\n")
    if meta.get("busy_warning"):
        md.append(meta["busy_warning"] + "\n")
    if meta.get("interrupted"):
        md.append("INTERRUPTED: the bench was stopped before it finished; this report covers only the runs that "
                  "finished before that (the command above lists what was asked for).\n")
    for m, why in (meta.get("refused") or {}).items():
        md.append(f"Not run: {parse_variant(m).label}: deepspeed_acco refuses its config: {why}\n")
    for label in [netns.format_bandwidth(b) for b in rates]:
        group = [r for r in results if r.bandwidth == label and r.seed == first_seed]
        if compute is not None:
            group = [compute] + group
        if not group:
            continue
        rows = report.table_rows(group, args.precision)
        for r in rows:
            r["bandwidth"] = label
        all_rows += [r for r in rows if not (r["method"] == "compute" and any(x["method"] == "compute" for x in all_rows))]
        link = meta.get("link", {}).get(label, {})
        measured = link.get("measured_bps") if label != "unshaped" else None
        heading = _link_heading(label, link)
        seed_note = f" (seed {first_seed})" if len(args.seeds) > 1 else ""
        parts = [heading + "\n", f"### Equal samples: {args.updates} updates{seed_note}\n",
                 report.markdown_table(rows) + "\n"]
        target = (meta.get("targets") or {}).get(label, {}).get(str(first_seed))
        if args.target_loss is not None:
            how = "DeepSpeed ZeRO-1's validation loss after --updates" if args.target_loss == "auto" else "given"
            resolution = max(1, int(TARGET_RESOLUTION * args.updates))
            parts += [f"### Time to target: validation loss <= "
                      f"{'(none: ZeRO-1 failed)' if target is None else f'{target:.4f}'} ({how}; evaluated every "
                      f"{args.eval_every} updates, and every {resolution} near the target: a resolution of "
                      f"{resolution} update(s); at most {args.max_updates}){seed_note}\n",
                      report.ttt_table(rows, args.eval_every, args.max_updates) + "\n"]
        if any(r["method"] == "sharded" for r in rows) and any(r["method"] == BASELINE for r in rows):
            parts += ["### Where the speed comes from: our engine and the overlap\n",
                      report.factor_table(rows) + "\n\nEach speedup over DeepSpeed ZeRO-1 (in parentheses: over "
                      "DeepSpeed ZeRO-1 at its best stage-1 settings, where it ran) is our engine's part (ShardedAdamW, "
                      "synchronous like ZeRO-1, over ZeRO-1: fewer bytes and less overhead, no overlap) times the "
                      "overlap's part (the method over ShardedAdamW).\n"]
        wires = report.wire_lines(rows)
        if wires:
            parts += ["\n".join(wires) + "\n"]
        if len(args.seeds) > 1:
            srows = report.seed_rows([r for r in results if r.bandwidth == label], args.seeds)
            seed_tables[label] = srows
            parts += [f"### Over seeds {', '.join(map(str, args.seeds))}: validation loss after {args.updates} "
                      f"updates, gap to ZeRO-1 of the same seed\n", report.seeds_table(srows) + "\n"]
        probe = link.get("probe")
        theory = _regime_lines(rows, meta.get("auto_bandwidth"), label) + network_cpu_lines(link)
        theory += _theory_lines(args, rows, compute, n_params, measured, probe, nodes)
        theory += _noise_lines(rows)
        theory += breakdown_lines(rows)
        md += parts + theory + [""]
        print("\n" + "\n".join(p.rstrip("\n") for p in parts) + "\n" + "\n".join(theory))
        base = next((r for r in rows if r["method"] == BASELINE), None)
        if base is not None and compute is not None and measured:
            t_comp = compute.ms_per_update / 1000.0
            for r in rows:
                if r["method"] in ("compute", BASELINE):
                    continue
                t_comm, sync = _run_comm(args, r, n_params, world, measured, nodes,
                                         backend=(probe or {}).get("backend", "gloo"))
                b = report.bound_seconds(r["method"], t_comp, t_comm, args.local_steps, args.gap_penalty, **sync)
                sweep_points.append(dict(method=r["method"], link_bps=measured, speedup=r["speedup_vs_zero1"],
                                         ttt_speedup=r["ttt_speedup_vs_zero1"],
                                         bound_speedup=(base["ms_per_update"] / 1000.0) / b if b else None))
    md += [section for section in [report.memory_section(results)] if section]
    md.append(report.TABLE_NOTES + "\n")
    if args.target_loss is not None:
        md.append(report.TTT_NOTES + "\n")
    if failed:
        md.append(f"FAILED runs: {', '.join(failed)} (see runs/*/launcher*.log)\n")

    report.write_steps_csv(os.path.join(out, "steps.csv"), results)
    report.write_summary_csv(os.path.join(out, "summary.csv"), all_rows)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(meta, table=all_rows, sweep=sweep_points, seeds_table=seed_tables), f, indent=1, default=str)
    plots = []
    if not args.no_plots and results:
        for label in [netns.format_bandwidth(b) for b in rates]:
            group = [r for r in results if r.bandwidth == label and r.seed == first_seed]
            if not group:
                continue
            suffix = "" if len(rates) == 1 else "_" + label.replace(" ", "").replace("/", "p")
            where = f"{args.nodes} nodes x {args.ranks_per_node}" if nodes >= 2 else f"{world} ranks"
            title = (f"GPT-Neo {n_params / 1e6:.1f}M {args.precision}, {where}, link {label}, "
                     f"{args.micro_batch * args.grad_accum * world} samples/update")
            target = (meta.get("targets") or {}).get(label, {}).get(str(first_seed))
            p1 = os.path.join(out, f"val_loss_vs_wallclock{suffix}.png")
            report.plot_val_vs_wall(p1, group, title, target=target if args.target_loss is not None else None)
            p2 = os.path.join(out, f"loss_vs_samples{suffix}.png")
            report.plot_loss_vs_samples(p2, group, title)
            plots += [p1, p2]
        if len(rates) > 1 and sweep_points:
            p3 = os.path.join(out, "speedup_vs_bandwidth.png")
            report.plot_speedup_vs_bandwidth(
                p3, sweep_points, f"GPT-Neo {n_params / 1e6:.1f}M, {world} ranks: measured speedup (solid)\n"
                                  f"bound T_ZeRO-1 / max(T_compute, k T_comm) (dashed; k: ACCO 2, DPU 1, "
                                  f"CO2 1/{co2_overlap_steps('co2', args.local_steps, args.gap_penalty)})",
                xlabel=("measured link rate per node and direction (Mbit/s)" if nodes >= 2 else
                        "measured link rate (Mbit/s, shared by both directions)"))
            plots.append(p3)
    if getattr(args, "trace", "") and not args.no_plots:
        plots += _timelines(args.trace)
    for p in plots:
        md.append(f"![{os.path.basename(p)}]({os.path.relpath(p, out)})\n")
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(md))
    print(f"\n{report.TABLE_NOTES}\n" + (f"{report.TTT_NOTES}\n" if args.target_loss is not None else "")
          + f"\nwrote {out}/results.md, steps.csv, summary.csv, results.json"
          + "".join(f", {os.path.basename(p)}" for p in plots))
    if failed:
        print(f"FAILED runs: {', '.join(failed)}", file=sys.stderr)


def _timelines(folder: str) -> List[str]:
    """timeline_<method>.png for every trace_<method>_rank0.json that --trace wrote into ``folder``."""
    import glob
    from .breakdown import plot_timeline
    pngs = []
    for trace in sorted(glob.glob(os.path.join(folder, "trace_*_rank0.json"))):
        method = os.path.basename(trace)[len("trace_"):-len("_rank0.json")]
        png = os.path.join(folder, f"timeline_{method}.png")
        label = "compute-only (no comm)" if method == "compute" else parse_variant(method).label
        plot_timeline(trace, png, f"{label}: rank 0's last updates before --updates (bench --trace)")
        pngs.append(png)
    return pngs


def _regime_lines(rows, auto: Optional[dict], label: str) -> List[str]:
    """The link rate's origin (--bandwidth auto) and the share of its update ZeRO-1 spent communicating,
    1 - compute-only / ZeRO-1 (ms per update)."""
    lines = []
    if auto and auto.get("bps"):
        probe = auto.get("probe_round_s")
        lines.append(f"Link rate {label}: chosen by --bandwidth auto so that "
                     f"{auto.get('calibrated_on') or 'DeepSpeed ZeRO-1'} communicates "
                     f"{auto['share']:.0%} of its update (compute-only {1000 * auto['t_compute_s']:.0f} ms/update; "
                     f"ZeRO-1's collectives measured "
                     + ("n/a" if probe is None else f"{1000 * probe:.0f} ms")
                     + f" at {netns.format_bandwidth(auto['probe_bps'])}, a fixed part of "
                     f"{1000 * auto['fixed_s']:.0f} ms).")
    compute = next((r for r in rows if r["method"] == "compute"), None)
    base = next((r for r in rows if r["method"] == BASELINE), None)
    if compute is not None and base is not None and base["ms_per_update"] > 0:
        share = 1.0 - compute["ms_per_update"] / base["ms_per_update"]
        lines.append(f"DeepSpeed ZeRO-1 measured: {share:.0%} of its update communicating (1 - compute-only "
                     f"{compute['ms_per_update']:.0f} / ZeRO-1 {base['ms_per_update']:.0f} ms per update).")
    return lines


def _noise_lines(rows) -> List[str]:
    """How much of the machine other processes took while each run trained (timings are only
    comparable when this is ~0 for every run)."""
    loads = [(r["label"], r.get("other_load_cores"), r.get("steal_cores")) for r in rows]
    if all(x[1] is None for x in loads):
        return []
    text = ", ".join(f"{label} {load:.2f}" + (f" (+{steal:.2f} stolen)" if steal and steal > 0.01 else "")
                     for label, load, steal in loads if load is not None)
    lines = [f"Other processes during training (cores busy outside the ranks, average; worst run): {text}."]
    paused = [(r["label"], r.get("paused_at_updates_s"), r.get("eval_comm_s") or 0.0) for r in rows]
    if any(c for _, c, _ in paused):
        lines.append("Clock paused for copying and evaluating the committed parameters up to --updates (the "
                     "communication that ran meanwhile stays on the clock): "
                     + ", ".join(f"{label} {c:.1f} s" + (f" ({x:.1f} s of communication kept on the clock)"
                                                          if x >= 0.05 else "")
                                 for label, c, x in paused if c is not None) + ".")
    if any(r.get("old_clock") for r in rows):
        lines.append("NOTE: these runs were timed with the bench's clock before 2026-12-03, which took the wait for "
                     "the communication job in flight off the clock at every evaluation (DPU, ACCO and CO2 got up "
                     "to one round free per evaluation); their wall-clock flatters the overlapped methods "
                     "(docs/bench.md, \"The clock\").")
    late = [r["label"] for r in rows if r.get("deadline_per_rank")]
    if late:
        lines.append("NOTE: " + ", ".join(late) + " timed before 2026-12-06, when each rank carried its whole drain "
                     "at an evaluation as its deadline: a rank that had waited for a peer to join the job resumed "
                     "behind it, and the offset could grow from one evaluation to the next where the ranks meet "
                     "only at the jobs (CO2 between averagings); their wall-clock can be too long "
                     "(docs/bench.md, \"The clock\").")
    if any(r.get("repeats", 1) > 1 for r in rows):
        spread = ", ".join(f"{r['label']} {1000 * r['wall_min_s'] / r['updates']:.0f}-"
                           f"{1000 * r['wall_max_s'] / r['updates']:.0f}" for r in rows)
        lines.append(f"Timings are medians of {max(r.get('repeats', 1) for r in rows)} interleaved runs; "
                     f"ms/update range: {spread}.")
    worst = max((x[1] or 0.0) + (x[2] or 0.0) for x in loads)
    if worst > 0.1:
        lines.append(f"WARNING: other work took up to {worst:.2f} cores of this {os.cpu_count()}-core machine during "
                     f"some runs; their timings are inflated. Rerun on a quiet machine for clean numbers.")
    return lines


def _run_comm(args, row, n_params: int, world: int, link_bps: float, nodes: int, backend: str = "gloo"):
    """(T_comm of one job of the run at its start, the bound's keywords): the wire the run's engine
    chose during the run (``row["wire"]``) switches T_comm from the update it was chosen at; a wire
    chosen before the first job (CO2's probe of the link) is the run's from the start."""
    from . import report
    t_comm = report.method_comm_seconds(row["method"], n_params, world, link_bps, args.precision, nodes,
                                        backend=backend)
    sync = dict(sync_updates=row.get("warmup_sync_updates") or 0, updates=row["updates"])
    wire = row.get("wire") or {}
    if wire.get("from_update") is not None and wire.get("start") and wire.get("wire") != wire.get("start"):
        def round_s(name: str) -> float:
            grad, param = report.wire_comm_bytes(row["method"], name, args.precision)
            return report.comm_round_seconds(n_params, world, link_bps, grad, param_bytes=param, nodes=nodes)

        after = round_s(wire["wire"])
        first = wire.get("before_first_job")
        t_comm = after if first else round_s(wire["start"])
        sync.update(switch_update=0 if first else int(wire["from_update"]), t_comm_after=after)
    return t_comm, sync


def _theory_lines(args, rows, compute, n_params, measured_bps, probe: Optional[dict] = None,
                  nodes: int = 1) -> List[str]:
    """Where the time should go: T_compute measured, T_comm from the measured link rate (ideal, in
    the bytes each method moves) and from the collective probe (real), and each method's bound."""
    from . import report
    if compute is None or not measured_bps:
        return []
    world = args.nodes * args.ranks_per_node
    t_comp = compute.ms_per_update / 1000.0
    t_fp32 = report.comm_round_seconds(n_params, world, measured_bps, 4, nodes=nodes)
    link = (f"each node's link at the measured {measured_bps / 1e6:.0f} Mbit/s per direction (ring over {world} "
            f"ranks, one ring edge per node)" if nodes >= 2 else
            f"the measured {measured_bps / 1e6:.0f} Mbit/s shared by all ranks")
    lines = [f"Per update: T_compute = {1000 * t_comp:.0f} ms (compute-only run); T_comm = {1000 * t_fp32:.0f} ms for "
             f"one reduce-scatter + all-gather of {n_params / 1e6:.2f}M fp32 values over {link}, ideal (each method's "
             f"own below, in the bytes it moves). Bounds: DPU max(T_compute, T_comm), ACCO max(T_compute, 2 T_comm), "
             f"CO2 T_compute + max(0, T_comm - {co2_overlap_steps('co2', args.local_steps, args.gap_penalty)} "
             f"T_compute) / {report.co2_local_steps('co2', args.local_steps)} (one averaging every local_steps inner "
             f"steps, hidden under anchor_merge_steps of them), ShardedAdamW T_compute + T_comm, DeepSpeed's ZeRO-1 "
             f"T_compute + T_comm x its passes / 2 (3 passes at its defaults, (W + 1)/W + 1 at its best on gloo)."]
    if probe:
        t_real = probe["round_s"]
        gloo_note = probe["backend"] == "gloo" and probe["reduce_scatter_s"] > 1.5 * probe["all_gather_s"]
        lines.append(f"Measured with {probe['backend']} over this network: one fp32 round (reduce-scatter + "
                     f"all-gather) {1000 * t_real:.0f} ms = {t_real / t_fp32:.2f}x ideal; all-reduce "
                     f"{1000 * probe['all_reduce_s']:.0f} ms, reduce-scatter {1000 * probe['reduce_scatter_s']:.0f} "
                     f"ms, all-gather {1000 * probe['all_gather_s']:.0f} ms."
                     + (" (gloo's reduce-scatter moves as many bytes as an all-reduce.)" if gloo_note else ""))
        if "engine_round_s" in probe:
            lines.append(f"Our engine's fp32 round on this network: {1000 * probe['engine_round_s']:.0f} ms = "
                         f"{probe['engine_round_s'] / t_fp32:.2f}x ideal (reduce-scatter "
                         f"{1000 * probe['engine_reduce_scatter_s']:.0f} ms"
                         + (", a ring of sends on gloo)." if probe["backend"] == "gloo" else ")."))
    for r in rows:
        if r["method"] == "compute":
            continue
        t_comm, sync = _run_comm(args, r, n_params, world, measured_bps, nodes,
                                 backend=(probe or {}).get("backend", "gloo"))
        b = report.bound_seconds(r["method"], t_comp, t_comm, args.local_steps, args.gap_penalty, **sync)
        line = (f"- {r['label']} ({r['comm']}): {r['ms_per_update']:.0f} ms/update measured vs bound {1000 * b:.0f} ms "
                f"({r['ms_per_update'] / (1000 * b):.2f}x the bound; T_comm {1000 * t_comm:.0f} ms"
                + (f"; its first {sync['sync_updates']} of {sync['updates']} updates synchronous, bounded by "
                   f"T_compute + T_comm" if sync["sync_updates"] else "") + ")")
        real = report.probe_round_seconds(probe, r["method"], args.precision) if probe else None
        if real is not None and sync.get("switch_update") is None:
            br = report.bound_seconds(r["method"], t_comp, real, args.local_steps, args.gap_penalty, **sync)
            line += f"; {1000 * br:.0f} ms with the measured round ({r['ms_per_update'] / (1000 * br):.2f}x)"
        lines.append(line)
    return lines
