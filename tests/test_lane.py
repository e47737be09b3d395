"""The communication lane (deepspeed_acco/runtime/comm.py): ordering, results read at the wait, the
hang check and the timeouts of our process groups; the device-side update decisions of the jobs.

Layers 1 and 2 of docs/design.md, section 4: pure functions and the lane with fake communicators, no
processes. The CUDA lane tests run where a GPU is visible (benchmarks/gpu_check.sh).
"""
import datetime
import math
import os
import threading
import time

import pytest
import torch

from deepspeed_acco.runtime import comm
from deepspeed_acco.runtime.comm import (CommunicationError, Communicator, DeviceReadback, Lane, PhaseClock,
                                         process_group_timeout_s)
from deepspeed_acco.runtime.jobs import CLIP_EPSILON, update_decision
from deepspeed_acco.runtime.optimizers.co2 import DISPLACEMENT_EPSILON, outer_decision

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ---- the jobs' decisions on the device, against the host arithmetic they replaced -----------
def _host_update_decision(global_sumsq, round_micro_batches, carried, clipping):
    """What ShardUpdateJob computed on the host before (one .tolist() and Python floats)."""
    micro_batches = int(round(round_micro_batches)) + carried
    grad_norm = math.sqrt(global_sumsq) / micro_batches if math.isfinite(global_sumsq) and micro_batches \
        else float("nan")
    skipped = not math.isfinite(grad_norm)
    scale = 1.0 / micro_batches if micro_batches else float("inf")
    if clipping > 0.0 and grad_norm > clipping:
        scale *= clipping / (grad_norm + CLIP_EPSILON)
    return skipped, grad_norm, micro_batches, scale


UPDATE_CASES = [
    # (sum of squares, micro-batches of the round, carried, clipping)
    (2.5, 4.0, 0, 0.0), (2.5, 4.0, 0, 1.0), (1e6, 3.0, 0, 1.0), (1e6, 3.0, 5, 0.5), (0.0, 2.0, 2, 1.0),
    (float("inf"), 4.0, 0, 1.0), (float("nan"), 4.0, 0, 0.0), (7.0, 0.0, 0, 1.0), (3.3e-9, 7.0, 0, 1e-5),
]


def _random_update_cases(count=2000):
    # Many random norms: torch's CPU float64 sqrt is off by an ulp for about one in a hundred.
    generator = torch.Generator().manual_seed(0)
    magnitudes = torch.rand(count, generator=generator, dtype=torch.float64) * 10.0 ** torch.randint(
        -6, 7, (count, ), generator=generator)
    return [(value, float(1 + i % 7), (i // 7) % 3, (0.0, 0.3, 1.0)[i % 3])
            for i, value in enumerate(magnitudes.tolist())]


def _assert_update_decision_matches_host(case):
    global_sumsq, round_micro_batches, carried, clipping = case
    control, summary = update_decision(torch.tensor([global_sumsq, round_micro_batches], dtype=torch.float64),
                                       carried_micro_batches=carried, gradient_clipping=clipping)
    skipped, grad_norm, micro_batches, scale = _host_update_decision(*case)
    assert summary.tolist()[0] == float(skipped), case
    assert (math.isnan(grad_norm) and math.isnan(summary[1].item())) or summary[1].item() == grad_norm, case
    assert summary[2].item() == micro_batches, case
    assert control.dtype == torch.float32 and control[1].item() == float(skipped), case
    if not skipped:
        # The fp32 multiplier the kernels apply is the one a grad.mul_(scale) applied before.
        assert control[0].item() == float(torch.tensor(scale, dtype=torch.float32)), case


@pytest.mark.parametrize("case", UPDATE_CASES)
def test_update_decision_reproduces_the_host_arithmetic_bitwise(case):
    _assert_update_decision_matches_host(case)


def test_update_decision_reproduces_the_host_arithmetic_on_random_norms():
    for case in _random_update_cases():
        _assert_update_decision_matches_host(case)


def _host_outer_decision(values, num_groups, gap_penalty):
    max_displacement = math.sqrt(max(values[:num_groups]))
    anchor_move = math.sqrt(values[num_groups])
    skipped = values[num_groups + 1] > 0 or not math.isfinite(max_displacement)
    penalty = 1.0 + anchor_move / (max_displacement + DISPLACEMENT_EPSILON) if gap_penalty == "adaptive" \
        else float(gap_penalty)
    return skipped, penalty, anchor_move, max_displacement


@pytest.mark.parametrize("values, gap_penalty", [
    ([0.3, 0.7, 0.02, 0.0], "adaptive"), ([0.3, 0.7, 0.02, 0.0], 2.0), ([0.0, 0.0, 0.0, 0.0], "adaptive"),
    ([1.5, 0.02, 0.0], "adaptive"), ([0.3, 0.7, 0.02, 4.0], "adaptive"), ([0.3, float("inf"), 0.1, 0.0], 1.0),
])
def test_outer_decision_reproduces_the_host_arithmetic_bitwise(values, gap_penalty):
    _assert_outer_decision_matches_host(values, gap_penalty)


def test_outer_decision_reproduces_the_host_arithmetic_on_random_norms():
    generator = torch.Generator().manual_seed(1)
    for trial in range(1000):
        values = (torch.rand(5, generator=generator, dtype=torch.float64) * 10.0 ** (trial % 9 - 4)).tolist()
        values[-1] = 0.0  # the non-finite count
        _assert_outer_decision_matches_host(values, "adaptive" if trial % 2 else 2.5)


def _assert_outer_decision_matches_host(values, gap_penalty):
    num_groups = len(values) - 2
    control, summary = outer_decision(torch.tensor(values, dtype=torch.float64), num_groups=num_groups,
                                      gap_penalty=gap_penalty)
    skipped, penalty, anchor_move, max_displacement = _host_outer_decision(values, num_groups, gap_penalty)
    assert summary.tolist() == [float(skipped), penalty, anchor_move, max_displacement]
    assert control[1].item() == float(skipped)
    assert control[0].item() == float(torch.tensor(penalty, dtype=torch.float32))


# ---- timeouts --------------------------------------------------------------------------------
@pytest.mark.parametrize("timeout_s", [1.0, 20.0, 300.0, 3600.0])
def test_process_groups_time_out_after_the_hang_check(timeout_s):
    group_timeout_s = process_group_timeout_s(timeout_s)
    # The check fires at timeout_s, plus at most one poll of a waiting training thread.
    assert group_timeout_s - timeout_s >= comm.WATCHDOG_GRACE_MIN_S > 10 * comm._POLL_INTERVAL_S
    assert group_timeout_s - timeout_s >= comm.WATCHDOG_GRACE_FRACTION * timeout_s
    assert process_group_timeout_s(300.0) == 375.0


class _FakeDist:
    """Stands in for torch.distributed's group creation; records the arguments and the environment."""

    def __init__(self, backend, world_size=4, rank=1):
        self.backend, self.world_size, self.rank = backend, world_size, rank
        self.calls = []

    def new_group(self, **kwargs):
        self.calls.append((kwargs, {name: os.environ.get(name) for name in comm.NCCL_GROUP_ENVIRONMENT}))
        return object()


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_new_communicator_sets_the_group_timeout_and_nccl_settings(monkeypatch, backend):
    fake = _FakeDist(backend)
    monkeypatch.setattr(comm.dist, "new_group", fake.new_group)
    monkeypatch.setattr(comm.dist, "get_backend", lambda: backend)
    monkeypatch.setattr(comm.dist, "get_rank", lambda: fake.rank)
    monkeypatch.setattr(comm.dist, "get_world_size", lambda: fake.world_size)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")  # the user's own choice, for their groups
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    communicator = comm.new_communicator([0, 1], 20.0, name="acco-test")
    (kwargs, environment), = fake.calls
    assert kwargs["timeout"] == datetime.timedelta(seconds=process_group_timeout_s(20.0))
    assert kwargs["ranks"] == [0, 1] and communicator.rank == 1 and communicator.world_size == 2
    if backend == "nccl":
        assert environment == comm.NCCL_GROUP_ENVIRONMENT
        assert not communicator.local and not communicator.point_to_point
    else:
        assert environment == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_BLOCKING_WAIT": None}
        assert communicator.point_to_point
    # The environment is the user's again afterwards.
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ


def test_groups_of_one_run_real_collectives_only_on_nccl():
    assert Communicator(object(), 0, 1, "one", backend="gloo").local
    assert Communicator(None, 0, 1, "none").local
    assert not Communicator(object(), 0, 1, "one", backend="nccl").local


def test_nccl_launch_order_is_requested_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv(comm.NCCL_LAUNCH_ORDER_ENV, raising=False)
    comm.prepare_nccl_environment()
    assert os.environ[comm.NCCL_LAUNCH_ORDER_ENV] == "1"
    monkeypatch.setattr(comm, "nccl_version", lambda: (2, 27, 3))
    assert comm.nccl_orders_by_host()
    monkeypatch.setattr(comm, "nccl_version", lambda: (2, 21, 5))
    assert not comm.nccl_orders_by_host()
    monkeypatch.setattr(comm, "nccl_version", lambda: (2, 27, 3))
    monkeypatch.setenv(comm.NCCL_LAUNCH_ORDER_ENV, "0")
    comm.prepare_nccl_environment()
    assert os.environ[comm.NCCL_LAUNCH_ORDER_ENV] == "0" and not comm.nccl_orders_by_host()


@pytest.mark.parametrize("reported, expected", [((2, 27, 3), (2, 27, 3)), ([2, 21, 5], (2, 21, 5)),
                                                (22703, (2, 27, 3)), (2708, (2, 7, 8))])
def test_nccl_version_reads_tuples_and_version_codes(monkeypatch, reported, expected):
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: reported, raising=False)
    assert comm.nccl_version() == expected


# ---- the lane on the CPU ---------------------------------------------------------------------
class BlockingCommunicator(Communicator):
    """A real Communicator (records, labels, errors) whose all-reduce blocks until released, like a
    collective whose peer has died; ``reduce_scatter`` completes at once."""

    def __init__(self, name="blocking"):
        super().__init__(object(), 0, 2, name, backend="gloo")
        self.release = threading.Event()
        self.entered = threading.Event()

    def all_reduce(self, tensor):
        def hang():
            self.entered.set()
            if not self.release.wait(60):
                raise RuntimeError("never released")
        self._run("all_reduce", hang)

    def reduce_scatter(self, output, input):
        self._run("reduce_scatter", lambda: output.copy_(input))


def test_hang_check_raises_before_the_group_timeout_and_names_the_collective():
    timeout_s = 1.0
    lane = Lane(0, torch.device("cpu"), timeout_s=timeout_s)
    blocking = BlockingCommunicator()
    work = lane.submit(lambda: (blocking.reduce_scatter(torch.zeros(2), torch.ones(2)),
                                blocking.all_reduce(torch.ones(1))), blocking, label="commit of update 7")
    started = time.monotonic()
    with pytest.raises(CommunicationError) as raised:
        work.wait()
    waited_s = time.monotonic() - started
    message = str(raised.value)
    assert "collective all_reduce" in message and "'blocking'" in message and "commit of update 7" in message
    assert "has not completed" in message and "rank 0" in message
    assert timeout_s <= waited_s < timeout_s + 2 * comm._POLL_INTERVAL_S + 1.0 < process_group_timeout_s(timeout_s)
    blocking.release.set()
    assert lane.close(join_timeout_s=10)


def test_hang_check_sees_a_hung_job_ahead_of_the_waited_one():
    lane = Lane(0, torch.device("cpu"), timeout_s=1.0)
    blocking = BlockingCommunicator()
    lane.submit(lambda: blocking.all_reduce(torch.ones(1)), blocking, label="outer averaging of round 3")
    queued = lane.submit(lambda: 42, blocking, label="checkpoint all-gather")
    with pytest.raises(CommunicationError, match=r"all_reduce .*\(of job 'outer averaging of round 3'\)"):
        queued.wait()
    blocking.release.set()
    assert queued.wait() == 42  # the queued job ran once the hung one came free
    assert lane.close(join_timeout_s=10)


def test_jobs_of_different_communicators_overlap_on_the_cpu():
    # CO2 with groups: the outer job (jobs communicator) must run while group steps (the group's
    # communicator) go on. Here the outer job can only finish once a later group job has run; if the
    # lane serialised communicators this would wait for the full timeout and fail.
    lane = Lane(0, torch.device("cpu"), timeout_s=30.0)
    outer, group = Communicator(None, 0, 1, "outer"), Communicator(None, 0, 1, "group")
    inner_ran = threading.Event()
    outer_work = lane.submit(lambda: inner_ran.wait(20), outer, label="outer")
    for step in range(3):
        assert lane.submit(lambda: inner_ran.set(), group, label=f"group step {step}").wait() is None
    assert outer_work.wait() is True
    assert lane.close(join_timeout_s=10)


def test_jobs_of_one_communicator_run_in_submission_order():
    lane = Lane(0, torch.device("cpu"), timeout_s=30.0)
    communicator = Communicator(None, 0, 1, "one")
    order = []
    works = [lane.submit(lambda i=i: (time.sleep(0.01 * (5 - i)), order.append(i)), communicator, label=str(i))
             for i in range(5)]
    for work in works:
        work.wait()
    assert order == list(range(5))
    assert lane.close(join_timeout_s=10)


def test_a_readback_becomes_the_result_at_the_wait_and_errors_carry_the_job_traceback():
    lane = Lane(0, torch.device("cpu"), timeout_s=30.0)
    communicator = Communicator(None, 0, 1, "one")
    built = []

    def job():
        clock = PhaseClock(torch.device("cpu"))
        with clock.phase("update"):
            values = torch.tensor([1.0, 2.5], dtype=torch.float64)
        return DeviceReadback(values, lambda v, t: built.append((v, sorted(t))) or tuple(v), clock)

    work = lane.submit(job, communicator, label="readback")
    assert work.wait() == (1.0, 2.5) and work.wait() == (1.0, 2.5)
    assert built == [([1.0, 2.5], ["update"])], "the result is built once, at the first wait"
    assert work.is_done()

    def broken_job():
        raise ValueError("injected failure inside a job")

    failed = lane.submit(broken_job, communicator, label="broken")
    for _ in range(2):  # every wait re-raises
        with pytest.raises(CommunicationError, match="injected failure") as raised:
            failed.wait()
        assert "broken_job" in str(raised.value) and "'broken'" in str(raised.value)
    assert lane.close(join_timeout_s=10)


def test_a_closed_lane_refuses_jobs():
    lane = Lane(0, torch.device("cpu"), timeout_s=30.0)
    assert lane.close()
    with pytest.raises(CommunicationError, match="closed"):
        lane.submit(lambda: None, Communicator(None, 0, 1, "one"), label="late")


def test_released_communicators_and_control_plane_refuse_collectives_instead_of_using_the_default_group():
    # engine.destroy() releases its process groups; a later collective must not fall back to
    # group=None (the default group) but say that the engine was destroyed.
    group = object()
    communicator = Communicator(group, 0, 2, "params", backend="gloo")
    communicator.release()
    assert communicator.group is None and not communicator.local
    flat = torch.zeros(4)
    for call in (lambda: communicator.all_gather(flat, flat[:2]), lambda: communicator.all_reduce(flat),
                 lambda: communicator.reduce_scatter(flat[:2], flat),
                 lambda: communicator.all_to_all(flat, flat, [2, 2], [2, 2])):
        with pytest.raises(CommunicationError, match="destroyed"):
            call()
    control = comm.ControlPlane(group, 2)
    control.release()
    assert control.group is None
    for call in (lambda: control.max(3), control.barrier):
        with pytest.raises(CommunicationError, match="destroyed"):
            call()
    assert comm.ControlPlane(None, 1).max(3) == 3  # one rank: no group, nothing to release


# ---- the lane on CUDA ------------------------------------------------------------------------
@needs_cuda
@pytest.mark.parametrize("shared_stream", [False, True], ids=["stream-per-communicator", "shared-stream"])
def test_cuda_jobs_are_enqueued_inline_and_waited_without_blocking_the_submission(shared_stream):
    device = torch.device("cuda", torch.cuda.current_device())
    lane = Lane(0, device, timeout_s=60.0, shared_stream=shared_stream)
    first, second = Communicator(None, 0, 1, "first"), Communicator(None, 0, 1, "second")
    source = torch.randn(1 << 20, device=device)
    target = torch.zeros_like(source)
    calls = []

    def job(sleep_cycles):
        def run():
            calls.append(threading.current_thread() is threading.main_thread())
            torch.cuda._sleep(sleep_cycles)
            target.copy_(source)
            return DeviceReadback(target.sum().double().reshape(1), lambda values, timings: values[0])
        return run

    # Warm-up, untimed: the first launch of each kernel loads it and the first pinned read-back
    # allocates its host block, and both synchronise the device. In the first CUDA lane test of a
    # process they landed inside the timed job, which was then done at submission (first GPU run,
    # 3 times in 3); once warm, the pinned block comes back from torch's host cache.
    lane.submit(job(1000), first, label="warm-up").wait()
    torch.cuda.synchronize()
    calls.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        started = time.perf_counter()
        work = lane.submit(job(100_000_000), first, label="sleepy")  # tens of milliseconds on the side stream
        submit_s = time.perf_counter() - started
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert calls == [True], "the job runs on the training thread, at submission"
    assert not work.is_done() and submit_s < 0.02
    assert work.wait() == pytest.approx(float(source.sum()), rel=1e-5)
    assert work.is_done() and torch.equal(target, source)
    # The training stream now waits for the job: using its output needs no host synchronisation.
    after = lane.submit(lambda: None, second, label="other communicator")
    after.wait()
    streams = set(lane._streams.values())
    assert len(streams) == (1 if shared_stream else 2)
    assert lane.close()


@needs_cuda
@pytest.mark.parametrize("shared_stream", [False, True], ids=["stream-per-communicator", "shared-stream"])
def test_cuda_jobs_of_different_communicators_overlap_unless_the_stream_is_shared(shared_stream):
    # CO2 with groups on CUDA: the outer averaging (one communicator) must not hold up the group
    # steps (another) on the device; with the shared-stream fallback it does, by design.
    device = torch.device("cuda", torch.cuda.current_device())
    lane = Lane(0, device, timeout_s=60.0, shared_stream=shared_stream)
    outer, group = Communicator(None, 0, 1, "outer"), Communicator(None, 0, 1, "group")
    slow = lane.submit(lambda: torch.cuda._sleep(400_000_000), outer, label="outer averaging")
    quick = lane.submit(lambda: None, group, label="group step")
    quick.wait()
    if shared_stream:
        assert slow.is_done(), "one shared stream runs the jobs in submission order"
    else:
        assert not slow.is_done(), "the group step waited for the outer job on the device"
    slow.wait()
    assert lane.close()


@needs_cuda
def test_cuda_job_waits_for_the_training_stream_before_it_starts():
    device = torch.device("cuda", torch.cuda.current_device())
    lane = Lane(0, device, timeout_s=60.0)
    communicator = Communicator(None, 0, 1, "one")
    values = torch.zeros(1 << 20, device=device)
    torch.cuda._sleep(100_000_000)
    values.fill_(3.0)  # enqueued on the training stream after the sleep
    seen = torch.empty_like(values)
    work = lane.submit(lambda: seen.copy_(values), communicator, label="reads the training stream's result")
    work.wait()
    assert seen.min().item() == 3.0
    assert lane.close()


# ---- the small all-reduce on gloo (three real processes) ---------------------------------------
def _small_all_reduce_worker(rank, world_size):
    import torch.distributed as dist
    from deepspeed_acco.runtime.comm import SMALL_ALL_REDUCE_NUMEL
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    communicator = Communicator(dist.group.WORLD, rank, world_size, "stats", backend="gloo")
    generator = torch.Generator().manual_seed(rank)
    small = torch.rand(2, dtype=torch.float64, generator=generator) * 10.0 ** (3 * rank)
    by_gloo = small.clone()
    dist.all_reduce(by_gloo)
    mine = small.clone()
    records = []
    comm._running_job.records = records  # what the hang check and its errors would see
    try:
        communicator.all_reduce(mine)
    finally:
        del comm._running_job.records
    large = torch.rand(SMALL_ALL_REDUCE_NUMEL + 1, generator=generator)
    large_by_gloo = large.clone()
    dist.all_reduce(large_by_gloo)
    communicator.all_reduce(large)
    everyone = [torch.zeros(2, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(everyone, small)
    in_rank_order = everyone[0].clone()
    for values in everyone[1:]:
        in_rank_order += values
    # The large collectives are point-to-point rings on gloo: the same values as gloo's own.
    vector = torch.randn(world_size * 37, generator=generator).to(torch.bfloat16)
    summed = vector.clone()
    dist.all_reduce(summed)
    shard = torch.empty(37, dtype=torch.bfloat16)
    communicator.reduce_scatter(shard, vector)
    gathered, by_gloo_gathered = torch.empty_like(vector), torch.empty_like(vector)
    communicator.all_gather(gathered, shard)
    dist.all_gather_into_tensor(by_gloo_gathered, shard)
    in_place = torch.zeros_like(vector)
    in_place.view(world_size, -1)[rank].copy_(shard)
    communicator.all_gather(in_place, in_place.view(world_size, -1)[rank])  # the input aliases its chunk
    splits = [0 if peer == rank else 5 + peer for peer in range(world_size)]
    sent = torch.arange(sum(splits), dtype=torch.uint8) + 10 * rank
    received = torch.zeros(sum(5 + rank for peer in range(world_size) if peer != rank), dtype=torch.uint8)
    received_splits = [0 if peer == rank else 5 + rank for peer in range(world_size)]
    communicator.all_to_all(received, sent, output_split_sizes=received_splits, input_split_sizes=splits)
    by_gloo_received = torch.zeros_like(received)
    dist.all_to_all_single(by_gloo_received, sent, output_split_sizes=received_splits, input_split_sizes=splits)
    return dict(mine=mine.tolist(), by_gloo=by_gloo.tolist(), in_rank_order=in_rank_order.tolist(),
                collectives=[(r.name, r.completed) for r in records], large_equal=bool(torch.equal(large, large_by_gloo)),
                # bf16 sums of three values may round differently in another order: within an ulp
                reduce_scatter_close=bool(torch.allclose(shard.float(), summed.view(world_size, -1)[rank].float(),
                                                         rtol=2 ** -7, atol=0)),
                all_gather_equal=bool(torch.equal(gathered, by_gloo_gathered) and torch.equal(in_place, gathered)),
                all_to_all_equal=bool(torch.equal(received, by_gloo_received)))


def test_gloo_collectives_small_all_reduce_and_point_to_point_rings():
    """A job's statistics (at most SMALL_ALL_REDUCE_NUMEL values) are all-gathered and summed in rank
    order on gloo: half the sequential messages of the ring all-reduce. Every rank gets the same
    bits, the rank-order sum, within an ulp or so of gloo's ring sum (values of different
    magnitudes make the order visible); larger tensors still take gloo's all-reduce. The
    reduce-scatter, the all-gather (also with the input aliasing its chunk) and the all-to-all run
    as point-to-point messages on gloo and give what gloo's own collectives give, at three ranks."""
    from distributed_utils import run_distributed
    results = run_distributed(_small_all_reduce_worker, 3)
    first = results[0]
    for result in results:
        assert result["mine"] == first["mine"] == result["in_rank_order"]
        assert result["mine"] == pytest.approx(result["by_gloo"], rel=1e-15)
        assert result["collectives"] == [("all_reduce", True)]  # errors still name the caller's collective
        assert result["large_equal"]
        assert result["reduce_scatter_close"] and result["all_gather_equal"] and result["all_to_all_equal"]


def test_point_to_point_posts_every_receive_before_any_send(monkeypatch):
    """gloo sends a large message only once the peer announced its receive; posting the receives first
    keeps that announcement from queueing behind data on a slow link (comm._point_to_point)."""
    posted = []

    class Handle:
        def wait(self):
            posted.append("wait")

    def post(kind):
        def call(tensor, src=None, dst=None, group=None, tag=0, group_src=None, group_dst=None):
            by_group_rank = group_src if kind == "recv" else group_dst
            posted.append((kind, by_group_rank if by_group_rank is not None else (src if kind == "recv" else dst)))
            return Handle()
        return call

    monkeypatch.setattr(comm.dist, "irecv", post("recv"))
    monkeypatch.setattr(comm.dist, "isend", post("send"))
    values = torch.zeros(4)
    global_ranks = [4, 5, 6]  # the group's members
    comm._point_to_point([(1, values), (2, values)], [(2, values), (1, values)], group=None, global_ranks=global_ranks)
    # By rank in the group where torch can (no lookup in its registry of groups: docs/failures.md, "Exit").
    peer = (lambda rank: rank) if comm._P2P_BY_GROUP_RANK else (lambda rank: global_ranks[rank])
    assert posted == [("recv", peer(2)), ("recv", peer(1)), ("send", peer(1)), ("send", peer(2)),
                      "wait", "wait", "wait", "wait"]
