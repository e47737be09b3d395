"""Flat per-param-group buffers and their ZeRO-1 shard geometry (DESIGN 3, notation).

Each param group's trainable parameters are laid out back to back in one flat vector, padded at
the end to a multiple of ``2 * world_size`` (DeepSpeed ZeRO-1's alignment, so shards line up with
DeepSpeed checkpoints) and split into ``world_size`` equal shards; rank r owns shard r.

The model's parameters become views into ``model_flat``, so installing gathered parameters is a
single copy. Gradients are accumulated in fp32 into ``grad_accum`` after every backward, whatever
the model dtype, and handed to a communication job at the round boundary.
"""
import math
from typing import Dict, List, Optional

import torch

# DeepSpeed ZeRO-1 pads each group to a multiple of nccl_start_alignment_factor (2) * world size.
DEEPSPEED_ALIGNMENT_FACTOR = 2


def padded_numel(numel: int, world_size: int) -> int:
    alignment = DEEPSPEED_ALIGNMENT_FACTOR * world_size
    return int(math.ceil(numel / alignment)) * alignment


class FlatParamGroup:
    """One param group flattened, with the buffers the pipeline needs for it.

    Buffers (P = padded numel, S = P / world_size):
      model_flat   [P] model dtype  the live parameters; every param is a view into it
      grad_accum   [P] fp32         raw gradient sums of the current round (training thread)
      job_grad     [P] comm dtype   the previous round's gradients, input of the running job
      gather       [P] model dtype  all-gather output of the running job (None if synchronous:
                                    then the job gathers straight into model_flat)
    """

    def __init__(self, params: List[torch.nn.Parameter], param_group: Dict, world_size: int, rank: int,
                 communication_dtype: torch.dtype, synchronous: bool, padding_world_size: Optional[int] = None):
        """``world_size``/``rank`` give the shard geometry; the padding follows ``padding_world_size``
        (default: the same) so that CO2 can shard one vector both inside a group and across all ranks."""
        assert params, "a flat group needs at least one trainable parameter"
        padding_world_size = padding_world_size or world_size
        assert padding_world_size % world_size == 0, "the padding must suit the shard geometry"
        self.params = params
        self.param_group = param_group  # the optimizer's dict: schedulers change its "lr"
        self.world_size = world_size
        self.rank = rank
        self.numel = sum(p.numel() for p in params)
        self.padded_numel = padded_numel(self.numel, padding_world_size)
        self.shard_numel = self.padded_numel // world_size
        self.shard_offset = rank * self.shard_numel
        self.offsets = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        first = params[0]
        self.device = first.device
        self.model_dtype = first.dtype
        self.model_flat = torch.zeros(self.padded_numel, dtype=self.model_dtype, device=self.device)
        for p, start in zip(params, self.offsets):
            view = self.model_flat[start:start + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view
        self.grad_accum = torch.zeros(self.padded_numel, dtype=torch.float32, device=self.device)
        self._accum_views = [self.grad_accum[s:s + p.numel()].view_as(p) for p, s in zip(params, self.offsets)]
        if communication_dtype == torch.float32:
            # Ping-pong with grad_accum: the boundary swaps the two instead of copying.
            self.job_grad = torch.zeros_like(self.grad_accum)
        else:
            self.job_grad = torch.zeros(self.padded_numel, dtype=communication_dtype, device=self.device)
        self.gather = None if synchronous else torch.zeros_like(self.model_flat)

    # ---- training thread -------------------------------------------------------------------
    def accumulate_grads(self) -> bool:
        """Add every param's ``.grad`` into ``grad_accum`` and free it; return False if none had a grad."""
        views, grads = [], []
        for p, view in zip(self.params, self._accum_views):
            if p.grad is not None:
                views.append(view)
                grads.append(p.grad)
                p.grad = None
        if not views:
            return False
        if all(g.dtype == torch.float32 for g in grads):
            torch._foreach_add_(views, grads)
        else:
            for view, grad in zip(views, grads):
                view.add_(grad)
        return True

    def hand_over_grads(self) -> torch.Tensor:
        """Move the round's gradient sums to ``job_grad`` and restart accumulation from zero."""
        if self.job_grad.dtype == torch.float32:
            self.grad_accum, self.job_grad = self.job_grad, self.grad_accum
            self._accum_views = [self.grad_accum[s:s + p.numel()].view_as(p) for p, s in zip(self.params, self.offsets)]
        else:
            self.job_grad.copy_(self.grad_accum)
        self.grad_accum.zero_()
        return self.job_grad

    def install(self, flat: torch.Tensor) -> None:
        """Make the model hold the parameters in ``flat`` (a full padded vector)."""
        self.model_flat.copy_(flat)

    # ---- views -----------------------------------------------------------------------------
    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full padded vector (a view)."""
        return flat[self.shard_offset:self.shard_offset + self.shard_numel]

    def unpadded(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[:self.numel]

    def gather_target(self) -> torch.Tensor:
        return self.model_flat if self.gather is None else self.gather
