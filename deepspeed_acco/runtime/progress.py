"""The engine's progress counters in one record, owned by the schedule (docs/design.md, section 2).

Only the schedule's commit accounting and micro-batch counting change these numbers; the engine
exposes them under DeepSpeed's names (``global_steps``, ``global_samples``, ``micro_steps``,
``skipped_steps``) and checkpoints store the record as it is.
"""
from dataclasses import asdict, dataclass, fields
from typing import Dict


@dataclass
class Progress:
    global_steps: int = 0
    """Update jobs completed and installed, applied or skipped (DeepSpeed's counter)."""
    global_samples: int = 0
    """Samples consumed; with dynamic accumulation, the samples of committed updates, counted globally."""
    micro_steps: int = 0
    """``engine.step()`` calls, i.e. micro-batches this rank fed."""
    applied_steps: int = 0
    """Updates applied (not skipped): the AdamW step count that drives bias correction."""
    skipped_steps: int = 0
    """Updates skipped for non-finite gradients."""
    scheduler_steps: int = 0
    """Times the LR scheduler was stepped."""

    def state_dict(self) -> Dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: Dict[str, int]) -> None:
        for item in fields(self):
            setattr(self, item.name, int(state.get(item.name, 0)))

    def copy(self) -> "Progress":
        return Progress(**asdict(self))
