"""The round schedules with a fake communicator (docs/design.md, section 4, layer 2): what is launched, installed
and sent at which boundary, and what an estimate leaves untouched. No processes, one rank."""
import torch

from deepspeed_acco.runtime.config import parse_config
from deepspeed_acco.runtime.comm import ControlPlane, Lane
from deepspeed_acco.runtime.jobs import JobKind
from deepspeed_acco.runtime.loss_scale import LossScale
from deepspeed_acco.runtime.optimizers import lookup
from deepspeed_acco.runtime.optimizers.acco import Phase
from deepspeed_acco.runtime.schedule import BuildContext


class RecordingCommunicator:
    """A one-rank communicator that records every collective and the sum of what it carried."""

    rank, world_size, name = 0, 1, "fake"
    current_collective = current_started_at = None

    def __init__(self):
        self.log = []

    def reduce_scatter(self, output, input):
        self.log.append(("reduce_scatter", float(input.sum())))
        output.copy_(input)

    def all_gather(self, output, input):
        self.log.append(("all_gather", output.numel()))
        if output.data_ptr() != input.data_ptr():
            output.copy_(input)

    def all_reduce(self, tensor):
        self.log.append(("all_reduce", tensor.numel()))


class Harness:
    """One rank of a type's schedule, built the way the engine builds it, on a recording communicator."""

    def __init__(self, type_name, accumulation=2, overlap=True):
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 3)
        self.communicator = RecordingCommunicator()
        self.lane = Lane(0, torch.device("cpu"), timeout_s=30)
        config = parse_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation,
                               "gradient_clipping": 0.0,
                               "optimizer": {"type": type_name, "params": {"lr": 0.1, "weight_decay": 0.0,
                                                                           "overlap": overlap}}}, world_size=1)
        context = BuildContext(params=config.params, config=config,
                               param_groups=[{"params": list(self.model.parameters())}], rank=0, world_size=1,
                               device=torch.device("cpu"), lane=self.lane, jobs_communicator=self.communicator,
                               control=ControlPlane(None, 1), loss_scale=LossScale(),
                               new_group_communicator=lambda size, name: self.communicator)
        self.schedule = lookup(type_name).build(context)
        self.optimizer = self.schedule.optimizer
        self.commits = []
        self.schedule.on_commit = self.commits.append
        self.inputs = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
        self.cursor = 0

    @property
    def applied_steps(self):
        return self.schedule.progress.applied_steps

    def params(self):
        return self.optimizer.flats[0].model_flat.clone()

    def micro_batch(self, scale=1.0):
        """One micro-batch whose gradient sum is known: returns whether it ended a round."""
        x = self.inputs[self.cursor:self.cursor + 4]
        self.cursor += 4
        (self.model(x).sum() * scale * self.schedule.backward_loss_scale()).backward()
        self.optimizer.flats[0].accumulate_grads()
        return self.schedule.micro_batch_done()

    def collectives(self):
        return [entry[0] for entry in self.communicator.log]


def test_acco_boundaries_launch_estimate_then_commit_and_install_in_order():
    h = Harness("ACCO", accumulation=4)
    shard = h.optimizer.shards[0]
    theta_0 = h.params()
    assert h.schedule.phase is Phase.FIRST_HALF
    assert not h.micro_batch()  # half = 2 micro-batches per round
    assert h.micro_batch()  # end of A_0: launch the estimate, model keeps theta_0
    assert h.schedule.phase is Phase.SECOND_HALF and h.schedule.running_kind is JobKind.ESTIMATE
    assert torch.equal(h.params(), theta_0)
    h.schedule.drain()
    # The estimate ran: no optimizer state changed (no clone/restore either: nothing to restore).
    assert h.applied_steps == 0
    assert shard.state["exp_avg"].abs().sum() == 0 and shard.state["exp_avg_sq"].abs().sum() == 0
    assert torch.equal(shard.master, theta_0)
    assert h.collectives() == ["reduce_scatter", "all_reduce", "all_gather"]
    first_half_sum = h.communicator.log[0][1]

    h.micro_batch()
    assert h.micro_batch()  # end of B_0: install the estimate, launch the commit on A_0 + B_0
    assert h.schedule.phase is Phase.FIRST_HALF and h.schedule.running_kind is JobKind.COMMIT
    estimate = h.params()
    assert not torch.equal(estimate, theta_0)
    h.schedule.drain()
    # The commit sends only B_0's gradients: A_0's reduced sum was kept from the estimate job.
    second_half_sum = h.communicator.log[3][1]
    assert abs(second_half_sum - first_half_sum) > 1e-6
    assert h.applied_steps == 0 and not h.commits  # committed, but not yet installed
    with h.schedule.committed_parameters():
        theta_1 = h.params()
    assert torch.equal(h.params(), estimate)  # the context restored what the model held

    h.micro_batch()
    assert h.micro_batch()  # end of A_1: install theta_1, launch the next estimate
    assert torch.equal(h.params(), theta_1) and torch.equal(shard.master, theta_1)
    assert len(h.commits) == 1 and h.commits[0].global_micro_batches == 4
    assert h.applied_steps == 1 and shard.state["exp_avg"].abs().sum() > 0
    h.lane.close()


def test_dpu_installs_each_update_one_round_late():
    h = Harness("DPU", accumulation=2)
    theta_0 = h.params()
    h.micro_batch()
    assert h.micro_batch()  # round 0 ends: launch commit 1; the model keeps theta_0
    assert torch.equal(h.params(), theta_0) and h.schedule.running_kind is JobKind.COMMIT
    h.micro_batch()
    assert h.micro_batch()  # round 1 (computed at theta_0) ends: install theta_1, launch commit 2
    theta_1 = h.params()
    assert not torch.equal(theta_1, theta_0) and len(h.commits) == 1
    h.schedule.drain()
    assert h.collectives() == ["reduce_scatter", "all_reduce", "all_gather"] * 2
    h.lane.close()


def test_sharded_adamw_commits_at_every_boundary_in_place():
    h = Harness("ShardedAdamW", accumulation=2)
    theta_0 = h.params()
    h.micro_batch()
    assert h.micro_batch()
    assert len(h.commits) == 1 and h.schedule.running is None
    assert not torch.equal(h.params(), theta_0)
    assert h.optimizer.flats[0].gather is None  # gathered straight into the model
    h.lane.close()


def test_overlap_off_gives_identical_parameters():
    results = []
    for overlap in (True, False):
        h = Harness("ACCO", accumulation=2, overlap=overlap)
        for _ in range(12):
            h.micro_batch()
        h.schedule.drain()
        results.append(h.params())
        h.lane.close()
    assert torch.equal(results[0], results[1])


def test_non_finite_gradient_skips_update_and_estimate_and_restores_committed_parameters():
    h = Harness("ACCO", accumulation=2)  # one micro-batch per half
    for _ in range(5):  # through A_2: theta_2 installed, the estimate of update 3 running
        h.micro_batch()
    h.schedule.drain()
    shard = h.optimizer.shards[0]
    state_before = (shard.master.clone(), shard.state["exp_avg"].clone(), shard.state["exp_avg_sq"].clone())
    h.micro_batch(scale=float("nan"))  # B_2 is poisoned: the commit of update 3 must skip
    h.micro_batch()  # end of A_3: installs the skipped commit's result, theta_2, over the estimate
    assert h.commits[-1].skipped and not any(c.skipped for c in h.commits[:-1])
    assert torch.equal(h.params(), state_before[0])
    assert h.applied_steps == 2
    for before, after in zip(state_before, (shard.master, shard.state["exp_avg"], shard.state["exp_avg_sq"])):
        assert torch.equal(before, after)
    h.lane.close()


def test_worker_exception_surfaces_at_the_next_boundary_with_its_traceback():
    h = Harness("DPU", accumulation=1)

    def broken_reduce_scatter(output, input):
        raise RuntimeError("injected failure in the communication worker")

    h.communicator.reduce_scatter = broken_reduce_scatter
    assert h.micro_batch()  # launches the job, which fails on the worker
    try:
        h.micro_batch()  # the next boundary waits for it
    except Exception as error:
        message = str(error)
        assert "injected failure" in message and "broken_reduce_scatter" in message
        assert "commit of update 1" in message
    else:
        raise AssertionError("the worker's exception did not surface")
    h.lane.close()
