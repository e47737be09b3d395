"""A delayed optimizer type written the way a newcomer would add one: one-step-stale ZeRO-1 SGD
with momentum, DPU's schedule (docs/design.md, 3.2) on the SGD rule of ``tests/toy_sync_sgd.py``.

Round t feeds batch B_t while the job launched at the end of round t-1 runs on the lane and
commits theta_t; so g_0 = g(theta_0; B_0), g_t = g(theta_{t-1}; B_t) and
theta_{t+1} = theta_t - lr * v_{t+1} with v_{t+1} = momentum * v_t + g_t. The boundary installs
the finished commit and launches the next one.

What is in flight between boundaries (the finished commit's result, the parameters it gathered,
and the parameters the model holds instead of them) is written to checkpoints and restored by the
``Schedule`` base; the momentum buffer travels in DeepSpeed's fields like AdamW's moments. So the
type needs no checkpoint code. ``tests/test_new_type.py`` registers it with one line, trains it,
checks it against a hand simulation and resumes it bitwise from a save taken with a job in flight.
"""
import enum

from toy_sync_sgd import SGDRule, SyncSGDParams

from deepspeed_acco.runtime.jobs import JobKind
from deepspeed_acco.runtime.schedule import Schedule


class Phase(enum.Enum):
    DELAYED = "delayed"
    """Accumulating batch t at theta_{t-1}; the running job commits theta_t (none in round 0)."""


class DelayedSGD(Schedule):
    type_name = "DelayedSGD"
    Params = SyncSGDParams
    Phase = Phase
    rule = SGDRule()

    def boundary(self) -> None:
        result = self._wait_running()
        if result is not None:  # theta_t, committed during the round that just ended
            self._install_gathered()
            self._account_commit(result)
        self._launch(JobKind.COMMIT)  # theta_{t+1} from this round's gradients, while round t+1 runs
