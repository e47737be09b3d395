"""The training engine for our optimizer types: DeepSpeed's engine interface on the overlapped pipeline.

Users keep DeepSpeed's loop (``loss = engine(batch); engine.backward(loss); engine.step()``, once
per micro-batch). The engine accumulates gradients in fp32, counts micro-batches, and lets the
type's :class:`~deepspeed_acco.runtime.schedule.Schedule` run the round boundaries; it keeps
DeepSpeed's counters, LR scheduler stepping, logging, monitors and checkpoints.
"""
import atexit
import collections
import contextlib
import logging
import os
import sys
import weakref
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .. import ops
from ..config import ACCO, CO2, DPU, AccoConfig, ShardedAdamW
from .co2 import CO2Schedule
from .comm import CommunicationError, Communicator, Pipeline, new_communicator
from .jobs import JobResult
from .optimizer import ShardedOptimizer
from .schedule import ACCOSchedule, DPUSchedule, ScheduleSettings, ShardedAdamWSchedule

logger = logging.getLogger("deepspeed_acco")

_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_RECENT_COMMITS = 1024
_SCHEDULES = {ShardedAdamW: ShardedAdamWSchedule, DPU: DPUSchedule, ACCO: ACCOSchedule}


def _configure_logger() -> None:
    """Give our logger a stdout handler (as DeepSpeed does for its own) unless the user configured one."""
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[deepspeed_acco] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _log_rank0(message: str, level: int = logging.INFO) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.log(level, message)


class AccoEngine(torch.nn.Module):
    """DeepSpeed-compatible engine running ShardedAdamW, DPU, ACCO or CO2 on the overlapped pipeline."""

    def __init__(self, *, model: torch.nn.Module, param_groups: List[Dict], config: AccoConfig,
                 lr_scheduler: Any = None, training_data=None, collate_fn=None, device: torch.device):
        super().__init__()
        _configure_logger()
        self.config = config
        self._config = config.raw
        self.module = model
        self.device = device
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.global_steps = 0
        """Update jobs completed (applied or skipped), like DeepSpeed's counter."""
        self.global_samples = 0
        """Samples consumed (with dynamic accumulation: samples in committed updates, counted globally)."""
        self.skipped_steps = 0
        self.micro_steps = 0
        self.recent_commits = collections.deque(maxlen=_RECENT_COMMITS)
        """Results of the latest commit jobs (micro-batch counts, norms, skips, phase timings)."""
        self._failure: Optional[BaseException] = None
        self._losses: List[torch.Tensor] = []
        self._last_grad_norm: Optional[float] = None
        self._step_applied = False

        model_dtype = _TORCH_DTYPES[config.precision]
        self.module.to(device=device, dtype=model_dtype if config.precision != "fp32" else None)
        self._broadcast_model()

        self.loss_scaler = self._make_loss_scaler()
        options = config.optimizer
        communication_dtype = _TORCH_DTYPES[config.communication_dtype]
        defaults = dict(lr=options.lr, betas=tuple(options.betas), eps=options.eps, weight_decay=options.weight_decay)
        # A dedicated process group for the worker, so the training loop's own collectives never
        # interleave with the jobs' (DESIGN 6).
        self.communicator = new_communicator(list(range(self.world_size)), options.communication_timeout_s,
                                             name="acco-jobs")
        self.pipeline = Pipeline(self.global_rank, device, [self.communicator], options.communication_timeout_s)
        self._communicators = [self.communicator]
        batch = config.batch
        nominal = batch.gradient_accumulation_steps
        if config.optimizer_type == ACCO:
            nominal = max(1, nominal // 2)
        settings = ScheduleSettings(overlap=options.overlap, gradient_clipping=config.gradient_clipping,
                                    nominal_round_micro_batches=nominal,
                                    dynamic_accumulation=getattr(options, "dynamic_accumulation", False))
        callbacks = dict(applied_steps=lambda: self.optimizer.applied_steps, on_commit=self._account_commit,
                         loss_scale=lambda: float(self.loss_scaler.cur_scale))
        self.optimizer, self.schedule = self._build_optimizer_and_schedule(param_groups, defaults,
                                                                           communication_dtype, settings, callbacks)
        self.basic_optimizer = self.optimizer

        self.lr_scheduler = self._make_lr_scheduler(lr_scheduler)
        self._scheduler_steps = 0
        self.training_dataloader = self._make_dataloader(training_data, collate_fn) if training_data is not None \
            else None
        self.monitor = self._make_monitor()
        self._print_interval = config.steps_per_print
        self._job_timings: Dict[str, float] = {}
        # A job still in flight at interpreter exit would be torn down inside a collective (gloo
        # aborts the process); finish it first. weakref: the hook must not keep the engine alive.
        engine_ref = weakref.ref(self)
        atexit.register(lambda: engine_ref() is not None and engine_ref().destroy())
        _log_rank0(f"engine ready: type={config.optimizer_type} ranks={self.world_size} "
                   f"train_batch_size={batch.train_batch_size} micro_batch={batch.micro_batch_size} "
                   f"accumulation={batch.gradient_accumulation_steps} precision={config.precision} "
                   f"overlap={options.overlap} update_backend={ops.backend()}")

    # ---- set-up helpers --------------------------------------------------------------------
    def _build_optimizer_and_schedule(self, param_groups, defaults, communication_dtype, settings, callbacks):
        """ZeRO-1 over all ranks for ShardedAdamW/DPU/ACCO; for CO2, ZeRO-1 inside each group for
        the inner steps, with flat buffers padded for all ranks so the outer state shards too."""
        options = self.config.optimizer
        if self.config.optimizer_type != CO2:
            optimizer = ShardedOptimizer(param_groups, defaults, world_size=self.world_size, rank=self.global_rank,
                                         communication_dtype=communication_dtype,
                                         synchronous=self.config.optimizer_type == ShardedAdamW)
            schedule = _SCHEDULES[self.config.optimizer_type](optimizer.flats, optimizer.shards, self.communicator,
                                                              self.pipeline, settings, **callbacks)
            return optimizer, schedule
        group_size = options.group_size
        inner = self._group_communicator(group_size, options.communication_timeout_s)
        self._communicators.append(inner)
        optimizer = ShardedOptimizer(param_groups, defaults, world_size=group_size, rank=self.global_rank % group_size,
                                     communication_dtype=communication_dtype, synchronous=True,
                                     padding_world_size=self.world_size)
        schedule = CO2Schedule(optimizer.flats, optimizer.shards, inner, self.pipeline, settings,
                               outer_communicator=self.communicator, local_steps=options.local_steps,
                               outer_lr=options.outer_lr, outer_momentum=options.outer_momentum,
                               gap_penalty=options.gap_penalty, clip_threshold=options.clip_threshold,
                               communication_dtype=communication_dtype, **callbacks)
        return optimizer, schedule

    def _broadcast_model(self) -> None:
        """Start every rank from rank 0's parameters and buffers, as DeepSpeed does."""
        if self.world_size == 1:
            return
        with torch.no_grad():
            for tensor in list(self.module.parameters()) + list(self.module.buffers()):
                dist.broadcast(tensor.data, src=0)

    def _group_communicator(self, group_size: int, timeout_s: float) -> Communicator:
        """CO2's intra-group communicator (ranks g*j .. g*j+g-1); every rank creates every group, in order."""
        if group_size == 1:
            return Communicator(group=None, rank=0, world_size=1, name="co2-local")
        mine = None
        for first in range(0, self.world_size, group_size):
            ranks = list(range(first, first + group_size))
            communicator = new_communicator(ranks, timeout_s, name=f"co2-group-{first // group_size}")
            if self.global_rank in ranks:
                mine = communicator
        return mine

    def _make_loss_scaler(self):
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        if self.config.precision != "fp16":
            return LossScaler(scale=1.0)
        options = self.config.fp16_loss_scale
        if options["loss_scale"] > 0:
            return LossScaler(scale=options["loss_scale"])
        # DeepSpeed's dynamic scaler logs overflows through deepspeed.comm, which must then wrap
        # our process group. Only here: on CPU its shared-memory op makes about one exit in ten
        # abort (measured with a bare two-rank gloo job: 2-3 of 20 with it, 0 of 20 without).
        import deepspeed.comm
        deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False,
                                        dist_init_required=False)
        return DynamicLossScaler(init_scale=2**options["initial_scale_power"], scale_window=options["loss_scale_window"],
                                 min_scale=options["min_loss_scale"], delayed_shift=options["hysteresis"],
                                 consecutive_hysteresis=False, raise_error_at_min_scale=False)

    def _make_lr_scheduler(self, client_scheduler):
        if client_scheduler is not None:
            scheduler = client_scheduler(self.optimizer) if callable(client_scheduler) and not hasattr(
                client_scheduler, "step") else client_scheduler
        else:
            section = self._config.get("scheduler")
            if not section:
                return None
            from deepspeed.runtime import lr_schedules
            name = section.get("type")
            params = section.get("params", {}) or {}
            if hasattr(lr_schedules, str(name)):
                cls = getattr(lr_schedules, name)
            elif hasattr(torch.optim.lr_scheduler, str(name)):
                cls = getattr(torch.optim.lr_scheduler, name)
            else:
                raise ValueError(f"deepspeed_acco config: scheduler.type: unknown scheduler {name!r}; use one of "
                                 f"DeepSpeed's (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) or "
                                 f"a torch.optim.lr_scheduler class name")
            scheduler = cls(self.optimizer, **params)
        # torch schedulers warn unless optimizer.step() ran first; our updates run in jobs instead.
        self.optimizer._opt_called = True
        return scheduler

    def _make_dataloader(self, dataset, collate_fn):
        sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=self.world_size,
                                                                  rank=self.global_rank)
        return torch.utils.data.DataLoader(dataset, batch_size=self.config.batch.micro_batch_size, sampler=sampler,
                                           collate_fn=collate_fn, drop_last=True)

    def _make_monitor(self):
        from deepspeed.monitor.config import get_monitor_config
        monitor_config = get_monitor_config(self._config)
        if not monitor_config.enabled:
            return None
        from deepspeed.monitor.monitor import MonitorMaster
        return MonitorMaster(monitor_config)

    # ---- DeepSpeed engine interface --------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        self._check_healthy()
        return self.module(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss`` and add the gradients to this round's fp32 accumulation buffers.

        The gradients are averaged over the micro-batches of the update inside the job (by the
        global count), so ``scale_wrt_gas`` needs no loss division here.
        """
        self._check_healthy()
        scale = float(self.loss_scaler.cur_scale)
        (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
        for flat in self.optimizer.flats:
            flat.accumulate_grads()
        self._losses.append(loss.detach())
        return loss

    def step(self, lr_kwargs=None) -> None:
        """End one micro-batch; at a round boundary, run the schedule (wait, install, launch)."""
        self._check_healthy()
        self.micro_steps += 1
        if not self.schedule.settings.dynamic_accumulation:
            self.global_samples += self.config.batch.micro_batch_size * self.world_size
        self._step_applied = False
        try:
            self.schedule.micro_batch_done()
        except CommunicationError as error:
            self._failure = error
            raise

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` ends a round (with dynamic accumulation: whether the job is done)."""
        schedule = self.schedule
        if schedule.settings.dynamic_accumulation and schedule.running is not None:
            return schedule.running.is_done()
        return schedule.round_micro_batches + 1 >= schedule.settings.nominal_round_micro_batches

    def was_step_applied(self) -> bool:
        return self._step_applied

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def get_lr(self) -> List[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        return self._last_grad_norm

    def train_batch_size(self) -> int:
        return self.config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.config.batch.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return 1

    def bfloat16_enabled(self) -> bool:
        return self.config.precision == "bf16"

    def fp16_enabled(self) -> bool:
        return self.config.precision == "fp16"

    def optimizer_name(self) -> str:
        return self.config.optimizer_type

    @property
    def communication_wait_s(self) -> float:
        """Cumulative seconds the training thread spent blocked waiting for communication jobs."""
        return self.schedule.total_wait_s

    @property
    def phase(self):
        """The schedule's current :class:`~deepspeed_acco.runtime.schedule.Phase`."""
        return self.schedule.phase

    @contextlib.contextmanager
    def committed_parameters(self):
        """Evaluate on the newest committed parameters: waits for the running job, restores afterwards.

        ACCO's model holds an estimate during first-half rounds and DPU's lags one update; inside
        this context the model holds the latest committed update instead. Training math is not
        affected.
        """
        self._check_healthy()
        with self.schedule.committed_parameters():
            yield

    def destroy(self) -> None:
        """Finish the job in flight (unless the pipeline failed) and stop the communication worker."""
        if self._failure is None and self.schedule.running is not None:
            try:
                self.schedule.drain()
            except Exception as error:  # already failing: report, but let shutdown proceed
                self._failure = error
                logger.warning("communication job failed during shutdown: %s", error)
        stopped = self.pipeline.close(join_timeout_s=0.0 if self._failure is not None else 10.0)
        if stopped and self._failure is None:
            # Release our process groups while the interpreter is intact: a gloo group that a
            # thread used and that is left to interpreter finalisation can abort the process.
            for group in {id(c.group): c.group for c in self._communicators if c.group is not None}.values():
                dist.destroy_process_group(group)
            self._communicators = []

    # ---- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        from .checkpoint import save_checkpoint
        self._check_healthy()
        return save_checkpoint(self, save_dir, tag=tag, client_state=client_state or {}, save_latest=save_latest)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        from .checkpoint import load_checkpoint
        self._check_healthy()
        return load_checkpoint(self, load_dir, tag=tag, load_module_strict=load_module_strict,
                               load_optimizer_states=load_optimizer_states and not load_module_only,
                               load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only)

    # ---- internals -------------------------------------------------------------------------
    def _check_healthy(self) -> None:
        if self.pipeline.closed:
            raise RuntimeError("the engine was destroyed (engine.destroy() or interpreter exit); create a new one")
        if self._failure is not None:
            raise RuntimeError("the engine's communication pipeline failed earlier; restart from a checkpoint") \
                from self._failure

    def _account_commit(self, result: JobResult) -> None:
        """Book-keeping for a commit whose result was just installed (before the next launch)."""
        self.global_steps += 1
        self.recent_commits.append(result)
        self._last_grad_norm = result.grad_norm
        if self.schedule.settings.dynamic_accumulation:
            self.global_samples += result.global_micro_batches * self.config.batch.micro_batch_size
        if hasattr(self.loss_scaler, "update_scale"):
            self.loss_scaler.update_scale(result.skipped)
        if result.skipped:
            self.skipped_steps += 1
            _log_rank0(f"step {self.global_steps}: non-finite gradient (norm {result.grad_norm}); update skipped on "
                       f"every rank, optimizer state untouched (skipped so far: {self.skipped_steps})",
                       logging.WARNING)
        else:
            self.optimizer.applied_steps += 1
            self._step_applied = True
            self._step_lr_scheduler()
        for name, seconds in result.timings_s.items():
            self._job_timings[name] = self._job_timings.get(name, 0.0) + seconds
        self._report_progress()

    def _step_lr_scheduler(self) -> None:
        if self.lr_scheduler is None:
            return
        if self.schedule.settings.dynamic_accumulation:
            # The schedule follows real samples: one scheduler step per train_batch_size samples.
            target = self.global_samples // self.config.batch.train_batch_size
            while self._scheduler_steps < target:
                self.lr_scheduler.step()
                self._scheduler_steps += 1
        else:
            self.lr_scheduler.step()
            self._scheduler_steps += 1

    def _report_progress(self) -> None:
        if self.global_steps % self._print_interval:
            return
        losses = [float(loss) for loss in self._losses]
        mean_loss = sum(losses) / len(losses) if losses else float("nan")
        message = (f"step={self.global_steps} skipped={self.skipped_steps} samples={self.global_samples} "
                   f"lr={self.get_lr()} loss={mean_loss:.4f} grad_norm={self._last_grad_norm:.4g}")
        if self.config.wall_clock_breakdown:
            recent = list(self.schedule.recent_wait_s)
            timings = ", ".join(f"{name}={seconds * 1e3 / max(1, self.global_steps):.1f}"
                                for name, seconds in self._job_timings.items())
            message += (f" | wait per round: mean {1e3 * sum(recent) / max(1, len(recent)):.1f} ms, "
                        f"max {1e3 * max(recent, default=0.0):.1f} ms | job ms/update: {timings}")
        _log_rank0(message)
        if self.monitor is not None:
            self.monitor.write_events([("Train/Samples/train_loss", mean_loss, self.global_samples),
                                       ("Train/Samples/lr", self.get_lr()[0], self.global_samples),
                                       ("Train/Samples/communication_wait_s", self.communication_wait_s,
                                        self.global_samples)])
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
