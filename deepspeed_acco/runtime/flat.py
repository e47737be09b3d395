"""Flat per-param-group buffers and their shard geometry (docs/design.md, "Notation").

Each param group's trainable parameters are laid out back to back in one flat vector, padded at
the end and split into equal shards, one per rank; rank r owns shard r.

Shards are padded so that every shard starts on a 64-byte boundary in every dtype the pipeline
uses (fp32, bf16, fp16): ``SHARD_ALIGNMENT_ELEMENTS`` = 32 elements is 64 bytes in 2-byte dtypes
and 128 in fp32, so the vectorised kernels run on every rank's shard. DeepSpeed's ZeRO-1 pads
less (to a multiple of 2 x world size); checkpoints convert between the two layouts
(:func:`deepspeed_geometry`, :mod:`deepspeed_acco.runtime.checkpoint`).

The model's parameters become views into ``model_flat``, so installing gathered parameters is a
single copy. Gradients are accumulated into ``grad_accum`` after every backward, in fp32 whatever
the model dtype (or in bf16 for a bf16 model with ``data_types.grad_accum_dtype``), and handed to
a communication job at the round boundary.
"""
import math
from dataclasses import dataclass
from typing import Dict, List

import torch

# Elements per shard-size quantum: 64 bytes in bf16/fp16, 128 bytes in fp32.
SHARD_ALIGNMENT_ELEMENTS = 32
# DeepSpeed ZeRO-1 pads each group to a multiple of nccl_start_alignment_factor (2) * world size.
DEEPSPEED_ALIGNMENT_FACTOR = 2


@dataclass(frozen=True)
class ShardGeometry:
    """How a vector of ``numel`` real elements is padded and split over ``world_size`` equal shards."""

    numel: int
    world_size: int
    shard_numel: int

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    def shard_range(self, rank: int):
        """[start, stop) of rank ``rank``'s shard in padded coordinates."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def valid_numel(self, rank: int) -> int:
        """How many leading elements of rank ``rank``'s shard are real (not padding)."""
        return max(0, min(self.shard_numel, self.numel - rank * self.shard_numel))


def aligned_geometry(numel: int, world_size: int) -> ShardGeometry:
    """Our layout: shards of a multiple of ``SHARD_ALIGNMENT_ELEMENTS`` (64-byte aligned starts)."""
    shard = int(math.ceil(numel / (SHARD_ALIGNMENT_ELEMENTS * world_size))) * SHARD_ALIGNMENT_ELEMENTS
    return ShardGeometry(numel=numel, world_size=world_size, shard_numel=max(shard, SHARD_ALIGNMENT_ELEMENTS))


def deepspeed_geometry(numel: int, world_size: int) -> ShardGeometry:
    """DeepSpeed ZeRO-1's layout, used in checkpoint files so DeepSpeed can load them."""
    alignment = DEEPSPEED_ALIGNMENT_FACTOR * world_size
    return ShardGeometry(numel=numel, world_size=world_size,
                         shard_numel=int(math.ceil(numel / alignment)) * alignment // world_size)


class FlatParamGroup:
    """One param group flattened, with the buffers the pipeline needs for it.

    Buffers (P = padded numel, S = P / world_size):
      model_flat   [P] model dtype  the live parameters; every param is a view into it
      grad_accum   [P] fp32 (bf16)  raw gradient sums of the current round (training thread)
      job_grad     [P] comm dtype   the previous round's gradients, input of the running job
      gather       [P] model dtype  all-gather output of the running job (None if synchronous:
                                    then the job gathers straight into model_flat); when the
                                    communication dtype is the model's, it *is* ``job_grad``
                                    (``gather_shares_job_grad``, below)

    Sharing ``gather`` with ``job_grad`` (docs/precision.md, "Memory: bytes per parameter per rank")
    saves b_m P bytes per rank. It is safe because a job reads ``job_grad`` only in its
    reduce-scatter, which has ended before its update writes the first gathered element, and the
    boundary installs the gathered vector into ``model_flat`` before the next hand-over writes new
    gradients there. Everything that reads ``gather`` between a job's end and the next launch
    (installs, ``committed_flats()``, checkpoints, a pending job restored from one) sees it intact.
    When the communication dtype is the accumulator's, ``job_grad`` ping-pongs with ``grad_accum``
    at every hand-over, and ``gather`` follows it, which is why it is a property.

    ``geometry`` gives the shard this rank owns; CO2 shards the same vector twice (inside its
    group for the inner steps, over all ranks for the outer state), so the padding follows
    ``padding_world_size``, a multiple of the shard world size.
    """

    def __init__(self, params: List[torch.nn.Parameter], param_group: Dict, world_size: int, rank: int,
                 communication_dtype: torch.dtype, synchronous: bool, padding_world_size: int = 0,
                 accumulation_dtype: torch.dtype = torch.float32):
        assert params, "a flat group needs at least one trainable parameter"
        padding_world_size = padding_world_size or world_size
        assert padding_world_size % world_size == 0, "the padding must suit the shard geometry"
        self.params = params
        self.param_group = param_group  # the optimizer's dict: schedulers change its "lr"
        self.rank = rank
        self.numel = sum(p.numel() for p in params)
        padded = aligned_geometry(self.numel, padding_world_size).padded_numel
        self.geometry = ShardGeometry(numel=self.numel, world_size=world_size, shard_numel=padded // world_size)
        self.padded_numel = padded
        self.shard_numel = self.geometry.shard_numel
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
        self.grad_accum = torch.zeros(self.padded_numel, dtype=accumulation_dtype, device=self.device)
        self._accum_views = self._views_of(self.grad_accum)
        self.synchronous = synchronous
        self.set_communication_dtype(communication_dtype)

    def set_communication_dtype(self, communication_dtype: torch.dtype) -> None:
        """(Re)allocate the job's gradient snapshot in ``communication_dtype`` and the all-gather output
        that goes with it; only between jobs (a wire chosen at run time, runtime/wire.py)."""
        if communication_dtype == self.grad_accum.dtype:
            # Ping-pong with grad_accum: the boundary swaps the two instead of copying.
            self.job_grad = torch.zeros_like(self.grad_accum)
        else:
            self.job_grad = torch.zeros(self.padded_numel, dtype=communication_dtype, device=self.device)
        # Our own all-gather output only when the job's gradient snapshot cannot hold it (another dtype).
        self.gather_shares_job_grad = not self.synchronous and self.job_grad.dtype == self.model_dtype
        self._gather = (None if self.synchronous or self.gather_shares_job_grad
                        else torch.zeros_like(self.model_flat))

    @property
    def gather(self):
        """The running (or last) job's all-gather output: ``job_grad`` itself when the dtypes match."""
        return self.job_grad if self.gather_shares_job_grad else self._gather

    def _views_of(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return [flat[s:s + p.numel()].view_as(p) for p, s in zip(self.params, self.offsets)]

    # ---- training thread -------------------------------------------------------------------
    def accumulate_grads(self, multiplier: float = 1.0) -> bool:
        """Add every param's ``.grad`` (times ``multiplier``) into ``grad_accum`` and free it.

        Returns False if no parameter had a gradient.
        """
        views, grads = [], []
        for p, view in zip(self.params, self._accum_views):
            if p.grad is not None:
                views.append(view)
                grads.append(p.grad)
                p.grad = None
        if not views:
            return False
        if multiplier == 1.0 and all(g.dtype == self.grad_accum.dtype for g in grads):
            torch._foreach_add_(views, grads)
        else:
            for view, grad in zip(views, grads):
                view.add_(grad, alpha=multiplier)
        return True

    def hand_over_grads(self, divisor: float = 1.0) -> torch.Tensor:
        """Move the round's gradient sums to ``job_grad`` and restart accumulation from zero.

        ``divisor`` (a reduced-precision ``job_grad`` only) divides the sums as they are cast (fp16's
        pre-division, undone by the job)."""
        if self.job_grad.dtype == self.grad_accum.dtype:
            assert divisor == 1.0, "gradients in the accumulator's dtype are handed over unscaled"
            self.grad_accum, self.job_grad = self.job_grad, self.grad_accum
            self._accum_views = self._views_of(self.grad_accum)
        elif divisor != 1.0:
            torch.mul(self.grad_accum, 1.0 / divisor, out=self.job_grad)
        else:
            self.job_grad.copy_(self.grad_accum)
        self.grad_accum.zero_()
        return self.job_grad

    def install(self, flat: torch.Tensor) -> None:
        """Make the model hold the parameters in ``flat`` (a full padded vector, any dtype)."""
        self.model_flat.copy_(flat)

    # ---- views -----------------------------------------------------------------------------
    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full padded vector (a view)."""
        return flat[self.shard_offset:self.shard_offset + self.shard_numel]

    def unpadded(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[:self.numel]

    def gather_target(self) -> torch.Tensor:
        return self.model_flat if self.gather is None else self.gather
