"""The bench's report: the table, the where-the-time-goes lines, CSVs, JSON, Markdown and plots of
a finished set of runs (:func:`finish`), and :func:`replot`, which rebuilds them from a run folder's
logs without running anything."""
import argparse
import json
import os
import sys
from typing import List

from . import netns
from .methods import BASELINE, resolve_methods

def replot(out: str) -> int:
    """Rebuild results.md, the CSVs and the plots of an earlier run folder from its per-rank logs."""
    from . import report
    with open(os.path.join(out, "results.json")) as f:
        meta = json.load(f)
    args = argparse.Namespace(**meta["args"])
    args.no_plots = False
    methods = resolve_methods(args.methods)
    rates = [netns.parse_bandwidth(b) for b in args.sweep_bandwidth.split(",") if b.strip()] \
        if args.sweep_bandwidth else [netns.parse_bandwidth(args.bandwidth)]
    labels = list(meta.get("link", {})) or [netns.format_bandwidth(r) for r in rates]
    rates = [next((r for r in rates if netns.format_bandwidth(r) == label), None) for label in labels]
    reps = [""] if max(1, getattr(args, "repeat", 1)) <= 1 else [f"rep{i}" for i in range(args.repeat)]
    results, failed = [], []

    def collect(sub, method, label, bps):
        first = None
        for tag in reps:
            d = os.path.join(out, "runs", sub, tag)
            try:
                r = report.load_run(d, method, label, bps)
            except FileNotFoundError:
                failed.append(f"{method}@{label}")
                continue
            if first is None:
                first = r
                results.append(r)
            else:
                first.reps.append(r)

    if not args.no_compute_only:
        collect("compute", "compute", "no communication", None)
    for label, bps in zip(labels, rates):
        for method in methods:
            if not os.path.isdir(os.path.join(out, "runs", method if len(labels) == 1 else
                                              os.path.join(label.replace(" ", "").replace("/", "p"), method))):
                continue
            sub = method if len(labels) == 1 else os.path.join(label.replace(" ", "").replace("/", "p"), method)
            collect(sub, method, label, bps)
    link = {label: v.get("measured_bps") for label, v in meta.get("link", {}).items()}
    finish(args, out, results, failed, meta, link, meta["n_params"], rates)
    return 0


def finish(args, out, results, failed, meta, link, n_params, rates) -> None:
    from . import report
    compute = next((r for r in results if r.method == "compute"), None)
    all_rows, sweep_points, md = [], [], []
    md.append(f"# deepspeed-acco bench, {meta['date_utc']} UTC\n")
    md.append(f"`{meta['command']}`\n")
    mi = meta["machine"]
    md.append(f"Machine: {mi['cpu']}, {mi['cores']} cores, {mi['mem_gib']} GiB; {mi['os']}; Python {mi['python']}, "
              f"torch {mi['torch']}, deepspeed {mi['deepspeed']}, transformers {mi['transformers']}; "
              f"{args.threads} thread(s) per rank, {args.world_size} ranks, launcher {args.launcher}.\n")
    md.append(f"Model: GPT-Neo '{args.model}' ({n_params:,} parameters), ctx {args.ctx}; micro-batch "
              f"{args.micro_batch} x accumulation {args.grad_accum} x {args.world_size} ranks; {args.updates} updates; "
              f"lr {args.lr:g}; data: {meta['corpus']}.\n")
    if meta.get("busy_warning"):
        md.append(meta["busy_warning"] + "\n")
    for label in [netns.format_bandwidth(b) for b in rates]:
        group = [r for r in results if r.bandwidth == label]
        if compute is not None:
            group = [compute] + group
        if not group:
            continue
        rows = report.table_rows(group)
        for r in rows:
            r["bandwidth"] = label
        all_rows += [r for r in rows if not (r["method"] == "compute" and any(x["method"] == "compute" for x in all_rows))]
        measured = link.get(label)
        heading = f"## Link: {label}" + (f" (measured {measured / 1e6:.0f} Mbit/s)" if measured and label != "unshaped" else "")
        table = report.markdown_table(rows)
        probe = meta["link"].get(label, {}).get("probe")
        theory = _theory_lines(args, rows, compute, n_params, measured if label != "unshaped" else None, probe)
        theory += _noise_lines(rows)
        md += [heading + "\n", table + "\n", *theory, ""]
        print(f"\n{heading}\n{table}\n" + "\n".join(theory))
        base = next((r for r in rows if r["method"] == BASELINE), None)
        if base is not None and compute is not None and measured:
            t_comp = compute.ms_per_update / 1000.0
            t_comm = report.comm_round_seconds(n_params, args.world_size, measured, 2 if args.bf16 else 4)
            for r in rows:
                if r["method"] in ("compute", BASELINE):
                    continue
                b = report.bound_seconds(r["method"], t_comp, t_comm, args.local_steps)
                sweep_points.append(dict(method=r["method"], link_bps=measured, speedup=r["speedup_vs_zero1"],
                                         bound_speedup=(base["ms_per_update"] / 1000.0) / b if b else None))
    md.append(report.TABLE_NOTES + "\n")
    if failed:
        md.append(f"FAILED runs: {', '.join(failed)} (see runs/*/launcher.log)\n")

    report.write_steps_csv(os.path.join(out, "steps.csv"), results)
    report.write_summary_csv(os.path.join(out, "summary.csv"), all_rows)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(meta, table=all_rows, sweep=sweep_points), f, indent=1, default=str)
    plots = []
    if not args.no_plots and results:
        for label in [netns.format_bandwidth(b) for b in rates]:
            group = [r for r in results if r.bandwidth == label]
            if not group:
                continue
            suffix = "" if len(rates) == 1 else "_" + label.replace(" ", "").replace("/", "p")
            title = (f"GPT-Neo {n_params / 1e6:.1f}M, {args.world_size} ranks, link {label}, "
                     f"{args.updates} updates x {args.micro_batch * args.grad_accum * args.world_size} samples")
            p1 = os.path.join(out, f"val_loss_vs_wallclock{suffix}.png")
            report.plot_val_vs_wall(p1, group, title)
            p2 = os.path.join(out, f"loss_vs_samples{suffix}.png")
            report.plot_loss_vs_samples(p2, group, title)
            plots += [p1, p2]
        if len(rates) > 1 and sweep_points:
            p3 = os.path.join(out, "speedup_vs_bandwidth.png")
            report.plot_speedup_vs_bandwidth(
                p3, sweep_points, f"GPT-Neo {n_params / 1e6:.1f}M, {args.world_size} ranks: measured speedup (solid)\n"
                                  f"bound T_ZeRO-1 / max(T_compute, k T_comm) (dashed; k: ACCO 2, DPU 1, "
                                  f"CO2 1/{args.local_steps})")
            plots.append(p3)
    for p in plots:
        md.append(f"![{os.path.basename(p)}]({os.path.basename(p)})\n")
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(md))
    print(f"\n{report.TABLE_NOTES}\n\nwrote {out}/results.md, steps.csv, summary.csv, results.json"
          + "".join(f", {os.path.basename(p)}" for p in plots))
    if failed:
        print(f"FAILED runs: {', '.join(failed)}", file=sys.stderr)


def _noise_lines(rows) -> List[str]:
    """How much of the machine other processes took while each run trained (timings are only
    comparable when this is ~0 for every run)."""
    loads = [(r["label"], r.get("other_load_cores"), r.get("steal_cores")) for r in rows]
    if all(x[1] is None for x in loads):
        return []
    text = ", ".join(f"{label} {load:.2f}" + (f" (+{steal:.2f} stolen)" if steal and steal > 0.01 else "")
                     for label, load, steal in loads if load is not None)
    lines = [f"Other processes during training (cores busy outside the ranks, average; worst run): {text}."]
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


def _theory_lines(args, rows, compute, n_params, measured_bps, probe=None) -> List[str]:
    """Where the time should go: T_compute measured, T_comm from the measured link rate (ideal) and
    from the collective probe (real), and each method's bound."""
    from . import report
    if compute is None or not measured_bps:
        return []
    t_comp = compute.ms_per_update / 1000.0
    t_comm = report.comm_round_seconds(n_params, args.world_size, measured_bps, 2 if args.bf16 else 4)
    lines = [f"Per update: T_compute = {1000 * t_comp:.0f} ms (compute-only run); T_comm = {1000 * t_comm:.0f} ms "
             f"(one reduce-scatter + all-gather of {n_params / 1e6:.2f}M {'bf16' if args.bf16 else 'fp32'} values at "
             f"the measured {measured_bps / 1e6:.0f} Mbit/s, ideal). Bounds: DPU max(T_compute, T_comm), "
             f"ACCO max(T_compute, 2 T_comm), CO2 max(T_compute, T_comm / {args.local_steps}), others T_compute + T_comm."]
    t_real = None
    if probe:
        t_real = probe["round_s"]
        lines.append(f"Measured with {probe['backend']} over this link: one round (reduce-scatter + all-gather) "
                     f"{1000 * t_real:.0f} ms = {t_real / t_comm:.2f}x ideal; all-reduce {1000 * probe['all_reduce_s']:.0f} ms, "
                     f"reduce-scatter {1000 * probe['reduce_scatter_s']:.0f} ms, all-gather "
                     f"{1000 * probe['all_gather_s']:.0f} ms."
                     + (" (gloo's reduce-scatter moves as many bytes as an all-reduce.)"
                        if probe["backend"] == "gloo" and probe["reduce_scatter_s"] > 1.5 * probe["all_gather_s"] else ""))
        if "engine_round_s" in probe:
            lines.append(f"Our engine's round on this link: {1000 * probe['engine_round_s']:.0f} ms = "
                         f"{probe['engine_round_s'] / t_comm:.2f}x ideal (reduce-scatter "
                         f"{1000 * probe['engine_reduce_scatter_s']:.0f} ms"
                         + (", a ring of sends on gloo)." if probe["backend"] == "gloo" else ")."))
    for r in rows:
        if r["method"] == "compute":
            continue
        b = report.bound_seconds(r["method"], t_comp, t_comm, args.local_steps)
        line = (f"- {r['label']}: {r['ms_per_update']:.0f} ms/update measured vs bound {1000 * b:.0f} ms "
                f"({r['ms_per_update'] / (1000 * b):.2f}x the bound)")
        if t_real is not None:
            # DeepSpeed on gloo: ZeRO-1 all-reduces the gradients then all-gathers, stage 0 only all-reduces.
            real = {"zero1": probe["all_reduce_s"] + probe["all_gather_s"],
                    "zero0": probe["all_reduce_s"]}.get(r["method"], probe.get("engine_round_s", t_real))
            br = report.bound_seconds(r["method"], t_comp, real, args.local_steps)
            line += f"; {1000 * br:.0f} ms with the measured round ({r['ms_per_update'] / (1000 * br):.2f}x)"
        lines.append(line)
    return lines
