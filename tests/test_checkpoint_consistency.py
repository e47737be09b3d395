"""Checkpoints in every state a job can be saved in (docs/checkpoints.md).

- Step counts: a checkpoint saved while a commit has finished but is not installed yet (DPU, ACCO
  after B_t) loads into another type (ShardedAdamW, DeepSpeed ZeRO-1) with the AdamW step, the LR
  and, K updates later, the parameters of an uninterrupted run of the target type started from the
  same committed state (item 3). ACCO after A_t, where no commit is pending, is the control.
- What a load reads: at the same world size a rank opens only its own optimizer file; re-sharding
  to another world size opens only the files whose shards overlap the rank's new shard (item 6).
- Same-type resume in bf16, fp16 (static and dynamic loss scale) and CO2 in bf16 is bitwise,
  fp32 masters included (item 9).
- Elastic ACCO resume (3 ranks -> 2) against a simulation of a run that never stopped: the
  re-sharded estimate and the kept first-half gradient (item 9).
- Dynamic accumulation with a slow rank: an evaluation (committed_parameters() and a user
  all-reduce) and a save at fixed iterations do not hang; after loading every rank holds the saved
  committed parameters, training continues and no micro-batch is lost or counted twice (item 4).
- Re-saving an existing tag is atomic: a rank killed in the middle leaves ``latest`` pointing at a
  loadable checkpoint (item 5).
"""
import builtins
import contextlib
import os
import pickle
import shutil
import signal
import time

import pytest
import torch

import engine_probe as probe
from distributed_utils import run_distributed, run_until_exit
from reference_sim import TinyNet, batch, flat_trainable, loss_fn, param_groups, run_sharded, simulate_acco, \
    simulate_dpu

MICRO_BATCH = 4
LR, MIN_LR, WARMUP_STEPS, CLIPPING, WEIGHT_DECAY = 1e-2, 1e-3, 10, 1.0, 0.1
"""The LR warms up linearly over 10 updates, so an LR one step behind is visible at every step."""
FP16_STATIC = {"enabled": True, "loss_scale": 2.0**10}
FP16_DYNAMIC = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2,
                "min_loss_scale": 1}


def make_config(kind, accumulation=2, precision=None, **params):
    if kind in ("DPU", "ACCO"):
        params.setdefault("warmup_sync_updates", 0)  # the rule from update 0 ("auto": test_defaults.py)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": accumulation,
              "gradient_clipping": CLIPPING, "steps_per_print": 10_000,
              "optimizer": {"type": kind, "params": dict(lr=LR, weight_decay=WEIGHT_DECAY, **params)},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": MIN_LR, "warmup_max_lr": LR,
                                                           "warmup_num_steps": WARMUP_STEPS,
                                                           "warmup_type": "linear"}}}
    if kind == "AdamW":
        config["zero_optimization"] = {"stage": 1}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif isinstance(precision, dict):
        config["fp16"] = precision
    return config


def sim_scheduler(optimizer):
    from deepspeed.runtime.lr_schedules import WarmupLR
    return WarmupLR(optimizer, warmup_min_lr=MIN_LR, warmup_max_lr=LR, warmup_num_steps=WARMUP_STEPS,
                    warmup_type="linear")


SIM_OPTIONS = dict(lr=LR, weight_decay=WEIGHT_DECAY, clipping=CLIPPING, lr_scheduler=sim_scheduler)


def new_engine(config, seed=0):
    import deepspeed_acco
    model = TinyNet(seed=seed)
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model, True, WEIGHT_DECAY),
                                           config=config)
    return engine, model


def feed(engine, model, rank, start, stop, delays_s=None):
    dtype = next(model.parameters()).dtype
    for index in range(start, stop):
        x, y = batch(rank, index, MICRO_BATCH)
        loss = loss_fn(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        if delays_s:
            time.sleep(delays_s[rank])
        engine.step()
    return loss


def committed(engine, model):
    committed_parameters = getattr(engine, "committed_parameters", None)
    if committed_parameters is None:  # DeepSpeed's engine: the module holds the committed parameters
        return flat_trainable(model).float()
    with committed_parameters():
        return flat_trainable(model).float()


def optimizer_file(rank, bf16=False):
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


@contextlib.contextmanager
def recorded_reads():
    """The names of the checkpoint files this process reads (via torch.load or open)."""
    names = []
    original_load, original_open = torch.load, builtins.open

    def note(file):
        if isinstance(file, (str, bytes, os.PathLike)):
            name = os.path.basename(os.fsdecode(file))
            if name.endswith(".pt") and name not in names:
                names.append(name)

    def load(file, *args, **kwargs):
        note(file)
        return original_load(file, *args, **kwargs)

    def open_(file, *args, **kwargs):
        note(file)
        return original_open(file, *args, **kwargs)

    torch.load, builtins.open = load, open_
    try:
        yield names
    finally:
        torch.load, builtins.open = original_load, original_open


def optimizer_files_read(names):
    return sorted(name for name in names if "optim_states" in name)


# ---- step counts across types (item 3), files read at the same world size (item 6) -----------
CROSS_TYPE_CASES = [
    # name, source type, micro-batches per rank before the save, target type. Accumulation 2.
    ("acco-commit-pending-to-sharded", "ACCO", 4, "ShardedAdamW"),  # after B_1: commit 2 drained, not installed
    ("acco-estimate-pending-to-sharded", "ACCO", 5, "ShardedAdamW"),  # after A_2: commit 2 installed (control)
    ("dpu-commit-pending-to-sharded", "DPU", 6, "ShardedAdamW"),  # after round 2: commit 3 drained, not installed
    ("acco-commit-pending-to-deepspeed", "ACCO", 4, "AdamW"),
    ("acco-estimate-pending-to-deepspeed", "ACCO", 5, "AdamW"),
    ("dpu-commit-pending-to-deepspeed", "DPU", 6, "AdamW"),
]
MORE_UPDATES = 3

# Same-type resume in low precision: name, type, accumulation, precision, extra params, save after, stop after.
LOW_PRECISION_RESUME_CASES = [
    ("sharded-bf16", "ShardedAdamW", 2, "bf16", {}, 6, 14),
    ("acco-bf16-commit-pending", "ACCO", 4, "bf16", {}, 8, 16),
    ("acco-fp16-dynamic-mid-round", "ACCO", 4, FP16_DYNAMIC, {}, 7, 20),
    ("dpu-fp16-static", "DPU", 2, FP16_STATIC, {}, 6, 14),
    ("dpu-fp16-dynamic", "DPU", 2, FP16_DYNAMIC, {}, 7, 17),
    ("co2-bf16-mid-round", "CO2", 2, "bf16", {"local_steps": 3}, 10, 22),
    ("co2-fp16-outer-boundary", "CO2", 2, FP16_DYNAMIC, {"local_steps": 2}, 8, 16),
]


def _snapshot(engine, model):
    result = {"holds": flat_trainable(model).float(), "global_steps": engine.global_steps,
              "global_samples": engine.global_samples, "lr": engine.get_lr()}
    result["committed"] = committed(engine, model)
    if hasattr(engine, "schedule"):
        result["fp32"] = probe.committed_fp32_fragments(engine)
        result["loss_scale"] = probe.loss_scale(engine)
    return result


def _cross_type_worker(rank, world_size, directory):
    results = {}
    for name, source, save_at, target in CROSS_TYPE_CASES:
        engine, model = new_engine(make_config(source))
        feed(engine, model, rank, 0, save_at)
        engine.save_checkpoint(directory, tag=name)
        committed_at_save = committed(engine, model)
        engine.destroy()
        module = torch.load(os.path.join(directory, name, "mp_rank_00_model_states.pt"), map_location="cpu",
                            weights_only=False)["module"]
        saved_module = torch.cat([module[n].reshape(-1).float() for n, p in model.named_parameters()
                                  if p.requires_grad])

        engine, model = new_engine(make_config(target), seed=7)
        with recorded_reads() as names:
            engine.load_checkpoint(directory, tag=name)
        result = {"files": optimizer_files_read(names), "committed_at_save": committed_at_save,
                  "saved_module": saved_module,
                  "at_load": (probe.adamw_step_count(engine), engine.get_lr()[0], engine.global_steps)}
        feed(engine, model, rank, save_at, save_at + 2 * MORE_UPDATES)
        result["after"] = (probe.adamw_step_count(engine), engine.get_lr()[0], engine.global_steps)
        result["params"] = committed(engine, model)
        if hasattr(engine, "destroy"):
            engine.destroy()
        results[name] = result

    for name, kind, accumulation, precision, params, save_at, stop in LOW_PRECISION_RESUME_CASES:
        config = make_config(kind, accumulation, precision, **params)
        engine, model = new_engine(config)
        feed(engine, model, rank, 0, stop)
        continuous = _snapshot(engine, model)
        engine.destroy()

        engine, model = new_engine(config)
        feed(engine, model, rank, 0, save_at)
        engine.save_checkpoint(directory, tag=name)
        engine.destroy()
        engine, model = new_engine(config, seed=123)  # different initial weights: all must come from the file
        with recorded_reads() as names:
            engine.load_checkpoint(directory, tag=name)
        feed(engine, model, rank, save_at, stop)
        resumed = _snapshot(engine, model)
        engine.destroy()
        results[name] = {"continuous": continuous, "resumed": resumed, "files": optimizer_files_read(names)}
    return results


def _cross_type_reference(source, save_at):
    """The committed state the checkpoint holds, as a simulator: (committed updates, LR at load, sim)."""
    accumulation = 2
    if source == "ACCO":
        num_updates, partial = divmod(save_at, accumulation)
        _, _, sim = simulate_acco(2, accumulation, num_updates, **SIM_OPTIONS)
        sim.skip(partial)  # A_t's gradient (estimate in flight) does not survive a change of type
    else:
        _, sim = simulate_dpu(2, accumulation, save_at // accumulation, **SIM_OPTIONS)
    return sim.committed_updates, sim.lr(), sim


@pytest.fixture(scope="module")
def cross_type_results(tmp_path_factory):
    return run_distributed(_cross_type_worker, 2, str(tmp_path_factory.mktemp("cross-type")), timeout_s=400)


@pytest.mark.slow
@pytest.mark.parametrize("name, source, save_at, target", CROSS_TYPE_CASES, ids=[case[0] for case in CROSS_TYPE_CASES])
def test_cross_type_load_continues_with_the_committed_step_and_lr(cross_type_results, name, source, save_at, target):
    committed_updates, lr_at_load, sim = _cross_type_reference(source, save_at)
    run_sharded(sim, 2, MORE_UPDATES)  # the uninterrupted run of the target type from the committed state
    for rank, rank_results in enumerate(cross_type_results):
        ours = rank_results[name]
        step, lr, global_steps = ours["at_load"]
        assert (step, global_steps) == (committed_updates, committed_updates), \
            f"rank {rank}: after loading, AdamW step {step} and global_steps {global_steps}; the checkpoint's " \
            f"masters hold {committed_updates} committed updates"
        assert lr == pytest.approx(lr_at_load, rel=1e-12), \
            f"rank {rank}: LR after loading {lr}, expected {lr_at_load} (the schedule after {committed_updates} " \
            f"updates)"
        step, lr, global_steps = ours["after"]
        assert (step, global_steps) == (committed_updates + MORE_UPDATES,) * 2, f"rank {rank}: {ours['after']}"
        assert lr == pytest.approx(sim.lr(), rel=1e-12), f"rank {rank}: LR {lr} after {MORE_UPDATES} more updates"
        difference = (ours["params"] - sim.flat()).abs().max().item()
        assert difference <= 1e-6, \
            f"rank {rank}: parameters {MORE_UPDATES} updates after the load differ from the uninterrupted {target} " \
            f"run by {difference}"


@pytest.mark.slow
def test_saved_module_weights_are_the_committed_parameters(cross_type_results):
    """DeepSpeed's loader takes the module weights of mp_rank_00_model_states.pt as the parameters
    its first step computes at (it does not refresh them from the fp32 partitions), as do tools
    that read the model states. Saved while a commit is pending, they must be that commit's
    parameters, not what the model held (ACCO's estimate, DPU's theta_t)."""
    mismatches = []
    for name, source, save_at, _ in CROSS_TYPE_CASES:
        ours = cross_type_results[0][name]
        difference = (ours["saved_module"] - ours["committed_at_save"]).abs().max().item()
        if difference != 0:
            mismatches.append(f"{name} ({source} after {save_at} micro-batches): max difference {difference:.3g}")
    assert not mismatches, "saved module weights are not the committed parameters:\n" + "\n".join(mismatches)


@pytest.mark.slow
def test_same_world_size_load_reads_only_the_rank_s_own_optimizer_file(cross_type_results):
    for rank, rank_results in enumerate(cross_type_results):
        for name, *_, target in CROSS_TYPE_CASES:
            if target != "AdamW":  # DeepSpeed's own loader is not ours to check
                assert rank_results[name]["files"] == [optimizer_file(rank)], (name, rank)
        for name, _, _, precision, *_ in LOW_PRECISION_RESUME_CASES:
            assert rank_results[name]["files"] == [optimizer_file(rank, precision == "bf16")], \
                f"{name}: rank {rank} read {rank_results[name]['files']}"


@pytest.mark.slow
@pytest.mark.parametrize("name", [case[0] for case in LOW_PRECISION_RESUME_CASES])
def test_low_precision_resume_is_bitwise(cross_type_results, name):
    for rank, rank_results in enumerate(cross_type_results):
        continuous, resumed = rank_results[name]["continuous"], rank_results[name]["resumed"]
        for key in ("holds", "committed"):
            assert torch.equal(continuous[key], resumed[key]), f"{name}, rank {rank}: {key} differs"
        for parameter, fragments in continuous["fp32"].items():
            for (start, values), (start_again, values_again) in zip(fragments, resumed["fp32"][parameter]):
                assert start == start_again and torch.equal(values, values_again), \
                    f"{name}, rank {rank}: fp32 master/anchor of {parameter} differs"
        for key in ("global_steps", "global_samples", "lr", "loss_scale"):
            assert continuous[key] == resumed[key], f"{name}, rank {rank}: {key} {continuous[key]} vs {resumed[key]}"


# ---- elastic ACCO resume against a run that never stopped (item 9), re-sharding reads (item 6) ----
ELASTIC_SAVE_AT = 7  # after A_3 on three ranks: commit 3 installed, the estimate of update 4 in flight
ELASTIC_STOP = 16  # A_4 .. B_7: four more updates on two ranks


def _elastic_worker(rank, world_size, directory, phase):
    config = make_config("ACCO")
    if phase == "save":
        engine, model = new_engine(config)
        feed(engine, model, rank, 0, ELASTIC_SAVE_AT)
        engine.save_checkpoint(directory, tag="elastic-acco")
        engine.destroy()
        return None
    engine, model = new_engine(config, seed=5)
    with recorded_reads() as names:
        engine.load_checkpoint(directory, tag="elastic-acco")
    feed(engine, model, rank, ELASTIC_SAVE_AT, ELASTIC_SAVE_AT + 1)  # B_3 on two ranks
    result = {"files": optimizer_files_read(names), "estimate": flat_trainable(model).float(),
              "first_commit": committed(engine, model)}
    feed(engine, model, rank, ELASTIC_SAVE_AT + 1, ELASTIC_STOP)
    result.update(holds=flat_trainable(model).float(), committed=committed(engine, model),
                  global_steps=engine.global_steps, lr=engine.get_lr()[0])
    engine.destroy()
    return result


def _overlapping_saved_ranks(rank, world_size, saved_world_size):
    """The saved ranks whose shard of some parameter group overlaps this rank's new shard.

    The files hold DeepSpeed's partitions (padding to 2 x world size); the engine's own shards are
    padded to 64-byte boundaries (docs/checkpoints.md).
    """
    from deepspeed_acco.runtime.flat import aligned_geometry, deepspeed_geometry
    model = TinyNet(0)
    needed = set()
    for group in param_groups(model, True, WEIGHT_DECAY):
        numel = sum(p.numel() for p in group["params"] if p.requires_grad)
        new = aligned_geometry(numel, world_size).shard_numel
        old = deepspeed_geometry(numel, saved_world_size).shard_numel
        low, high = rank * new, min((rank + 1) * new, numel)
        needed |= {saved for saved in range(saved_world_size) if saved * old < high and (saved + 1) * old > low}
    return needed


@pytest.fixture(scope="module")
def elastic_results(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("elastic"))
    run_distributed(_elastic_worker, 3, directory, "save")
    return run_distributed(_elastic_worker, 2, directory, "load")


@pytest.mark.slow
def test_elastic_acco_resume_matches_a_run_that_never_stopped(elastic_results):
    results = elastic_results
    three, two = {0: 1, 1: 1, 2: 1}, {0: 1, 1: 1}
    counts = [(three, three)] * 3 + [(three, two)] + [(two, two)] * 4  # A_3 on three ranks, B_3 on two
    flat = lambda tensors: torch.cat([t.reshape(-1) for t in tensors])  # noqa: E731
    estimate, first_commit, _ = simulate_acco(3, 2, counts=counts[:4], **SIM_OPTIONS)
    final_estimate, final_commit, sim = simulate_acco(3, 2, counts=counts, **SIM_OPTIONS)
    for rank, result in enumerate(results):
        checks = (("estimate", estimate, "the estimate re-sharded from the checkpoint"),
                  ("first_commit", first_commit, "the commit of A_3 (3 ranks, kept in the checkpoint) + B_3 (2 ranks)"),
                  ("holds", final_estimate, "the estimate 4 updates later"),
                  ("committed", final_commit, "the committed parameters 4 updates later"))
        for key, reference, what in checks:
            difference = (result[key] - flat(reference)).abs().max().item()
            assert difference <= 1e-6, f"rank {rank}: {what} differs from the never-stopped run by {difference}"
        assert result["global_steps"] == sim.committed_updates - 1  # the last commit is in flight
        assert result["lr"] == pytest.approx(sim_scheduler_lr(sim.committed_updates - 1), rel=1e-12)


@pytest.mark.slow
def test_resharding_load_reads_only_the_overlapping_optimizer_files(elastic_results):
    for rank, result in enumerate(elastic_results):
        allowed = {optimizer_file(saved) for saved in _overlapping_saved_ranks(rank, 2, 3)}
        extra = sorted(set(result["files"]) - allowed)
        assert not extra, f"re-sharding 3 -> 2 ranks: rank {rank} needs only {sorted(allowed)} but also read {extra}"


def sim_scheduler_lr(num_updates):
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = sim_scheduler(optimizer)
    for _ in range(num_updates):
        scheduler.step()
    return optimizer.param_groups[0]["lr"]


# ---- dynamic accumulation: evaluation and save at fixed iterations (item 4) -----------------
DYNAMIC_DELAYS_S = (0.01, 0.05)  # rank 1 computes five times slower
DYNAMIC_TIMEOUT_S = 20
EVAL_AT, SAVE_AT, FIRST_STOP, MORE = 9, 15, 24, 16


def _dynamic_worker(rank, world_size, directory):
    import torch.distributed as dist
    config = make_config("ACCO", dynamic_accumulation=True, communication_timeout_s=DYNAMIC_TIMEOUT_S)
    engine, model = new_engine(config)
    result = {}
    for index in range(FIRST_STOP):
        loss = feed(engine, model, rank, index, index + 1, DYNAMIC_DELAYS_S)
        if index == EVAL_AT:  # an evaluation: committed parameters and a user collective
            result["eval"] = committed(engine, model)
            total = loss.detach().float().reshape(1).clone()
            dist.all_reduce(total)
            result["eval_loss"] = total.item()
        if index == SAVE_AT:
            engine.save_checkpoint(directory, tag="dynamic", client_state={"cursor": index + 1})
            # What is not in an installed commit now is in the checkpoint.
            result["installed_before_save"] = sum(count for _, count, _ in probe.commit_micro_batches(engine))
            result["saved"] = committed(engine, model)
    result["first_run_steps"] = engine.global_steps
    engine.destroy()

    engine, model = new_engine(config, seed=5)
    _, client_state = engine.load_checkpoint(directory, tag="dynamic")
    cursor = client_state["cursor"]
    result["loaded"] = committed(engine, model)
    result["steps_at_load"] = engine.global_steps
    feed(engine, model, rank, cursor, cursor + MORE, DYNAMIC_DELAYS_S)
    result["final"] = committed(engine, model)
    result["final_steps"] = engine.global_steps
    result["installed_after_load"] = sum(count for _, count, _ in probe.commit_micro_batches(engine))
    result["in_flight"] = probe.in_flight_micro_batches(engine)
    result["partial"] = probe.partial_round_micro_batches(engine)
    engine.destroy()
    return result


@pytest.mark.slow
def test_dynamic_accumulation_eval_save_and_load_do_not_hang_and_agree(tmp_path):
    # Well below the default timeout: a hang fails within two minutes, with every rank's traceback.
    results = run_distributed(_dynamic_worker, 2, str(tmp_path), timeout_s=150)
    first, second = results
    assert torch.equal(first["eval"], second["eval"]), "the ranks evaluated different committed parameters"
    assert torch.equal(first["saved"], second["saved"]), "the ranks saved different committed parameters"
    for rank, result in enumerate(results):
        assert torch.equal(result["loaded"], first["saved"]), f"rank {rank} does not hold the saved parameters"
        assert torch.isfinite(result["final"]).all()
        assert result["final_steps"] > result["steps_at_load"], f"rank {rank}: training did not continue"
    assert torch.equal(first["final"], second["final"])
    assert not torch.equal(first["final"], first["saved"])
    # Every micro-batch fed before the save is in a commit installed before it or in the checkpoint;
    # after the load each is counted once: in an installed commit, the job in flight or the partial round.
    fed = 2 * (SAVE_AT + 1) + 2 * MORE
    counted = (first["installed_before_save"] + first["installed_after_load"] + first["in_flight"]
               + first["partial"] + second["partial"])
    assert counted == fed, f"{fed} micro-batches fed, {counted} accounted for"


# ---- atomic re-save (item 5) -------------------------------------------------------------------
KILLED_EXIT = -signal.SIGKILL


def _latest_is_loadable(directory, world_size):
    """``latest`` names a directory holding the model states and every rank's optimizer file."""
    try:
        with open(os.path.join(directory, "latest")) as handle:
            tag = handle.read().strip()
    except OSError:
        return False
    names = ["mp_rank_00_model_states.pt"] + [optimizer_file(rank) for rank in range(world_size)]
    return all(os.path.isfile(os.path.join(directory, tag, name)) for name in names)


def _watch_the_save(directory, snapshot_root, world_size):
    """From now on, after every call that moves, deletes or opens for writing a file under
    ``directory``: copy the directory as it is (what a crash at that instant would leave), and if
    ``latest`` no longer names a complete checkpoint, SIGKILL this process right there."""
    real = {"rename": os.rename, "replace": os.replace, "remove": os.remove, "unlink": os.unlink, "rmdir": os.rmdir,
            "rmtree": shutil.rmtree, "open": builtins.open}
    root = os.path.abspath(directory)
    state = {"busy": False, "count": 0}

    def after(description):
        if state["busy"]:
            return
        state["busy"] = True
        try:
            state["count"] += 1
            name = f"{state['count']:03d}"
            target = os.path.join(snapshot_root, name)
            for _ in range(50):
                try:
                    shutil.copytree(root, target, symlinks=True)
                    break
                except (shutil.Error, FileNotFoundError):  # the other rank moved a file meanwhile: copy again
                    real["rmtree"](target, ignore_errors=True)
            else:
                raise RuntimeError(f"could not copy {root} while the other ranks kept changing it")
            with real["open"](os.path.join(snapshot_root, "steps.txt"), "a") as log:
                log.write(f"{name} {description}\n")
            if not _latest_is_loadable(root, world_size):
                os.kill(os.getpid(), signal.SIGKILL)
        finally:
            state["busy"] = False

    def relative(path):
        return os.path.relpath(os.path.abspath(os.fsdecode(path)), root)

    def watched(name):
        def call(*args, **kwargs):
            outcome = real[name](*args, **kwargs)
            after(f"{name} {' -> '.join(relative(a) for a in args[:2] if isinstance(a, (str, os.PathLike)))}")
            return outcome
        return call

    def open_(file, mode="r", *args, **kwargs):
        handle = real["open"](file, mode, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)) and any(flag in mode for flag in "wax+") \
                and os.path.abspath(os.fsdecode(file)).startswith(root + os.sep):
            after(f"open({mode}) {relative(file)}")
        return handle

    os.rename, os.replace, os.remove, os.unlink, os.rmdir = (watched(n) for n in ("rename", "replace", "remove",
                                                                                  "unlink", "rmdir"))
    shutil.rmtree = watched("rmtree")
    builtins.open = open_


def _resave_then_die(rank, world_size, port, directory, snapshot_root, expected_path):
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    config = make_config("ACCO", communication_timeout_s=10)  # the survivor of a kill gives up soon
    engine, model = new_engine(config)
    feed(engine, model, rank, 0, 6)
    engine.save_checkpoint(directory, tag="ckpt")
    old = committed(engine, model)
    feed(engine, model, rank, 6, 10)
    new = committed(engine, model)
    if rank == 0:
        with open(expected_path, "wb") as handle:
            pickle.dump({"old": old, "new": new}, handle)
        _watch_the_save(directory, snapshot_root, world_size)
    engine.save_checkpoint(directory, tag="ckpt")  # replaces the existing tag
    os._exit(0)


def _load_latest(rank, world_size, directories):
    results = {}
    for directory in directories:
        engine, model = new_engine(make_config("ACCO"), seed=9)
        engine.load_checkpoint(directory)
        results[directory] = {"loaded": committed(engine, model)}
        feed(engine, model, rank, 10, 12)
        results[directory]["continued"] = committed(engine, model)
        engine.destroy()
    return results


@pytest.mark.slow
def test_resaving_a_tag_leaves_latest_loadable_at_every_instant(tmp_path):
    """A crash at any instant of a re-save (simulated at each file move, delete or open-for-write by
    copying the directory, and for real by a SIGKILL at the first instant that breaks ``latest``)
    leaves ``latest`` naming a checkpoint that loads as the old or the new one."""
    expected_path = str(tmp_path / "expected.pkl")
    directory, snapshots = tmp_path / "checkpoints", tmp_path / "snapshots"
    snapshots.mkdir()
    exit_codes = run_until_exit(_resave_then_die, 2, str(directory), str(snapshots), expected_path, timeout_s=120)
    steps = (snapshots / "steps.txt").read_text().splitlines() if (snapshots / "steps.txt").exists() else []
    assert steps, f"the re-save touched no file under the checkpoint directory (exit codes {exit_codes})"
    broken = [step for step in steps if not _latest_is_loadable(str(snapshots / step.split()[0]), 2)]
    assert not broken, "a crash right after these steps of the re-save leaves 'latest' naming no complete " \
                       "checkpoint:\n" + "\n".join(broken) + f"\n(all steps:\n" + "\n".join(steps) + ")"
    assert exit_codes[0] in (0, KILLED_EXIT), exit_codes
    assert _latest_is_loadable(str(directory), 2)
    with open(expected_path, "rb") as handle:
        expected = pickle.load(handle)
    candidates = [str(directory)] + [str(snapshots / step.split()[0]) for step in steps]
    results = run_distributed(_load_latest, 2, candidates)
    for rank, rank_results in enumerate(results):
        for candidate, result in rank_results.items():
            assert torch.equal(result["loaded"], expected["old"]) or torch.equal(result["loaded"], expected["new"]), \
                f"rank {rank}: {candidate} loaded neither the old nor the new checkpoint"
            assert torch.isfinite(result["continued"]).all()


def test_replacing_a_tag_without_renameat2_recovers_the_retired_directory(tmp_path, monkeypatch):
    """Where the filesystem cannot exchange two directories atomically, a save retires the old
    directory first; a crash before the new one is in place leaves the retired one, which loading
    then uses (layer 1: no processes, the directory moves only)."""
    from deepspeed_acco.runtime import checkpoint_files
    save_dir = str(tmp_path)
    for name, marker in (("tag", "old"), (".tag.staging", "new")):
        os.makedirs(os.path.join(save_dir, name))
        with open(os.path.join(save_dir, name, checkpoint_files.MODEL_STATES_NAME), "w") as handle:
            handle.write(marker)
    monkeypatch.setattr(checkpoint_files, "exchange_directories", lambda first, second: False)
    renames = {"count": 0}
    real_rename = os.rename

    def crash_on_second_rename(source, destination):
        renames["count"] += 1
        if renames["count"] == 2:
            raise KeyboardInterrupt("crash between retiring the old directory and renaming the new one")
        real_rename(source, destination)

    monkeypatch.setattr(checkpoint_files.os, "rename", crash_on_second_rename)
    final, retired = os.path.join(save_dir, "tag"), checkpoint_files.retired_name(save_dir, "tag")
    with pytest.raises(KeyboardInterrupt):
        checkpoint_files.replace_directory(os.path.join(save_dir, ".tag.staging"), final, retired)
    assert not os.path.exists(final)
    resolved = checkpoint_files.resolve_directory(save_dir, "tag")
    with open(os.path.join(resolved, checkpoint_files.MODEL_STATES_NAME)) as handle:
        assert handle.read() == "old", "the interrupted save must leave the previous checkpoint loadable"
    # Without the crash the new directory replaces the old one and nothing is left behind.
    monkeypatch.setattr(checkpoint_files.os, "rename", real_rename)
    checkpoint_files.replace_directory(os.path.join(save_dir, ".tag.staging"), final, retired)
    with open(os.path.join(checkpoint_files.resolve_directory(save_dir, "tag"), checkpoint_files.MODEL_STATES_NAME)) as handle:
        assert handle.read() == "new"
    assert not os.path.exists(retired)


def test_renameat2_exchange_swaps_two_directories(tmp_path):
    from deepspeed_acco.runtime import checkpoint_files
    for name in ("a", "b"):
        os.makedirs(tmp_path / name)
        (tmp_path / name / "marker").write_text(name)
    if not checkpoint_files.exchange_directories(str(tmp_path / "a"), str(tmp_path / "b")):
        pytest.skip("this filesystem or OS has no renameat2(RENAME_EXCHANGE); saves use the retire-and-rename path")
    assert (tmp_path / "a" / "marker").read_text() == "b" and (tmp_path / "b" / "marker").read_text() == "a"
