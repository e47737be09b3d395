"""Per-rank training worker of the bench, started by the ``deepspeed`` launcher (or torchrun).

``python -m deepspeed_acco.bench.running.train --method acco --run-dir DIR ...`` on every rank. It

1. loads the (cached) corpus and builds the GPT-Neo preset from a seeded config;
2. for a DeepSpeed method (with its modifiers, e.g. ``acco+bf16comm``), calls
   ``deepspeed_acco.initialize`` (which delegates DeepSpeed's own optimizer types to
   ``deepspeed.initialize``); for ``compute`` it trains the same model with plain
   ``torch.optim.AdamW`` (fp32 masters under bf16, as DeepSpeed keeps them) and no collective at
   all: the compute-only floor, run with the same number of processes started together, so CPU
   contention is the same;
3. after a barrier, starts the clock and trains, one ``engine(batch)`` / ``engine.backward`` /
   ``engine.step`` per micro-batch, writing one JSON line per committed update to
   ``DIR/rank<R>.jsonl`` (update, samples, wall seconds since the start, mean train loss of the
   update's micro-batches on this rank, cumulative communication wait, lr);
4. evaluates the newest committed parameters on the fixed held-out windows at update 0, every
   ``--eval-every`` updates and at ``--updates``; the ranks split the windows and all-reduce the
   loss, so every rank takes the same decision to stop. The copy is taken right after the step that
   committed the update, under ``engine.committed_parameters(wait=False)``: the parameters that
   have landed, without waiting for the job in flight, so evaluation never changes when a method
   communicates. The clock is paused while the job in flight finishes alone (``eval_comm_s``), the
   parameters are copied (``snapshot_s``) and evaluated (``eval_s``); what the job needed then
   becomes a deadline after the pause that the next boundary waits for if it comes sooner, the wait
   a run without evaluation would have had (:func:`finish_job_in_flight`); a rank's wait for a peer
   to join the job stays on its clock, and every rank carries the same deadline
   (:func:`peer_wait_split`);
5. stops after ``--updates`` committed updates (the equal-samples point), or, with
   ``--target-loss``, at the first evaluation at or past ``--updates`` whose loss is at or below the
   target, and at ``--max-updates`` at the latest. The LR schedule's horizon is ``--updates`` for
   every method; beyond it the learning rate stays at its floor;
6. writes ``DIR/rank<R>.summary.json``: totals, the validation losses, the wall-clock at
   ``--updates`` and when (if) the target was first reached.

Wall-clock excludes process start-up and ``initialize`` (reported separately as ``init_s``);
``process_wall_s`` (start of this worker to the end of training) = ``init_s`` + ``final_wall_s`` +
``eval_comm_s`` + ``snapshot_s`` + ``eval_s``, which a test checks. A
config that the engine refuses (``ValueError``) is written to ``DIR/error.txt`` for the bench to
report.
"""
import argparse
import contextlib
import json
import os
import resource
import sys
import time
import traceback
from typing import Optional

from ..reporting.report import MIN_TARGET_MARGIN, TARGET_RESOLUTION


def _sync_updates(text: str):
    """``--warmup-sync-updates``: 'auto' or an integer >= 0."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 0, got {text!r}")
    return value


def parse_args(argv=None):
    from ..workload.methods import LR_SCHEDULES, parse_variant
    from ..workload.models import DEFAULT_PRESET, PRESETS

    def method(text):
        if text == "compute":
            return text
        try:
            return parse_variant(text).name
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", required=True, type=method, help="a method, with modifiers if any (acco+bf16comm)")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--model", default=DEFAULT_PRESET, choices=sorted(PRESETS))
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--updates", type=int, default=60, help="the equal-samples point and the LR schedule's horizon")
    p.add_argument("--max-updates", type=int, default=0, help="with --target-loss: stop here at the latest")
    p.add_argument("--target-loss", type=float, default=None)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lr-schedule", default="decay", choices=LR_SCHEDULES)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local-steps", type=int, default=None, help="CO2 (default: the engine's)")
    p.add_argument("--warmup-sync-updates", type=_sync_updates, default=None,
                   help="DPU, ACCO, CO2: 'auto' or N (default: the engine's)")
    p.add_argument("--sync-after-updates", type=int, default=None)
    p.add_argument("--group-size", type=int, default=1, help="CO2: ranks that average gradients every step")
    p.add_argument("--outer-lr", type=float, default=None)
    p.add_argument("--outer-momentum", type=float, default=None)
    p.add_argument("--gap-penalty", default=None)
    p.add_argument("--dynamic-accumulation", action="store_true")
    p.add_argument("--slow-rank", default="", help="R:F, rank R's compute F times slower")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--data", default=None)
    p.add_argument("--cache-dir", default="default")
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--keep-denormals", action="store_true",
                   help="keep denormal floats (default: flushed to zero, as every method of a bench run is)")
    p.add_argument("--communication-timeout-s", type=float, default=None,
                   help="our methods: the engine's communication_timeout_s (default: the engine's)")
    p.add_argument("--save-every", type=int, default=0,
                   help="save a checkpoint every N committed updates into --save-dir (0: never); on the clock")
    p.add_argument("--save-dir", default="", help="where --save-every saves (default RUN_DIR/checkpoints)")
    p.add_argument("--resume", default="", metavar="DIR",
                   help="continue from the latest checkpoint in DIR, at this run's world size (the optimizer "
                        "state is re-sharded when it differs)")
    p.add_argument("--trace", default="", metavar="DIR",
                   help="rank 0 writes its timeline of the last updates before --updates to DIR (Chrome trace)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.max_updates = max(args.max_updates, args.updates) if args.target_loss is not None else args.updates
    return args


def parse_slow_rank(text: str):
    """``"R:F"`` -> ``(R, F)``; ``""`` -> ``None``."""
    if not text:
        return None
    try:
        rank, factor = text.split(":")
        rank, factor = int(rank), float(factor)
    except ValueError:
        raise ValueError(f"--slow-rank takes R:F (rank R, slowdown factor F >= 1), got {text!r}") from None
    if rank < 0 or factor < 1.0:
        raise ValueError(f"--slow-rank: need rank >= 0 and factor >= 1, got {text!r}")
    return rank, factor


class TargetWatch:
    """When to evaluate densely on the way to a target loss (docs/bench.md, "Time to target").

    After each evaluation on the ``--eval-every`` grid, the run goes dense (every
    :data:`TARGET_RESOLUTION` x ``--updates``) once its loss is within a margin of the target: 1.5
    times the largest relative drop seen between two grid evaluations (at least
    :data:`MIN_TARGET_MARGIN`), so that the next grid interval cannot jump past the target unseen.
    """

    def __init__(self, target: Optional[float], updates: int, resolution: float = TARGET_RESOLUTION):
        self.target = target
        self.every = max(1, int(resolution * updates))
        self.dense = False
        self.largest_drop = 0.0
        self._last: Optional[float] = None

    def on_grid(self, loss: float) -> None:
        """A loss evaluated on the grid."""
        if self.target is None:
            return
        if self._last is not None and self._last > 0:
            self.largest_drop = max(self.largest_drop, (self._last - loss) / self._last)
        self._last = loss
        margin = max(MIN_TARGET_MARGIN, 1.5 * self.largest_drop)
        if loss <= self.target * (1.0 + margin):
            self.dense = True

    def evaluate_now(self, update: int, reached: bool) -> bool:
        """Whether to evaluate after ``update`` although it is off the grid."""
        return self.target is not None and self.dense and not reached and update % self.every == 0


def is_eval_update(update: int, eval_every: int, updates: int) -> bool:
    """Whether the committed parameters after ``update`` updates are evaluated: the initial weights,
    every ``eval_every`` updates, and the equal-samples point ``updates``."""
    return update == 0 or update == updates or (eval_every > 0 and update % eval_every == 0)


class _ComputeOnly:
    """The compute-only baseline behind the engine's training-loop interface: same model, batches
    and per-update work (forward/backward per micro-batch, clipping, AdamW step on fp32 masters),
    no communication. Under bf16 the model holds bf16 copies of the fp32 masters, as DeepSpeed's."""

    def __init__(self, model, args, world_size):
        import torch
        from ..workload.methods import BETA2, warmup_decay_lr
        self.args, self.torch = args, torch
        self.bf16 = args.precision == "bf16"
        if self.bf16:
            self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
            model = model.to(torch.bfloat16)
        else:
            self.masters = list(model.parameters())
        self.module = model
        self.opt = torch.optim.AdamW(self.masters, lr=warmup_decay_lr(0, args.lr, args.warmup, args.updates, args.lr_schedule),
                                     betas=(args.beta1, BETA2), eps=1e-8, weight_decay=args.weight_decay)
        self.lr_at = lambda s: warmup_decay_lr(s, args.lr, args.warmup, args.updates, args.lr_schedule)
        self.global_steps, self.global_samples, self._micro = 0, 0, 0
        self.train_batch_size = args.micro_batch * args.grad_accum * world_size

    def __call__(self, **kwargs):
        return self.module(**kwargs)

    def backward(self, loss):
        (loss / self.args.grad_accum).backward()

    def step(self):
        self._micro += 1
        if self._micro % self.args.grad_accum:
            return
        params = list(self.module.parameters())
        if self.bf16:
            for master, p in zip(self.masters, params):
                master.grad = None if p.grad is None else p.grad.float()
        if self.args.clip > 0:
            self.torch.nn.utils.clip_grad_norm_(self.masters, self.args.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.bf16:
            with self.torch.no_grad():
                for master, p in zip(self.masters, params):
                    p.copy_(master)
                    p.grad = None
        self.global_steps += 1
        self.global_samples += self.train_batch_size
        for group in self.opt.param_groups:
            group["lr"] = self.lr_at(self.global_steps)

    def get_lr(self):
        return [g["lr"] for g in self.opt.param_groups]


def co2_options(args) -> dict:
    """The CO2 params given on the command line (the rest keep the engine's defaults)."""
    out = {}
    if args.outer_lr is not None:
        out["outer_lr"] = args.outer_lr
    if args.outer_momentum is not None:
        out["outer_momentum"] = args.outer_momentum
    if args.gap_penalty is not None:
        out["gap_penalty"] = args.gap_penalty if args.gap_penalty == "adaptive" else float(args.gap_penalty)
    if getattr(args, "group_size", 1) > 1:
        out["group_size"] = int(args.group_size)
    return out


def _system_cpu():
    """``(busy, steal)`` CPU seconds of the whole machine so far (all cores, from /proc/stat), or None."""
    from ..network.netns import BUSY_KINDS, cpu_times
    times = cpu_times()
    if times is None:
        return None
    return sum(times[kind] for kind in BUSY_KINDS), times["steal"]


def _snapshot(engine):
    """CPU copy of the newest committed parameters that have landed, taken without waiting for the
    communication job in flight (``engine.committed_parameters(wait=False)``; DeepSpeed's engines
    and the compute-only run hold them in the model). Called right after the ``step()`` that
    committed an update, where every type has them (docs/bench.md, "The clock")."""
    committed = getattr(engine, "committed_parameters", None)
    with (committed(wait=False) if callable(committed) else contextlib.nullcontext()):
        return {k: v.detach().to("cpu", copy=True) for k, v in engine.module.state_dict().items()}


def _update_backend(engine, device) -> Optional[str]:
    """The update kernels our engine dispatches to on ``device`` (``cpu``/``cuda``: the fused kernels,
    ``torch``: the reference); None for DeepSpeed's engine and the compute-only loop."""
    from deepspeed_acco import ops
    from ..reporting.breakdown import engine_kind
    if engine_kind(engine) != "ours":
        return None
    return ops.backend(device)


def finish_job_in_flight(engine) -> float:
    """Seconds until the communication job in flight (if any) is done; nothing else runs meanwhile.

    Called when the clock stops for an evaluation: the job then finishes alone, as fast as it would
    have next to the training's compute, before the evaluation takes the cores. Those seconds are
    what the job still needed; a run without evaluation would have computed on meanwhile and waited
    only for what was left at its next boundary, which is where the training loop waits them out
    after the pause (docs/bench.md, "The clock")."""
    if not getattr(engine, "communication_in_flight", False):
        return 0.0
    start = time.perf_counter()
    # The schedule's own wait: it raises, naming the collective, if a peer died meanwhile.
    engine.schedule.drain()
    return time.perf_counter() - start


def peer_wait_split(needed: float, shared: bool):
    """``(peer_wait, remaining)``: of the seconds a rank's drain took (:func:`finish_job_in_flight`),
    what it spent waiting for the last rank to launch the job, and what the job took from there.

    The job's last collective ends on every rank at once, so the shortest drain over the ranks is
    the job's own remaining time, and a longer drain began by waiting for a peer. That wait stays on
    the waiting rank's clock (a run without evaluation waits for its peer too), and every rank
    carries the same remaining seconds as its deadline after the pause, so the ranks resume in step.
    Charging each rank its whole drain as its deadline instead had the rank that waited resume
    behind its peer by the wait: the next job then found the peer waiting in turn, and CO2, whose
    inner steps do not synchronise the ranks between averagings, carried a growing offset from
    evaluation to evaluation (docs/bench.md, "The clock"). ``shared``: all-reduce the minimum over
    the world's ranks (a collective: every rank calls it at every evaluation)."""
    if not shared:
        return 0.0, needed
    import torch
    import torch.distributed as dist
    shortest = torch.tensor([needed], dtype=torch.float64)
    dist.all_reduce(shortest, op=dist.ReduceOp.MIN)
    remaining = float(shortest[0])  # <= needed: this rank's own figure is one of the minimum's
    return needed - remaining, remaining


def evaluate(model, windows, batch_size: int) -> float:
    """Mean next-byte cross-entropy (nats) over the validation windows."""
    total, count = evaluate_sum(model, windows, batch_size)
    return total / max(count, 1)


def evaluate_sum(model, windows, batch_size: int):
    """``(sum over windows of the mean next-byte cross-entropy, number of windows)``."""
    import torch
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            x = torch.from_numpy(windows[i:i + batch_size])
            total += float(model(input_ids=x, labels=x).loss) * len(x)
            count += len(x)
    return total, count


class _Validator:
    """Evaluates a parameter copy on the fixed held-out windows, split over the ranks (window i on
    rank i mod W); the all-reduced mean is the same number on every rank."""

    def __init__(self, model, windows, rank: int, world: int, batch_size: int):
        self.model, self.batch_size, self.world = model, batch_size, world
        self.windows = windows[rank::world]

    def __call__(self, state_dict) -> float:
        import torch
        import torch.distributed as dist
        self.model.load_state_dict(state_dict)
        total, count = evaluate_sum(self.model, self.windows, self.batch_size) if len(self.windows) else (0.0, 0)
        if self.world > 1 and dist.is_initialized():
            both = torch.tensor([total, float(count)], dtype=torch.float64)
            dist.all_reduce(both)
            total, count = float(both[0]), int(both[1])
        return total / max(count, 1)


def _write_error(run_dir: str, rank: int, exc: BaseException) -> None:
    """Record why this rank could not start (the bench prints the first line, not a traceback)."""
    with open(os.path.join(run_dir, f"error_rank{rank}.txt"), "w") as f:
        f.write(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")


def run(args) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    import torch.distributed as dist

    from ..reporting.breakdown import TRACE_UPDATES, LoopClock, engine_kind, job_summary_ms, per_update_ms
    from ..workload.data import WindowSampler, load_corpus, validation_windows
    from ..workload.methods import BETA2, ds_config
    from ..workload.models import build_model, count_parameters

    t_proc = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(not args.keep_denormals)  # the same for every method (docs/bench.md)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    node = int(os.environ.get("GROUP_RANK", os.environ.get("CROSS_RANK", 0)))
    slow = parse_slow_rank(args.slow_rank)
    slow_factor = slow[1] if slow and slow[0] == rank else 1.0
    os.makedirs(args.run_dir, exist_ok=True)

    corpus = load_corpus(args.data, cache_dir=args.cache_dir or None)
    sampler = WindowSampler(corpus.train, args.ctx, args.micro_batch, seed=args.seed, rank=rank)
    model = build_model(args.model, args.ctx, args.seed)
    n_params = count_parameters(model)

    if args.method == "compute":
        if world > 1 and not dist.is_initialized():  # only for the start barrier, never during training
            dist.init_process_group("gloo", rank=rank, world_size=world)
        if torch.cuda.is_available():  # on GPUs the floor is GPU compute too
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            model = model.to(torch.device("cuda", torch.cuda.current_device()))
        engine = _ComputeOnly(model, args, world)
        # Every rank's replica trains alone on its own batches; each evaluates its own on every window
        # (the clock is paused), and rank 0's figure is "a lone replica" in the report.
        validator = _Validator(build_model(args.model, args.ctx, args.seed), validation_windows(
            corpus.val, args.ctx, args.val_windows), 0, 1, batch_size=max(1, 2 * args.micro_batch))
    else:
        cfg = ds_config(args.method, world_size=world, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                        lr=args.lr, total_updates=args.updates, warmup=args.warmup, weight_decay=args.weight_decay,
                        betas=(args.beta1, BETA2), clip=args.clip, local_steps=args.local_steps, dynamic_accumulation=args.dynamic_accumulation,
                        bf16=args.precision == "bf16", torch_adam=not torch.cuda.is_available(),
                        warmup_sync_updates=args.warmup_sync_updates, co2_options=co2_options(args),
                        sync_after_updates=args.sync_after_updates,
                        lr_schedule=args.lr_schedule)
        if args.communication_timeout_s is not None:  # fault runs (bench/running/faults.py) use a short one
            cfg["optimizer"]["params"]["communication_timeout_s"] = args.communication_timeout_s
        if rank == 0:
            with open(os.path.join(args.run_dir, "ds_config.json"), "w") as f:
                json.dump(cfg, f, indent=1)
        import deepspeed_acco  # the engine under test; it delegates DeepSpeed's own optimizer types to deepspeed
        try:
            engine, _, _, _ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        except Exception as exc:
            _write_error(args.run_dir, rank, exc)
            raise
        windows = validation_windows(corpus.val, args.ctx, args.val_windows)
        validator = _Validator(build_model(args.model, args.ctx, args.seed), windows, rank, world,
                               batch_size=max(1, 2 * args.micro_batch))
    start_update, micro = 0, 0
    if args.resume:
        if args.method == "compute":
            raise ValueError("--resume: the compute-only run has no checkpoints")
        path, client = engine.load_checkpoint(args.resume)
        if path is None:
            raise FileNotFoundError(f"--resume {args.resume}: no 'latest' file there; point it at a --save-dir")
        # Each rank continues its own stream of micro-batches where the saved run's rank of the same
        # number left it (rank r's stream is the same at any world size).
        micro = int(client.get("bench_micro_batches", 0))
        start_update = int(engine.global_steps)
    save_dir = args.save_dir or os.path.join(args.run_dir, "checkpoints")
    checkpoints, save_s = [], 0.0
    device = getattr(engine, "device", None) or next(engine.module.parameters()).device
    train_batch_size = args.micro_batch * args.grad_accum * world

    # The clock stops only for what a run without evaluation would not do: copying the committed
    # parameters (snapshot_s) and evaluating them (eval_s). A communication job in flight finishes
    # first, alone; the seconds it still needed (eval_comm_s) run on after the pause as a deadline
    # that the next boundary's step() waits for if it comes sooner: the wait a run without
    # evaluation would have had. No method gets communication off the clock.
    val, snapshot_s, eval_s, eval_comm_s, eval_peer_wait_s, landed_waits = {}, 0.0, 0.0, 0.0, 0.0, 0
    due_after_eval = None  # perf_counter time before which the next boundary's step() must not come
    clock = LoopClock(engine, engine_kind(engine))

    def validate(update):
        nonlocal snapshot_s, eval_s, eval_comm_s, eval_peer_wait_s, landed_waits, due_after_eval
        ts = time.perf_counter()
        needed = finish_job_in_flight(engine)
        tj = time.perf_counter()
        peer_wait, needed = peer_wait_split(needed, shared=args.method != "compute" and dist.is_initialized())
        tq = time.perf_counter()  # the split's all-reduce is the evaluation's (paused), like its own
        if peer_wait > 0.0:
            clock.record("debt", ts, ts + peer_wait, "waiting for a peer to join the job (on the clock)")
        eval_peer_wait_s += peer_wait
        try:
            state = _snapshot(engine)
        except LookupError:  # not at a commit (cannot happen in this loop): wait on the clock, then copy
            landed_waits += 1
            with engine.committed_parameters():  # drains and installs the newest commit
                state = {k: v.detach().to("cpu", copy=True) for k, v in engine.module.state_dict().items()}
        te = time.perf_counter()
        val[update] = validator(state)
        tf = time.perf_counter()
        snapshot_s += te - tq
        eval_s += (tf - te) + (tq - tj)
        eval_comm_s += needed
        clock.timeline.add("bench loop", "job finishing (clock paused)", ts + peer_wait, tj)
        clock.timeline.add("bench loop", "evaluation (clock paused)", tj, tf)
        if needed > 0.0:
            due_after_eval = tf + needed

    log = open(os.path.join(args.run_dir, f"rank{rank}.jsonl"), "w", buffering=1)
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    cpu0, sys0 = time.process_time(), _system_cpu()
    init_s = t0 - t_proc
    if validator is not None:
        validate(start_update)
    losses, committed, slow_s = [], start_update, 0.0
    wall_at_updates, cpu_at_updates, sys_at_updates, paused_at_updates = None, None, None, None
    reached_update, reached_wall = None, None
    target = args.target_loss if validator is not None and args.method != "compute" else None
    if target is not None and val[start_update] <= target:
        reached_update, reached_wall = start_update, 0.0
    watch = TargetWatch(target, args.updates)
    if target is not None:
        watch.on_grid(val[start_update])

    def paused() -> float:
        return snapshot_s + eval_s + eval_comm_s

    trace_from = max(start_update, args.updates - TRACE_UPDATES) if args.trace and rank == 0 else None
    if trace_from == start_update:
        clock.start_trace()
    breakdown_at_updates, jobs_at_updates = None, None
    while True:
        x = torch.from_numpy(sampler.micro_batch_at(micro)).to(device)
        micro += 1
        tc = time.perf_counter()
        with clock.call("forward"):
            loss = engine(input_ids=x, labels=x).loss
        if slow_factor > 1.0:
            # A slower accelerator: forward + backward ~ 3 x forward, so sleep (F - 1) x 3 x forward time.
            # Sleeping (not spinning) idles the host like a slow device would; measured on the forward
            # alone because DeepSpeed's backward also runs its gradient all-reduce.
            extra = (slow_factor - 1.0) * 3.0 * (time.perf_counter() - tc)
            with clock.call("slow"):
                time.sleep(extra)
            slow_s += extra
        with clock.call("backward"):
            engine.backward(loss)
        if due_after_eval is not None and engine.is_gradient_accumulation_boundary():
            with clock.call("debt"):
                time.sleep(max(0.0, due_after_eval - time.perf_counter()))
            due_after_eval = None
        with clock.call("step"):
            engine.step()
        losses.append(float(loss.detach()))
        if engine.global_steps == committed:
            continue
        committed = int(engine.global_steps)
        wall = time.perf_counter() - t0 - paused()
        wait = getattr(engine, "communication_wait_s", None)
        engine_samples = int(getattr(engine, "global_samples", 0) or 0)
        # Committed samples: updates x global batch, except with dynamic accumulation, where only the
        # engine knows (it counts them at commit). Our engines count fixed-accumulation samples when
        # consumed, which runs ahead of the commits of a delayed method.
        samples = engine_samples if args.dynamic_accumulation else committed * train_batch_size
        row = dict(update=committed, samples=samples, engine_samples=engine_samples, wall_s=wall,
                   loss=sum(losses) / len(losses), micro_batches=len(losses),
                   comm_wait_s=None if wait is None else float(wait), lr=float(engine.get_lr()[0]))
        log.write(json.dumps(row) + "\n")
        losses = []
        if committed == args.updates:
            wall_at_updates, cpu_at_updates, sys_at_updates = wall, time.process_time() - cpu0, _system_cpu()
            paused_at_updates = paused()
            breakdown_at_updates, jobs_at_updates = clock.parts(wall), clock.job_phases()
            if trace_from is not None:
                _write_trace(args, clock)
                trace_from = None
        elif committed == trace_from:
            clock.start_trace()
        on_grid = is_eval_update(committed, args.eval_every, args.updates)
        if validator is not None and (on_grid or watch.evaluate_now(committed, reached_update is not None)):
            validate(committed)
            if on_grid:
                watch.on_grid(val[committed])
            if target is not None and reached_update is None and val[committed] <= target:
                reached_update, reached_wall = committed, wall
        if args.save_every and committed % args.save_every == 0 and committed < args.max_updates:
            ts = time.perf_counter()  # on the clock: saving is part of what such a run pays
            engine.save_checkpoint(save_dir, tag=f"update{committed}", client_state={"bench_micro_batches": micro})
            save_s += time.perf_counter() - ts
            checkpoints.append(committed)
        if committed >= args.max_updates or (committed >= args.updates
                                             and (target is None or reached_update is not None)):
            break
    t_end = time.perf_counter()
    final_wall = t_end - t0 - paused()  # the clock stops while parameters are copied/evaluated
    cpu_s, sys1 = time.process_time() - cpu0, _system_cpu()
    log.close()
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB
    peak_gpu_mib = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    wait = getattr(engine, "communication_wait_s", None)
    engine_samples = int(getattr(engine, "global_samples", 0) or 0)
    at_updates = min(committed, args.updates)
    # The equal-samples numbers are those at --updates; CPU accounting too, so that the noise check
    # covers the same span as the wall-clock it qualifies.
    if wall_at_updates is None:
        wall_at_updates, cpu_at_updates, sys_at_updates, paused_at_updates = final_wall, cpu_s, sys1, paused()
        breakdown_at_updates, jobs_at_updates = clock.parts(final_wall), clock.job_phases()
    breakdown_updates = max(1, at_updates - start_update)
    summary = dict(method=args.method, rank=rank, node=node, world_size=world, updates=at_updates,
                   final_update=committed, micro_batches=micro,
                   samples=engine_samples if args.dynamic_accumulation else at_updates * train_batch_size,
                   engine_samples=engine_samples, precision=args.precision,
                   train_batch_size=train_batch_size, wall_s=wall_at_updates, final_wall_s=final_wall,
                   init_s=init_s, snapshot_s=snapshot_s, eval_s=eval_s, paused_at_updates_s=paused_at_updates,
                   eval_comm_s=eval_comm_s, eval_peer_wait_s=eval_peer_wait_s, landed_waits=landed_waits,
                   evaluations=len(val),
                   process_wall_s=t_end - t_proc,
                   target_loss=target, reached_update=reached_update, reached_wall_s=reached_wall,
                   target_resolution_updates=watch.every if target is not None else None,
                   dense_from_update=min((u for u in val if not is_eval_update(u, args.eval_every, args.updates)),
                                         default=None),
                   max_updates=args.max_updates,
                   resumed_from_update=start_update if args.resume else None, checkpoints=checkpoints, save_s=save_s,
                   slow_sleep_s=slow_s, comm_wait_s=None if wait is None else float(wait),
                   peak_rss_mib=peak_rss_mib, peak_gpu_mib=peak_gpu_mib, cpu_s=cpu_at_updates,
                   machine_busy_s=None if sys0 is None or sys_at_updates is None else sys_at_updates[0] - sys0[0],
                   machine_steal_s=None if sys0 is None or sys_at_updates is None else sys_at_updates[1] - sys0[1],
                   n_params=n_params, slow_factor=slow_factor, engine=type(engine).__name__,
                   val_windows=args.val_windows, val={str(k): v for k, v in sorted(val.items())},
                   corpus=corpus.describe(), torch_threads=torch.get_num_threads(),
                   breakdown_ms=per_update_ms(breakdown_at_updates, breakdown_updates),
                   job_ms=job_summary_ms(jobs_at_updates or {}),
                   warmup_sync_updates=getattr(getattr(engine, "schedule", None), "warmup_sync_updates", None),
                   regime=_regime_record(engine), update_backend=_update_backend(engine, device))
    from ..reporting.memory import engine_memory  # bytes per parameter by category (docs/precision.md, "Memory: bytes per parameter per rank")
    summary["memory"] = engine_memory(engine)
    with open(os.path.join(args.run_dir, f"rank{rank}.summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return summary


def _regime_record(engine) -> Optional[dict]:
    """What ``engine.regime()`` says (our engines), for the report."""
    regime = engine.regime() if callable(getattr(engine, "regime", None)) else None
    if regime is None:
        return None
    return dict(t_compute_s=regime.t_compute_s, t_comm_s=regime.t_comm_s, updates=regime.updates,
                communication_share=regime.communication_share, predicted_s=regime.predicted_s,
                fastest=regime.fastest, quantization_s=regime.quantization_s, measured_wire=regime.wire_name,
                wire=regime.wire, wire_now=getattr(engine, "wire", None))


def _write_trace(args, clock) -> None:
    """Rank 0's timeline of the last updates (``--trace``) as a Chrome/Perfetto trace file."""
    os.makedirs(args.trace, exist_ok=True)
    path = os.path.join(args.trace, f"trace_{args.method}_rank0.json")
    with open(path, "w") as f:
        json.dump(clock.trace(f"{args.method} rank 0"), f)


def _write_failure(run_dir: str, exc: BaseException) -> None:
    """Record when and why this rank failed during training (bench/running/faults.py reads it): the wall
    time, then the error's first line and its traceback."""
    rank = int(os.environ.get("RANK", 0))
    with open(os.path.join(run_dir, f"failure_rank{rank}.txt"), "w") as f:
        f.write(f"{time.time():.3f}\n{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")


def main(argv=None):
    args = parse_args(argv)
    try:
        run(args)
    except Exception as exc:
        _write_failure(args.run_dir, exc)
        raise
    # Everything is written and every rank passed the final barrier: skip the interpreter's slow
    # teardown of torch/DeepSpeed/transformers (~5 s per job on 2 cores).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
