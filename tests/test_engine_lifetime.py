"""What an engine keeps and for how long (docs/design.md, 2, "Engine surface"): ``destroy()`` and ``del`` free it without
the garbage collector, and no per-micro-batch record grows between progress reports.

Several engines in one process (a hyper-parameter search, tests, a notebook) must not need
``gc.collect()``: on the first GPU run every type's engine outlived ``destroy(); del engine`` (2120
to 4402 MiB of CUDA memory each for the bench's model) through reference cycles, freed only by the
collector, which allocating GPU memory never triggers. One fresh process (the first engine
of a process meets torch's own lazy import of ``torch._dynamo``, see runtime/initialize.py) runs
every type with the collector disabled from the start and checks weak references to the engine,
its optimizer, schedule, lane, flat groups and their buffers.
"""
import gc
import sys
import weakref

import pytest

from distributed_utils import run_distributed
from reference_sim import TinyNet, batch, loss_fn, param_groups

# Only our engine runs here: selecting these tests prebuilds none of DeepSpeed's ops (tests/conftest.py).
pytestmark = pytest.mark.without_deepspeed_ops

CASES = [("ShardedAdamW", {}), ("DPU", {}), ("ACCO", {}), ("CO2", {"local_steps": 3})]
MICRO_BATCHES = 14  # past the first update's boundary for every type, so every kind of job has run


def _config(kind, extra, steps_per_print):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "steps_per_print": steps_per_print, "optimizer": {"type": kind, "params": dict(lr=1e-2, **extra)}}


def _train_and_destroy(kind, extra):
    """Train, destroy, drop every strong reference; return weak references to what the engine held."""
    import deepspeed_acco
    model = TinyNet(seed=0)
    engine, optimizer, _, _ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model),
                                                        config=_config(kind, extra, steps_per_print=10 ** 9))
    for index in range(MICRO_BATCHES):
        x, y = batch(0, index)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    held = {"engine": engine, "optimizer": optimizer, "schedule": engine.schedule, "lane": engine.lane,
            "model": model}
    for index, flat in enumerate(optimizer.flats):
        held[f"flat group {index}"] = flat
        held[f"flat group {index} gradient accumulator"] = flat.grad_accum
        held[f"flat group {index} model buffer"] = flat.model_flat
    references = {name: weakref.ref(value) for name, value in held.items()}
    engine.destroy()
    del engine, optimizer, model, held, flat
    return references


def _lifetime_worker(rank, world_size):
    gc.disable()  # for the whole process: whatever is freed below is freed by reference counting
    dynamo_imported_before = "torch._dynamo" in sys.modules
    alive = {}
    for kind, extra in CASES:
        references = _train_and_destroy(kind, extra)
        alive[kind] = sorted(name for name, reference in references.items() if reference() is not None)
    return {"alive": alive, "dynamo_imported_before": dynamo_imported_before}


def _loss_record_worker(rank, world_size):
    import logging

    import deepspeed_acco
    messages = []

    class Records(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("DeepSpeed.acco").addHandler(Records())
    logging.getLogger("DeepSpeed.acco").setLevel(logging.INFO)
    results = {}
    for steps_per_print in (10 ** 9, 3):
        model = TinyNet(seed=0)
        engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model),
                                               config=_config("ACCO", {}, steps_per_print))
        losses, held, pending = [], [], []
        for index in range(40):
            x, y = batch(0, index)
            loss = loss_fn(engine(x), y)
            losses.append(float(loss))
            engine.backward(loss)
            engine.step()
            held.append(_tensors_held(engine))
            pending.append(engine._num_losses)  # drops to 0 where the step printed a report
        results[steps_per_print] = {"losses": losses, "tensors_held": held, "pending": pending,
                                    "loss_sum": None if engine._loss_sum is None else float(engine._loss_sum)}
        engine.destroy()
    results["messages"] = [m for m in messages if m.startswith("step=")]
    return results


def _tensors_held(engine):
    """Tensors the engine's own attributes hold, directly or in a list, tuple or deque."""
    import collections

    import torch
    count = 0
    for value in vars(engine).values():
        if isinstance(value, torch.Tensor):
            count += 1
        elif isinstance(value, (list, tuple, collections.deque)):
            count += sum(isinstance(item, torch.Tensor) for item in value)
    return count


@pytest.mark.slow
def test_destroy_and_del_free_every_engine_without_the_garbage_collector():
    result = run_distributed(_lifetime_worker, 1)[0]
    assert not result["dynamo_imported_before"], \
        "the worker must build its process's first optimizer before anything imports torch._dynamo"
    leaks = {kind: names for kind, names in result["alive"].items() if names}
    assert not leaks, f"still alive after destroy() and del, with the garbage collector off: {leaks}"


@pytest.mark.slow
def test_losses_between_reports_are_a_running_sum():
    result = run_distributed(_loss_record_worker, 1)[0]
    rare = result[10 ** 9]
    # No report in 40 micro-batches: the engine keeps one sum, not one tensor per micro-batch.
    assert rare["pending"] == list(range(1, 41))
    assert rare["loss_sum"] == pytest.approx(sum(rare["losses"]), rel=1e-6)
    assert len(set(rare["tensors_held"])) == 1, f"the engine holds more tensors as it trains: {rare['tensors_held']}"
    # Reported every 3 updates: each report is the mean of the losses since the previous one.
    frequent = result[3]
    expected, start = [], 0
    for index, pending in enumerate(frequent["pending"]):
        if pending == 0:
            expected.append(sum(frequent["losses"][start:index + 1]) / (index + 1 - start))
            start = index + 1
    reported = [float(m.split("loss=")[1].split()[0]) for m in result["messages"]]
    assert len(expected) >= 5 and len(reported) == len(expected)
    assert reported == pytest.approx(expected, abs=1e-4)  # the log prints 4 decimals
