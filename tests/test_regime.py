"""Where the time goes and the regime a job is in (docs/design.md, "Where the time goes"; test plan layers 1 and
2): a wait split by the job's phases, the regime's predictions from the bounds on a fake clock, when the engine
logs it, and the breakdown a schedule counts on a communicator that takes known time."""
import time

import pytest
import torch

from deepspeed_acco.runtime.regime import REGIME_UPDATES, RegimeMonitor, int8_bytes, measure, predict
from deepspeed_acco.runtime.timeline import TimeBreakdown, Timeline, chrome_trace, split_wait
from test_schedule import Harness, RecordingCommunicator


def test_a_wait_is_split_by_the_jobs_update_phase():
    spans = [("reduce_scatter", 0.0, 1.0), ("update", 1.0, 1.5), ("all_gather", 1.5, 3.0)]
    assert split_wait(0.5, 3.0, spans) == (2.0, 0.5)   # waited through the update: 0.5 s of optimizer
    assert split_wait(2.0, 3.0, spans) == (1.0, 0.0)   # only the all-gather left
    assert split_wait(3.0, 3.0, spans) == (0.0, 0.0)
    # Without spans (CUDA): a synchronous job's update time is the optimizer's, an overlapped one's is not.
    assert split_wait(0.0, 2.0, [], update_s=0.25, synchronous=True) == (1.75, 0.25)
    assert split_wait(0.0, 2.0, [], update_s=0.25) == (2.0, 0.0)


def test_breakdown_counts_each_job_once_and_traces_what_overlapped():
    breakdown = TimeBreakdown()
    breakdown.timeline.start()
    breakdown.add("compute", 0.0, 0.4, "forward")
    spans = [("reduce_scatter", 0.1, 0.3), ("update", 0.3, 0.35), ("all_gather", 0.35, 0.5)]
    phases = {"reduce_scatter": 0.2, "update": 0.05, "all_gather": 0.15}
    breakdown.wait(0.4, 0.5, "commit of update 1", spans, phases=phases, submitted_at=0.05)
    breakdown.wait(0.6, 0.6, "commit of update 1", spans)  # a later wait for the same job counts nothing more
    values = breakdown.snapshot()
    assert values["compute"] == pytest.approx(0.4) and values["blocked"] == pytest.approx(0.1)
    assert values["jobs"] == 1 and values["job_s"] == pytest.approx(0.45)
    assert values["job_update_s"] == pytest.approx(0.05)
    trace = chrome_trace(breakdown.timeline.events(), process_name="rank 0")
    tracks = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and "tid" in e}
    events = [(tracks[e["tid"]], e["name"], e["ts"], e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X"]
    assert (Timeline.TRAINING, "forward", 0.0, 400000.0) in events
    assert (Timeline.COMMUNICATION, "update", 300000.0, 50000.0) in events
    assert sum(1 for track, *_ in events if track == Timeline.COMMUNICATION) == 3  # the job's phases once


def _snapshots(compute_s, comm_s, update_s, updates, jobs_per_update):
    jobs = updates * jobs_per_update
    before = {"compute": 1.0, "jobs": 2, "job_reduce_scatter_s": 0.5, "job_all_reduce_s": 0.0,
              "job_all_gather_s": 0.5, "job_update_s": 0.1}
    after = dict(before, compute=1.0 + compute_s * updates, jobs=2 + jobs,
                 job_reduce_scatter_s=0.5 + 0.5 * comm_s * jobs, job_all_reduce_s=0.01 * comm_s * jobs,
                 job_all_gather_s=0.5 + 0.49 * comm_s * jobs, job_update_s=0.1 + update_s * updates)
    return before, after


def test_regime_on_a_fake_clock_predicts_every_type_from_the_bounds():
    # 390 ms of forward + backward and 10 ms of optimizer per update; 264 ms per bf16 round (2 + 2 bytes).
    before, after = _snapshots(0.39, 0.264, 0.01, updates=10, jobs_per_update=1)
    regime = measure(before, after, 10, round_bytes=4.0, model_bytes=2.0, communication_bytes=2.0)
    assert regime.t_compute_s == pytest.approx(0.4) and regime.t_comm_s == pytest.approx(0.264)
    assert regime.communication_share == pytest.approx(0.264 / 0.664)
    predicted = regime.predicted_s
    assert predicted["ShardedAdamW"] == pytest.approx(0.664)
    assert predicted["DPU"] == pytest.approx(0.4)
    assert predicted["ACCO"] == pytest.approx(0.528)                       # two rounds per update
    assert predicted["ACCO with int8 communication"] == pytest.approx(0.4)  # 2 x 2.06 bytes: hidden
    assert predicted["CO2"] == pytest.approx(0.528)                        # fp32: 8 bytes per value
    assert regime.fastest == "DPU, ACCO with int8 communication"  # both hide their rounds under compute
    text = regime.describe("ACCO")
    assert "communication is 40% of a synchronous update" in text and "ACCO 528 ms (0.80x)" in text
    # Measured in an fp32 round, the bf16 types' rounds are half as long.
    fp32 = predict(0.4, 0.5, round_bytes=8.0, model_bytes=2.0, communication_bytes=2.0)
    assert fp32["ShardedAdamW"] == pytest.approx(0.65) and fp32["ACCO"] == pytest.approx(0.5)
    assert predict(0.1, 1.0, round_bytes=4.0, model_bytes=2.0, communication_bytes=2.0)[
        "ACCO with int8 communication"] == pytest.approx(2 * 2 * int8_bytes(128) / 4.0)
    assert measure(before, before, 10, round_bytes=4.0, model_bytes=2.0, communication_bytes=2.0) is None


class _Config:
    optimizer_type, precision, communication_dtype = "ACCO", "bf16", "bf16"

    class compression:
        gradients = weights = False

        class format:
            block_size = 128


def test_regime_is_logged_once_at_the_end_of_the_warmup_or_after_a_few_updates():
    def run(warmup):
        monitor, said = RegimeMonitor(_Config()), []
        for steps in range(1, 20):
            before, after = _snapshots(0.39, 0.264, 0.01, updates=steps, jobs_per_update=1)
            message = monitor.note(steps, after, warmup)
            if message:
                said.append((steps, message))
        return monitor, said

    monitor, said = run(warmup=8)
    assert [steps for steps, _ in said] == [8] and said[0][1].startswith("ACCO: your regime, measured over 7 updates")
    assert monitor.regime(19, {}) is monitor.regime(8, {})  # the logged window, afterwards
    _, said = run(warmup=0)
    assert [steps for steps, _ in said] == [1 + REGIME_UPDATES]


class _SlowCommunicator(RecordingCommunicator):
    """Collectives that take known time: 30 ms per all-gather."""

    def all_gather(self, output, input):
        time.sleep(0.03)
        super().all_gather(output, input)


def test_a_schedule_counts_its_waits_and_jobs_on_a_slow_communicator():
    h = Harness("ShardedAdamW")
    h.schedule.communicator = h.communicator = _SlowCommunicator()
    for _ in range(6):
        h.micro_batch()
    values = h.schedule.time.snapshot()
    assert h.applied_steps == 3 and values["jobs"] == 3
    assert values["job_all_gather_s"] >= 3 * 0.03
    # Synchronous updates: the whole job is waited for, every all-gather of it as blocked time.
    assert values["blocked"] >= 3 * 0.03 and values["boundary"] < values["blocked"]  # the waits are not boundary work
    assert values["optimizer"] == pytest.approx(values["job_update_s"], abs=0.01)
    assert torch.isfinite(h.params()).all()


def test_jobs_that_only_copy_locally_are_not_counted_as_communication():
    """A job on a local communicator (CO2's inner step without groups, a one-rank gloo group) has no
    network round: its waits count, its phases do not (the regime's T_comm is a network round)."""
    h = Harness("ShardedAdamW")
    h.communicator.local = True
    for _ in range(4):
        h.micro_batch()
    values = h.schedule.time.snapshot()
    assert h.applied_steps == 2 and values["jobs"] == 0 and "job_all_gather_s" not in values
    assert values["blocked"] + values["optimizer"] > 0.0
