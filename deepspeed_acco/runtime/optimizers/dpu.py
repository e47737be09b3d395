"""DPU: delayed parameter update, one-step stale gradients (docs/design.md, 3.2).

One round per update; round t consumes full batch B_t while the job launched at the end of round
t-1 commits theta_t. So g_0 = g(theta_0; B_0) and g_t = g(theta_{t-1}; B_t): the model computes
one update behind. After the step() that ends round t+1 the model holds theta_{t+1}.
"""
import enum
from dataclasses import dataclass

from ..jobs import JobKind
from ..schedule import Schedule
from .params import AdamWParams, WarmupParams


@dataclass(kw_only=True)
class DPUParams(WarmupParams, AdamWParams):
    """Delayed parameter update: AdamW params and an optional synchronous warm-up."""


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
        self._launch(JobKind.COMMIT)
