"""The engine on a GPU (test plan layer 4): the side-stream pipeline with CUDA events, one rank.

Runs only where CUDA is available (the lent GPU machine, via benchmarks/gpu_check.sh); one GPU
cannot host two NCCL ranks, so collectives are trivial here and the multi-rank math is covered
by the CPU tests. What this checks: jobs on the side stream, event ordering, fused CUDA kernels,
and that GPU results match the CPU engine's.
"""
import unittest

import pytest
import torch

from distributed_utils import run_distributed
from reference_sim import TinyNet, batch, flat_trainable, loss_fn, param_groups

CASES = [("ShardedAdamW", {}), ("DPU", {}), ("ACCO", {}), ("CO2", {"local_steps": 3})]


def _train_everywhere(rank, world_size, device_name, overlap):
    import deepspeed_acco
    results = {}
    for kind, extra in CASES:
        model = TinyNet(seed=0)
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
                  "optimizer": {"type": kind, "params": dict(lr=1e-2, overlap=overlap, **extra)}}
        engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model), config=config)
        assert engine.device.type == device_name
        for index in range(24):
            x, y = batch(rank, index)
            engine.backward(loss_fn(engine(x.to(engine.device)), y.to(engine.device)))
            engine.step()
        with engine.committed_parameters():
            results[kind] = flat_trainable(model).cpu()
        results[kind + "-holds"] = flat_trainable(model).cpu()
        engine.destroy()
    return results


@pytest.mark.slow
@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA GPU (run benchmarks/gpu_check.sh on the GPU machine)")
def test_gpu_pipeline_matches_cpu_and_overlap_is_bitwise():
    gpu = run_distributed(_train_everywhere, 1, "cuda", True)[0]
    gpu_no_overlap = run_distributed(_train_everywhere, 1, "cuda", False)[0]
    cpu = run_distributed(_train_everywhere, 1, "cpu", True, env={"CUDA_VISIBLE_DEVICES": ""})[0]
    for key in gpu:
        assert torch.equal(gpu[key], gpu_no_overlap[key]), f"{key}: overlap on/off differ on the GPU"
        difference = (gpu[key] - cpu[key]).abs().max().item()
        assert difference < 1e-4, f"{key}: GPU and CPU differ by {difference}"
