"""The bench's breakdown of an update and its timeline picture (docs/bench.md, "Where the time goes"):
the parts from each kind of engine, the per-update and per-job figures, the report's lines and the
drawing of a trace. No processes; tests/test_bench_clock.py checks the same on real runs."""
import pytest

from deepspeed_acco.bench.reporting.breakdown import (LoopClock, breakdown_lines, engine_kind, job_summary_ms,
                                                      per_update_ms, plot_timeline)
from deepspeed_acco.runtime.timeline import Timeline, chrome_trace


class _Ours:
    def __init__(self):
        self.timeline = Timeline()

    def time_breakdown(self):
        return {"compute": 8.0, "blocked": 1.0, "optimizer": 0.5, "boundary": 0.2, "jobs": 20, "job_s": 3.0,
                "job_update_s": 0.1, "job_worker_cpu_s": 0.2}


class _DeepSpeedLike:
    def __init__(self):
        self.allreduce_gradients = lambda: None


def test_parts_of_our_engine_and_of_the_compute_only_run_add_up_to_the_loop():
    ours = LoopClock(_Ours(), engine_kind(_Ours()))
    assert ours.kind == "ours"
    ours.calls.update(forward=4.0, backward=4.5, step=1.6, debt=0.3)
    parts = ours.parts(loop_s=11.0)
    assert parts["compute"] == 8.0 and parts["blocked"] == pytest.approx(1.3)  # the debt is blocked time
    assert parts["rest"] == pytest.approx(11.0 - 10.4)
    assert parts["unattributed"] == pytest.approx(11.0 - (8.0 + 1.3 + 0.5 + 0.2 + 0.6))
    compute = LoopClock(object(), "compute")
    compute.calls.update(forward=3.0, backward=5.0, step=1.0, slow=2.0)
    parts = compute.parts(loop_s=11.5)
    assert parts["compute"] == 10.0 and parts["optimizer"] == 1.0 and parts["rest"] == pytest.approx(0.5)
    assert parts["unattributed"] == pytest.approx(0.0)
    assert engine_kind(_DeepSpeedLike()) == "deepspeed"


def test_per_update_and_per_job_figures_and_the_report_lines():
    assert per_update_ms({"compute": 2.0}, 4) == {"compute": 500.0}
    jobs = job_summary_ms(LoopClock(_Ours(), "ours").job_phases())
    assert jobs["jobs"] == 20 and jobs["total"] == pytest.approx(150.0) and jobs["update"] == pytest.approx(5.0)
    assert job_summary_ms({}) is None
    row = dict(label="ACCO", updates=10, ms_per_update=1100.0, job_ms=jobs,
               breakdown=[dict(rank=0, compute=800.0, blocked=100.0, optimizer=50.0, boundary=20.0, rest=60.0,
                               unattributed=70.0)])
    lines = breakdown_lines([row])
    assert "| ACCO | 0 | 800 | 100 | 50 | 20 | 60 | 1030 | 1100 | +70 |" in lines
    # 2 jobs of 150 ms per update; the training thread waited 150 of those 300 ms.
    assert any("2.00 per update" in line and "50% of the jobs' time hidden" in line for line in lines), lines
    assert breakdown_lines([dict(row, breakdown=[])]) == []


def test_a_trace_is_drawn_with_a_row_per_track(tmp_path):
    import json
    events = [(Timeline.TRAINING, "forward", 0.0, 0.1, {}), (Timeline.TRAINING, "wait: commit of update 1", 0.1, 0.15, {}),
              (Timeline.COMMUNICATION, "reduce_scatter", 0.02, 0.08, {}), ("bench loop", "forward", 0.0, 0.1, {}),
              ("bench loop", "evaluation (clock paused)", 0.2, 0.3, {})]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(chrome_trace(events, process_name="rank 0")))
    plot_timeline(str(path), str(tmp_path / "timeline.png"), "a test")
    assert (tmp_path / "timeline.png").stat().st_size > 1000
