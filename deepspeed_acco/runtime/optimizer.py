"""The optimizer object ``initialize`` returns: param groups plus this rank's shards of each group.

It is a ``torch.optim.Optimizer`` so that DeepSpeed's and torch's LR schedulers can drive its
``param_groups[i]["lr"]``; the update itself is run by the engine's communication jobs, so
``step()`` is not for users (DeepSpeed's ZeRO optimizers are used the same way).
"""
from typing import Dict, List, Optional

import torch

from .flat import FlatParamGroup
from .jobs import ShardState, UpdateRule
from .loss_scale import LossScale


class ShardedOptimizer(torch.optim.Optimizer):
    """Param groups and, per group with trainable parameters, its flat buffers and shard state."""

    def __init__(self, param_groups: List[Dict], defaults: Dict, *, world_size: int, rank: int,
                 communication_dtype: torch.dtype, synchronous: bool, rule: UpdateRule, padding_world_size: int = 0,
                 accumulation_dtype: torch.dtype = torch.float32):
        super().__init__(param_groups, defaults)
        self.flats: List[FlatParamGroup] = []
        for group in self.param_groups:
            trainable = [p for p in group["params"] if p.requires_grad]
            if trainable:
                self.flats.append(FlatParamGroup(trainable, group, world_size, rank, communication_dtype, synchronous,
                                                 padding_world_size, accumulation_dtype=accumulation_dtype))
        if not self.flats:
            raise ValueError("model_parameters: no parameter requires a gradient; there is nothing to optimize")
        self.shards = [ShardState(flat, communication_dtype, rule) for flat in self.flats]
        # DeepSpeed's optimizers report this after each step; the engine keeps it current.
        self.overflow = False
        self._loss_scale: Optional[LossScale] = None

    def attach_loss_scale(self, loss_scale: LossScale) -> None:
        """The schedule's loss scale, which ``cur_scale`` and ``loss_scale`` report."""
        self._loss_scale = loss_scale

    @property
    def cur_scale(self) -> float:
        """The current loss scale, as DeepSpeed's fp16 optimizers have it (dynamic or static in fp16;
        1.0 in bf16 and fp32). Read by training loops written for DeepSpeed's fp16 optimizers."""
        return float(self._loss_scale.scale) if self._loss_scale is not None else 1.0

    @property
    def loss_scale(self) -> float:
        """DeepSpeed's alias of ``cur_scale``."""
        return self.cur_scale

    def step(self, closure=None):
        raise RuntimeError("deepspeed_acco runs the optimizer inside engine.step(); call engine.step() once per "
                           "micro-batch instead of optimizer.step()")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop any ``.grad`` the model holds; the engine's accumulated gradients are not affected."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
