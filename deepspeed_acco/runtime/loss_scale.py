"""Loss scaling for fp16 with DeepSpeed's rules, without DeepSpeed's process-group dependencies.

DeepSpeed's ``DynamicLossScaler`` logs overflows through ``deepspeed.comm``, which would have to
wrap our process group; this class follows the same documented rules (``initial_scale_power``,
``loss_scale_window``, ``hysteresis``, ``min_loss_scale``; ``consecutive_hysteresis`` off) and
converts to and from DeepSpeed's scaler objects for checkpoints, so fp16 checkpoints stay
interchangeable with DeepSpeed's.

Rules, per committed update: an overflow uses up one unit of hysteresis; once none is left the
scale is divided by 2 (not below the minimum) and the hysteresis refilled at the next doubling.
After ``window`` consecutive updates without overflow the scale doubles.
"""
import copy
from typing import Any, Dict, Optional

SCALE_FACTOR = 2.0


class LossScale:
    """The loss scale of an engine: static (including 1.0 for fp32/bf16) or dynamic."""

    def __init__(self, scale: float = 1.0, dynamic: bool = False, window: int = 1000, hysteresis: int = 2,
                 min_scale: float = 1.0):
        self.scale = float(scale)
        self.dynamic = dynamic
        self.window = int(window)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.iteration = 0
        self.last_overflow_iteration = -1
        self.hysteresis_left = int(hysteresis)

    @classmethod
    def from_config(cls, options: Optional[Dict[str, Any]]) -> "LossScale":
        """``options``: the parsed fp16 section (None: no scaling, as in fp32 and bf16)."""
        if not options:
            return cls()
        if options["loss_scale"] > 0:
            return cls(scale=options["loss_scale"])
        return cls(scale=2.0**options["initial_scale_power"], dynamic=True, window=options["loss_scale_window"],
                   hysteresis=options["hysteresis"], min_scale=options["min_loss_scale"])

    def update(self, overflow: bool) -> None:
        """Account one committed update (``overflow``: it was skipped for non-finite gradients)."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                self.scale = max(self.scale / SCALE_FACTOR, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            clean_updates = self.iteration - self.last_overflow_iteration - 1
            if clean_updates > 0 and clean_updates % self.window == 0:
                self.hysteresis_left = self.hysteresis
                self.scale *= SCALE_FACTOR
        self.iteration += 1

    def copy(self) -> "LossScale":
        return copy.copy(self)

    # ---- checkpoints: DeepSpeed's scaler objects -----------------------------------------------
    def to_deepspeed(self):
        """A DeepSpeed scaler object with this state (what DeepSpeed stores under "loss_scaler")."""
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        if not self.dynamic:
            return LossScaler(scale=self.scale)
        scaler = DynamicLossScaler(init_scale=self.scale, scale_window=self.window, min_scale=self.min_scale,
                                   delayed_shift=self.hysteresis, consecutive_hysteresis=False,
                                   raise_error_at_min_scale=False)
        scaler.cur_iter = self.iteration
        scaler.last_overflow_iter = self.last_overflow_iteration
        scaler.cur_hysteresis = self.hysteresis_left
        return scaler

    def load_deepspeed(self, scaler) -> None:
        """Continue from a DeepSpeed scaler object (ours saved, or DeepSpeed's own)."""
        self.scale = float(scaler.cur_scale)
        if self.dynamic and getattr(scaler, "dynamic", False):
            self.iteration = int(scaler.cur_iter)
            self.last_overflow_iteration = int(scaler.last_overflow_iter)
            self.hysteresis_left = int(scaler.cur_hysteresis)
