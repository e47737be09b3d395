"""A job that ends without ``engine.destroy()`` exits with status 0 (docs/design.md, 6 "Exit").

Most training scripts never call ``destroy()``. Each rank here trains an engine of every type at
once (micro-batches interleaved) and ends without destroying them, the way a script ends, in a
process started as ``torch.multiprocessing.spawn`` starts its ranks (multiprocessing's spawn
context: interpreter exit with atexit hooks and finalisation). The last rank runs the last
micro-batch of the overlapped types only once the other ranks have ended their rank functions:
they reach interpreter exit with the last job of every overlapped type still inside a collective
that waits for it. Before the exit hook waited for such jobs, a worker
returning from that collective while the interpreter finalised aborted the process ("terminate
called without an active exception") in most runs of this test.

Two endings, one job each: the rank function returns, so reference counting frees the engines
before exit (the hook must reach what they left running without them), and the engines stay in a
module global until exit (the hook destroys them).
"""
import json
import os
import time

import pytest

from distributed_utils import run_until_exit
from reference_sim import TinyNet, batch, loss_fn

# Only our engine runs here: selecting these tests prebuilds none of DeepSpeed's ops (tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.without_deepspeed_ops]

WORLD_SIZE = 3
TYPES = [("ShardedAdamW", {}), ("DPU", {"warmup_sync_updates": 0}), ("ACCO", {"warmup_sync_updates": 0}),
         ("CO2", {"local_steps": 3, "warmup_sync_updates": 0})]
UPDATES = 6
"""A multiple of CO2's local_steps: the last micro-batch launches a job of every overlapped type."""
ACCUMULATION = 2
LATE_S = 0.5
"""How long after the other ranks have ended their functions the last rank runs the last micro-batch
of the overlapped types (they are then exiting)."""

_KEPT = []
"""The engines of the "global" ending, alive until the interpreter exits."""


def _config(kind, extra):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUMULATION,
            "steps_per_print": 10 ** 9, "optimizer": {"type": kind, "params": dict(lr=1e-2, **extra)}}


def _wait_for_the_others(out_dir, ending, world_size):
    paths = [os.path.join(out_dir, f"{ending}_rank{rank}.json") for rank in range(world_size - 1)]
    while not all(os.path.exists(path) for path in paths):
        time.sleep(0.01)
    time.sleep(LATE_S)


def _train_every_type(rank, world_size, ending, out_dir):
    """Train one engine per type; return them and whether each has a job in flight at the end."""
    import deepspeed_acco
    engines = []
    for kind, extra in TYPES:
        model = TinyNet(seed=0)
        engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(),
                                               config=_config(kind, extra))
        engines.append(engine)
    micro_batches = UPDATES * ACCUMULATION
    for index in range(micro_batches):
        x, y = batch(rank, index)
        # ShardedAdamW first: its step waits for its job, so every rank meets there before the last
        # rank falls behind.
        for position, engine in enumerate(engines):
            if index == micro_batches - 1 and position == 1 and rank == world_size - 1:
                _wait_for_the_others(out_dir, ending, world_size)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
    in_flight = {kind: engine.communication_in_flight for (kind, _), engine in zip(TYPES, engines)}
    return engines, in_flight


def _rank(rank, world_size, port, ending, out_dir):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    import torch
    torch.set_num_threads(1)
    engines, in_flight = _train_every_type(rank, world_size, ending, out_dir)
    if ending == "global":
        _KEPT.extend(engines)
    del engines
    path = os.path.join(out_dir, f"{ending}_rank{rank}.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(in_flight, handle)
    os.replace(path + ".tmp", path)
    # Returns without destroy(): the process exits through atexit and interpreter finalisation.


@pytest.mark.parametrize("ending", ["return", "global"])
def test_ranks_that_never_destroy_their_engines_exit_cleanly(tmp_path, ending):
    codes = run_until_exit(_rank, WORLD_SIZE, ending, str(tmp_path), timeout_s=300)
    assert codes == [0] * WORLD_SIZE, f"exit codes {codes} (-6: SIGABRT, None: still running)"
    for rank in range(WORLD_SIZE - 1):  # what they left running at the end: jobs waiting for the late rank
        with open(tmp_path / f"{ending}_rank{rank}.json") as handle:
            in_flight = json.load(handle)
        assert in_flight == {"ShardedAdamW": False, "DPU": True, "ACCO": True, "CO2": True}, in_flight
