"""The engine on GPUs (docs/design.md section 7, layer 4): the real NCCL pipeline, run on the lent GPU machine.

Skipped without CUDA (benchmarks/gpu_check.sh runs them there). What they check:

* World size 1 with a real NCCL group of one (the communicator does not short-cut collectives on
  NCCL): jobs enqueued inline on side streams, CUDA events, the fused CUDA kernels with their
  device-side control tensor, results read back at the boundary; every optimizer type, bitwise
  equal with overlap on and off, and equal to the CPU engine within ``CPU_TOLERANCE``.
* No host synchronisation in steady state: ``torch.cuda.set_sync_debug_mode`` around every step
  after warm-up. Non-boundary steps must not synchronise at all; boundary steps neither, since jobs
  keep their statistics on the device and the boundary's wait polls the job's event.
* A collective of the user's own (an all-reduce of the loss on the default group, from the
  training thread) between steps neither deadlocks nor changes the results.
* World size 2 over NCCL where two GPUs exist, including CO2 with ``group_size`` 2, whose group
  steps and outer averaging are two NCCL communicators in flight at once.
"""
import os
import unittest
import warnings

import pytest
import torch

from distributed_utils import run_distributed
from reference_sim import TinyNet, batch, flat_trainable, loss_fn, param_groups

# Only our engine runs here (and the CPU engine to compare with), never DeepSpeed's: selecting these
# tests prebuilds none of DeepSpeed's ops (tests/conftest.py), whose CUDA FusedAdam takes minutes.
pytestmark = pytest.mark.without_deepspeed_ops

CASES = [("ShardedAdamW", {}), ("DPU", {}), ("ACCO", {}), ("CO2", {"local_steps": 3})]
MICRO_BATCHES = 24
# GPU against CPU after 12 updates at lr 1e-2: matmul reductions differ in order (CUDA vs CPU
# BLAS) and the kernels' sqrt/division round alike only up to the last bit, so parameters drift by
# a few 1e-6; 1e-4 leaves room without hiding a wrong update (one update moves them ~1e-2).
CPU_TOLERANCE = 1e-4

needs_cuda = unittest.skipUnless(torch.cuda.is_available(),
                                 "needs a CUDA GPU (run benchmarks/gpu_check.sh on the GPU machine)")
needs_two_gpus = unittest.skipUnless(torch.cuda.is_available() and torch.cuda.device_count() >= 2,
                                     "needs two CUDA GPUs")


def _config(kind, extra, overlap, accumulation=2):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation,
            "steps_per_print": 1_000_000, "gradient_clipping": 1.0,
            "optimizer": {"type": kind, "params": dict(lr=1e-2, overlap=overlap, **extra)}}


def _check_real_pipeline(engine, device_name):
    """On CUDA: inline lane, NCCL communicators that really communicate (no world-size-1 short-cut)."""
    assert engine.device.type == device_name
    if device_name != "cuda":
        return
    assert engine.lane.inline
    if os.environ.get("ACCO_GPU_CHECK"):  # benchmarks/gpu_check.sh: the fused CUDA kernels, not the fallback
        from deepspeed_acco import ops
        assert ops.backend("cuda") == "cuda", "the fused CUDA kernels did not load"
    communicators = [c for c in engine._communicators if c is not None]
    assert communicators and all(c.backend == "nccl" and not c.local for c in communicators)


def _case_name(kind, extra):
    return kind + (f"-groups-of-{extra['group_size']}" if extra.get("group_size", 1) > 1 else "")


def _train(rank, world_size, device_name, overlap, cases, user_collectives):
    import torch.distributed as dist

    import deepspeed_acco
    results = {}
    for kind, extra in cases:
        name = _case_name(kind, extra)
        model = TinyNet(seed=0)
        engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model),
                                               config=_config(kind, extra, overlap))
        _check_real_pipeline(engine, device_name)
        for index in range(MICRO_BATCHES):
            x, y = batch(rank, index)
            loss = loss_fn(engine(x.to(engine.device)), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            if user_collectives:
                # The user's logging collective on the default group, issued between steps.
                logged = loss.detach().clone()
                dist.all_reduce(logged)
        with engine.committed_parameters():
            results[name] = flat_trainable(model).cpu()
        results[name + "-holds"] = flat_trainable(model).cpu()
        engine.destroy()
    return results


def _train_everywhere(rank, world_size, device_name, overlap, user_collectives=False, cases=None):
    return _train(rank, world_size, device_name, overlap, cases or CASES, user_collectives)


def _assert_matches(ours, theirs, what, tolerance=None):
    for key in ours:
        if tolerance is None:
            assert torch.equal(ours[key], theirs[key]), f"{key}: {what} differ"
        else:
            difference = (ours[key] - theirs[key]).abs().max().item()
            assert difference < tolerance, f"{key}: {what} differ by {difference}"


@pytest.mark.slow
@needs_cuda
def test_gpu_pipeline_at_world_size_one_matches_cpu_and_overlap_is_bitwise():
    gpu = run_distributed(_train_everywhere, 1, "cuda", True)[0]
    gpu_no_overlap = run_distributed(_train_everywhere, 1, "cuda", False)[0]
    gpu_user_collectives = run_distributed(_train_everywhere, 1, "cuda", True, True)[0]
    cpu = run_distributed(_train_everywhere, 1, "cpu", True, env={"CUDA_VISIBLE_DEVICES": ""})[0]
    _assert_matches(gpu, gpu_no_overlap, "GPU overlap on/off")
    _assert_matches(gpu, gpu_user_collectives, "GPU with and without a user all-reduce between steps")
    _assert_matches(gpu, cpu, "GPU and CPU", tolerance=CPU_TOLERANCE)
    initial = flat_trainable(TinyNet(seed=0))
    assert all((gpu[kind] - initial).abs().max() > 1e-3 for kind, _ in CASES), "every type must have trained"


def _sync_report(rank, world_size):
    """Train each type past warm-up, then record every synchronising CUDA call of the steady state."""
    import deepspeed_acco
    reports = {}
    for kind, extra in CASES:
        model = TinyNet(seed=0)
        engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model),
                                               config=_config(kind, extra, overlap=True))
        _check_real_pipeline(engine, "cuda")
        # Inputs on the device beforehand: a pageable host-to-device copy is itself a synchronisation.
        batches = [tuple(t.to(engine.device) for t in batch(rank, index)) for index in range(MICRO_BATCHES * 2)]
        warm_up = 12  # two CO2 rounds (3 inner steps of 2 micro-batches): every job kind has run once
        for x, y in batches[:warm_up]:
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        torch.cuda.synchronize()
        records = []
        for index, (x, y) in enumerate(batches[warm_up:]):
            boundary = engine.is_gradient_accumulation_boundary()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    engine.backward(loss_fn(engine(x), y))
                    engine.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            records += [(index, boundary, str(w.message)) for w in caught if "synchroniz" in str(w.message)]
        reports[kind] = {"records": records, "steps": engine.global_steps}
        engine.destroy()
    return reports


@pytest.mark.slow
@needs_cuda
def test_steady_state_steps_do_not_synchronise_the_host():
    reports = run_distributed(_sync_report, 1)[0]
    for kind, report in reports.items():
        assert report["steps"] > 0
        inside = [r for r in report["records"] if not r[1]]
        assert not inside, f"{kind}: host synchronisation outside round boundaries: {inside[:3]}"
        at_boundaries = [r for r in report["records"] if r[1]]
        assert not at_boundaries, f"{kind}: a job or boundary synchronised with a torch call: {at_boundaries[:3]}"


@pytest.mark.slow
@needs_two_gpus
def test_two_ranks_over_nccl_match_cpu_and_co2_groups_overlap_safely():
    cases = CASES + [("CO2", {"local_steps": 3, "group_size": 2})]
    gpu = run_distributed(_train_everywhere, 2, "cuda", True, False, cases)
    gpu_no_overlap = run_distributed(_train_everywhere, 2, "cuda", False, False, cases)
    gpu_user_collectives = run_distributed(_train_everywhere, 2, "cuda", True, True, cases)
    cpu = run_distributed(_train_everywhere, 2, "cpu", True, False, cases, env={"CUDA_VISIBLE_DEVICES": ""})
    for rank in range(2):
        _assert_matches(gpu[rank], gpu_no_overlap[rank], f"rank {rank}: GPU overlap on/off")
        _assert_matches(gpu[rank], gpu_user_collectives[rank], f"rank {rank}: GPU with/without a user all-reduce")
        _assert_matches(gpu[rank], cpu[rank], f"rank {rank}: GPU and CPU", tolerance=CPU_TOLERANCE)
