"""ShardedAdamW: synchronous ZeRO-1 AdamW, the baseline and parity anchor (docs/design.md, 3.1).

theta_{t+1} = AdamW(theta_t, m_t, v_t, g(theta_t; B_t), t+1): one job per update, waited at once,
gathered straight into the model. Same math as DeepSpeed ZeRO stage 1 with AdamW.
"""
import enum
from dataclasses import dataclass

from ..jobs import JobKind
from ..schedule import Schedule
from .params import AdamWParams


@dataclass(kw_only=True)
class ShardedAdamWParams(AdamWParams):
    """Synchronous ZeRO-1 AdamW: the common AdamW params only."""


class Phase(enum.Enum):
    SYNC = "sync"
    """Accumulating full batch t at theta_t; no job runs between boundaries."""


class ShardedAdamW(Schedule):
    type_name = "ShardedAdamW"
    Params = ShardedAdamWParams
    Phase = Phase
    synchronous = True

    def boundary(self) -> None:
        work = self._launch(JobKind.COMMIT, wait=True)
        self._account_commit(work.wait())
