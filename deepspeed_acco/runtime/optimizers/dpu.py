"""DPU: delayed parameter update, one-step stale gradients (docs/design.md, 3.2).

One round per update; round t consumes full batch B_t while the job launched at the end of round
t-1 commits theta_t. So g_0 = g(theta_0; B_0) and g_t = g(theta_{t-1}; B_t): the model computes
one update behind. After the step() that ends round t+1 the model holds theta_{t+1}. With
``sync_after_updates`` N the commit of update N - 1 is waited for and installed at once, and every
later update is ShardedAdamW's.
"""
import enum
from dataclasses import dataclass

from ..jobs import JobKind
from ..schedule import Schedule
from .params import AdamWParams, CooldownParams, WarmupParams


@dataclass(kw_only=True)
class DPUParams(CooldownParams, WarmupParams, AdamWParams):
    """Delayed parameter update: AdamW params and an optional synchronous warm-up and cool-down."""


class Phase(enum.Enum):
    DELAYED = "delayed"
    """Accumulating full batch t at theta_{t-1}; the running job commits theta_t (none in round 0)."""


class DPU(Schedule):
    type_name = "DPU"
    Params = DPUParams
    Phase = Phase

    def boundary(self) -> None:
        result = self._wait_running()
        if result is not None:
            self._install_gathered()
            self._account_commit(result)
        if self.cooldown_starts_with_next_commit():
            # The last update of the rule (sync_after_updates): waited for and installed at once, so
            # the synchronous updates that follow compute at theta_N.
            self._sync_boundary()
            return
        self._launch(JobKind.COMMIT)
