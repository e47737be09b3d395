"""Turn the per-rank logs of bench runs into the table, the CSVs and the plots.

A run directory holds, per rank ``R``: ``rank<R>.jsonl`` (one row per committed update) and
``rank<R>.summary.json`` (totals, and the validation losses of the parameter copies that rank
evaluated). :func:`load_run` merges them into one :class:`RunResult`.
"""
import csv
import glob
import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from .methods import BASELINE, METHODS


@dataclass
class RunResult:
    method: str
    bandwidth: str                 # label, e.g. "1 Gbit/s" or "unshaped"
    bps: Optional[float]           # nominal rate, bits/s (None: unshaped)
    rows: Dict[int, List[dict]]    # rank -> per-update rows
    summaries: Dict[int, dict]     # rank -> summary
    val: Dict[int, float] = field(default_factory=dict)  # update -> validation loss
    job: dict = field(default_factory=dict)                # launcher exit code, job seconds, load averages
    reps: List["RunResult"] = field(default_factory=list)  # repeated runs (--repeat): timings use the median

    def _all(self) -> List["RunResult"]:
        return [self] + list(self.reps)

    @property
    def label(self) -> str:
        return METHODS[self.method].label

    @property
    def updates(self) -> int:
        return min(s["updates"] for s in self.summaries.values())

    @property
    def samples(self) -> int:
        return max(s["samples"] for s in self.summaries.values())

    @property
    def own_wall_s(self) -> float:
        """This run's training wall-clock: the slowest rank, from the post-initialize barrier to its last update."""
        return max(s["wall_s"] for s in self.summaries.values())

    @property
    def wall_s(self) -> float:
        """Training wall-clock; with repeated runs the median over them."""
        return _median([r.own_wall_s for r in self._all()])

    @property
    def wall_range(self):
        walls = [r.own_wall_s for r in self._all()]
        return min(walls), max(walls)

    @property
    def ms_per_update(self) -> float:
        return 1000.0 * self.wall_s / max(self.updates, 1)

    @property
    def steady_ms_per_update(self) -> float:
        """Per-update time over the second half of the run (rank 0), without start-up transients."""
        rows = self.rows.get(0) or next(iter(self.rows.values()))
        if len(rows) < 4:
            return self.ms_per_update
        half = len(rows) // 2
        a, b = rows[half - 1], rows[-1]
        return 1000.0 * (b["wall_s"] - a["wall_s"]) / max(b["update"] - a["update"], 1)

    @property
    def own_comm_wait_s(self) -> Optional[float]:
        waits = [s.get("comm_wait_s") for s in self.summaries.values()]
        if any(w is None for w in waits) or not waits:
            return None
        return sum(waits) / len(waits)

    @property
    def comm_wait_s(self) -> Optional[float]:
        """Mean over ranks of the engine's cumulative communication wait (median over repeats); None where
        the engine has no counter."""
        waits = [r.own_comm_wait_s for r in self._all()]
        return None if any(w is None for w in waits) else _median(waits)

    @property
    def own_other_load(self) -> Optional[float]:
        busy = [s.get("machine_busy_s") for s in self.summaries.values()]
        if any(b is None for b in busy) or not busy:
            return None
        own = sum(s.get("cpu_s", 0.0) for s in self.summaries.values())
        return max(0.0, (sum(busy) / len(busy) - own) / max(self.own_wall_s, 1e-9))

    @property
    def other_load(self) -> Optional[float]:
        """Cores used by processes other than this job's ranks during the training, on average (machine
        busy time minus the ranks' CPU time, over the wall-clock; the worst of repeated runs); ~0 on a
        quiet machine."""
        loads = [r.own_other_load for r in self._all()]
        return None if any(x is None for x in loads) else max(loads)

    @property
    def steal_cores(self) -> Optional[float]:
        out = []
        for r in self._all():
            steal = [s.get("machine_steal_s") for s in r.summaries.values()]
            if any(x is None for x in steal) or not steal:
                return None
            out.append((sum(steal) / len(steal)) / max(r.own_wall_s, 1e-9))
        return max(out)

    def final_train_loss(self, frac: float = 0.1) -> float:
        """Mean train loss over the last ``frac`` of the updates, over all ranks."""
        vals = []
        for rows in self.rows.values():
            k = max(1, int(round(len(rows) * frac)))
            vals += [r["loss"] for r in rows[-k:]]
        return sum(vals) / len(vals) if vals else float("nan")

    @property
    def final_val_loss(self) -> float:
        return self.val[max(self.val)] if self.val else float("nan")

    @property
    def peak_rss_mib(self) -> float:
        return max(s["peak_rss_mib"] for s in self.summaries.values())

    def wall_at(self, update: int) -> float:
        if update == 0:
            return 0.0
        rows = self.rows.get(0) or next(iter(self.rows.values()))
        for r in rows:
            if r["update"] == update:
                return r["wall_s"]
        return float("nan")

    def mean_loss_curve(self):
        """``[(update, samples, mean loss over ranks)]``."""
        by_update: Dict[int, List[float]] = {}
        samples: Dict[int, int] = {}
        for rows in self.rows.values():
            for r in rows:
                by_update.setdefault(r["update"], []).append(r["loss"])
                samples[r["update"]] = r["samples"]
        return [(u, samples[u], sum(v) / len(v)) for u, v in sorted(by_update.items())]


def _median(values: Sequence[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def load_run(run_dir: str, method: str, bandwidth: str = "", bps: Optional[float] = None) -> RunResult:
    rows, summaries, val = {}, {}, {}
    for path in sorted(glob.glob(os.path.join(run_dir, "rank*.summary.json"))):
        with open(path) as f:
            s = json.load(f)
        summaries[s["rank"]] = s
        val.update({int(k): float(v) for k, v in s.get("val", {}).items()})
        with open(os.path.join(run_dir, f"rank{s['rank']}.jsonl")) as f:
            rows[s["rank"]] = [json.loads(line) for line in f if line.strip()]
    if not summaries:
        raise FileNotFoundError(f"no rank summaries in {run_dir} (the run failed; see its launcher.log)")
    job = {}
    if os.path.exists(os.path.join(run_dir, "job.json")):
        with open(os.path.join(run_dir, "job.json")) as f:
            job = json.load(f)
    return RunResult(method=method, bandwidth=bandwidth, bps=bps, rows=rows, summaries=summaries, val=val, job=job)


# ----------------------------------------------------------------------------------------------
# Tables


def _fmt(x, spec=".2f", none="n/a"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def table_rows(results: Sequence[RunResult]) -> List[dict]:
    """One dict per run with every table column (numbers, not strings)."""
    compute = next((r for r in results if r.method == "compute"), None)
    base = next((r for r in results if r.method == BASELINE), None)
    out = []
    for r in results:
        is_compute = r.method == "compute"
        wait, derived = r.comm_wait_s, False
        if wait is None and compute is not None and not is_compute:
            wait, derived = max(0.0, r.wall_s - compute.wall_s), True
        row = dict(method=r.method, label=r.label, bandwidth=r.bandwidth, updates=r.updates, samples=r.samples,
                   wall_s=r.wall_s, ms_per_update=r.ms_per_update, steady_ms_per_update=r.steady_ms_per_update,
                   samples_per_s=r.samples / r.wall_s if r.wall_s > 0 else float("nan"),
                   x_compute=(r.wall_s / compute.wall_s) if compute is not None else None,
                   speedup_vs_zero1=(base.wall_s / r.wall_s) if base is not None and not is_compute else None,
                   comm_wait_s=wait if not is_compute else 0.0, comm_wait_derived=derived,
                   train_loss=None if is_compute else r.final_train_loss(),
                   val_loss=None if is_compute else r.final_val_loss,
                   val_ppl=None if is_compute else math.exp(r.final_val_loss),
                   val_gap_vs_zero1=((r.final_val_loss / base.final_val_loss - 1.0)
                                     if base is not None and not is_compute else None),
                   peak_rss_mib=r.peak_rss_mib, init_s=max(s["init_s"] for s in r.summaries.values()),
                   snapshot_s=max(s.get("snapshot_s", 0.0) for s in r.summaries.values()),
                   wall_incl_copies_s=max(s.get("wall_incl_copies_s", s["wall_s"]) for s in r.summaries.values()),
                   job_s=r.job.get("job_s"), loadavg_before=r.job.get("loadavg_before"),
                   other_load_cores=r.other_load, steal_cores=r.steal_cores, repeats=1 + len(r.reps),
                   wall_min_s=r.wall_range[0], wall_max_s=r.wall_range[1],
                   rank_cpu_s=sum(s.get("cpu_s", 0.0) for s in r.summaries.values()))
        out.append(row)
    return out


def markdown_table(rows: Sequence[dict]) -> str:
    head = ["method", "wall (s)", "ms/update", "x compute", "samples/s", "speedup vs ZeRO-1", "comm wait (s)",
            "train loss", "val loss", "val vs ZeRO-1", "val ppl", "peak RSS/rank (MiB)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        wait = _fmt(r["comm_wait_s"], ".1f")
        if r["comm_wait_derived"]:
            wait = f"~{wait}*"
        cells = [r["label"], _fmt(r["wall_s"], ".1f"), _fmt(r["ms_per_update"], ".0f"),
                 (_fmt(r["x_compute"], ".2f") + "x") if r["x_compute"] is not None else "",
                 _fmt(r["samples_per_s"], ".1f"),
                 (_fmt(r["speedup_vs_zero1"], ".2f") + "x") if r["speedup_vs_zero1"] is not None else "",
                 wait, _fmt(r["train_loss"], ".3f", ""), _fmt(r["val_loss"], ".4f", ""),
                 (f"{100 * r['val_gap_vs_zero1']:+.2f}%") if r["val_gap_vs_zero1"] is not None else "",
                 _fmt(r["val_ppl"], ".2f", ""), _fmt(r["peak_rss_mib"], ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


TABLE_NOTES = (
    "Equal samples for every method (same updates x global batch). wall = training only (after initialize and a "
    "barrier, slowest rank; paused while the committed parameters are copied for validation, see snapshot_s and "
    "wall_incl_copies_s in summary.csv); x compute = wall / compute-only wall, the floor (same processes and batches, no "
    "communication). comm wait: the engine's measured time blocked on communication (mean over ranks); "
    "`~x*` = derived as wall - compute-only wall, for DeepSpeed's engine, which has no such counter. train loss: "
    "mean of the last 10% of updates over ranks; val loss: held-out files, after the last update (nats/byte, "
    "ppl = exp); val vs ZeRO-1: relative gap.")


def write_steps_csv(path: str, results: Sequence[RunResult]) -> None:
    cols = ["bandwidth", "method", "rank", "update", "samples", "wall_s", "loss", "micro_batches", "comm_wait_s",
            "lr", "val_loss"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in results:
            if 0 in r.val:
                w.writerow(dict(bandwidth=r.bandwidth, method=r.method, rank=0, update=0, samples=0, wall_s=0.0,
                                val_loss=r.val[0]))
            for rank in sorted(r.rows):
                for row in r.rows[rank]:
                    out = dict(row, bandwidth=r.bandwidth, method=r.method, rank=rank)
                    if rank == 0 and row["update"] in r.val:
                        out["val_loss"] = r.val[row["update"]]
                    w.writerow(out)


def write_summary_csv(path: str, rows: Sequence[dict]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


# ----------------------------------------------------------------------------------------------
# Theory: the bound max(T_compute, k * T_comm)


def comm_round_seconds(n_params: int, world_size: int, link_bps: float, bytes_per_element: int = 4) -> float:
    """Ideal time of one reduce-scatter of the gradients plus one all-gather of the parameters (or one
    all-reduce: same volume) when every byte crosses one shared link of ``link_bps``: each of the W ranks
    sends 2 (W - 1) / W of the model, 2 (W - 1) P b bytes in all."""
    return 8.0 * 2 * (world_size - 1) * n_params * bytes_per_element / link_bps


def bound_seconds(method: str, t_compute: float, t_comm: float, local_steps: int) -> Optional[float]:
    """Lower bound on the per-update time: overlapped methods max(T_compute, k T_comm) (ACCO k = 2,
    DPU 1, CO2 1/local_steps); the others T_compute + T_comm."""
    spec = METHODS[method]
    if spec.optimizer is None:
        return t_compute
    if not spec.overlapped:
        return t_compute + t_comm
    k = 1.0 / max(local_steps, 1) if method == "co2" else spec.comm_jobs
    return max(t_compute, k * t_comm)


# ----------------------------------------------------------------------------------------------
# Plots


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


_STYLE = {"compute": ("0.6", ":"), "zero1": ("tab:red", "-"), "zero0": ("tab:orange", "-"),
          "sharded": ("tab:purple", "-"), "dpu": ("tab:green", "-"), "acco": ("tab:blue", "-"),
          "co2": ("tab:brown", "-")}


def plot_val_vs_wall(path: str, results: Sequence[RunResult], title: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        if r.method == "compute" or not r.val:
            continue
        color, ls = _STYLE.get(r.method, (None, "-"))
        pts = sorted((r.wall_at(u), v) for u, v in r.val.items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=color, ls=ls,
                label=f"{r.label} ({r.wall_s:.0f} s)")
    ax.set_xlabel("training wall-clock (s)")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _smooth(values: Sequence[float], k: int) -> List[float]:
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def plot_loss_vs_samples(path: str, results: Sequence[RunResult], title: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    for r in results:
        if r.method == "compute":
            continue
        color, _ = _STYLE.get(r.method, (None, "-"))
        curve = r.mean_loss_curve()
        if curve:
            k = max(1, len(curve) // 20)
            ax.plot([c[1] for c in curve], _smooth([c[2] for c in curve], k), color=color, lw=1, alpha=0.8,
                    label=f"{r.label} train (moving avg {k})")
        if r.val:
            tbs = r.summaries[min(r.summaries)]["train_batch_size"]
            pts = sorted((u * tbs, v) for u, v in r.val.items())
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, ls="--", marker="o", ms=4,
                    label=f"{r.label} validation")
    ax.set_xlabel("samples")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_speedup_vs_bandwidth(path: str, points: Sequence[dict], title: str) -> None:
    """``points``: dicts with method, link_bps, speedup, bound_speedup."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in [m for m in METHODS if any(p["method"] == m for p in points)]:
        pts = sorted((p for p in points if p["method"] == method), key=lambda p: p["link_bps"])
        color, _ = _STYLE.get(method, (None, "-"))
        xs = [p["link_bps"] / 1e6 for p in pts]
        ax.plot(xs, [p["speedup"] for p in pts], marker="o", color=color, label=f"{METHODS[method].label} measured")
        if METHODS[method].overlapped and all(p.get("bound_speedup") for p in pts):
            ax.plot(xs, [p["bound_speedup"] for p in pts], ls="--", color=color, alpha=0.7,
                    label=f"{METHODS[method].label} bound")
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set_xscale("log")
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    ticks = sorted({p["link_bps"] / 1e6 for p in points})
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:.0f}"))
    ax.set_xlabel("measured link rate (Mbit/s, shared by both directions)")
    ax.set_ylabel("speedup vs DeepSpeed ZeRO-1 (equal samples)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
