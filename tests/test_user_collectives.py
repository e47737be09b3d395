"""Collectives of the user's own between steps, next to the engine's ordered lane (gloo, CPU).

CO2 with ``group_size`` 2 at W = 4 keeps two of the engine's communicators busy at once (the
group's inner steps and the outer averaging over all ranks, overlapped) while the training loop
all-reduces its loss on the default group after every step and meets a barrier now and then, as
logging and evaluation code do. This must never deadlock (the run is bounded by a timeout) and
must give bitwise the same parameters as the same run without the user's collectives. ACCO, whose
job is in flight across every step, is checked the same way.
"""
import pytest
import torch

from distributed_utils import run_distributed
from reference_sim import TinyNet, batch, flat_trainable, loss_fn, param_groups

ACCUMULATION, LOCAL_STEPS, ROUNDS = 2, 3, 3
RUNS = [("CO2", {"local_steps": LOCAL_STEPS, "group_size": 2}), ("ACCO", {})]


def _train(rank, world_size, user_collectives):
    import torch.distributed as dist

    import deepspeed_acco
    results = {}
    for kind, extra in RUNS:
        model = TinyNet(seed=0)
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUMULATION,
                  "steps_per_print": 1_000_000,
                  "optimizer": {"type": kind, "params": dict(lr=1e-2, weight_decay=0.1, **extra)}}
        engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model), config=config)
        logged = []
        for index in range(ROUNDS * LOCAL_STEPS * ACCUMULATION):
            x, y = batch(rank, index)
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            if user_collectives:
                total = loss.detach().clone()
                dist.all_reduce(total)  # default group, training thread, while a job may be in flight
                logged.append(total.item() / world_size)
                if index % 5 == 4:
                    dist.barrier()
        with engine.committed_parameters():
            committed = flat_trainable(model)
        results[kind] = {"committed": committed, "holds": flat_trainable(model), "steps": engine.global_steps,
                         "logged": logged}
        engine.destroy()
    return results


@pytest.mark.slow
def test_user_collectives_between_steps_neither_deadlock_nor_change_the_result():
    with_user = run_distributed(_train, 4, True, timeout_s=300)
    without = run_distributed(_train, 4, False, timeout_s=300)
    for rank in range(4):
        for kind, _ in RUNS:
            ours, plain = with_user[rank][kind], without[rank][kind]
            assert ours["steps"] == plain["steps"] > 0
            assert torch.equal(ours["committed"], plain["committed"]), f"rank {rank} {kind}: committed parameters"
            assert torch.equal(ours["holds"], plain["holds"]), f"rank {rank} {kind}: what the model holds"
            assert len(ours["logged"]) == ROUNDS * LOCAL_STEPS * ACCUMULATION
    # The logged means are global: every rank logged the same values.
    for kind, _ in RUNS:
        assert all(r[kind]["logged"] == with_user[0][kind]["logged"] for r in with_user)
