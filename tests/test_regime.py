"""Where the time goes and the regime a job is in (docs/wire.md, "Where the time goes"; test plan layers 1 and
2): a wait split by the job's phases, the regime's predictions from the bounds on a fake clock, when the engine
logs it, and the breakdown a schedule counts on a communicator that takes known time."""
import time

import pytest
import torch

from deepspeed_acco.runtime.regime import (DECISION_JOBS, DECISION_UPDATES, RegimeMonitor, int8_bytes, measure, predict,
                                          quantized_bytes, round_bytes, update_bound_s,
                                          update_wire_bytes)
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


def test_regime_on_a_fake_clock_predicts_every_type_on_every_wire_from_the_bounds():
    # 390 ms of forward + backward and 10 ms of optimizer per update; 264 ms per bf16 round (2 + 2 bytes).
    before, after = _snapshots(0.39, 0.264, 0.01, updates=10, jobs_per_update=1)
    regime = measure(before, after, 10, round_bytes=4.0, model_bytes=2.0, communication_bytes=2.0)
    assert regime.t_compute_s == pytest.approx(0.4) and regime.t_comm_s == pytest.approx(0.264)
    assert regime.communication_share == pytest.approx(0.264 / 0.664)
    predicted = regime.predicted_s
    assert predicted["ShardedAdamW"] == pytest.approx(0.664)
    assert predicted["DPU (bf16)"] == pytest.approx(0.4)
    assert predicted["ACCO (bf16)"] == pytest.approx(0.528)  # two rounds per update
    assert predicted["ACCO (int8)"] == pytest.approx(0.4)  # 2 x 2.06 bytes: hidden
    # CO2 averages fp32 (8 bytes per value: 528 ms) once every 4 inner steps and may take 1 of them:
    # 0.4 + (0.528 - 0.4) / 4 per inner step.
    assert predicted["CO2 (fp32)"] == pytest.approx(0.4 + 0.128 / 4)
    assert predicted["CO2 (int8)"] == pytest.approx(0.4)
    assert regime.fastest.startswith("DPU (bf16), DPU (int8), DPU (int4), ACCO (int8)")
    text = regime.describe("ACCO")
    assert "communication is 40% of a synchronous update" in text and "ACCO (bf16) 528 ms (0.80x)" in text
    # Measured in an fp32 round, the bf16 types' rounds are half as long.
    fp32 = predict(0.4, 0.5, measured_bytes=8.0, model_dtype="bf16")
    assert fp32["ShardedAdamW"] == pytest.approx(0.65) and fp32["ACCO (bf16)"] == pytest.approx(0.5)
    slow = predict(0.1, 1.0, measured_bytes=4.0, model_dtype="bf16", quantization_s={"int8": 0.02, "int4": 0.03})
    assert slow["ACCO (int8)"] == pytest.approx(2 * (2 * int8_bytes(128) / 4.0 + 0.02))
    assert slow["ACCO (int4)"] == pytest.approx(2 * (2 * quantized_bytes(4, 128) / 4.0 + 0.03))
    assert measure(before, before, 10, round_bytes=4.0, model_bytes=2.0, communication_bytes=2.0) is None


def test_co2_bound_pays_only_what_its_averaging_does_not_hide_once_per_round():
    # T_compute 0.4 s, the averaging takes 2 s, every 4 inner steps, and may take 1 (eager) or 4 of them.
    assert update_bound_s("CO2", 0.4, 2.0, local_steps=4, averaging_steps=1) == pytest.approx(0.4 + 1.6 / 4)
    assert update_bound_s("CO2", 0.4, 2.0, local_steps=4, averaging_steps=4) == pytest.approx(0.4 + 0.4 / 4)
    assert update_bound_s("CO2", 0.4, 0.3, local_steps=4, averaging_steps=1) == pytest.approx(0.4)  # hidden
    assert update_bound_s("ACCO", 0.4, 0.3) == pytest.approx(0.6)
    assert update_bound_s("DPU", 0.4, 0.3) == pytest.approx(0.4)
    assert update_bound_s("ShardedAdamW", 0.4, 0.3) == pytest.approx(0.7)
    with pytest.raises(ValueError, match="no bound for optimizer type"):
        update_bound_s("Adam", 0.4, 0.3)
    # The bytes a job moves per value on each wire (block 128).
    assert round_bytes("ACCO", "bf16", model_dtype="bf16") == 4.0
    assert round_bytes("ACCO", "fp32", model_dtype="bf16") == 6.0  # fp32 gradients, bf16 parameters
    assert round_bytes("CO2", "fp32", model_dtype="bf16") == 8.0
    assert round_bytes("CO2", "int4", model_dtype="bf16") == pytest.approx(2 * (0.5 + 4 / 128))


def test_regime_window_ends_after_a_few_updates_with_enough_network_jobs():
    monitor = RegimeMonitor()
    assert not monitor.complete(0, {"jobs": 0})  # nothing starts before the first update
    assert not monitor.complete(1, {"jobs": 1})  # the window starts after it
    assert monitor.window(1, {"jobs": 1}) is None
    assert not monitor.complete(1 + DECISION_UPDATES - 1, {"jobs": 9})
    assert monitor.complete(1 + DECISION_UPDATES, {"jobs": 1 + DECISION_JOBS})
    assert not monitor.complete(1 + DECISION_UPDATES, {"jobs": DECISION_JOBS})  # CO2: one averaging so far
    assert monitor.no_network(1 + DECISION_UPDATES, {"jobs": 1})
    # An early, clear choice may be made one update and one network job into the window.
    early = RegimeMonitor()
    assert not early.complete(1, {"jobs": 0}) and not early.early(1, {"jobs": 0})
    assert not early.early(2, {"jobs": 0})  # CO2 between averagings: no job yet
    assert early.early(2, {"jobs": 1}) and not early.complete(2, {"jobs": 1})
    updates, t_compute, t_comm = monitor.window(3, {"jobs": 3, "compute": 0.8, "job_update_s": 0.2,
                                                    "job_reduce_scatter_s": 0.2, "job_all_gather_s": 0.2})
    assert (updates, t_compute, t_comm) == (2, pytest.approx(0.5), pytest.approx(0.2))


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


def test_bytes_per_update_follow_what_the_jobs_send():
    """The README's table of bytes per update (runtime/regime.py) against the collectives' own count
    (runtime/compression.py's ``job_wire_bytes``, which tests/test_compressed_training.py checks on gloo's
    sockets) for a large model at W = 8: within the packing's padding."""
    from deepspeed_acco.runtime.compression import QuantizationFormat, job_wire_bytes
    values, world = 1 << 22, 8
    for bits, wire in ((8, "int8"), (4, "int4")):
        per_job = sum(job_wire_bytes(values, world, QuantizationFormat(bits=bits)).values())
        assert update_wire_bytes("ACCO", wire, values, world) == pytest.approx(2 * per_job, rel=1e-3)
        assert update_wire_bytes("CO2", wire, values, world) == pytest.approx(per_job / 4, rel=1e-3)
    fp32_job = sum(job_wire_bytes(values, world, None).values())  # fp32 both ways
    assert update_wire_bytes("CO2", "fp32", values, world) == pytest.approx(fp32_job / 4)
    assert update_wire_bytes("ShardedAdamW", "fp32", values, world, model_dtype="fp32") == pytest.approx(fp32_job)
    assert update_wire_bytes("ACCO", "bf16", values, world) == pytest.approx(fp32_job)  # two jobs of half the bytes


def test_the_readmes_box_is_the_engines_count():
    """README.md's "What each type sends" table: every row's bytes per parameter and its seconds for 1B
    parameters at 25 Gbit/s follow from update_wire_bytes (our types, which test_bytes_per_update_follow_
    what_the_jobs_send ties to the collectives) and from DeepSpeed's passes (docs/bench.md)."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"\d+\.\d\d", cells[2]) and cells[3].endswith(" s"):
            rows[cells[0].replace("`", "")] = (float(cells[2]), float(cells[3][:-2]))
    values, world = 1 << 24, 8
    share = (world - 1) / world
    expected = {"DeepSpeed ZeRO-1, defaults": 3 * 2 * share,
                "DeepSpeed ZeRO-1, best stage-1 settings (gloo)": ((world + 1) / world + 1) * 2 * share}
    for name, wire in (("ShardedAdamW", "bf16"), ("DPU", "bf16"), ("ACCO, bf16", "bf16"), ("ACCO, int8", "int8"),
                       ("ACCO, int4", "int4"), ("CO2, fp32 averaging", "fp32"), ("CO2, int8", "int8"),
                       ("CO2, int4", "int4")):
        expected[name] = update_wire_bytes(name.split(",")[0], wire, values, world) / values
    assert set(rows) == set(expected), sorted(rows)
    for name, per_param in expected.items():
        assert rows[name][0] == pytest.approx(per_param, abs=0.005), name
        assert rows[name][1] == pytest.approx(per_param * 1e9 * 8 / 25e9, abs=0.0051), name  # 0.595 prints 0.60


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_compute_is_timed_on_the_device_not_by_the_host():
    """What the regime reads as T_compute on CUDA (``device_compute``): the device time of the blocks
    timed as compute only, not the host's, which on CUDA only launches the kernels."""
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        x @ x
    torch.cuda.synchronize()
    breakdown = TimeBreakdown(cuda=True)
    with breakdown.timed("compute", "forward"):
        for _ in range(20):
            x @ x
    with breakdown.timed("boundary"):  # device work outside the compute part is not T_compute
        for _ in range(20):
            x @ x
    snapshot = breakdown.snapshot(wait_for_device=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        x @ x
    end.record()
    end.synchronize()
    reference = start.elapsed_time(end) / 1e3
    assert 0.5 * reference <= snapshot["device_compute"] <= 2.0 * reference
    assert snapshot["device_compute"] >= 2 * snapshot["compute"]  # the host only launched them
    assert breakdown.snapshot()["device_compute"] == snapshot["device_compute"]  # nothing pending is lost or counted twice
