"""Where each method's update goes, per rank, and one rank's timeline (docs/bench.md, "Where the time
goes").

Every training job of the bench measures, between the start of its clock and the equal-samples
point, the training thread's time in five parts:

* ``compute``: forward and backward passes;
* ``blocked``: waiting for communication;
* ``optimizer``: the optimizer step while the training thread waits for it;
* ``boundary``: the rest of the work at an update's boundary;
* ``rest``: everything else (the bench's own loop: batches, losses, logging), measured as the time
  outside the engine's calls; what no part accounts for is ``unattributed``, reported, and small.

Who measures what: our engine counts compute, blocked, optimizer and boundary itself
(``engine.time_breakdown()``, runtime/timeline.py). DeepSpeed's engine has no such counters, so the
bench times its calls from outside and wraps three of its internals in this process only: the
gradient all-reduce of ``backward`` (``DeepSpeedEngine.allreduce_gradients``: blocked), the base
optimizer's step inside ZeRO's ``step`` (``_optimizer_step``: optimizer) and the all-gather of the
updated partitions (``all_gather_dp_groups``: blocked); the rest of its ``backward`` is compute and
of its ``step`` boundary. The compute-only run's step is its optimizer.

With ``--trace``, rank 0 records the last updates before the equal-samples point: the bench's loop,
the engine's boundaries and waits and each communication job's phases, written as a Chrome/Perfetto
trace (runtime/timeline.py, :func:`~deepspeed_acco.runtime.timeline.chrome_trace`).
"""
import contextlib
import time
from typing import Dict, List, Optional

from ...runtime.timeline import Timeline, chrome_trace

PARTS = ("compute", "blocked", "optimizer", "boundary", "rest")
"""The parts of an update, in report order."""

TRACE_UPDATES = 4
"""Updates a ``--trace`` records on rank 0 (the last ones before the equal-samples point)."""


class _Counter:
    """Seconds spent in a wrapped callable (and its events on a timeline while recording)."""

    def __init__(self, function, name: str, timeline: Timeline):
        self.function, self.name, self.timeline, self.seconds = function, name, timeline, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.function(*args, **kwargs)
        finally:
            end = time.perf_counter()
            self.seconds += end - start
            self.timeline.add(Timeline.TRAINING, self.name, start, end)


class LoopClock:
    """The bench's side of the breakdown: times the engine's calls and what happens outside them.

    ``with clock.call("forward"): ...`` around each engine call; ``clock.parts()`` gives the
    cumulative parts of :data:`PARTS` (``rest`` included, ``unattributed`` aside) from the engine's own
    counters or, for DeepSpeed's engine and the compute-only run, from the bench's measurements.
    """

    def __init__(self, engine, kind: str):
        self.engine, self.kind = engine, kind
        self.calls: Dict[str, float] = {"forward": 0.0, "backward": 0.0, "step": 0.0, "slow": 0.0, "debt": 0.0}
        """Seconds in the engine's calls, in ``--slow-rank``'s sleep (compute of a slower device) and in
        the wait for a job that ran through an evaluation pause (communication; train.py's clock)."""
        self.timeline = Timeline()
        self._wrapped: Dict[str, _Counter] = {}
        if kind == "deepspeed":
            self._wrap_deepspeed()

    # ---- DeepSpeed's engine: three internals timed in this process -----------------------------
    def _wrap_deepspeed(self) -> None:
        engine = self.engine
        self._wrapped["allreduce"] = _Counter(engine.allreduce_gradients, "gradient all-reduce", self.timeline)
        engine.allreduce_gradients = self._wrapped["allreduce"]
        zero = getattr(engine, "optimizer", None)
        if zero is not None and hasattr(zero, "_optimizer_step"):
            self._wrapped["optimizer"] = _Counter(zero._optimizer_step, "optimizer step", self.timeline)
            zero._optimizer_step = self._wrapped["optimizer"]
        try:
            from deepspeed.runtime.zero import stage_1_and_2
        except ImportError:  # pragma: no cover - DeepSpeed always has it
            return
        self._wrapped["all_gather"] = _Counter(stage_1_and_2.all_gather_dp_groups, "parameter all-gather",
                                               self.timeline)
        stage_1_and_2.all_gather_dp_groups = self._wrapped["all_gather"]

    def _wrapped_s(self, name: str) -> float:
        counter = self._wrapped.get(name)
        return counter.seconds if counter is not None else 0.0

    # ---- measuring ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def call(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, start, time.perf_counter())

    def record(self, name: str, start: float, end: float, label: Optional[str] = None) -> None:
        """Count ``end - start`` seconds as part ``name`` (measured after the fact), with its span on
        the bench loop's track (``label``, default ``name``)."""
        self.calls[name] += end - start
        self.timeline.add("bench loop", label or name, start, end)

    def start_trace(self) -> None:
        self.timeline.start()
        engine_timeline = getattr(self.engine, "timeline", None)
        if isinstance(engine_timeline, Timeline):
            engine_timeline.start()

    def trace(self, process_name: str) -> Dict:
        """The recorded events (the bench's, and the engine's for our engines) as a Chrome trace."""
        events = self.timeline.events()
        engine_timeline = getattr(self.engine, "timeline", None)
        if isinstance(engine_timeline, Timeline):
            events += engine_timeline.events()
        events.sort(key=lambda event: event[2])
        return chrome_trace(events, process_name=process_name)

    def parts(self, loop_s: float) -> Dict[str, float]:
        """Cumulative seconds per part after ``loop_s`` seconds of training (the clock's time, pauses
        excluded); ``rest`` is the loop's time outside the engine's calls, and ``unattributed`` what
        the engine's calls took beyond the parts measured inside them."""
        calls = self.calls
        inside = sum(calls.values())
        if self.kind == "ours":
            measured = self.engine.time_breakdown()
            parts = {name: float(measured.get(name, 0.0)) for name in PARTS if name != "rest"}
        elif self.kind == "deepspeed":
            allreduce, gather = self._wrapped_s("allreduce"), self._wrapped_s("all_gather")
            optimizer = self._wrapped_s("optimizer")
            parts = dict(compute=calls["forward"] + calls["backward"] - allreduce,
                         blocked=allreduce + gather, optimizer=optimizer,
                         boundary=max(0.0, calls["step"] - optimizer - gather))
        else:  # the compute-only floor: its step is the optimizer
            parts = dict(compute=calls["forward"] + calls["backward"], blocked=0.0, optimizer=calls["step"],
                         boundary=0.0)
        parts["compute"] += calls["slow"]
        parts["blocked"] += calls["debt"]
        parts["rest"] = max(0.0, loop_s - inside)
        parts["unattributed"] = loop_s - sum(parts[name] for name in PARTS)
        return parts

    def job_phases(self) -> Dict[str, float]:
        """Our engine's summed job phases (``job_<phase>_s``), the job count and summed job time."""
        if self.kind != "ours":
            return {}
        return {key: value for key, value in self.engine.time_breakdown().items()
                if key.startswith("job") or key == "jobs"}


def engine_kind(engine) -> str:
    """``ours`` (our engine's counters), ``deepspeed`` (DeepSpeed's engine) or ``compute``."""
    if callable(getattr(engine, "time_breakdown", None)):
        return "ours"
    if hasattr(engine, "allreduce_gradients"):
        return "deepspeed"
    return "compute"


def per_update_ms(parts: Dict[str, float], updates: int) -> Dict[str, float]:
    """Cumulative seconds -> milliseconds per update."""
    return {name: 1e3 * seconds / max(1, updates) for name, seconds in parts.items()}


def job_summary_ms(phases: Dict[str, float]) -> Optional[Dict[str, float]]:
    """Milliseconds per job of each phase, of the whole job (submission to its last phase) and the
    worker's CPU time, from :meth:`LoopClock.job_phases`; None without jobs."""
    jobs = int(phases.get("jobs", 0))
    if jobs <= 0:
        return None
    summary = {key[len("job_"):-len("_s")]: 1e3 * value / jobs for key, value in phases.items()
               if key.startswith("job_") and key.endswith("_s") and key != "job_s"}
    summary["total"] = 1e3 * phases.get("job_s", 0.0) / jobs
    summary["jobs"] = jobs
    return summary


def rank_rows(summaries: List[dict]) -> List[dict]:
    """One row per rank with its per-update parts (for the report's breakdown table)."""
    rows = []
    for summary in sorted(summaries, key=lambda s: s.get("rank", 0)):
        breakdown = summary.get("breakdown_ms")
        if breakdown:
            rows.append(dict(rank=summary.get("rank", 0), **breakdown))
    return rows


JOB_PHASES = ("reduce_scatter", "norm", "all_reduce", "update", "all_gather")
"""The phases of a shard-update job, in the order a job runs them (runtime/jobs.py)."""


def breakdown_lines(rows: List[dict]) -> List[str]:
    """The report's "where the time goes" section: per method and rank, milliseconds per update in
    each part, and per method the communication jobs' phases and how much of them was hidden."""
    rows = [r for r in rows if r.get("breakdown")]
    if not rows:
        return []
    lines = ["", "### Where the time goes: ms per update, per rank (docs/bench.md, \"Where the time goes\")", "",
             "| method | rank | " + " | ".join(PARTS) + " | sum | measured | unattributed |",
             "|---|---:|" + "---:|" * (len(PARTS) + 3)]
    for r in rows:
        for part in r["breakdown"]:
            total = sum(part.get(name, 0.0) for name in PARTS)
            lines.append(f"| {r['label']} | {part['rank']} | " + " | ".join(f"{part.get(name, 0.0):.0f}" for name in PARTS)
                         + f" | {total:.0f} | {r['ms_per_update']:.0f} | {part.get('unattributed', 0.0):+.0f} |")
    lines.append("")
    lines.append("compute: forward + backward; blocked: waiting for communication; optimizer: the optimizer step while "
                 "the training thread waits for it; boundary: the rest of an update's boundary; rest: the bench's loop "
                 "outside the engine (batches, losses, logging). measured: the table's ms/update (the slowest rank's "
                 "wall-clock); unattributed: a rank's wall-clock minus its parts.")
    for r in rows:
        job = r.get("job_ms")
        if not job:
            continue
        jobs_per_update = job["jobs"] / max(1, r["updates"])
        phases = ", ".join(f"{name} {job[name]:.1f}" for name in JOB_PHASES if name in job)
        rank0 = r["breakdown"][0]
        waited = rank0.get("blocked", 0.0) + rank0.get("optimizer", 0.0)
        job_per_update = job["total"] * jobs_per_update
        hidden = 1.0 - waited / job_per_update if job_per_update > 0 else 0.0
        lines.append(f"- {r['label']} jobs (rank 0): {jobs_per_update:.2f} per update, each {job['total']:.0f} ms "
                     f"from launch to its last phase ({phases} ms; the worker's CPU "
                     f"{job.get('worker_cpu', 0.0):.1f} ms); the training thread waited {waited:.0f} ms per update: "
                     f"{max(0.0, hidden):.0%} of the jobs' time hidden behind compute.")
    return lines


_TRACK_ORDER = ("bench loop", "training thread", "communication job")
_COLOURS = {"forward": "tab:blue", "backward": "tab:cyan", "boundary": "tab:orange", "reduce_scatter": "tab:red",
            "all_gather": "tab:purple", "all_reduce": "tab:pink", "norm": "tab:gray", "update": "tab:green",
            "debt": "black", "gradient all-reduce": "tab:red", "parameter all-gather": "tab:purple",
            "optimizer step": "tab:green"}


def plot_timeline(trace_path: str, png_path: str, title: str) -> None:
    """Draw a ``--trace`` file: one row per track, a bar per event, waits hatched, pauses grey."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    engine_track = any(e["ph"] == "X" and e["name"] == "forward" and names.get(e["tid"]) == "training thread"
                       for e in events)

    def shown(e) -> bool:  # the bench loop's calls only where the engine has no track of its own
        return e["ph"] == "X" and not (engine_track and names.get(e["tid"]) == "bench loop"
                                       and e["name"] in ("forward", "backward", "step"))

    drawn = [e for e in events if shown(e)]
    tracks = [track for track in _TRACK_ORDER if any(names.get(e["tid"]) == track for e in drawn)]
    rows = {track: len(tracks) - 1 - index for index, track in enumerate(tracks)}
    fig, ax = plt.subplots(figsize=(12, 0.8 * len(tracks) + 1.6))
    used = {}
    for e in drawn:
        if names.get(e["tid"]) not in rows:
            continue
        name, start, width = e["name"], e["ts"] / 1e3, e["dur"] / 1e3
        if name.startswith("wait"):
            colour, hatch, label = "white", "////", "wait (blocked / optimizer)"
        elif "paused" in name:
            colour, hatch, label = "0.85", None, "clock paused"
        else:
            colour, hatch, label = _COLOURS.get(name, "0.5"), None, name
        ax.broken_barh([(start, max(width, 0.2))], (rows[names[e["tid"]]] - 0.35, 0.7), facecolors=colour,
                       edgecolor="0.3", linewidth=0.3, hatch=hatch)
        used.setdefault(label, (colour, hatch))
    ax.set_yticks(list(rows.values()))
    ax.set_yticklabels(list(rows))
    ax.set_xlabel("ms (rank 0)")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(facecolor=c, hatch=h, edgecolor="0.3", label=label) for label, (c, h) in used.items()],
              loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=6, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
