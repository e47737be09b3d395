"""A fifth optimizer type written the way a newcomer would add one: synchronous ZeRO-1 SGD with
momentum, in one file. ``tests/test_new_type.py`` registers it with one line and trains with it."""
import enum
from dataclasses import dataclass

import torch

from deepspeed_acco.ops import CONTROL_SKIP, CONTROL_VALUE
from deepspeed_acco.runtime.checks import config_error
from deepspeed_acco.runtime.jobs import JobKind, UpdateRule
from deepspeed_acco.runtime.optimizers.params import PipelineParams
from deepspeed_acco.runtime.schedule import Schedule


@dataclass(kw_only=True)
class SyncSGDParams(PipelineParams):
    """SGD with heavy-ball momentum (``torch.optim.SGD`` semantics, no dampening)."""

    lr: float = 1e-2
    """Learning rate."""
    momentum: float = 0.0
    """mu: momentum factor."""

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        if self.lr <= 0:
            raise config_error(f"{prefix}.lr", f"must be > 0, got {self.lr}", "use e.g. 0.01")
        if not 0.0 <= self.momentum < 1.0:
            raise config_error(f"{prefix}.momentum", f"must lie in [0, 1), got {self.momentum}", "use e.g. 0.9")


class SGDRule(UpdateRule):
    state_names = ("momentum_buffer", )

    def defaults(self, params):
        return dict(lr=params.lr, momentum=params.momentum)

    def hyperparameters(self, param_group):
        return dict(lr=float(param_group["lr"]), momentum=float(param_group["momentum"]))

    def commit(self, master, grad, state, *, step, out, control, lr, momentum):
        # The job decides on the device: control holds the gradient multiplier (averaging and
        # clipping) and a skip flag, which is applied as a select, never read on the host.
        skip = control[CONTROL_SKIP] != 0
        buffer = state["momentum_buffer"]
        new_buffer = buffer * momentum + grad * control[CONTROL_VALUE]  # first step: buffer = grad
        buffer.copy_(torch.where(skip, buffer, new_buffer))
        master.copy_(torch.where(skip, master, master - lr * buffer))
        out.copy_(master)


class Phase(enum.Enum):
    SYNC = "sync"
    """Accumulating full batch t at theta_t; no job runs between boundaries."""


class SyncSGD(Schedule):
    type_name = "SyncSGD"
    Params = SyncSGDParams
    Phase = Phase
    rule = SGDRule()
    synchronous = True

    def boundary(self) -> None:
        work = self._launch(JobKind.COMMIT, wait=True)
        self._account_commit(work.wait())
