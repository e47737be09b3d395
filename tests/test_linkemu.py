"""The link emulator of the GPU study (deepspeed_acco/bench/network/linkemu.py, docs/gpu_study.md).

Test plan layer 1: the ring's volumes and latencies, the rate for a communication share, the spin's
calibration math. Layer 2: the hooks, on fakes of torch.distributed and DeepSpeed and on our real
communicator (a group of one, whose collectives are local copies), with the CPU's host delay.
Layer 4: the spin kernel on a GPU (calibration, and that a delay holds its stream, not the device).
"""
import math
import sys
import threading
import time
import types

import pytest
import torch
import torch.distributed as dist

from deepspeed_acco.bench.network import linkemu
from deepspeed_acco.bench.network.linkemu import Link, LinkEmulator, fit_spin, rate_for_share
from deepspeed_acco.runtime.comm import Communicator

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CPU = torch.device("cpu")


# ---- layer 1: the ring ------------------------------------------------------------------------
def test_ring_times_by_hand():
    link = Link(world_size=8, rate_bps=100e9, latency_s=10e-6)
    vector = 174e6  # the 125M preset's gradient in bf16, bytes
    one_pass = 7 / 8 * vector * 8 / 100e9  # each rank's link carries 7/8 of the vector once
    assert link.seconds("reduce_scatter", vector) == pytest.approx(7 * 10e-6 + one_pass)
    assert link.seconds("all_gather", vector) == pytest.approx(7 * 10e-6 + one_pass)
    assert link.seconds("all_reduce", vector) == pytest.approx(14 * 10e-6 + 2 * one_pass)
    assert link.seconds("all_to_all", vector) == pytest.approx(10e-6 + one_pass)
    assert link.traffic("all_reduce", 16) == (14, 2 * 7 / 8 * 16 * 8)
    assert Link(2, 1e9).seconds("all_gather", 1e6) == pytest.approx(0.5e6 * 8 / 1e9)
    counting = Link(8, math.inf, 0.0)  # no link: traffic counted, no time
    assert counting.seconds("all_reduce", vector) == 0.0 and counting.traffic("all_reduce", 16)[0] == 14


def test_link_refuses_what_it_cannot_model():
    with pytest.raises(ValueError, match="--world-size"):
        Link(1, 1e9)
    with pytest.raises(ValueError, match="--rate-gbps"):
        Link(8, 0.0)
    with pytest.raises(ValueError, match="--latency-us"):
        Link(8, 1e9, -1e-6)
    with pytest.raises(ValueError, match="unknown collective"):
        Link(8, 1e9).seconds("broadcast", 1.0)


def test_rate_for_share_gives_that_share():
    update_s, bits, messages, latency_s = 0.040, 3.6e9, 49, 20e-6
    for share in (0.2, 0.35, 0.5):
        rate = rate_for_share(share, update_s, bits, messages, latency_s)
        t_comm = messages * latency_s + bits / rate
        assert t_comm / (update_s + t_comm) == pytest.approx(share)
    with pytest.raises(ValueError, match="--latency-us"):
        rate_for_share(0.2, 0.001, 1e6, 49, 20e-6)  # 0.98 ms of latency > 0.25 ms allowed
    with pytest.raises(ValueError, match="--shares"):
        rate_for_share(1.0, update_s, bits, messages, latency_s)


def test_spin_calibration_fits_a_line_and_checks_delays():
    points = [(c, 4e-6 + c / 1.98e9) for c in (2e6, 8e6, 32e6) for _ in range(3)]
    fitted = fit_spin(points)
    assert fitted.cycles_per_s == pytest.approx(1.98e9)
    assert fitted.overhead_s == pytest.approx(4e-6)
    assert fitted.cycles_for(0.01) == 19_800_000 and fitted.cycles_for(0.0) == 0
    with pytest.raises(ValueError, match="two or more"):
        fit_spin([(1e6, 1e-3), (1e6, 1e-3)])
    with pytest.raises(RuntimeError, match="cannot be calibrated"):
        fit_spin([(1e6, 2e-3), (2e6, 1e-3)])
    assert linkemu.spin_check_failures([(0.01, 0.0102), (0.05, 0.049)], tolerance=0.03) == []
    failures = linkemu.spin_check_failures([(0.01, 0.011), (0.05, 0.0501)], tolerance=0.03)
    assert len(failures) == 1 and "+10.0%" in failures[0]


# ---- layer 2: the hooks, with the CPU's host delay -------------------------------------------
class FakeWork:
    def __init__(self):
        self.waited = False

    def wait(self, timeout=None):
        self.waited = True
        return True


@pytest.fixture
def fake_dist(monkeypatch):
    """torch.distributed's collectives as fakes that log their calls (the emulator wraps these)."""
    calls = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        calls.append(("all_reduce", tensor.numel()))
        return FakeWork() if async_op else None

    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        calls.append(("all_gather_into_tensor", output_tensor.numel()))
        dist.all_reduce(input_tensor[:1])  # a nested collective: charged with its caller, not again

    def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
        calls.append(("broadcast", tensor.numel()))

    for function in (all_reduce, all_gather_into_tensor, broadcast):
        monkeypatch.setattr(dist, function.__name__, function)
    return calls


def test_torch_distributed_collectives_are_delayed_once_each(fake_dist):
    link = Link(8, 2e9, 1e-4)
    emulator = LinkEmulator(link, CPU)
    gradient, parameters = torch.zeros(250_000), torch.zeros(500_000, dtype=torch.bfloat16)
    with emulator.installed():
        started = time.perf_counter()
        dist.all_reduce(gradient)
        dist.all_gather_into_tensor(parameters, parameters[:1000])
        dist.broadcast(gradient, src=0)
        took = time.perf_counter() - started
    record = emulator.take().as_dict()
    expected = link.seconds("all_reduce", 1e6) + link.seconds("all_gather", 1e6)
    assert record["calls"] == {"reduce_scatter": 0, "all_gather": 1, "all_reduce": 1, "all_to_all": 0}
    assert record["requested_s"] == pytest.approx(expected)
    assert record["messages"] == 14 + 7
    assert record["unmodelled"] == {"broadcast": 1}
    assert expected <= record["measured_s"] <= took  # slept on this thread, never less than asked
    assert [name for name, _ in fake_dist] == ["all_reduce", "all_gather_into_tensor", "all_reduce", "broadcast"]
    assert dist.all_reduce.__name__ == "all_reduce" and not hasattr(dist.all_reduce, "__wrapped__"), "restored"


def test_an_async_collective_waits_for_the_link_in_its_wait(fake_dist):
    link = Link(8, 0.2e9)
    emulator = LinkEmulator(link, CPU)
    gradient = torch.zeros(1_000_000)
    link_s = link.seconds("all_reduce", 4e6)  # 0.28 s
    with emulator.installed():
        started = time.perf_counter()
        work = dist.all_reduce(gradient, async_op=True)
        returned = time.perf_counter() - started
        work.wait()
        waited = time.perf_counter() - started
    assert work._work.waited
    assert returned < link_s / 2 and waited >= link_s


def test_deepspeed_zero1_pays_the_all_gather_it_skips_alone(fake_dist, monkeypatch):
    """At a data-parallel world size of 1 ZeRO-1's all_gather_dp_groups gathers nothing; W ranks would."""
    gathered = []
    zero = types.ModuleType("deepspeed.runtime.zero.stage_1_and_2")
    zero.all_gather_dp_groups = lambda groups_flat, *rest, **options: gathered.append(len(groups_flat))
    backend = types.SimpleNamespace(all_gather_function=dist.all_gather_into_tensor, reduce_scatter_function=None)
    ds_comm = types.ModuleType("deepspeed.comm.comm")
    ds_comm.cdb = backend
    monkeypatch.setitem(sys.modules, zero.__name__, zero)
    monkeypatch.setitem(sys.modules, ds_comm.__name__, ds_comm)
    original = backend.all_gather_function
    flat = [torch.zeros(300, dtype=torch.bfloat16), torch.zeros(100, dtype=torch.bfloat16)]
    emulator = LinkEmulator(Link(4, 1e9), CPU)
    with emulator.installed():
        zero.all_gather_dp_groups(flat, None, None, 1, 10**9)
        assert backend.all_gather_function is not original  # the function DeepSpeed bound at its start-up
        backend.all_gather_function(output_tensor=torch.zeros(8), input_tensor=torch.zeros(2))
    record = emulator.take()
    assert gathered == [2] and record.calls["all_gather"] == 2 and record.calls["all_reduce"] == 0
    assert record.bits == pytest.approx(8 * 3 / 4 * (800 + 32))
    assert backend.all_gather_function is original


def test_our_communicator_is_charged_and_a_group_less_one_is_not():
    """A gloo group of one copies locally without calling torch.distributed; a communicator without a
    process group (CO2's group of one rank) is local at every world size, so it crosses no link."""
    jobs = Communicator(group=object(), rank=0, world_size=1, name="jobs", backend="gloo")
    group_of_one = Communicator(group=None, rank=0, world_size=1, name="co2-group-local")
    original = Communicator.reduce_scatter
    link = Link(8, 5e9)
    emulator = LinkEmulator(link, CPU)
    gradient, shard = torch.ones(1000), torch.empty(1000)
    with emulator.installed():
        jobs.reduce_scatter(shard, gradient)
        jobs.all_reduce(torch.zeros(2, dtype=torch.float64))
        jobs.all_gather(gradient, shard)
        group_of_one.reduce_scatter(shard, gradient)
        group_of_one.all_gather(gradient, shard)
    record = emulator.take()
    assert torch.equal(shard, gradient)
    assert record.calls == {"reduce_scatter": 1, "all_gather": 1, "all_reduce": 1, "all_to_all": 0}
    assert record.requested_s == pytest.approx(2 * link.seconds("all_gather", 4000) + link.seconds("all_reduce", 16))
    assert Communicator.reduce_scatter is original


def test_take_starts_a_new_record():
    emulator = LinkEmulator(Link(2, math.inf), CPU)
    emulator.charge("all_gather", 100.0)
    first, second = emulator.take(), emulator.take()
    assert first.calls["all_gather"] == 1 and first.bits == 400.0 and second.calls["all_gather"] == 0


def test_a_record_taken_during_a_delay_waits_for_it():
    """A job's delay that outlasts a timed window (a worker still sleeping) counts in that window."""
    link = Link(2, 8e6)
    emulator = LinkEmulator(link, CPU)
    worker = threading.Thread(target=emulator.charge, args=("all_gather", 1e5))  # 50 ms
    worker.start()
    while emulator._record.calls["all_gather"] == 0:
        time.sleep(0.001)
    record = emulator.take()
    assert record.measured_s() >= link.seconds("all_gather", 1e5)
    worker.join()
    assert emulator.take().measured_s() == 0.0


def test_a_cuda_emulator_needs_the_calibration():
    with pytest.raises(ValueError, match="calibrat"):
        LinkEmulator(Link(8, 1e9), torch.device("cuda", 0))


# ---- layer 4: the spin on a GPU ----------------------------------------------------------------
@needs_cuda
def test_cuda_spin_is_calibrated_and_holds_its_stream_only():
    device = torch.device("cuda", torch.cuda.current_device())
    calibration = linkemu.calibrate_spin(device)
    checks = linkemu.check_spin(device, calibration)
    assert all(abs(c["error"]) <= 0.03 for c in checks)
    assert linkemu.check_stream_only(device, calibration) < 0.03


@needs_cuda
def test_cuda_delay_follows_the_collective_on_the_current_stream():
    device = torch.device("cuda", torch.cuda.current_device())
    calibration = linkemu.calibrate_spin(device)
    link = Link(8, 10e9)
    emulator = LinkEmulator(link, device, calibration)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        emulator.charge("all_gather", 20e6)  # 14 ms on the side stream
        done = torch.cuda.Event()
        done.record(side)
    assert not done.query(), "the delay is enqueued, the host did not wait for it"
    record = emulator.take()
    assert record.measured_s() == pytest.approx(link.seconds("all_gather", 20e6), rel=0.03)
    assert done.query()
