"""A job that ends without ``engine.destroy()`` exits with status 0 (docs/failures.md, "Exit").

Most training scripts never call ``destroy()``. Each rank here trains an engine of every type at
once (micro-batches interleaved) and ends without destroying them, in a process started the way
``torch.multiprocessing.spawn`` starts its ranks (multiprocessing's spawn context: the process
exits through atexit hooks and interpreter finalisation). The last rank runs the last micro-batch
of the overlapped types only once the other ranks have finished training, so they end with the
last job of every overlapped type inside a collective that waits for it. A worker that returns
from such a collective while the interpreter finalises aborts the process ("terminate called
without an active exception", SIGABRT).

Three endings, one job each (three rank exits with four engines each):

* ``return``: the rank function returns, and reference counting frees the engines before exit,
  so the exit hook must finish the jobs they left running without reaching the engines. Before
  it did, this run ended with exit codes [-6, -6, -6].
* ``destroy-group``: the same, then the script calls ``dist.destroy_process_group()`` (as many
  torchrun scripts end) while those jobs are in flight.
* ``global-destroy-group``: the engines stay in a module global, the script calls
  ``dist.destroy_process_group()``, and the exit hook destroys the engines, which waits for their
  last jobs: none may fail (messages addressed by global rank made every one fail there,
  "communication job failed during shutdown").
"""
import atexit
import json
import logging
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
UPDATES = 12
"""A multiple of CO2's local_steps: the last micro-batch launches a job of every overlapped type. Past
the point where every type has measured its regime and agreed on its wire with the other ranks (a
collective in step(), after CO2's second averaging at the latest): the last rank's lateness must fall
where the other ranks' steps wait for nobody."""
ACCUMULATION = 2
LATE_S = 0.5
"""How long after the other ranks have finished training the last rank runs the last micro-batch
of the overlapped types (they are then freeing their engines and exiting)."""
TIMEOUT_S = 60
"""communication_timeout_s: how long the exit hook would wait for a job that cannot complete."""
EXIT_WITHIN_S = 40
"""From the end of a rank's training to the end of its atexit hooks, less than TIMEOUT_S."""

_KEPT = []
"""The engines of the "global-destroy-group" ending, alive until the interpreter exits."""


def _config(kind, extra):
    params = dict(lr=1e-2, communication_timeout_s=TIMEOUT_S, **extra)
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUMULATION,
            "steps_per_print": 10 ** 9, "optimizer": {"type": kind, "params": params}}


def _write(path, value):
    with open(path + ".tmp", "w") as handle:
        json.dump(value, handle)
    os.replace(path + ".tmp", path)


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


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
    import torch.distributed as dist

    torch.set_num_threads(1)
    logged = _Warnings()
    logging.getLogger("DeepSpeed").getChild("acco").addHandler(logged)
    # Registered before the engines' hooks, so it runs after them, last.
    exit_path = os.path.join(out_dir, f"{ending}_rank{rank}_exit.json")
    atexit.register(lambda: _write(exit_path, {"exited_at": time.time(), "warnings": logged.messages}))
    engines, in_flight = _train_every_type(rank, world_size, ending, out_dir)
    logged.messages.clear()  # from here on, what the end of the job says (a job that failed at exit)
    # The last rank goes on once the others have written this.
    _write(os.path.join(out_dir, f"{ending}_rank{rank}.json"), {"in_flight": in_flight, "trained_at": time.time()})
    if ending == "global-destroy-group":
        _KEPT.extend(engines)
    del engines
    if ending.endswith("destroy-group"):
        dist.destroy_process_group()
    # Returns without destroy(): the process exits through atexit and interpreter finalisation.


@pytest.mark.parametrize("ending", ["return", "destroy-group", "global-destroy-group"])
def test_ranks_that_never_destroy_their_engines_exit_cleanly(tmp_path, ending):
    codes = run_until_exit(_rank, WORLD_SIZE, ending, str(tmp_path), timeout_s=600)
    assert codes == [0] * WORLD_SIZE, f"exit codes {codes} (-6: SIGABRT, None: still running)"
    for rank in range(WORLD_SIZE):
        with open(tmp_path / f"{ending}_rank{rank}.json") as handle:
            trained = json.load(handle)
        with open(tmp_path / f"{ending}_rank{rank}_exit.json") as handle:
            exited = json.load(handle)
        if rank < WORLD_SIZE - 1:  # what they left running: jobs waiting for the late rank
            assert trained["in_flight"] == {"ShardedAdamW": False, "DPU": True, "ACCO": True, "CO2": True}, trained
        # No job failed at the end ("communication job failed during shutdown"), none was left running.
        assert exited["warnings"] == [], (rank, exited["warnings"])
        # No rank waited at exit for a job that could not complete (that wait is TIMEOUT_S).
        assert exited["exited_at"] - trained["trained_at"] < EXIT_WITHIN_S, (rank, exited, trained)
