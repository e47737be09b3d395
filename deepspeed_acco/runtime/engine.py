"""The training engine for our optimizer types: DeepSpeed's engine interface on the overlapped pipeline.

Users keep DeepSpeed's loop (``loss = engine(batch); engine.backward(loss); engine.step()``, once
per micro-batch). The engine backpropagates with the round's loss scale, accumulates gradients in
fp32 and hands every ``step()`` to the type's schedule, which runs the round boundaries and owns
the counters; the engine reports progress, and saves and loads checkpoints.
"""
import atexit
import collections
import contextlib
import logging
import weakref
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .. import ops
from ..config import EngineConfig
from .builder import build, local_rank
from .comm import CommunicationError
from .jobs import JobResult

logger = logging.getLogger("DeepSpeed").getChild("acco")

_RECENT_COMMITS = 1024
_LIVE_ENGINES: "weakref.WeakSet[AccoEngine]" = weakref.WeakSet()
_EXIT_HOOK_REGISTERED = False


def _destroy_live_engines() -> None:
    """At interpreter exit, finish the jobs still in flight: a job torn down inside a collective aborts gloo."""
    for engine in list(_LIVE_ENGINES):
        engine.destroy()


def _track(engine: "AccoEngine") -> None:
    global _EXIT_HOOK_REGISTERED
    _LIVE_ENGINES.add(engine)
    if not _EXIT_HOOK_REGISTERED:
        atexit.register(_destroy_live_engines)
        _EXIT_HOOK_REGISTERED = True


def _compression_note(config: EngineConfig) -> str:
    compression = config.compression
    if not compression.enabled:
        return ""
    parts = [name for name, on in (("gradients", compression.gradients), ("weights", compression.weights)) if on]
    return (f" compressed={'+'.join(parts)} (int{compression.format.bits}, "
            f"block {compression.format.block_size})")


def _log_rank0(message: str, level: int = logging.INFO) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.log(level, message)


class AccoEngine(torch.nn.Module):
    """DeepSpeed-compatible engine running one of our optimizer types on the overlapped pipeline."""

    def __init__(self, *, model: torch.nn.Module, param_groups: List[Dict], config: EngineConfig,
                 lr_scheduler: Any = None, training_data=None, collate_fn=None, device: torch.device):
        super().__init__()
        self.engine_config = config
        self.module = model
        self.device = device
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = local_rank()
        parts = build(module=model, param_groups=param_groups, config=config, device=device,
                      client_lr_scheduler=lr_scheduler, training_data=training_data, collate_fn=collate_fn)
        self.schedule = parts.schedule
        self.lane = parts.lane
        self.control = parts.control
        self._communicators = parts.communicators
        self.optimizer = self.schedule.optimizer
        self.basic_optimizer = self.optimizer
        self.lr_scheduler = parts.lr_scheduler
        self.training_dataloader = parts.dataloader
        self.monitor = parts.monitor
        self.schedule.on_commit = self._after_commit
        self._failure: Optional[BaseException] = None
        self._losses: List[torch.Tensor] = []
        self._last_grad_norm: Optional[float] = None
        self._step_applied = False
        self._job_timings: Dict[str, float] = {}
        self.recent_commits = collections.deque(maxlen=_RECENT_COMMITS)
        """Results of the latest installed commits (micro-batch counts, norms, skips, phase timings)."""
        _track(self)
        batch = config.batch
        _log_rank0(f"engine ready: type={config.optimizer_type} ranks={self.world_size} "
                   f"train_batch_size={batch.train_batch_size} micro_batch={batch.micro_batch_size} "
                   f"accumulation={batch.gradient_accumulation_steps} precision={config.precision} "
                   f"overlap={self.schedule.overlap} update_backend={ops.backend()}{_compression_note(config)}")

    # ---- counters (owned by the schedule's progress record) ----------------------------------
    @property
    def global_steps(self) -> int:
        """Update jobs completed and installed (applied or skipped), like DeepSpeed's counter."""
        return self.schedule.progress.global_steps

    @property
    def global_samples(self) -> int:
        return self.schedule.progress.global_samples

    @property
    def micro_steps(self) -> int:
        return self.schedule.progress.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.schedule.progress.skipped_steps

    @property
    def communication_wait_s(self) -> float:
        """Cumulative seconds the training thread spent blocked waiting for communication jobs."""
        return self.schedule.total_wait_s

    def wire_bytes_per_job(self) -> Dict[str, int]:
        """Bytes this rank sends per update job (CO2: per outer averaging job), by collective:
        ``{"reduce_scatter": ..., "all_gather": ...}``, with or without compression (docs/design.md, 3.7)."""
        return self.schedule.wire_bytes_per_job()

    @property
    def phase(self):
        """The schedule's current phase (an enum of the optimizer type's module)."""
        return self.schedule.phase

    # ---- DeepSpeed engine interface --------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        self._check_healthy()
        return self.module(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss`` and add the gradients to this round's fp32 accumulation buffers.

        Every update averages its micro-batches' gradients by their global count inside the job,
        which is what DeepSpeed's ``scale_wrt_gas=True`` computes. With ``scale_wrt_gas=False`` the
        caller has already divided the loss by gradient_accumulation_steps (HF Trainer, Accelerate),
        so that division is undone here and the update is the same.
        """
        self._check_healthy()
        scale = self.schedule.backward_loss_scale()
        (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        multiplier = 1.0 if scale_wrt_gas else float(self.engine_config.batch.gradient_accumulation_steps)
        for flat in self.optimizer.flats:
            flat.accumulate_grads(multiplier)
        self._losses.append(loss.detach() * multiplier)
        return loss

    def step(self, lr_kwargs=None) -> None:
        """End one micro-batch; at a round boundary the schedule waits, installs and launches."""
        self._check_healthy()
        self._step_applied = False
        try:
            self.schedule.micro_batch_done()
        except CommunicationError as error:
            self._failure = error
            raise

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` ends a round (with dynamic accumulation: whether the job is done)."""
        return self.schedule.next_step_ends_round()

    def was_step_applied(self) -> bool:
        return self._step_applied

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def get_lr(self) -> List[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        return self._last_grad_norm

    def train_batch_size(self) -> int:
        return self.engine_config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine_config.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.engine_config.batch.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return 1

    def bfloat16_enabled(self) -> bool:
        return self.engine_config.precision == "bf16"

    def fp16_enabled(self) -> bool:
        return self.engine_config.precision == "fp16"

    def optimizer_name(self) -> str:
        return self.engine_config.optimizer_type

    @property
    def config(self) -> Dict[str, Any]:
        """The DeepSpeed config as given (a dict), like ``DeepSpeedEngine.config``."""
        return self.engine_config.raw

    def synchronize(self) -> None:
        """Bring every rank to the same job and wait for it (collective).

        Needed before collective work of your own at a fixed iteration when dynamic accumulation is
        on (ranks may then be a round apart); ``committed_parameters()``, ``save_checkpoint`` and
        ``load_checkpoint`` call it themselves. Without dynamic accumulation it only drains.
        """
        self._check_healthy()
        self._guard(self.schedule.synchronize)

    @contextlib.contextmanager
    def committed_parameters(self):
        """Evaluate on the newest committed parameters: waits for the running job, restores afterwards.

        ACCO's model holds an estimate during first-half rounds, DPU's lags one update and CO2's
        holds a local replica; inside this context the model holds the latest committed update
        instead. Training math is not affected. Collective (it calls ``synchronize()``).
        """
        self.synchronize()
        with self.schedule.committed_parameters():
            yield

    def destroy(self) -> None:
        """Finish the job in flight (unless the pipeline failed) and stop the communication lane."""
        if self.lane.closed:
            return
        if self._failure is None and (self.schedule.running is not None or self.schedule.dynamic_accumulation):
            try:
                # With dynamic accumulation a peer may have launched one more job than this rank
                # at the same iteration; synchronize() brings both to the same job first.
                self.schedule.synchronize()
            except Exception as error:  # already failing: report, but let shutdown proceed
                self._failure = error
                logger.warning("communication job failed during shutdown: %s", error)
        stopped = self.lane.close(join_timeout_s=0.0 if self._failure is not None else 10.0)
        if stopped and self._failure is None:
            # Release our process groups while the interpreter is intact: a gloo group that a
            # thread used and that is left to interpreter finalisation can abort the process.
            groups = {id(c.group): c.group for c in self._communicators if c is not None and c.group is not None}
            if self.control.group is not None:
                groups[id(self.control.group)] = self.control.group
            for group in groups.values():
                dist.destroy_process_group(group)
            self._communicators = []
        _LIVE_ENGINES.discard(self)

    # ---- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        from .checkpoint import save_checkpoint
        self._check_healthy()
        return self._guard(lambda: save_checkpoint(self, save_dir, tag=tag, client_state=client_state or {},
                                                   save_latest=save_latest))

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        from .checkpoint import load_checkpoint
        self._check_healthy()
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint: custom_load_fn is not supported by deepspeed_acco's engine; "
                             "load the module state dict yourself and pass load_module_only=True for the rest")
        return self._guard(lambda: load_checkpoint(
            self, load_dir, tag=tag, load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states and not load_module_only,
            load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only))

    # ---- internals -------------------------------------------------------------------------
    def _guard(self, action):
        try:
            return action()
        except CommunicationError as error:
            self._failure = error
            raise

    def _check_healthy(self) -> None:
        if self.lane.closed:
            raise RuntimeError("the engine was destroyed (engine.destroy() or interpreter exit); create a new one")
        if self._failure is not None:
            raise RuntimeError("the engine's communication pipeline failed earlier; restart from a checkpoint") \
                from self._failure

    def _after_commit(self, result: JobResult) -> None:
        """Reporting for a commit just accounted by the schedule (before the next launch)."""
        self._last_grad_norm = result.grad_norm
        self.optimizer.overflow = result.skipped
        self.recent_commits.append(result)
        progress = self.schedule.progress
        if result.skipped:
            _log_rank0(f"step {progress.global_steps}: non-finite gradient (norm {result.grad_norm}); update skipped "
                       f"on every rank, optimizer state untouched (skipped so far: {progress.skipped_steps})",
                       logging.WARNING)
        else:
            self._step_applied = True
        for name, seconds in result.timings_s.items():
            self._job_timings[name] = self._job_timings.get(name, 0.0) + seconds
        self._report_progress()

    def _report_progress(self) -> None:
        interval = self.engine_config.steps_per_print
        progress = self.schedule.progress
        if interval is None or progress.global_steps % interval:
            return
        losses = [float(loss) for loss in self._losses]
        mean_loss = sum(losses) / len(losses) if losses else float("nan")
        message = (f"step={progress.global_steps} skipped={progress.skipped_steps} samples={progress.global_samples} "
                   f"lr={self.get_lr()} loss={mean_loss:.4f} grad_norm={self._last_grad_norm:.4g}")
        if self.engine_config.wall_clock_breakdown:
            recent = list(self.schedule.recent_wait_s)
            timings = ", ".join(f"{name}={seconds * 1e3 / max(1, progress.global_steps):.1f}"
                                for name, seconds in self._job_timings.items())
            message += (f" | wait per boundary: mean {1e3 * sum(recent) / max(1, len(recent)):.1f} ms, "
                        f"max {1e3 * max(recent, default=0.0):.1f} ms | job ms/update: {timings}")
        _log_rank0(message)
        if self.monitor is not None:
            self.monitor.write_events([("Train/Samples/train_loss", mean_loss, progress.global_samples),
                                       ("Train/Samples/lr", self.get_lr()[0], progress.global_samples),
                                       ("Train/Samples/communication_wait_s", self.communication_wait_s,
                                        progress.global_samples)])
        self._losses.clear()

    def __getattr__(self, name):
        # Like DeepSpeed's engine: unknown attributes come from the wrapped module.
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = super().__getattr__("module")
            if hasattr(module, name):
                return getattr(module, name)
            raise
