"""Turn the per-rank logs of bench runs into the table, the CSVs and the plots.

A run directory holds, per rank ``R``: ``rank<R>.jsonl`` (one row per committed update) and
```rank<R>.summary.json`` (totals at ``--updates``, the validation losses, when the target loss was
reached). :func:`load_run` merges them into one :class:`RunResult`. A run may go on past
``--updates`` (time to a target loss); the equal-samples numbers are those at ``--updates``.
"""
import csv
import glob
import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from ..workload.methods import BASELINE, co2_overlap_steps, METHODS, parse_variant

TARGET_RESOLUTION = 0.02
"""Near the target loss a run is evaluated every this share of ``--updates`` (at least every update), so
that time to target resolves 2% and not the grid of ``--eval-every`` (running/train.py, TargetWatch)."""

MIN_TARGET_MARGIN = 0.005
"""Dense evaluation starts at the latest within this relative distance above the target."""


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
    seed: int = 0
    defines_target: bool = False  # ZeRO-1 under --target-loss auto: its loss after --updates is the target

    def _all(self) -> List["RunResult"]:
        return [self] + list(self.reps)

    @property
    def label(self) -> str:
        return "compute-only (no comm)" if self.method == "compute" else parse_variant(self.method).label

    @property
    def _first(self) -> dict:
        return self.summaries[min(self.summaries)]

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
    def new_clock(self) -> bool:
        """Whether the run was timed with the clock of 2026-12-03 (docs/bench.md, "The clock"): copies
        taken without waiting for the job in flight. Older runs' copies included that wait, off the clock."""
        return all("process_wall_s" in s for s in self.summaries.values())

    @property
    def deadline_per_rank(self) -> bool:
        """Whether evaluations found a job in flight on several ranks and each rank carried its whole
        drain as its deadline (runs before 2026-12-06; docs/bench.md, "The clock"): a rank that waited
        for a peer to join the job then resumed behind it by that wait."""
        summaries = list(self.summaries.values())
        return (len(summaries) > 1 and any((s.get("eval_comm_s") or 0.0) > 0.0 for s in summaries)
                and not all("eval_peer_wait_s" in s for s in summaries))

    @property
    def ms_per_update(self) -> float:
        return 1000.0 * self.wall_s / max(self.updates, 1)

    def _rank0_rows(self) -> List[dict]:
        """Rank 0's rows up to the equal-samples point."""
        rows = self.rows.get(0) or next(iter(self.rows.values()))
        return [r for r in rows if r["update"] <= self.updates]

    @property
    def steady_ms_per_update(self) -> float:
        """Per-update time over the second half of the run (rank 0), without start-up transients."""
        rows = self._rank0_rows()
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
        """Mean train loss over the last ``frac`` of the updates up to ``--updates``, over all ranks."""
        vals = []
        for rows in self.rows.values():
            rows = [r for r in rows if r["update"] <= self.updates]
            k = max(1, int(round(len(rows) * frac)))
            vals += [r["loss"] for r in rows[-k:]]
        return sum(vals) / len(vals) if vals else float("nan")

    @property
    def final_val_loss(self) -> float:
        """Validation loss after ``--updates`` (the equal-samples point)."""
        if self.updates in self.val:
            return self.val[self.updates]
        return self.val[max(self.val)] if self.val else float("nan")

    # ---- time to target ----------------------------------------------------------------------
    @property
    def target_loss(self) -> Optional[float]:
        return self.final_val_loss if self.defines_target else self._first.get("target_loss")

    @property
    def reached_update(self) -> Optional[int]:
        return self.updates if self.defines_target else self._first.get("reached_update")

    @property
    def reached_wall_s(self) -> Optional[float]:
        """Wall-clock when the target was first reached (slowest rank; median over repeats)."""
        if self.defines_target:
            return self.wall_s
        walls = []
        for r in self._all():
            per_rank = [s.get("reached_wall_s") for s in r.summaries.values()]
            if any(w is None for w in per_rank) or not per_rank:
                return None
            walls.append(max(per_rank))
        return _median(walls)

    @property
    def wire(self) -> Optional[dict]:
        """What our engine's wire was (runtime/wire.py): ``start`` (the measured wire), ``wire`` (the one
        of the rest of the run), ``from_update`` and ``reason`` of an automatic choice, ``before_first_job``
        where it was made before any job ran (CO2's probe of the link); None for DeepSpeed's engine and
        runs recorded before the choice existed."""
        regime = self._first.get("regime") or {}
        if not regime or "wire_now" not in regime:
            return None
        choice = regime.get("wire") or {}
        return dict(start=regime.get("measured_wire"), wire=choice.get("wire", regime.get("wire_now")),
                    from_update=choice.get("decided_at_update"), reason=choice.get("reason"),
                    before_first_job=bool(choice.get("probe_bytes")),
                    predicted_s=choice.get("predicted_s") or {}, extra_bytes=(choice.get("extra_bytes") or {}).get(
                        choice.get("wire"), 0))

    @property
    def target_resolution_updates(self) -> Optional[int]:
        """Updates between evaluations near the target (the time-to-target resolution)."""
        return self._first.get("target_resolution_updates")

    @property
    def final_update(self) -> int:
        return min(s.get("final_update", s["updates"]) for s in self.summaries.values())

    @property
    def last_val(self):
        """``(update, loss)`` of the last evaluation (at the stop)."""
        if not self.val:
            return None, float("nan")
        u = max(self.val)
        return u, self.val[u]

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


def add_run(results: List[RunResult], by_key: Dict, r: RunResult) -> RunResult:
    """Append ``r`` to ``results``, or, if a run of the same method, link and seed is there already
    (``--repeat``), to that run's repetitions. Returns ``r``."""
    key = (r.method, r.bandwidth, r.seed)
    if key in by_key:
        by_key[key].reps.append(r)
    else:
        by_key[key] = r
        results.append(r)
    return r


def load_run(run_dir: str, method: str, bandwidth: str = "", bps: Optional[float] = None, seed: int = 0) -> RunResult:
    rows, summaries, val_by_rank = {}, {}, {}
    for path in sorted(glob.glob(os.path.join(run_dir, "rank*.summary.json"))):
        with open(path) as f:
            s = json.load(f)
        summaries[s["rank"]] = s
        val_by_rank[s["rank"]] = {int(k): float(v) for k, v in s.get("val", {}).items()}
        with open(os.path.join(run_dir, f"rank{s['rank']}.jsonl")) as f:
            rows[s["rank"]] = [json.loads(line) for line in f if line.strip()]
    if not summaries:
        raise FileNotFoundError(f"no rank summaries in {run_dir} (the run failed; see its launcher.log)")
    # Rank 0's evaluations: every rank of a data-parallel method holds the same committed weights, and
    # in the compute-only run each rank is a lone replica of its own, of which rank 0's is reported.
    val = next((val_by_rank[r] for r in sorted(val_by_rank) if val_by_rank[r]), {})
    job = {}
    if os.path.exists(os.path.join(run_dir, "job.json")):
        with open(os.path.join(run_dir, "job.json")) as f:
            job = json.load(f)
    return RunResult(method=method, bandwidth=bandwidth, bps=bps, rows=rows, summaries=summaries, val=val, job=job,
                     seed=seed)


# ----------------------------------------------------------------------------------------------
# Tables


def _fmt(x, spec=".2f", none="n/a"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def _wire_name(value: float):
    """A wire's name from its bytes per value: a dtype, or a compressed wire of runtime/regime.py with its
    blocks' scales (:func:`quantized_bytes`, what the modifiers and :func:`wire_comm_bytes` count)."""
    from deepspeed_acco.runtime.regime import COMPRESSED_BITS, quantized_bytes
    names = {4.0: "fp32", 2.0: "bf16", **{quantized_bytes(bits): name for name, bits in COMPRESSED_BITS.items()}}
    return names.get(value, value)


def comm_label(method: str, precision: str, wire: Optional[dict] = None) -> str:
    """What one round moves per value: ``"fp32/bf16"`` = fp32 gradients reduced, bf16 parameters gathered.

    With ``wire`` (:attr:`RunResult.wire`), a wire our engine chose from the link and ran on instead of
    its config's shows too: ``"bf16/bf16 for 2 updates, then int4/int4"``, or ``"int4/int4 (chosen)"``
    where it was chosen before the first job."""
    if method == "compute":
        return ""
    variant = parse_variant(method)

    def text(grad: float, param: float) -> str:
        grad_text = str(_wire_name(grad))
        collective = variant.method.gradient_collective
        if collective != "reduce_scatter":  # DeepSpeed's: all-reduce, or reduce to each partition's owner
            grad_text += " " + collective.replace("_", "-")
        return grad_text if not variant.method.gathers_parameters else f"{grad_text}/{_wire_name(param)}"
    label = text(*variant.comm_bytes(precision))
    if not wire or wire.get("from_update") is None or wire.get("wire") in (None, wire.get("start")):
        return label
    chosen = text(*wire_comm_bytes(method, wire["wire"], precision))
    if wire.get("before_first_job"):
        return f"{chosen} (chosen)"
    return f"{label} for {wire['from_update']} updates, then {chosen}"


def table_rows(results: Sequence[RunResult], precision: str = "fp32") -> List[dict]:
    """One dict per run with every table column (numbers, not strings)."""
    compute = next((r for r in results if r.method == "compute"), None)
    base = next((r for r in results if r.method == BASELINE), None)
    base_ttt = base.reached_wall_s if base is not None else None
    out = []
    for r in results:
        is_compute = r.method == "compute"
        ttt = None if is_compute else r.reached_wall_s
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
                   # compute-only: rank 0's replica, which trained alone ("a lone replica")
                   val_loss=r.final_val_loss if r.val else None,
                   val_ppl=math.exp(r.final_val_loss) if r.val else None,
                   val_gap_vs_zero1=((r.final_val_loss / base.final_val_loss - 1.0)
                                     if base is not None and r.val else None),
                   peak_rss_mib=r.peak_rss_mib, init_s=max(s["init_s"] for s in r.summaries.values()),
                   snapshot_s=max(s.get("snapshot_s", 0.0) for s in r.summaries.values()),
                   paused_at_updates_s=max(s.get("paused_at_updates_s", s.get("snapshot_at_updates_s")) or 0.0
                                           for s in r.summaries.values()),
                   eval_comm_s=max((s.get("eval_comm_s") or 0.0) for s in r.summaries.values()),
                   old_clock=not r.new_clock, deadline_per_rank=r.deadline_per_rank,
                   job_s=r.job.get("job_s"), loadavg_before=r.job.get("loadavg_before"),
                   other_load_cores=r.other_load, steal_cores=r.steal_cores, repeats=1 + len(r.reps),
                   wall_min_s=r.wall_range[0], wall_max_s=r.wall_range[1],
                   rank_cpu_s=sum(s.get("cpu_s") or 0.0 for s in r.summaries.values()),
                   seed=r.seed, comm=comm_label(r.method, precision, None if is_compute else r.wire),
                   target_loss=None if is_compute else r.target_loss,
                   updates_to_target=None if is_compute else r.reached_update, time_to_target_s=ttt,
                   ttt_speedup_vs_zero1=(base_ttt / ttt) if base_ttt and ttt else None,
                   final_update=r.final_update, last_val_loss=None if is_compute else r.last_val[1],
                   eval_s=max(s.get("eval_s", 0.0) for s in r.summaries.values()),
                   warmup_sync_updates=r._first.get("warmup_sync_updates") or 0,
                   wire=None if is_compute else r.wire,
                   breakdown=[dict(rank=rank, **s["breakdown_ms"]) for rank, s in sorted(r.summaries.items())
                              if s.get("breakdown_ms")],
                   job_ms=r._first.get("job_ms"))
        out.append(row)
    return out


def memory_section(results: Sequence[RunResult]) -> str:
    """Markdown: each method's held buffers in bytes/param/rank and its peak memory per rank (the
    first run of each method; memory does not depend on the link)."""
    from .memory import memory_table
    columns = {}
    for r in results:
        if r.method != "compute" and r.label not in columns:
            columns[r.label] = list(r.summaries.values())
    table = memory_table(columns)
    if not table:
        return ""
    return ("### Memory per rank: buffers in bytes per parameter (engine.memory_breakdown(); DeepSpeed walked "
            "the same way) and peak memory\n\n" + table + "\n")


def markdown_table(rows: Sequence[dict]) -> str:
    """The equal-samples table."""
    head = ["method", "comm", "wall (s)", "ms/update", "x compute", "samples/s", "speedup vs ZeRO-1", "comm wait (s)",
            "train loss", "val loss", "val vs ZeRO-1", "val ppl", "peak RSS/rank (MiB)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        wait = _fmt(r["comm_wait_s"], ".1f")
        if r["comm_wait_derived"]:
            wait = f"~{wait}*"
        cells = [r["label"], r.get("comm", ""), _fmt(r["wall_s"], ".1f"), _fmt(r["ms_per_update"], ".0f"),
                 (_fmt(r["x_compute"], ".2f") + "x") if r["x_compute"] is not None else "",
                 _fmt(r["samples_per_s"], ".1f"),
                 (_fmt(r["speedup_vs_zero1"], ".2f") + "x") if r["speedup_vs_zero1"] is not None else "",
                 wait, _fmt(r["train_loss"], ".3f", ""), _fmt(r["val_loss"], ".4f", ""),
                 (f"{100 * r['val_gap_vs_zero1']:+.2f}%") if r["val_gap_vs_zero1"] is not None else "",
                 _fmt(r["val_ppl"], ".2f", ""), _fmt(r["peak_rss_mib"], ".0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ttt_table(rows: Sequence[dict], eval_every: int, max_updates: int) -> str:
    """The time-to-target table: when each method's validation loss first reached the target."""
    head = ["method", "updates to target", "time to target (s)", "speedup vs ZeRO-1", "val loss at stop"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        if r["method"] == "compute":
            continue
        if r["updates_to_target"] is not None:
            cells = [r["label"], str(r["updates_to_target"]), _fmt(r["time_to_target_s"], ".1f"),
                     (_fmt(r["ttt_speedup_vs_zero1"], ".2f") + "x") if r["ttt_speedup_vs_zero1"] else "",
                     _fmt(r["last_val_loss"], ".4f")]
        else:
            cells = [r["label"], f"not reached in {r['final_update']}", "", "not reached",
                     _fmt(r["last_val_loss"], ".4f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def seed_rows(results: Sequence[RunResult], seeds: Sequence[int]) -> List[dict]:
    """Per method, over seeds: validation loss after --updates, its gap to ZeRO-1 of the same seed
    (mean and range), and the time-to-target speedup over ZeRO-1 of the same seed."""
    by = {(r.method, r.seed): r for r in results if r.method != "compute" or r.val}
    methods = list(dict.fromkeys(r.method for r in results if r.method != "compute" or r.val))
    out = []
    for m in methods:
        vals, gaps, speedups, reached, n = [], [], [], 0, 0
        for seed in seeds:
            r, base = by.get((m, seed)), by.get((BASELINE, seed))
            if r is None:
                continue
            n += 1
            vals.append(r.final_val_loss)
            if base is not None:
                gaps.append(r.final_val_loss / base.final_val_loss - 1.0)
                if r.reached_wall_s and base.reached_wall_s:
                    speedups.append(base.reached_wall_s / r.reached_wall_s)
            reached += r.reached_update is not None
        if not n:
            continue

        def stats(v):
            return (sum(v) / len(v), min(v), max(v)) if v else (None, None, None)
        label = "lone replica (compute-only run, rank 0)" if m == "compute" else parse_variant(m).label
        out.append(dict(method=m, label=label, seeds=n, val_mean=stats(vals)[0],
                        gap_mean=stats(gaps)[0], gap_min=stats(gaps)[1], gap_max=stats(gaps)[2],
                        ttt_speedup_mean=stats(speedups)[0], ttt_speedup_min=stats(speedups)[1],
                        ttt_speedup_max=stats(speedups)[2], reached=reached,
                        target=m != "compute" and any(by[(m, s)].target_loss is not None or m == BASELINE
                                                      for s in seeds if (m, s) in by)))
    return out


def seeds_table(rows: Sequence[dict]) -> str:
    head = ["method", "seeds", "val loss (mean)", "val vs ZeRO-1: mean", "range (min..max)",
            "time-to-target speedup: mean", "range", "reached target"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        gap = "" if r["gap_mean"] is None else f"{100 * r['gap_mean']:+.2f}%"
        rng = "" if r["gap_min"] is None else f"{100 * r['gap_min']:+.2f}% .. {100 * r['gap_max']:+.2f}%"
        spd = "" if r["ttt_speedup_mean"] is None else f"{r['ttt_speedup_mean']:.2f}x"
        srng = "" if r["ttt_speedup_min"] is None else f"{r['ttt_speedup_min']:.2f}x .. {r['ttt_speedup_max']:.2f}x"
        lines.append("| " + " | ".join([r["label"], str(r["seeds"]), _fmt(r["val_mean"], ".4f"), gap, rng, spd, srng,
                                        f"{r['reached']}/{r['seeds']}" if r["target"] else ""]) + " |")
    return "\n".join(lines)


TTT_NOTES = (
    "Time to target: every method trains with the same hyper-parameters and LR schedule (horizon --updates; "
    "beyond it the lr stays at its floor) until an evaluation of the fixed validation windows (every --eval-every "
    "updates, clock paused) is at or below the target, or --max-updates. updates/time to target: the first such "
    "evaluation; near the target (within 1.5 times the largest drop between two evaluations) every 2% of --updates "
    "(the resolution the table's heading states); speedup vs ZeRO-1: ZeRO-1's time to target over the method's.")

TABLE_NOTES = (
    "Equal samples for every method (same updates x global batch). wall = training only (after initialize and a "
    "barrier, slowest rank; paused only while the committed parameters are copied and evaluated, without waiting "
    "for the communication in flight, whose time during the pause stays on the clock: snapshot_s, eval_s and "
    "eval_comm_s in summary.csv, docs/bench.md \"The clock\"); x compute = wall / compute-only wall, the floor (same processes and batches, no "
    "communication). comm wait: the engine's measured time blocked on communication (mean over ranks); "
    "`~x*` = derived as wall - compute-only wall, for DeepSpeed's engine, which has no such counter. train loss: "
    "mean of the last 10% of updates over ranks; val loss: held-out files, after the last update (nats/byte, "
    "ppl = exp); val vs ZeRO-1: relative gap. comm: what one round moves per value, gradients/parameters (DeepSpeed "
    "communicates gradients in the model's dtype by default, and so does deepspeed_acco; CO2's round averages fp32 parameters), "
    "with DeepSpeed's gradient collective where it is not a reduce-scatter: all-reduce (its default) or reduce (to "
    "each partition's owner, ZeRO-1 best); a wire chosen from the link shows from when it ran (\"bf16/bf16 for 2 "
    "updates, then int4/int4\"; \"(chosen)\": before the first job).")


def write_steps_csv(path: str, results: Sequence[RunResult]) -> None:
    cols = ["bandwidth", "method", "seed", "rank", "update", "samples", "wall_s", "loss", "micro_batches",
            "comm_wait_s", "lr", "val_loss"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in results:
            if 0 in r.val:
                w.writerow(dict(bandwidth=r.bandwidth, method=r.method, seed=r.seed, rank=0, update=0, samples=0,
                                wall_s=0.0, val_loss=r.val[0]))
            for rank in sorted(r.rows):
                for row in r.rows[rank]:
                    out = dict(row, bandwidth=r.bandwidth, method=r.method, seed=r.seed, rank=rank)
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


def comm_round_seconds(n_params: int, world_size: int, link_bps: float, bytes_per_element: float = 4, *,
                       param_bytes: Optional[float] = None, nodes: int = 1) -> float:
    """Ideal time of one reduce-scatter of the gradients (``bytes_per_element`` per value) plus one
    all-gather of the parameters (``param_bytes``, default the same; an all-reduce moves the same
    volume) as a ring over the W ranks, each of which sends (W - 1) / W of the model per collective.

    ``nodes == 1``: every byte crosses one shared link of ``link_bps`` (the shaped loopback), (W - 1) P
    (b_g + b_p) bytes in all. ``nodes >= 2``: each node has its own full-duplex link of ``link_bps``
    per direction and its ranks are consecutive in the ring, so exactly one ring edge leaves each
    node and carries (W - 1) / W P (b_g + b_p) bytes; the nodes send at once. (A hierarchical
    algorithm that first reduces inside each node would need only (N - 1) / N of that per node.)"""
    volume = n_params * (bytes_per_element + (bytes_per_element if param_bytes is None else param_bytes))
    if nodes >= 2:
        return 8.0 * (world_size - 1) / world_size * volume / link_bps
    return 8.0 * (world_size - 1) * volume / link_bps


def method_comm_seconds(method: str, n_params: int, world_size: int, link_bps: float, precision: str,
                        nodes: int = 1, backend: str = "gloo") -> float:
    """:func:`comm_round_seconds` with the bytes ``method`` (a variant) moves: its bytes per value times
    the passes it makes over the model (:meth:`methods.Variant.comm_passes`): our engine reduce-scatters
    the gradients and gathers the parameters (1 + 1); DeepSpeed's ZeRO-1 at its default config
    all-reduces the gradients (2 + 1), at its best reduces each partition to its owner ((W + 1) / W + 1
    on gloo); its stage 0 all-reduces only (2 + 0)."""
    variant = parse_variant(method)
    grad, param = variant.comm_bytes(precision)
    grad_passes, param_passes = variant.comm_passes(world_size, backend)
    return comm_round_seconds(n_params, world_size, link_bps, grad * grad_passes, param_bytes=param * param_passes,
                              nodes=nodes)


def probe_round_seconds(probe: dict, method: str, precision: str) -> Optional[float]:
    """The round of ``method`` as timed by :mod:`.commprobe` on the link, or None where not timed:
    DeepSpeed on gloo all-reduces the gradients (ZeRO-1 then all-gathers the parameters); our
    engine runs its own round (ring reduce-scatter + all-gather) in the method's dtypes."""
    grad, param = parse_variant(method).comm_bytes(precision)
    base = parse_variant(method).method
    fp32, model = 4.0, (2.0 if precision == "bf16" else 4.0)
    if not base.ours and base.gradient_collective != "all_reduce":
        return None  # the probe times no reduce to each partition's owner
    if base.ours:
        key = {(fp32, fp32): "engine_round_s", (fp32, 2.0): "engine_round_model_dtype_s",
               (2.0, 2.0): "engine_round_bf16comm_s"}.get((grad, param))
        return probe.get(key) if key else None
    suffix = {fp32: "_s", 2.0: "_model_dtype_s"}
    if grad not in suffix or param not in suffix or (2.0 in (grad, param) and model != 2.0):
        return None
    all_reduce = probe.get("all_reduce" + suffix[grad])
    if base.name == "zero0":
        return all_reduce
    all_gather = probe.get("all_gather" + suffix[param])
    return None if all_reduce is None or all_gather is None else all_reduce + all_gather


def probe_round_bits(method: str, n_params: int, world_size: int, precision: str, nodes: int = 1) -> float:
    """Ideal volume (bits through the busiest link, as :func:`comm_round_seconds` counts it) of the
    collectives :func:`probe_round_seconds` times for ``method``: those the method runs, so what
    :func:`method_comm_seconds` counts (DeepSpeed's default ZeRO-1 on gloo: an all-reduce of the
    gradients, twice a reduce-scatter's volume, plus an all-gather of the parameters)."""
    return method_comm_seconds(method, n_params, world_size, 1.0, precision, nodes)


def wire_comm_bytes(method: str, wire: str, precision: str) -> tuple:
    """Bytes per value of (gradient reduce-scatter, parameter all-gather) for our ``method`` on ``wire``
    (runtime/wire.py): a compressed wire's blocks both ways; a dtype for the gradients with the model's
    dtype for the parameters (CO2 averages and gathers fp32 parameters, or the dtype named)."""
    from deepspeed_acco.runtime.regime import COMPRESSED_BITS, quantized_bytes
    if wire in COMPRESSED_BITS:
        q = quantized_bytes(COMPRESSED_BITS[wire])
        return q, q
    dtype = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}[wire]
    if parse_variant(method).method.name == "co2":
        return dtype, 4.0
    return dtype, (2.0 if precision == "bf16" else 4.0)


def co2_local_steps(method: str, local_steps: Optional[int] = None) -> int:
    """CO2's tau for ``method``: its modifiers, else --local-steps, else the engine's default."""
    from deepspeed_acco.runtime.optimizers.co2 import CO2Params
    for m in parse_variant(method).modifiers:
        if "local_steps" in m.config.get("optimizer", {}).get("params", {}):
            return int(m.config["optimizer"]["params"]["local_steps"])
    return int(local_steps) if local_steps is not None else int(CO2Params.local_steps)


def bound_seconds(method: str, t_compute: float, t_comm: float, local_steps: Optional[int] = None,
                  gap_penalty=None, *, sync_updates: int = 0, updates: int = 0, t_comm_after: Optional[float] = None,
                  switch_update: Optional[int] = None) -> Optional[float]:
    """Lower bound on the mean per-update time (docs/wire.md, "Where the time goes"), T_comm being one
    job of the method: DPU max(T_compute, T_comm), ACCO max(T_compute, 2 T_comm), CO2 T_compute +
    max(0, T_comm - H T_compute) / tau (its averaging, once every tau = local_steps inner steps, may take
    H of them: :func:`methods.co2_overlap_steps`), synchronous methods T_compute + T_comm (for
    DeepSpeed's, ``t_comm`` already counts its passes). The first ``sync_updates`` of ``updates``
    (``warmup_sync_updates``) pay T_compute + T_comm; from ``switch_update`` on (a wire chosen during
    the run) T_comm is ``t_comm_after``."""
    variant = None if method == "compute" else parse_variant(method)
    spec = METHODS["compute"] if variant is None else variant.method
    if spec.optimizer is None:
        return t_compute
    if not spec.overlapped:
        return t_compute + t_comm

    def overlapped(comm: float) -> float:
        if spec.name == "co2":
            hide = max(co2_overlap_steps(method, local_steps, gap_penalty), 1)
            return t_compute + max(0.0, comm - hide * t_compute) / max(1, co2_local_steps(method, local_steps))
        return max(t_compute, spec.comm_jobs * comm)

    if updates <= 0:
        return overlapped(t_comm if t_comm_after is None else t_comm_after)
    total = 0.0
    for update in range(updates):
        comm = t_comm_after if t_comm_after is not None and switch_update is not None and update >= switch_update \
            else t_comm
        total += t_compute + comm if update < sync_updates else overlapped(comm)
    return total / updates


def factor_rows(rows: Sequence[dict]) -> List[dict]:
    """Where each method's speed comes from: its speedup over DeepSpeed ZeRO-1 (default, and at its best
    where it ran) split into our engine's part (ShardedAdamW over DeepSpeed ZeRO-1: bytes and overhead,
    no overlap) and the overlap's part (the method over ShardedAdamW), per update and to the target."""
    by = {r["method"]: r for r in rows}
    base, best, sharded = by.get(BASELINE), by.get("zero1best"), by.get("sharded")
    out = []
    for r in rows:
        if r["method"] in ("compute", BASELINE) or not parse_variant(r["method"]).method.ours:
            continue  # DeepSpeed's own runs are the baselines, not factored

        def ratio(a, b, key):
            x, y = (a or {}).get(key), (b or {}).get(key)
            return x / y if x and y else None
        out.append(dict(label=r["label"], method=r["method"],
                        per_update=ratio(base, r, "ms_per_update"), per_update_best=ratio(best, r, "ms_per_update"),
                        engine=ratio(base, sharded, "ms_per_update"), overlap=ratio(sharded, r, "ms_per_update"),
                        to_target=ratio(base, r, "time_to_target_s"),
                        to_target_best=ratio(best, r, "time_to_target_s"),
                        engine_to_target=ratio(base, sharded, "time_to_target_s"),
                        overlap_to_target=ratio(sharded, r, "time_to_target_s")))
    return out


def factor_table(rows: Sequence[dict]) -> str:
    """:func:`factor_rows` as Markdown: speedup = engine x overlap, per update and to the target."""
    head = ["method", "per update vs DeepSpeed ZeRO-1 (best)", "= our engine (ShardedAdamW vs ZeRO-1)",
            "x the overlap (vs ShardedAdamW)", "to target vs ZeRO-1 (best)", "= engine", "x overlap"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]

    def x(value):
        return "" if value is None else f"{value:.2f}x"
    for f in factor_rows(rows):
        lines.append("| " + " | ".join([
            f["label"], x(f["per_update"]) + (f" ({x(f['per_update_best'])})" if f["per_update_best"] else ""),
            x(f["engine"]), x(f["overlap"]),
            x(f["to_target"]) + (f" ({x(f['to_target_best'])})" if f["to_target_best"] else ""),
            x(f["engine_to_target"]), x(f["overlap_to_target"])]) + " |")
    return "\n".join(lines)


def wire_lines(rows: Sequence[dict]) -> List[str]:
    """The wire each of our methods ran on, and why (an automatic choice, or fixed by its config)."""
    lines = []
    for r in rows:
        wire = r.get("wire")
        if not wire:
            continue
        if wire.get("before_first_job"):
            text = (f"{wire['wire']} from its first job on (chosen at update {wire['from_update']}, before that "
                    f"job: {wire.get('reason')})")
        elif wire.get("from_update") is not None and wire["wire"] != wire.get("start"):
            text = (f"{wire['start']} for its first {wire['from_update']} updates, then {wire['wire']} (chosen: "
                    f"{wire.get('reason')})")
        elif wire.get("from_update") is not None:
            text = f"{wire['wire']} throughout (chosen at update {wire['from_update']}: {wire.get('reason')})"
        else:
            text = f"{wire['wire']} throughout (fixed by its config)"
        lines.append(f"- {r['label']}: {text}.")
    return ["Wires (docs/wire.md, \"The wire\"):"] + lines if lines else []


# ----------------------------------------------------------------------------------------------
# Plots


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


_COLORS = {"compute": "0.6", "zero1": "tab:red", "zero1best": "tab:pink", "zero0": "tab:orange",
           "sharded": "tab:purple", "dpu": "tab:green", "acco": "tab:blue", "co2": "tab:brown"}
_MODIFIER_LINES = ["--", "-.", ":"]


def _style(method: str):
    """Colour by method; solid without modifiers, else a line style per set of modifiers."""
    if method == "compute":
        return _COLORS["compute"], ":"
    from ..workload.methods import MODIFIERS
    variant = parse_variant(method)
    if not variant.modifiers:
        return _COLORS.get(variant.method.name), "-"
    index = sum(list(MODIFIERS).index(m.name) + 1 for m in variant.modifiers) - 1
    return _COLORS.get(variant.method.name), _MODIFIER_LINES[index % len(_MODIFIER_LINES)]


def plot_val_vs_wall(path: str, results: Sequence[RunResult], title: str, target: Optional[float] = None) -> None:
    """Validation loss against training wall-clock, every evaluation; with ``target``, the target
    loss as a horizontal line, a star where each method first reached it, and a second panel
    zoomed on the losses near the target."""
    plt = _plt()
    panels = 2 if target is not None else 1
    fig, axes = plt.subplots(1, panels, figsize=(7 + 4 * (panels - 1), 4.5), squeeze=False)
    axes = axes[0]
    lowest = []
    for r in results:
        if r.method == "compute" or not r.val:
            continue
        color, ls = _style(r.method)
        pts = sorted((r.wall_at(u), v) for u, v in r.val.items())
        lowest.append(min(v for _, v in pts))
        ttt = r.reached_wall_s if target is not None else None
        note = f"target at {ttt:.1f} s" if ttt is not None else ("target not reached" if target is not None
                                                                 else f"{r.wall_s:.0f} s")
        for i, ax in enumerate(axes):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, color=color, ls=ls,
                    label=f"{r.label} ({note})" if i == 0 else None)
            if ttt is not None and r.reached_update in r.val:
                ax.plot([ttt], [r.val[r.reached_update]], marker="*", ms=12, color=color, ls="none")
    if target is not None:
        for i, ax in enumerate(axes):
            ax.axhline(target, color="0.3", lw=1, ls="--", label=f"target {target:.4f}" if i == 0 else None)
        if lowest:
            low = min(min(lowest), target)
            axes[1].set_ylim(low - 0.02 * abs(target), target + 0.08 * abs(target))
            axes[1].set_title("near the target", fontsize=9)
    for ax in axes:
        ax.set_xlabel("training wall-clock (s, evaluation excluded)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (nats/byte)")
    fig.suptitle(title, fontsize=9)
    fig.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 0.92))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
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
        color, _ = _style(r.method)
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


def plot_speedup_vs_bandwidth(path: str, points: Sequence[dict], title: str,
                              xlabel: str = "measured link rate (Mbit/s)") -> None:
    """``points``: dicts with method, link_bps, speedup, bound_speedup."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in list(dict.fromkeys(p["method"] for p in points)):
        pts = sorted((p for p in points if p["method"] == method), key=lambda p: p["link_bps"])
        color, ls = _style(method)
        variant = parse_variant(method)
        xs = [p["link_bps"] / 1e6 for p in pts]
        ax.plot(xs, [p["speedup"] for p in pts], marker="o", color=color, ls=ls, label=f"{variant.label} measured")
        if variant.method.overlapped and all(p.get("bound_speedup") for p in pts):
            ax.plot(xs, [p["bound_speedup"] for p in pts], ls=(0, (2, 2)), color=color, alpha=0.7,
                    label=f"{variant.label} bound")
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set_xscale("log")
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    ticks = sorted({p["link_bps"] / 1e6 for p in points})
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:.0f}"))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("speedup vs DeepSpeed ZeRO-1 (equal samples)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
