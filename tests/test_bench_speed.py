"""Where a figure's speed comes from (docs/bench.md): time to target at 2% resolution (the evaluation grid
goes dense near the target, early enough that the next grid interval cannot jump past it unseen), the
speedup over DeepSpeed ZeRO-1 split into our engine's part and the overlap's, each method's bound on
the wire its engine chose, and the report's line on that wire."""
import pytest

from deepspeed_acco.bench.reporting.report import MIN_TARGET_MARGIN
from deepspeed_acco.bench.running.train import TargetWatch, is_eval_update


def _crossing(losses, target, eval_every, updates):
    """The first update at which a run with these per-update losses is seen at or below ``target``."""
    watch = TargetWatch(target, updates)
    watch.on_grid(losses[0])
    for update in range(1, len(losses)):
        on_grid = is_eval_update(update, eval_every, updates)
        if on_grid or watch.evaluate_now(update, False):
            if on_grid:
                watch.on_grid(losses[update])
            if losses[update] <= target:
                return update, watch
    return None, watch


def test_dense_evaluation_finds_the_crossing_to_the_update():
    # A loss falling 1% per update from 3.0; the target lies between grid points 50 and 55.
    losses = [3.0 * 0.99 ** u for u in range(160)]
    target = losses[52] * 1.001  # first reached at update 52
    update, watch = _crossing(losses, target, eval_every=5, updates=50)
    assert watch.every == 1 and update == 52  # the grid alone would say 55: 10% late
    # A run that never nears the target stays on the grid.
    flat = [3.0] * 60
    update, watch = _crossing(flat, 2.0, eval_every=5, updates=50)
    assert update is None and not watch.dense


def test_resolution_is_two_percent_of_the_updates_and_the_margin_follows_the_drops():
    assert TargetWatch(1.0, 240).every == 4 and TargetWatch(1.0, 50).every == 1
    watch = TargetWatch(2.0, 240)
    watch.on_grid(2.2)
    assert not watch.dense
    watch.on_grid(2.1)  # dropped 4.5% in one grid interval: dense from within 6.8% of the target
    assert watch.dense and watch.largest_drop > 0.04
    slow = TargetWatch(2.0, 240)
    slow.on_grid(2.0 * (1 + 2 * MIN_TARGET_MARGIN))
    assert not slow.dense  # no drop seen yet: only within the minimum margin
    assert not TargetWatch(None, 50).evaluate_now(10, False)


def test_bounds_follow_the_wire_chosen_during_the_run_and_co2_pays_once_per_round():
    from deepspeed_acco.bench.reporting.report import bound_seconds, wire_comm_bytes
    # ACCO: 8 synchronous updates of 10, bf16 jobs of 0.3 s until update 5, then int8 jobs of 0.1 s.
    b = bound_seconds("acco", 0.4, 0.3, sync_updates=8, updates=10, switch_update=5, t_comm_after=0.1)
    assert b == pytest.approx((5 * 0.7 + 3 * 0.5 + 2 * 0.4) / 10)
    assert bound_seconds("acco", 0.4, 0.3) == pytest.approx(0.6)
    # CO2 (local_steps 4, eager: 1 inner step to hide in): T_compute + max(0, T_job - T_compute) / 4.
    assert bound_seconds("co2", 0.4, 2.0) == pytest.approx(0.4 + 1.6 / 4)
    assert bound_seconds("co2", 0.4, 0.3) == pytest.approx(0.4)
    assert bound_seconds("co2", 0.4, 2.0, local_steps=8) == pytest.approx(0.4 + 1.6 / 8)
    assert wire_comm_bytes("acco", "int8", "bf16") == (pytest.approx(1 + 4 / 128),) * 2
    assert wire_comm_bytes("acco", "bf16", "bf16") == (2.0, 2.0)
    assert wire_comm_bytes("co2", "fp32", "bf16") == (4.0, 4.0)
    # A wire chosen before the first job (CO2's probe of the link) bounds the whole run; one chosen
    # after jobs ran switches at its update.
    from types import SimpleNamespace
    from deepspeed_acco.bench.reporting.summary import _run_comm
    args = SimpleNamespace(precision="bf16")
    row = dict(method="co2", updates=50, wire={"start": "fp32", "wire": "int4", "from_update": 4,
                                               "before_first_job": True})
    t_comm, sync = _run_comm(args, row, 3_000_000, 2, 30e6, 2)
    int4 = wire_comm_bytes("co2", "int4", "bf16")
    assert t_comm == pytest.approx(2 * 0.5 * 3e6 * int4[0] * 8 / 30e6) and sync["switch_update"] == 0
    row["wire"]["before_first_job"] = False
    t_fp32, sync = _run_comm(args, row, 3_000_000, 2, 30e6, 2)
    assert t_fp32 == pytest.approx(t_comm * 4.0 / int4[0]) and sync["switch_update"] == 4


def test_reports_say_which_runs_carried_a_whole_drain_as_each_rank_s_deadline():
    """docs/bench.md, "The clock": runs timed before the ranks shared one deadline after an evaluation
    are named under the tables; runs without a job in flight at evaluations, or on one rank, are not."""
    from deepspeed_acco.bench.reporting.report import RunResult
    from deepspeed_acco.bench.reporting.summary import _noise_lines

    def run(method, summaries):
        result = RunResult(method=method, bandwidth="30 Mbit/s", bps=30e6, rows={}, summaries=dict(enumerate(summaries)))
        return dict(label=result.label, other_load_cores=0.0, deadline_per_rank=result.deadline_per_rank)

    before = {"eval_comm_s": 3.0, "process_wall_s": 1.0}
    now = dict(before, eval_peer_wait_s=0.2)
    rows = [run("co2", [before, before]), run("acco", [now, now]), run("zero1", [{"eval_comm_s": 0.0}] * 2),
            run("sharded", [before])]
    assert [r["deadline_per_rank"] for r in rows] == [True, False, False, False]
    note = [line for line in _noise_lines(rows) if "2026-12-06" in line]
    assert len(note) == 1 and note[0].startswith("NOTE: CO2 timed before 2026-12-06"), note


def _row(method, ms, ttt=None, wire=None):
    from deepspeed_acco.bench.workload.methods import parse_variant
    return dict(method=method, label=parse_variant(method).label, ms_per_update=ms, time_to_target_s=ttt, wire=wire)


def test_the_speedup_over_deepspeed_is_our_engine_times_the_overlap():
    from deepspeed_acco.bench.reporting.report import factor_rows, factor_table, wire_lines
    rows = [_row("zero1", 720.0, 36.0), _row("sharded", 589.0, 29.5), _row("acco", 503.0, 27.0),
            _row("co2", 420.0, None)]
    factors = {f["method"]: f for f in factor_rows(rows)}
    acco = factors["acco"]
    assert acco["per_update"] == pytest.approx(720 / 503)
    assert acco["per_update"] == pytest.approx(acco["engine"] * acco["overlap"])
    assert acco["engine"] == pytest.approx(720 / 589) and acco["overlap"] == pytest.approx(589 / 503)
    assert acco["to_target"] == pytest.approx(acco["engine_to_target"] * acco["overlap_to_target"])
    assert factors["co2"]["to_target"] is None and "sharded" in factors and "zero1" not in factors
    table = factor_table(rows)
    assert "| ACCO | 1.43x | 1.22x | 1.17x | 1.33x | 1.22x | 1.09x |" in table
    rows[1]["wire"] = {"start": "bf16", "wire": "bf16", "from_update": None}
    rows[2]["wire"] = {"start": "bf16", "wire": "int8", "from_update": 5, "reason": "r"}
    lines = wire_lines(rows)
    assert "- ShardedAdamW: bf16 throughout (fixed by its config)." in lines
    assert "- ACCO: bf16 for its first 5 updates, then int8 (chosen: r)." in lines
    rows[3]["wire"] = {"start": "fp32", "wire": "int4", "from_update": 4, "reason": "r", "before_first_job": True}
    assert "- CO2: int4 from its first job on (chosen at update 4, before that job: r)." in wire_lines(rows)
