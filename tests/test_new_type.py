"""A new optimizer type is one file plus one registry line (tests/toy_sync_sgd.py): it trains on
the real pipeline (2 ranks), matches torch.optim.SGD on the averaged gradient, and checkpoints."""
import pytest
import torch

from distributed_utils import run_distributed
from reference_sim import Simulator, TinyNet, batch, flat_trainable, loss_fn

LR, MOMENTUM, ACCUMULATION, UPDATES = 0.05, 0.9, 2, 6


def _config():
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": ACCUMULATION,
            "gradient_clipping": 0.0, "steps_per_print": 1000,
            "optimizer": {"type": "SyncSGD", "params": {"lr": LR, "momentum": MOMENTUM}}}


def _worker(rank, world_size, directory):
    import deepspeed_acco
    from toy_sync_sgd import SyncSGD
    deepspeed_acco.register_optimizer_type(SyncSGD)  # the one registry line

    def run(save_at=None, load=False):
        model = TinyNet(seed=0)
        engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=_config())
        start = 0
        if load:
            engine.load_checkpoint(directory, tag="sgd")
            start = save_at
        for index in range(start, UPDATES * ACCUMULATION):
            if index == save_at and not load:
                engine.save_checkpoint(directory, tag="sgd")
            x, y = batch(rank, index)
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        result = (flat_trainable(model), engine.global_steps, type(engine.schedule).__name__)
        engine.destroy()
        return result

    straight = run()
    run(save_at=6)
    resumed = run(save_at=6, load=True)
    return {"straight": straight, "resumed": resumed}


@pytest.mark.slow
def test_a_fifth_type_from_one_file_and_one_registry_line(tmp_path):
    results = run_distributed(_worker, 2, str(tmp_path))
    params, steps, schedule_name = results[0]["straight"]
    assert schedule_name == "SyncSGD" and steps == UPDATES
    assert torch.equal(params, results[1]["straight"][0])
    # Reference: torch.optim.SGD with momentum on the mean gradient of both ranks' micro-batches.
    sim = Simulator(2, two_groups=False)
    sim.optimizer = torch.optim.SGD(sim.trainable, lr=LR, momentum=MOMENTUM, foreach=False)
    for _ in range(UPDATES):
        total, count = sim.gradient_sum(sim.get(), ACCUMULATION)
        sim.adamw([t / count for t in total])
    assert (params - sim.flat()).abs().max().item() <= 1e-6
    # Its momentum buffer went through a checkpoint like AdamW's moments: exact resume.
    assert torch.equal(results[0]["resumed"][0], params)
