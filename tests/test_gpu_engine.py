"""The engine on GPUs (docs/design.md, section 4, layer 4): the real NCCL pipeline, run on the lent GPU machine.

Skipped without CUDA (benchmarks/gpu_check.sh runs them there). What they check:

* World size 1 with a real NCCL group of one (the communicator does not short-cut collectives on
  NCCL): jobs enqueued inline on side streams, CUDA events, the fused CUDA kernels with their
  device-side control tensor, results read back at the boundary; every optimizer type, bitwise
  equal with overlap on and off, and equal to the CPU engine within ``CPU_TOLERANCE``.
* No host synchronisation in steady state, for every type: ``torch.cuda.set_sync_debug_mode`` around
  every step after warm-up, counting torch's own message ("called a synchronizing CUDA operation";
  its "prototype feature" notice about the mode itself is not a synchronisation). Non-boundary steps
  must not synchronise at all; boundary steps neither, since jobs keep their statistics on the
  device and the boundary's wait polls the job's event.
* ``destroy()`` and ``del`` return CUDA memory to its level before the engine, with the garbage
  collector off (docs/design.md, 2, "Engine surface"): on the first GPU run each engine kept 2120 to 4402 MiB until
  ``gc.collect()``.
* A collective of the user's own (an all-reduce of the loss on the default group, from the
  training thread) between steps neither deadlocks nor changes the results.
* World size 2 over NCCL where two GPUs exist, including CO2 with ``group_size`` 2, whose group
  steps and outer averaging are two NCCL communicators in flight at once.
"""
import gc
import os
import time
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
# torch's warning for a synchronising call under set_sync_debug_mode("warn") (c10/cuda's
# warn_or_error_on_sync). Setting the mode also warns, once, that it "is a prototype feature and does
# not yet detect all synchronizing operations": the first GPU run counted that as a synchronisation.
TORCH_SYNC_WARNING = "called a synchronizing CUDA operation"

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
    import deepspeed_acco
    results = {}
    gc.disable()  # what destroy() and del do not free stays allocated, and _released() sees it
    for kind, extra in cases:
        name = _case_name(kind, extra)
        model = TinyNet(seed=0)
        allocated_before = _cuda_allocated(device_name)
        engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model),
                                               config=_config(kind, extra, overlap))
        _check_real_pipeline(engine, device_name)
        _run_micro_batches(engine, rank, user_collectives)
        with engine.committed_parameters():
            results[name] = flat_trainable(model).cpu()
        results[name + "-holds"] = flat_trainable(model).cpu()
        engine.destroy()
        del engine, model
        _released(allocated_before, device_name, name)
    gc.enable()
    return results


def _run_micro_batches(engine, rank, user_collectives):
    """Train MICRO_BATCHES micro-batches; every tensor made here is freed on return."""
    import torch.distributed as dist
    for index in range(MICRO_BATCHES):
        x, y = batch(rank, index)
        loss = loss_fn(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        if user_collectives:
            # The user's logging collective on the default group, issued between steps.
            logged = loss.detach().clone()
            dist.all_reduce(logged)


def _cuda_allocated(device_name):
    """Bytes of CUDA tensors allocated, without cuBLAS's workspaces (kept per stream for the process's life)."""
    if device_name != "cuda":
        return 0
    torch.cuda.synchronize()
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    return torch.cuda.memory_allocated()


def _released(allocated_before, device_name, name, patience_s=5.0):
    """Assert that the engine just destroyed and deleted left no CUDA tensor behind.

    torch's NCCL watchdog releases the tensors it keeps for completed collectives on its own thread,
    so the check waits up to ``patience_s`` for them; a tensor held by a reference cycle never
    goes (the collector is off), so a leak still fails.
    """
    deadline = time.monotonic() + patience_s
    while True:
        left = _cuda_allocated(device_name) - allocated_before
        if left <= 0 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left <= 0, f"{name}: {left} bytes of CUDA memory still allocated after destroy() and del"


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
            records += [(index, boundary, where) for where in host_synchronisations(caught)]
        reports[kind] = {"records": records, "steps": engine.global_steps}
        engine.destroy()
    return reports


def host_synchronisations(caught):
    """``file:line`` of each synchronising call among the warnings ``caught`` under sync debug mode "warn"."""
    return [f"{w.filename}:{w.lineno}" for w in caught if TORCH_SYNC_WARNING in str(w.message)]


def test_only_torchs_synchronisation_warning_counts():
    caught = [warnings.WarningMessage(message, UserWarning, "engine.py", line) for message, line in (
        ("Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations", 1),
        ("called a synchronizing CUDA operation", 2), ("an unrelated warning", 3))]
    assert host_synchronisations(caught) == ["engine.py:2"]


@pytest.mark.slow
@needs_cuda
def test_steady_state_steps_do_not_synchronise_the_host():
    reports = run_distributed(_sync_report, 1)[0]
    assert sorted(reports) == sorted(kind for kind, _ in CASES)
    failures = []
    for kind, report in reports.items():  # every type is checked before the test fails
        if report["steps"] == 0:
            failures.append(f"{kind}: no update was committed")
        inside = [r for r in report["records"] if not r[1]]
        if inside:
            failures.append(f"{kind}: host synchronisation outside round boundaries: {inside[:3]}")
        at_boundaries = [r for r in report["records"] if r[1]]
        if at_boundaries:
            failures.append(f"{kind}: a job or boundary synchronised with a torch call: {at_boundaries[:3]}")
    assert not failures, "\n".join(failures)


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
