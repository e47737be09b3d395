"""The training engine for our optimizer types: DeepSpeed's engine interface on the overlapped pipeline.

Users keep DeepSpeed's loop (``loss = engine(batch); engine.backward(loss); engine.step()``, once
per micro-batch). The engine backpropagates with the round's loss scale, accumulates gradients in
fp32 and hands every ``step()`` to the type's schedule, which runs the round boundaries and owns
the counters; the engine reports progress, and saves and loads checkpoints.

The engine is a ``deepspeed.runtime.engine.DeepSpeedEngine`` (it does not run DeepSpeed's
constructor, which would build DeepSpeed's own optimizer), so code that recognises DeepSpeed's
engine by type (the Hugging Face Trainer, Accelerate) unwraps and drives it the same way. The
part of DeepSpeed's interface those callers use is implemented here (docs/hf.md lists it):
caller-decided accumulation boundaries (``set_gradient_accumulation_boundary``), the config
queries, ``no_sync``, ``save_16bit_model``; every other DeepSpeedEngine method raises
``NotImplementedError`` naming itself.

Where a caller reads the module directly, it sees the committed parameters (ACCO's model holds
an estimate in first-half rounds, DPU's lags one update, CO2's is a local replica):
``module.state_dict()`` returns them, and a forward in evaluation mode without autograd (how
trainers evaluate) runs on them until training resumes. Both only wait for the local job, so
they are left out under dynamic accumulation, whose ranks can be a round apart: there,
``engine.committed_parameters()`` (collective) is the way.
"""
import atexit
import collections
import contextlib
import logging
import os
import weakref
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine

from .. import ops
from .builder import build, local_rank
from .comm import CommunicationError
from .config import EngineConfig, no_effect_note
from .jobs import JobResult
from .regime import Regime

logger = logging.getLogger("DeepSpeed").getChild("acco")

_RECENT_COMMITS = 1024
_LIVE_ENGINES: "weakref.WeakSet[AccoEngine]" = weakref.WeakSet()
_NOT_DESTROYED: "set[_Leftovers]" = set()
"""What each engine that was not destroyed leaves for the exit hook, whether it is still alive or not."""
_EXIT_HOOK_REGISTERED = False


class _Leftovers:
    """What an engine must stop and release before the interpreter finalizes, held without the engine.

    Most scripts never call ``destroy()``, and the engine is usually a local of a function that has
    returned by the time the interpreter exits: reference counting has freed it, so the exit hook
    cannot reach it. Freeing its lane lets the workers run the jobs already queued, then exit, but
    waits for nothing, and the process groups stay registered. A worker that returns from a
    collective while the interpreter finalizes is ended by Python inside torch's C++ frames, which
    aborts the process ("terminate called without an active exception", SIGABRT). So this record
    keeps the lane's threads and the engine's process groups, nothing else (no buffer, no reference
    to the engine), for the exit hook.
    """

    def __init__(self, threads, groups: list, timeout_s: float):
        self.threads = threads
        self.groups = groups
        self.timeout_s = timeout_s
        self.failed = False
        """The engine's pipeline failed (a job raised, or a collective hung): nothing is waited for,
        as ``destroy()`` then waits for nothing."""

    def release_groups(self) -> None:
        """Destroy the engine's process groups (its workers must have exited) and drop the references."""
        groups, self.groups = self.groups, []
        for group in groups:
            if dist.is_initialized():  # else destroy_process_group() of the default group destroyed them all
                try:
                    dist.destroy_process_group(group)
                except ValueError:  # destroyed already (the group is no longer registered)
                    pass

    def finish(self) -> None:
        """Let the workers run the jobs already queued (every rank queued the same ones), then release."""
        self.threads.stop()
        if self.threads.join(0.0 if self.failed else self.timeout_s):
            self.release_groups()
        elif not self.failed:
            logger.warning("deepspeed_acco: a communication job was still running %.0f s into interpreter exit "
                           "(communication_timeout_s); a peer is probably dead or stuck, and the process may "
                           "abort as it exits", self.timeout_s)


def _destroy_live_engines() -> None:
    """At interpreter exit (before ``destroy_process_group()`` of the default group, whose hook is
    registered first): destroy the engines still alive, then finish and release what the engines freed
    without ``destroy()`` left running; docs/failures.md, "Exit"."""
    for engine in list(_LIVE_ENGINES):
        engine.destroy()
    for leftovers in list(_NOT_DESTROYED):
        leftovers.finish()
    _NOT_DESTROYED.clear()


def _track(engine: "AccoEngine") -> None:
    global _EXIT_HOOK_REGISTERED
    _LIVE_ENGINES.add(engine)
    groups = {id(c.group): c.group for c in engine._communicators if c is not None and c.group is not None}
    if engine.control.group is not None:
        groups[id(engine.control.group)] = engine.control.group
    engine._leftovers = _Leftovers(engine.lane.threads, list(groups.values()), engine.lane.timeout_s)
    _NOT_DESTROYED.add(engine._leftovers)
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


class AccoEngine(DeepSpeedEngine):
    """DeepSpeed-compatible engine running one of our optimizer types on the overlapped pipeline."""

    def __init__(self, *, model: torch.nn.Module, param_groups: List[Dict], config: EngineConfig,
                 lr_scheduler: Any = None, training_data=None, collate_fn=None, device: torch.device):
        # DeepSpeedEngine.__init__ would build DeepSpeed's own optimizer and ZeRO state; our engine
        # is a DeepSpeedEngine by type only, so only torch.nn.Module is initialised.
        torch.nn.Module.__init__(self)
        self.engine_config = config
        self.module = model
        self.device = device
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.dp_world_size = self.world_size
        self.mp_world_size = 1
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
        self.schedule.on_commit = _weak_method(self._after_commit)
        self._failure: Optional[BaseException] = None
        self._loss_sum: Optional[torch.Tensor] = None
        """Sum of the micro-batch losses since the last progress report, in float64 on the loss's device:
        a running sum, so an engine that reports rarely (``steps_per_print`` 10**9) keeps one tensor."""
        self._num_losses = 0
        self._last_grad_norm: Optional[float] = None
        self._step_applied = False
        self._job_timings: Dict[str, float] = {}
        self._caller_boundary: Optional[bool] = None
        """The boundary set by set_gradient_accumulation_boundary; None while the engine counts (DeepSpeed's
        managed accumulation)."""
        self._inside_no_sync = False
        self._evaluation_view: Optional[contextlib.ExitStack] = None
        """Open while an evaluation forward made the model hold the committed parameters."""
        self._short_update_logged = False
        self._committed_depth = 0
        """Nesting depth of committed_parameters() contexts: the model holds the committed parameters."""
        self.recent_commits = collections.deque(maxlen=_RECENT_COMMITS)
        """Results of the latest installed commits (micro-batch counts, norms, skips, phase timings)."""
        self._module_hooks = [] if self.schedule.uneven_rounds else _register_module_hooks(self, model)
        _track(self)
        batch = config.batch
        _log_rank0(f"engine ready: type={config.optimizer_type} ranks={self.world_size} "
                   f"train_batch_size={batch.train_batch_size} micro_batch={batch.micro_batch_size} "
                   f"accumulation={batch.gradient_accumulation_steps} precision={config.precision} "
                   f"overlap={self.schedule.overlap} update_backend={ops.backend(device)}{_compression_note(config)}")
        self.defaults_note = parts.defaults_note
        """What the defaults did for this config, logged once here (docs/design.md, 2 "Defaults")."""
        if self.defaults_note:
            _log_rank0(self.defaults_note)
        if no_effect_note(config):  # keys the config gives that do nothing here (docs/usage.md)
            _log_rank0(no_effect_note(config), logging.WARNING)

    def __del__(self):
        # DeepSpeedEngine.__del__ calls destroy(); ours finishes jobs and releases process groups,
        # which must not happen at an arbitrary garbage collection. destroy() runs at exit anyway.
        pass

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

    def regime(self) -> Optional[Regime]:
        """Measured compute and communication time per update, the communication share, each type's
        predicted time per update on each wire from the bounds, and the wire this engine chose
        (runtime/regime.py, runtime/wire.py; docs/wire.md, "Where the time goes" and "The wire"). The
        window is the one logged once near the start (:data:`~deepspeed_acco.runtime.regime.DECISION_UPDATES`
        updates after the first); before its end, the updates since the first; None before a job finished."""
        return self.schedule.regime()

    @property
    def wire(self) -> str:
        """The wire the communication jobs run on now ("bf16", "fp32", "fp16", "int8", "int4")."""
        return self.schedule.wire_name

    def _note_regime(self) -> None:
        message = self.schedule.take_regime_log()
        if message:
            # At WARNING: DeepSpeed's logger shows nothing below it by default, and this line is the
            # one report a user reads to choose a type and see the wire (docs/wire.md, "The wire").
            _log_rank0(message, logging.WARNING)

    def time_breakdown(self) -> Dict[str, float]:
        """Cumulative seconds of this rank's training thread, per part: ``compute`` (forward and
        backward), ``blocked`` (waiting for communication), ``optimizer`` (waiting for a job's shard
        update), ``boundary`` (the rest of the round boundaries); docs/wire.md, "Where the time goes"."""
        return self.schedule.time.snapshot()

    @property
    def timeline(self):
        """The training thread's and the jobs' events while recording (``engine.timeline.start()``;
        ``deepspeed_acco.runtime.timeline.chrome_trace`` writes them as a Chrome/Perfetto trace)."""
        return self.schedule.time.timeline

    def wire_bytes_per_job(self) -> Dict[str, int]:
        """Bytes this rank sends per update job (CO2: per outer averaging job), by collective:
        ``{"reduce_scatter": ..., "all_gather": ...}``, with or without compression (docs/wire.md, "Compressed communication")."""
        return self.schedule.wire_bytes_per_job()

    @property
    def phase(self):
        """The schedule's current phase (an enum of the optimizer type's module)."""
        return self.schedule.phase

    # ---- the training loop -----------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        self._check_healthy()
        if self.engine_config.auto_cast:  # fp16.auto_cast: DeepSpeed's rule, positional inputs only
            inputs = cast_floating(inputs, self.engine_config.model_torch_dtype)
        if not torch.is_grad_enabled():  # an evaluation: not part of training's time
            return self.module(*inputs, **kwargs)
        with self.schedule.time.timed("compute", "forward"):
            return self.module(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss`` and add the gradients to this round's fp32 accumulation buffers.

        Every update averages its micro-batches' gradients by their global count inside the job,
        which is what DeepSpeed's ``scale_wrt_gas=True`` computes. With ``scale_wrt_gas=False`` the
        caller has already divided the loss by the accumulation (HF Trainer), so that division is
        undone here and the update is the same. Returns the loss as DeepSpeed does (divided by
        gradient_accumulation_steps when ``scale_wrt_gas``).

        After ``set_gradient_accumulation_boundary`` this also counts the micro-batch, and ends a
        round inside the update where the type puts one (ACCO's first half): callers that set the
        boundary call ``step()`` only at their boundary.
        """
        self._check_healthy()
        self._leave_evaluation_view()
        if self._caller_boundary is not None:
            self._check_room_for_micro_batch()
        scale = self.schedule.backward_loss_scale()
        accumulation = self.engine_config.batch.gradient_accumulation_steps
        multiplier = 1.0 if scale_wrt_gas else float(accumulation)
        with self.schedule.time.timed("compute", "backward"):
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
            for flat in self.optimizer.flats:
                flat.accumulate_grads(multiplier)
        # float64 and in feeding order: the report's mean equals a Python sum of the losses read one by one.
        value = (loss.detach() * multiplier).double()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._num_losses += 1
        if self._caller_boundary is not None:
            self._guard(self._caller_micro_batch_done)
        return loss / accumulation if scale_wrt_gas else loss

    def step(self, lr_kwargs=None) -> None:
        """End one micro-batch; at a round boundary the schedule waits, installs and launches.

        After ``set_gradient_accumulation_boundary`` the caller decides: ``step()`` ends the update
        when the boundary is set and does nothing otherwise (``backward`` counted the micro-batch).
        """
        self._check_healthy()
        self._leave_evaluation_view()
        if self._inside_no_sync:
            raise RuntimeError("step() was called inside engine.no_sync(); leave the no_sync() context first "
                               "(DeepSpeed forbids it too)")
        self._step_applied = False
        if self._caller_boundary is None:
            self._guard(self.schedule.micro_batch_done)
        elif self._caller_boundary:
            self._guard(self._end_update_at_caller_boundary)

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` ends an update (DeepSpeed's meaning).

        Without a caller-set boundary: whether it ends a round (with dynamic accumulation: whether
        the running job is done); after ``set_gradient_accumulation_boundary(b)``: ``b``.
        """
        if self._caller_boundary is not None:
            return self._caller_boundary
        return self.schedule.next_step_ends_round()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Let the caller decide where updates end, as DeepSpeed does (HF Trainer, Accelerate).

        From the first call on, ``backward`` counts micro-batches and the update ends at the
        ``step()`` made while the boundary is set. Rounds inside an update still end where the type
        puts them (ACCO's halves). An update may end early (the short last update of an epoch): it
        then holds fewer micro-batches and averages like DeepSpeed, dividing by the accumulation
        the config sets, since the caller normalised the loss over the micro-batches it fed. An
        update cannot hold more than gradient_accumulation_steps micro-batches per rank.
        """
        error = self.schedule.caller_boundaries_error()
        if error is not None:
            raise ValueError(error)
        self._caller_boundary = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self):
        """DeepSpeed's ``no_sync``: accepted and free, since gradients stay local until a round ends.

        Our rounds end where the type puts them (ACCO communicates the first half of an update
        while the second half computes, inside ``no_sync`` too); ``step()`` inside is an error, as
        in DeepSpeed.
        """
        previous, self._inside_no_sync = self._inside_no_sync, True
        try:
            yield
        finally:
            self._inside_no_sync = previous

    def was_step_applied(self) -> bool:
        return self._step_applied

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def train(self, mode: bool = True):
        """``torch.nn.Module.train``; back in training mode the model holds what the schedule trains on."""
        torch.nn.Module.train(self, mode)
        if mode:
            self._leave_evaluation_view()
        return self

    def eval(self):
        return self.train(False)

    # ---- DeepSpeed's queries -----------------------------------------------------------------
    def get_lr(self) -> List[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_mom(self) -> List:
        return [group["betas"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        """The global gradient norm of the newest installed update, before clipping."""
        return self._last_grad_norm

    def train_batch_size(self) -> int:
        return self.engine_config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine_config.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.engine_config.batch.gradient_accumulation_steps

    def get_batch_info(self):
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    def gradient_clipping(self) -> float:
        return self.engine_config.gradient_clipping

    def steps_per_print(self) -> Optional[int]:
        return self.engine_config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.engine_config.wall_clock_breakdown

    def managed_gradient_accumulation(self) -> bool:
        return True

    def zero_optimization(self) -> bool:
        return True  # optimizer states are sharded over the ranks, as in ZeRO stage 1

    def zero_optimization_stage(self) -> int:
        return 1

    def zero_optimization_partition_gradients(self) -> bool:
        return False

    def zero_optimization_partition_weights(self) -> bool:
        return False

    def zero_offload_optimizer(self):
        return None

    def zero_offload_param(self):
        return None

    def zero_cpu_offload(self) -> bool:
        return False

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """The config's ``zero_optimization.gather_16bit_weights_on_model_save`` (ZeRO-3 only in DeepSpeed)."""
        zero = self.engine_config.raw.get("zero_optimization") or {}
        return bool(zero.get("gather_16bit_weights_on_model_save",
                             zero.get("stage3_gather_16bit_weights_on_model_save", False)))

    def bfloat16_enabled(self) -> bool:
        return self.engine_config.precision == "bf16"

    def fp16_enabled(self) -> bool:
        return self.engine_config.precision == "fp16"

    def fp16_auto_cast(self) -> bool:
        """Whether the forward casts floating-point inputs to fp16 (``fp16.auto_cast`` under fp16)."""
        return self.engine_config.auto_cast

    def amp_enabled(self) -> bool:
        return False

    def torch_autocast_enabled(self) -> bool:
        return False

    def dynamic_loss_scale(self) -> bool:
        return self.fp16_enabled() and self.schedule.loss_scale.dynamic

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: ``communication_data_type`` if the config gives it, else the
        model's (DeepSpeed's rule; fp32 with compressed gradients, whose int8 codes quantise fp32 sums)."""
        return self.schedule.communication_torch_dtype

    def memory_breakdown(self) -> Dict[str, Any]:
        """The buffers this rank's engine holds, in bytes and bytes per parameter, by category
        (docs/precision.md, "Memory: bytes per parameter per rank"; :mod:`deepspeed_acco.runtime.memory`)."""
        from .memory import engine_breakdown
        return engine_breakdown(self)

    @property
    def is_compiled(self) -> bool:
        return False

    def optimizer_name(self) -> str:
        return self.engine_config.optimizer_type

    def optimizer_params(self) -> Dict[str, Any]:
        return dict(self.engine_config.raw["optimizer"].get("params") or {})

    def scheduler_name(self) -> Optional[str]:
        return (self.engine_config.raw.get("scheduler") or {}).get("type")

    def scheduler_params(self) -> Optional[Dict[str, Any]]:
        return (self.engine_config.raw.get("scheduler") or {}).get("params")

    def dataloader_drop_last(self) -> bool:
        return self.engine_config.dataloader_drop_last

    def get_data_parallel_rank(self) -> int:
        return self.global_rank

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_tensor_parallel_rank(self) -> int:
        return 0

    @property
    def config(self) -> Dict[str, Any]:
        """The DeepSpeed config as given (a dict), like ``DeepSpeedEngine.config``."""
        return self.engine_config.raw

    # ---- committed parameters ----------------------------------------------------------------
    def synchronize(self) -> None:
        """Bring every rank to the same job and wait for it (collective).

        Needed before collective work of your own at a fixed iteration when dynamic accumulation is
        on (ranks may then be a round apart); ``committed_parameters()``, ``save_checkpoint`` and
        ``load_checkpoint`` call it themselves. Without dynamic accumulation it only drains.
        """
        self._check_healthy()
        self._leave_evaluation_view()
        self._guard(self.schedule.synchronize)

    @contextlib.contextmanager
    def committed_parameters(self, wait: bool = True):
        """Evaluate on the newest committed parameters: waits for the running job, restores afterwards.

        ACCO's model holds an estimate during first-half rounds, DPU's lags one update and CO2's
        holds a local replica; inside this context the model holds the latest committed update
        instead. Training math is not affected. Collective (it calls ``synchronize()``).

        ``wait=False``: the newest committed parameters that have already landed on this rank,
        without waiting for the running job and without any collective (the communication keeps
        its timing). Right after the ``step()`` that advanced ``global_steps`` those are that
        update's for every type (CO2: the newest landed anchor); in an ACCO first-half round, where
        the update being committed exists only inside its job, it raises ``LookupError``.
        """
        if not wait:
            self._check_healthy()
            self._leave_evaluation_view()
            with self.schedule.landed_parameters():
                self._committed_depth += 1
                try:
                    yield
                finally:
                    self._committed_depth -= 1
            return
        self.synchronize()
        with self.schedule.committed_parameters():
            self._committed_depth += 1
            try:
                yield
            finally:
                self._committed_depth -= 1

    @property
    def communication_in_flight(self) -> bool:
        """Whether a communication job is running right now (never blocks)."""
        return self.schedule.job_in_flight()

    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False):
        """The module's state dict with the committed parameters (DeepSpeed's method)."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    state.pop(prefix + name, None)
        return state

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the committed parameters in the model's dtype to ``save_dir/save_filename``."""
        self._check_healthy()
        state = {key: value.detach().to("cpu", copy=True)
                 for key, value in self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters).items()}
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            temporary = f"{path}.tmp-{os.getpid()}"
            torch.save(state, temporary)
            os.replace(temporary, path)
        return True

    def destroy(self) -> None:
        """Finish the job in flight (unless the pipeline failed) and stop the communication lane.

        The model is left holding the newest committed parameters.
        """
        if self.lane.closed:
            return
        self._leave_evaluation_view()
        if self._failure is None and (self.schedule.running is not None or self.schedule.uneven_rounds):
            try:
                # With uneven rounds (dynamic accumulation) a peer may have launched one more job
                # than this rank at the same iteration; synchronize() brings both to the same job first.
                self.schedule.synchronize()
            except Exception as error:  # already failing: report, but let shutdown proceed
                self._failure = error
                logger.warning("communication job failed during shutdown: %s", error)
        if self._failure is None:
            committed = self.schedule.committed_flats()  # the job is done: no waiting
            for flat, values in zip(self.optimizer.flats, committed or []):
                flat.install(values)
        for handle in self._module_hooks:
            handle.remove()
        self._module_hooks = []
        stopped = self.lane.close(join_timeout_s=0.0 if self._failure is not None else 10.0)
        if stopped and self._failure is None:
            # Release our process groups while the interpreter is intact: a gloo group that a
            # thread used and that is left to interpreter finalisation can abort the process.
            # destroy_process_group only unregisters a group: its gloo threads live until the last
            # reference goes, so the communicators and the control plane drop theirs here too
            # (otherwise the threads outlive interpreter exit, where finishing the last job aborts).
            self._leftovers.release_groups()
            for communicator in self._communicators:
                if communicator is not None:
                    communicator.release()
            self.control.release()
            self._communicators = []
        _NOT_DESTROYED.discard(self._leftovers)
        _LIVE_ENGINES.discard(self)

    # ---- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        from .checkpoint import save_checkpoint
        self._check_healthy()
        self._leave_evaluation_view()
        return self._guard(lambda: save_checkpoint(self, save_dir, tag=tag, client_state=client_state or {},
                                                   save_latest=save_latest))

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None,
                        trusted_classes=None):
        """DeepSpeed's ``load_checkpoint``. Every file is read with ``torch.load(weights_only=True)``:
        tensors, plain data and DeepSpeed's checkpoint classes; ``trusted_classes`` names further
        classes (or functions) you trust the files to hold, e.g. the objects of your ``client_state``
        (what ``torch.serialization.safe_globals`` accepts). Every file is checked before anything
        changes: a refused load raises ``ValueError`` on every rank and leaves the engine as it was."""
        from .checkpoint import load_checkpoint
        self._check_healthy()
        self._leave_evaluation_view()
        if custom_load_fn is not None:
            raise ValueError("load_checkpoint: custom_load_fn is not supported by deepspeed_acco's engine; "
                             "load the module state dict yourself and pass load_module_only=True for the rest")
        return self._guard(lambda: load_checkpoint(
            self, load_dir, tag=tag, load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states and not load_module_only,
            load_lr_scheduler_states=load_lr_scheduler_states and not load_module_only,
            trusted_classes=trusted_classes))

    # ---- internals: caller-decided boundaries ------------------------------------------------
    def _update_position(self):
        """(index of the round in progress within its update, whether it is the update's last round)."""
        schedule = self.schedule
        index = schedule.round_index_in_update()
        return index, index == schedule.current_rounds_per_update - 1

    def _check_room_for_micro_batch(self) -> None:
        schedule = self.schedule
        _, last = self._update_position()
        if last and schedule.round_micro_batches >= schedule.nominal_round_micro_batches:
            accumulation = self.gradient_accumulation_steps()
            raise RuntimeError(f"backward: the update already holds gradient_accumulation_steps={accumulation} "
                               f"micro-batches per rank and the caller has not ended it; call "
                               f"set_gradient_accumulation_boundary(True) before the last micro-batch's backward and "
                               f"step() after it, and give the caller (Trainer, Accelerate) the same "
                               f"gradient_accumulation_steps as the DeepSpeed config")

    def _caller_micro_batch_done(self) -> None:
        schedule = self.schedule
        schedule.count_micro_batch()
        _, last = self._update_position()
        if not last and not self._caller_boundary and \
                schedule.round_micro_batches >= schedule.nominal_round_micro_batches:
            # A round inside the update (ACCO's first half) ends where the type puts it, unless the
            # caller ends the whole update here: step() then ends it as a short update.
            schedule.end_round()

    def _end_update_at_caller_boundary(self) -> None:
        """End the update now. Each round is counted as its share of gradient_accumulation_steps, so
        that a short update averages as in DeepSpeed (gradient sum / (accumulation x ranks))."""
        schedule = self.schedule
        index, _ = self._update_position()
        if index == 0 and schedule.round_micro_batches == 0:
            raise RuntimeError("step(): the accumulation boundary is set but no backward() ran since the last "
                               "update; call engine.backward(loss) for each micro-batch before the step() that "
                               "ends the update")
        nominal = schedule.nominal_round_micro_batches
        remaining = self.gradient_accumulation_steps() - index * nominal
        if schedule.round_micro_batches < remaining and not self._short_update_logged:
            self._short_update_logged = True
            _log_rank0(f"step {self.global_steps}: the caller ended an update after "
                       f"{index * nominal + schedule.round_micro_batches} of gradient_accumulation_steps="
                       f"{self.gradient_accumulation_steps()} micro-batches (e.g. the last one of an epoch); it is "
                       f"committed as a short update, averaged like DeepSpeed's (logged once)")
        # Rounds the update ends early are counted as the rest of it: for ACCO's first half this lets
        # the estimate use the whole (short) batch, and the empty second half adds nothing.
        schedule.round_micro_batches = remaining
        schedule.end_round()
        while schedule.round_index_in_update() != 0:
            schedule.round_micro_batches = 0
            schedule.end_round()

    # ---- internals: the committed parameters where the module is read directly ----------------
    def _pipeline_usable(self) -> bool:
        return not self.lane.closed and self._failure is None

    def _before_module_forward(self, module: torch.nn.Module) -> None:
        if module.training or torch.is_grad_enabled():
            self._leave_evaluation_view()
        else:
            self._enter_evaluation_view()

    def _enter_evaluation_view(self) -> None:
        if self._evaluation_view is not None or self._committed_depth or not self._pipeline_usable():
            return
        view = contextlib.ExitStack()
        self._guard(lambda: view.enter_context(self.schedule.committed_parameters()))
        self._evaluation_view = view

    def _leave_evaluation_view(self) -> None:
        view, self._evaluation_view = self._evaluation_view, None
        if view is not None:
            view.close()  # the model holds what it held before the evaluation again

    def _committed_into_state_dict(self, module: torch.nn.Module, state_dict, prefix: str) -> None:
        """Replace the trainable parameters in ``state_dict`` by the committed ones, one tensor each
        (tied parameters share theirs)."""
        if self._evaluation_view is not None or self._committed_depth or not self._pipeline_usable():
            return  # the model holds the committed parameters (or nothing else is known)
        self._guard(self.schedule.drain)
        committed = self.schedule.committed_flats()
        if committed is None:
            return
        values = {}
        for flat, full in zip(self.optimizer.flats, committed):
            for p, offset in zip(flat.params, flat.offsets):
                values[id(p)] = full[offset:offset + p.numel()].view_as(p).to(flat.model_dtype, copy=True)
        for name, p in module.named_parameters(remove_duplicate=False):
            key = prefix + name
            if id(p) in values and key in state_dict and not isinstance(state_dict[key], torch.nn.Parameter):
                state_dict[key] = values[id(p)]  # keep_vars=True callers get the parameters themselves

    # ---- internals -------------------------------------------------------------------------
    def _guard(self, action):
        try:
            return action()
        except CommunicationError as error:
            self._failure = error
            self._leftovers.failed = True
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
        self._note_regime()
        self._report_progress()

    def _report_progress(self) -> None:
        interval = self.engine_config.steps_per_print
        progress = self.schedule.progress
        if interval is None:  # never printed (Accelerate sets infinity): keep no losses either
            self._forget_losses()
            return
        if progress.global_steps % interval:
            return
        mean_loss = float(self._loss_sum) / self._num_losses if self._num_losses else float("nan")
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
        self._forget_losses()

    def _forget_losses(self) -> None:
        self._loss_sum = None
        self._num_losses = 0

    def __getattr__(self, name):
        # Like DeepSpeed's engine: unknown attributes come from the wrapped module.
        try:
            return torch.nn.Module.__getattr__(self, name)
        except AttributeError:
            pass
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None and hasattr(module, name):
            return getattr(module, name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}, nor has its module. "
                             f"deepspeed_acco's engine is a DeepSpeedEngine that does not run DeepSpeed's "
                             f"constructor, so DeepSpeed's internal state is not there; docs/hf.md lists the "
                             f"engine interface it implements")


def _weak_method(method):
    """``method`` as a callback that does not keep its object alive.

    The schedule belongs to the engine; a bound method in it would make a cycle that only the garbage
    collector frees, holding every buffer of the engine until it runs (docs/design.md, 2, "Engine surface").
    """
    reference = weakref.WeakMethod(method)

    def call(*args):
        bound = reference()
        if bound is not None:
            bound(*args)
    return call


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor in it cast to ``dtype``, through lists, tuples and dicts
    (``fp16.auto_cast``, as DeepSpeed's engine casts the forward's positional inputs); other values as they are."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(cast_floating(item, dtype) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(item, dtype) for item in value)
    if isinstance(value, dict):
        return {key: cast_floating(item, dtype) for key, item in value.items()}
    return value


def _register_module_hooks(engine: AccoEngine, module: torch.nn.Module) -> list:
    """Hooks that show the committed parameters where the module is read directly (see the module docstring).

    They hold the engine weakly: the module may outlive it.
    """
    reference = weakref.ref(engine)

    def before_forward(hooked_module, args):
        current = reference()
        if current is not None:
            current._before_module_forward(hooked_module)

    def after_state_dict(hooked_module, state_dict, prefix, local_metadata):
        current = reference()
        if current is not None:
            current._committed_into_state_dict(hooked_module, state_dict, prefix)

    def before_load_state_dict(hooked_module, *args):
        current = reference()
        if current is not None:
            current._leave_evaluation_view()  # what gets loaded must not be undone when training resumes

    register_state_dict_post_hook = getattr(module, "register_state_dict_post_hook", None) \
        or module._register_state_dict_hook  # torch < 2.5
    return [module.register_forward_pre_hook(before_forward), register_state_dict_post_hook(after_state_dict),
            module.register_load_state_dict_pre_hook(before_load_state_dict)]


def _unsupported(name: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(
            f"DeepSpeedEngine.{name}() is not available on deepspeed_acco's engine (optimizer type "
            f"{self.engine_config.optimizer_type}): it works on state that DeepSpeed's own optimizers build. "
            f"docs/hf.md lists what the engine implements; for {name}() use one of DeepSpeed's optimizer types")
    method.__name__ = name
    method.__qualname__ = f"AccoEngine.{name}"
    return method


def _unsupported_attribute(name: str):
    def getter(self):
        raise AttributeError(f"DeepSpeedEngine.{name} is not available on deepspeed_acco's engine; docs/hf.md lists "
                             f"what the engine implements")
    return getter


# Every other DeepSpeedEngine method raises a clear error instead of failing on state that
# DeepSpeed's constructor would have created. Static helpers are stateless and stay.
for _name, _value in vars(DeepSpeedEngine).items():
    if _name.startswith("__") or _name in vars(AccoEngine) or isinstance(_value, staticmethod):
        continue
    if callable(_value):
        setattr(AccoEngine, _name, _unsupported(_name))
    elif isinstance(_value, property):  # an AttributeError, so that hasattr() probes keep working
        setattr(AccoEngine, _name, property(_unsupported_attribute(_name)))
del _name, _value
