"""ACCO: accumulate while you communicate, two rounds per update (docs/design.md, 3.3 and 3.4).

Each update's full batch is split into halves A_t, B_t (h = gradient_accumulation_steps / 2
micro-batches per rank each, consecutive in feeding order):

  round A_t   the model holds the estimate theta~_t (theta~_0 = theta_0) and accumulates
              g(theta~_t; A_t); the running job commits theta_t (none for t = 0).
  boundary    wait for the commit, install theta_t; launch the estimate job
              theta~_{t+1} = Peek(theta_t, m_t, v_t, mean of A_t): it reduces A_t, keeps the
              reduced sum (``first_half_sum``) for the commit, and leaves m, v, t untouched.
  round B_t   the model holds theta_t and accumulates g(theta_t; B_t) into a zeroed buffer.
  boundary    wait for the estimate, install theta~_{t+1}; launch the commit job
              theta_{t+1} = AdamW(theta_t, m_t, v_t, (sum A_t + sum B_t) / (|A_t| + |B_t|), t+1):
              it reduces only B_t and adds the kept sum of A_t.

Every committed update averages a full batch, half computed at the committed parameters and half
at an estimate of them. After the step() that ends round A_{t+1} the model holds theta_{t+1}.
With ``dynamic_accumulation`` a round ends as soon as the running job is done (and at least one
micro-batch was fed); each job all-reduces the micro-batch count, and the mean divides by the
global count. With ``sync_after_updates`` N the commit of update N - 1 is waited for and installed
at once, and every later update is ShardedAdamW's (one round of the full batch).
"""
import enum
from dataclasses import dataclass
from typing import Optional

import torch

from ..checks import config_error
from ..jobs import JobKind
from ..schedule import CheckpointState, Schedule
from .params import AdamWParams, CooldownParams, WarmupParams


@dataclass(kw_only=True)
class ACCOParams(CooldownParams, WarmupParams, AdamWParams):
    """Accumulate while you communicate."""

    dynamic_accumulation: bool = False
    """Keep accumulating micro-batches until the running job is done instead of waiting for it
    (uneven hardware); the rounds then follow timing, not gradient_accumulation_steps."""


class Phase(enum.Enum):
    FIRST_HALF = "first_half"
    """A_t: accumulating at theta~_t; the running job commits theta_t (none for t = 0)."""
    SECOND_HALF = "second_half"
    """B_t: accumulating at theta_t; the running job estimates theta~_{t+1} from A_t."""


class ACCO(Schedule):
    type_name = "ACCO"
    Params = ACCOParams
    Phase = Phase
    rounds_per_update = 2

    @classmethod
    def validate_config(cls, params: ACCOParams, batch, world_size: int) -> None:
        accumulation, micro = batch.gradient_accumulation_steps, batch.micro_batch_size
        caller_sets_boundaries = getattr(batch, "caller_sets_boundaries", False)
        if params.dynamic_accumulation and caller_sets_boundaries:
            raise config_error("optimizer.params.dynamic_accumulation", "the HF Trainer and Accelerate decide where "
                               "each update ends (set_gradient_accumulation_boundary), and dynamic accumulation ends "
                               "rounds when a job is done", "set it to false (an even gradient_accumulation_steps "
                               "splits each update into ACCO's two halves)")
        if params.dynamic_accumulation or accumulation % 2 == 0:
            return
        problem = f"ACCO splits each update's micro-batches into two halves, so it must be even, got {accumulation}"
        source = getattr(batch, "accumulation_source", "config")
        if source == "default":
            problem += " (DeepSpeed's default when the key is absent)"
        elif source == "derived":
            problem += (f" (train_batch_size / (train_micro_batch_size_per_gpu {micro} x {world_size} data-parallel "
                        f"ranks))")
        if accumulation == 1 and micro % 2 == 0:
            # Two lines that keep the samples per update.
            fix = (f"keep the batch with two lines: \"train_micro_batch_size_per_gpu\": {micro // 2} and "
                   f"\"gradient_accumulation_steps\": 2 (HF Trainer: --per_device_train_batch_size {micro // 2} "
                   f"--gradient_accumulation_steps 2)")
        elif accumulation == 1:
            fix = (f"set \"gradient_accumulation_steps\": 2 (HF Trainer: --gradient_accumulation_steps 2); "
                   f"train_micro_batch_size_per_gpu {micro} is odd, so an update then takes twice the samples")
        else:
            fix = ("use an even number (e.g. halve train_micro_batch_size_per_gpu and double "
                   "gradient_accumulation_steps)")
        if caller_sets_boundaries:
            # The HF Trainer and Accelerate decide the boundaries, which dynamic accumulation cannot follow.
            raise config_error("gradient_accumulation_steps", problem, fix)
        raise config_error("gradient_accumulation_steps", problem,
                           fix + ", or set optimizer.params.dynamic_accumulation to true")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dynamic_accumulation = bool(self.params.dynamic_accumulation)
        """Rounds end when the running job is done (3.4), not after gradient_accumulation_steps / 2."""
        self.first_half_sum = [torch.zeros_like(shard.grad) for shard in self.shards]
        """Per group, the reduced and unscaled gradient sum of A_t, kept for the commit of update t."""

    # ---- dynamic accumulation (docs/design.md, 3.4) ----------------------------------------------
    @property
    def uneven_rounds(self) -> bool:
        return self.dynamic_accumulation

    def round_ends(self) -> bool:
        if self.dynamic_accumulation and self.running is not None:
            # Accumulate while you communicate: end the round as soon as the job is done.
            return self.round_micro_batches >= 1 and self.running.is_done()
        return super().round_ends()

    def next_step_ends_round(self) -> bool:
        if self.dynamic_accumulation and self.running is not None:
            return self.running.is_done()
        return super().next_step_ends_round()

    def caller_boundaries_error(self) -> Optional[str]:
        if not self.dynamic_accumulation:
            return None
        return ("optimizer.params.dynamic_accumulation: with dynamic accumulation the engine ends "
                "rounds when the running job is done, so it cannot follow the boundaries a caller "
                "sets (set_gradient_accumulation_boundary, as the HF Trainer and Accelerate do); set "
                "dynamic_accumulation to false, or drive the engine with engine.backward(loss) and "
                "engine.step() on every micro-batch")

    def boundary(self) -> None:
        if self.phase is Phase.FIRST_HALF:
            result = self._wait_running()
            if result is not None:
                self._install_gathered()
                self._account_commit(result)
            self._launch(JobKind.ESTIMATE, keep_reduced=self.first_half_sum)
            self.phase = Phase.SECOND_HALF
        else:
            estimate = self._wait_running()
            carried = dict(carried=self.first_half_sum, carried_micro_batches=estimate.global_micro_batches)
            self.phase = Phase.FIRST_HALF
            if self.cooldown_starts_with_next_commit():
                # The last update of the rule (sync_after_updates): its commit is waited for and
                # installed at once, so the synchronous updates that follow start from theta_N.
                self._sync_boundary(**carried)
                return
            self._install_gathered()
            self._launch(JobKind.COMMIT, **carried)

    def checkpoint_state(self) -> CheckpointState:
        state = super().checkpoint_state()
        if self.phase is Phase.SECOND_HALF:
            state.sharded["first_half_sum"] = [values.clone() for values in self.first_half_sum]
        return state

    def check_type_state(self, state: CheckpointState) -> None:
        if state.meta["phase"] == Phase.SECOND_HALF.value and "first_half_sum" not in state.sharded:
            raise ValueError("saved in the second half of an update, but the kept first-half sum is missing")

    def load_type_state(self, state: CheckpointState) -> None:
        if self.phase is Phase.SECOND_HALF:
            for target, values in zip(self.first_half_sum, state.sharded["first_half_sum"]):
                target.copy_(values)
