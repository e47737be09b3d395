"""Checkpoints are data, not code; a refused load changes nothing (docs/checkpoints.md, "Load" and "Safety";
docs/usage.md, Checkpoints).

- Layer 1 (this process): a file whose unpickling would run code (an object whose ``__reduce__``
  creates a marker file) is refused naming the file and what it holds, by the loader and by
  ``zero_to_fp32`` (function and command line), and nothing runs; the allowlist covers what
  DeepSpeed's ZeRO-1 files hold; ``trusted_classes`` opts a user's class in; tags and ``latest``
  stay inside the directory.
- Layer 2 (one rank) and layer 3 (two ranks, gloo): each refused load (a file that would run code,
  truncated files, another model's optimizer file, a missing rank, files of another world size, a
  shape mismatch, type pairs docs/design.md refuses, incomplete round state, a tag or ``latest``
  outside the directory) raises on every rank and leaves the engine bitwise as it was, its job in
  flight included; the next updates are bitwise those of an engine that never tried. On two ranks
  one rank's bad file is refused by both. DeepSpeed-written ZeRO-1 checkpoints (fp32, bf16, fp16)
  still load. A failed save (disk full, a failure while publishing) raises on every rank at once and
  leaves no staging directory or temporary file, with ``latest`` and the previous checkpoint intact.
"""
import builtins
import collections
import dataclasses
import errno
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

import engine_probe as probe
from distributed_utils import run_distributed
from reference_sim import TinyNet, batch, loss_fn, param_groups
from test_checkpoint import MICRO_BATCH
from test_checkpoint import make_config as checkpoint_config

MODEL_FILE = "mp_rank_00_model_states.pt"
SAVE_AT, TOTAL = 5, 11
"""ACCO with accumulation 2 (one micro-batch per half): after 5 micro-batches the estimate of update 3
is in flight and the rank accumulates a second half, so the kept first-half sum is part of the state."""


def optimizer_file(rank, bf16=False):
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


class Payload:
    """Unpickling it creates ``path``: what a malicious checkpoint could do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return builtins.open, (self.path, "w")


@dataclasses.dataclass
class Cursor:
    """A user's own object in ``client_state`` (loaded only when named in ``trusted_classes``)."""

    position: int


class SmallNet(torch.nn.Module):
    """Another model (fewer parameters) whose optimizer file must not load into TinyNet's engine."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(5, 3)
        self.head = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)))


def make_config(kind="ACCO", accumulation=2, precision=None, **params):
    """tests/test_checkpoint.py's config, with a 4-step warm-up and the model's precision."""
    config = checkpoint_config(kind, accumulation, **params)
    config["steps_per_print"] = 10_000
    config["scheduler"]["params"]["warmup_num_steps"] = 4
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1}
    return config


def new_engine(config, model=None, seed=0):
    import deepspeed_acco
    model = model if model is not None else TinyNet(seed=seed)
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model, True, 0.1), config=config)
    return engine, model


def feed(engine, model, rank, start, stop):
    dtype = next(model.parameters()).dtype
    for index in range(start, stop):
        x, y = batch(rank, index, MICRO_BATCH)
        engine.backward(loss_fn(engine(x.to(dtype)), y.to(dtype)).float())
        engine.step()


def rewrite(path, edit):
    """Load one of our own (trusted) files, change it and write it back."""
    content = torch.load(path, weights_only=False)
    edit(content)
    torch.save(content, path)


def truncate(path):
    with open(path, "rb") as handle:
        data = handle.read()
    with open(path, "wb") as handle:
        handle.write(data[:len(data) // 2])


# ---- layer 1: what a file may hold, tags, bounds -----------------------------------------------------
def _handmade_checkpoint(directory, model_extra=None, optimizer_extra=None):
    """A one-rank ZeRO-1 checkpoint of a 6-parameter model, written by hand."""
    os.makedirs(directory, exist_ok=True)
    weight = torch.arange(6, dtype=torch.float32)
    model_states = {"module": {"w": weight.view(2, 3).clone()},
                    "param_shapes": [collections.OrderedDict([("w", torch.Size([2, 3]))])],
                    "dp_world_size": 1, **(model_extra or {})}
    optimizer = {"optimizer_state_dict": {"single_partition_of_fp32_groups": [weight + 0.5], **(optimizer_extra or {})}}
    torch.save(model_states, os.path.join(directory, MODEL_FILE))
    torch.save(optimizer, os.path.join(directory, optimizer_file(0)))
    with open(os.path.join(os.path.dirname(directory), "latest"), "w") as handle:
        handle.write(os.path.basename(directory))


def test_a_file_that_would_run_code_is_refused_naming_the_file_and_what_it_holds(tmp_path):
    from deepspeed_acco.runtime.checkpoint import load_file
    marker = tmp_path / "ran"
    path = str(tmp_path / "file.pt")
    torch.save({"module": {"w": torch.ones(2)}, "payload": Payload(str(marker))}, path)
    with pytest.raises(ValueError, match=rf"load_checkpoint: {path} holds (io|builtins)\.open, which a checkpoint file "
                                         r"may not hold unless you trust it \(nothing in the file was run\)"):
        load_file(path)
    assert not marker.exists()
    # A user's own class: refused by name, loaded once named trusted (and only that class).
    torch.save({"client": Cursor(7)}, path)
    with pytest.raises(ValueError, match=r"holds test_checkpoint_safety\.Cursor.*trusted_classes=\[\.\.\.\]"):
        load_file(path)
    assert load_file(path, trusted_classes=[Cursor]) == {"client": Cursor(7)}
    torch.save({"client": Cursor(7), "payload": Payload(str(marker))}, path)
    with pytest.raises(ValueError, match=r"holds (io|builtins)\.open"):
        load_file(path, trusted_classes=[Cursor])
    assert not marker.exists()
    # A file torch cannot read is refused naming it.
    truncate(path)
    with pytest.raises(ValueError, match=rf"{path} cannot be read as a checkpoint file .*truncated or damaged"):
        load_file(path)


def test_the_allowlist_holds_what_deepspeed_zero1_files_hold(tmp_path):
    """DeepSpeed's loss scalers (fp16 with dynamic scaling writes a DynamicLossScaler), ZeroStageEnum and
    fragment_address load with weights_only=True and come back equal; nothing else is on the list."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    from deepspeed_acco.runtime.checkpoint import checkpoint_classes, load_file
    assert set(checkpoint_classes()) == {LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address}
    dynamic = DynamicLossScaler(init_scale=2.0**8, scale_window=2, min_scale=1, delayed_shift=2,
                                consecutive_hysteresis=False, raise_error_at_min_scale=False)
    dynamic.cur_iter, dynamic.cur_hysteresis = 5, 1
    content = {"loss_scaler": dynamic, "static": LossScaler(scale=128.0), "zero_stage": ZeroStageEnum.optimizer_states,
               "param_slice_mappings": [collections.OrderedDict(w=fragment_address(numel=3, start=1))],
               "sets": set(), "shapes": collections.OrderedDict(w=torch.Size([2, 3])), "dtype": torch.bfloat16}
    path = str(tmp_path / "deepspeed.pt")
    torch.save(content, path)
    loaded = load_file(path)
    assert vars(loaded["loss_scaler"]) == vars(dynamic) and loaded["static"].cur_scale == 128.0
    assert loaded["zero_stage"] is ZeroStageEnum.optimizer_states
    assert loaded["param_slice_mappings"] == content["param_slice_mappings"]
    assert loaded["shapes"] == content["shapes"] and loaded["dtype"] is torch.bfloat16


@pytest.mark.slow
def test_zero_to_fp32_runs_nothing_as_a_function_and_on_the_command_line(tmp_path):
    from deepspeed_acco.zero_to_fp32 import consolidate
    marker = tmp_path / "ran"
    root = tmp_path / "checkpoints"
    _handmade_checkpoint(str(root / "clean"))
    assert torch.equal(consolidate(str(root), "clean")["w"], torch.arange(6.0).view(2, 3) + 0.5)
    _handmade_checkpoint(str(root / "model-payload"), model_extra={"payload": Payload(str(marker))})
    _handmade_checkpoint(str(root / "optimizer-payload"), optimizer_extra={"payload": Payload(str(marker))})
    _handmade_checkpoint(str(root / "client"), model_extra={"cursor": Cursor(3)})
    environment = dict(os.environ, PYTHONPATH=os.path.dirname(__file__) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def command_line(*arguments):
        return subprocess.run([sys.executable, "-m", "deepspeed_acco.zero_to_fp32", str(root),
                               str(tmp_path / "out.pt"), *arguments], capture_output=True, text=True, timeout=300,
                              env=environment)

    for tag, name in (("model-payload", MODEL_FILE), ("optimizer-payload", optimizer_file(0))):
        with pytest.raises(ValueError, match=rf"zero_to_fp32: .*{tag}/{name} holds (io|builtins)\.open"):
            consolidate(str(root), tag)
        completed = command_line("--tag", tag)
        assert completed.returncode == 1 and "holds io.open" in completed.stderr.replace("builtins.open", "io.open"), \
            completed.stderr
        assert not marker.exists(), tag
    with pytest.raises(ValueError, match=r"holds test_checkpoint_safety\.Cursor.*--trusted-class MODULE\.NAME"):
        consolidate(str(root), "client")
    assert consolidate(str(root), "client", trusted_classes=[Cursor])["w"].shape == (2, 3)
    completed = command_line("--tag", "client", "--trusted-class", "test_checkpoint_safety.Cursor")
    assert completed.returncode == 0, completed.stderr
    completed = command_line("--tag", "../outside")
    assert completed.returncode == 1 and "is not a checkpoint name inside the directory" in completed.stderr


def test_tags_and_latest_stay_inside_the_directory(tmp_path):
    from deepspeed_acco.runtime.checkpoint import check_tag, read_latest
    for tag in ("../other/tag", "..", "a/b", "/abs/tag", ".hidden", "", "x\0y"):
        with pytest.raises(ValueError, match="is not a checkpoint name inside the directory"):
            check_tag(tag, "load_checkpoint")
    assert check_tag("global_step12", "load_checkpoint") == "global_step12"
    assert read_latest(str(tmp_path), "load_checkpoint") is None
    (tmp_path / "latest").write_text("../outside/tag\n")
    with pytest.raises(ValueError, match=r"the tag in .*latest '\.\./outside/tag' is not a checkpoint name"):
        read_latest(str(tmp_path), "load_checkpoint")
    (tmp_path / "latest").write_text("global_step3\n")
    assert read_latest(str(tmp_path), "load_checkpoint") == "global_step3"


# ---- layers 2 and 3: refused loads change nothing, on one rank and on two -----------------------------
def _save_checkpoints(rank, world_size, root):
    """The good checkpoint and the others whose variants are refused."""
    engine, model = new_engine(make_config("ACCO"))
    feed(engine, model, rank, 0, SAVE_AT)
    engine.save_checkpoint(root, tag="good", client_state={"cursor": SAVE_AT})
    engine.destroy()
    engine, model = new_engine(make_config("ACCO"), model=SmallNet())
    feed(engine, model, rank, 0, SAVE_AT)
    engine.save_checkpoint(root, tag="small")
    engine.destroy()
    engine, model = new_engine(make_config("CO2", local_steps=2))
    feed(engine, model, rank, 0, SAVE_AT)
    engine.save_checkpoint(root, tag="co2")
    engine.destroy()
    engine, model = new_engine(make_config("ACCO", accumulation=4))
    feed(engine, model, rank, 0, 5)  # inside the second half of update 1: partial sums
    engine.save_checkpoint(root, tag="mid-round")
    engine.destroy()
    engine, model = new_engine(make_config("ACCO"))
    feed(engine, model, rank, 0, SAVE_AT)
    engine.save_checkpoint(root, tag="trusted", client_state={"cursor": Cursor(SAVE_AT)})
    engine.destroy()


def _make_variants(root, world_size, marker):
    """Broken copies of "good" (rank 0 writes them). Damage that concerns one rank's file hits the
    last rank's, so on two ranks rank 0 alone would find nothing wrong."""
    last = world_size - 1

    def variant(name, edit):
        shutil.copytree(os.path.join(root, "good"), os.path.join(root, name))
        edit(os.path.join(root, name))

    variant("truncated-optimizer", lambda d: truncate(os.path.join(d, optimizer_file(last))))
    variant("truncated-model", lambda d: truncate(os.path.join(d, MODEL_FILE)))
    variant("other-model-optimizer", lambda d: shutil.copy(os.path.join(root, "small", optimizer_file(last)),
                                                           os.path.join(d, optimizer_file(last))))
    variant("missing-rank", lambda d: os.remove(os.path.join(d, optimizer_file(last))))

    def other_world_size(d):  # files of `world_size` ranks, model states claiming one more
        rewrite(os.path.join(d, MODEL_FILE), lambda s: s.update(dp_world_size=world_size + 1))
        shutil.copy(os.path.join(d, optimizer_file(0)), os.path.join(d, optimizer_file(world_size)))
    variant("other-world-size", other_world_size)
    variant("shape-mismatch", lambda d: rewrite(os.path.join(d, MODEL_FILE),
                                                lambda s: s["module"].update({"head.weight": torch.zeros(3, 6)})))
    variant("payload-model", lambda d: rewrite(os.path.join(d, MODEL_FILE),
                                               lambda s: s.update(payload=Payload(marker))))
    variant("payload-optimizer", lambda d: rewrite(
        os.path.join(d, optimizer_file(last)), lambda s: s["optimizer_state_dict"].update(payload=Payload(marker))))
    variant("round-state", lambda d: rewrite(
        os.path.join(d, optimizer_file(last)),
        lambda s: s["optimizer_state_dict"]["deepspeed_acco"]["sharded"].pop("first_half_sum")))
    outside = os.path.join(os.path.dirname(root), "outside")
    shutil.copytree(os.path.join(root, "good"), os.path.join(outside, "tag"))
    os.makedirs(os.path.join(os.path.dirname(root), "latest-outside"))
    with open(os.path.join(os.path.dirname(root), "latest-outside", "latest"), "w") as handle:
        handle.write("../outside/tag")


# name, directory ("root" or another), load_checkpoint arguments, the refusal (regex)
REFUSALS = [
    ("truncated optimizer file", "root", dict(tag="truncated-optimizer"), r"cannot be read as a checkpoint file"),
    ("truncated model file", "root", dict(tag="truncated-model"), r"cannot be read as a checkpoint file"),
    ("another model's optimizer file", "root", dict(tag="other-model-optimizer"),
     r"single_partition_of_fp32_groups\[0\] has \d+ values, but partition \d of parameter group 0"),
    ("missing rank", "root", dict(tag="missing-rank"), r"optimizer states of rank \d are missing"),
    ("files of another world size", "root", dict(tag="other-world-size"), r"was written for \[\d+, \d+\] ranks"),
    ("shape mismatch", "root", dict(tag="shape-mismatch"), r"head\.weight is torch\.float32 of shape \(3, 6\)"),
    ("a CO2 checkpoint into ACCO", "root", dict(tag="co2"), r"a CO2 checkpoint cannot continue as ACCO"),
    ("incomplete round state", "root", dict(tag="round-state"), r"the kept first-half sum is missing"),
    ("a tag outside the directory", "root", dict(tag="../outside/tag"), r"is not a checkpoint name inside"),
    ("latest pointing outside", "latest-outside", dict(), r"latest '\.\./outside/tag' is not a checkpoint name"),
    ("code in the model file", "root", dict(tag="payload-model"), r"holds (io|builtins)\.open"),
    ("code in the model file, weights only", "root", dict(tag="payload-model", load_optimizer_states=False),
     r"holds (io|builtins)\.open"),
    ("code in an optimizer file", "root", dict(tag="payload-optimizer"), r"holds (io|builtins)\.open"),
    ("a client_state class not named trusted", "root", dict(tag="trusted"),
     r"holds test_checkpoint_safety\.Cursor.*trusted_classes"),
]


def _final(engine):
    probe.drain(engine)  # the job in flight writes its buffers until it ends
    state = probe.engine_state(engine)
    state.pop("running")  # another job object in another engine
    return state


def _refusal_worker(rank, world_size, base, cases, extra):
    import torch.distributed as dist
    root, marker = os.path.join(base, "root"), os.path.join(base, "ran")
    _save_checkpoints(rank, world_size, root)
    if rank == 0:
        _make_variants(root, world_size, marker)
    dist.barrier()
    results = {"refusals": {}}

    engine, model = new_engine(make_config("ACCO"))
    feed(engine, model, rank, 0, TOTAL)
    results["never-tried"] = _final(engine)
    engine.destroy()

    engine, model = new_engine(make_config("ACCO"))
    feed(engine, model, rank, 0, SAVE_AT)
    assert engine.schedule.running is not None and probe.acco_half(engine) == "B"  # a job in flight
    probe.drain(engine)  # its buffers are final (waiting changes nothing, the result stays pending)
    before = probe.engine_state(engine)
    for name, directory, arguments, _ in cases:
        start = time.monotonic()
        try:
            engine.load_checkpoint(os.path.join(base, directory), **arguments)
            outcome = None
        except ValueError as error:
            outcome = str(error)
        results["refusals"][name] = dict(error=outcome, seconds=time.monotonic() - start, ran=os.path.exists(marker),
                                         changed=probe.state_differences(before, probe.engine_state(engine)))
    feed(engine, model, rank, SAVE_AT, TOTAL)
    results["after-refusals"] = _final(engine)
    # What does load after all that: the trusted opt-in, the weights of a file whose optimizer part
    # would run code, and a good checkpoint.
    path, client_state = engine.load_checkpoint(os.path.join(base, "root"), tag="trusted", trusted_classes=[Cursor])
    results["trusted"] = client_state["cursor"]
    engine.load_checkpoint(os.path.join(base, "root"), tag="payload-optimizer", load_optimizer_states=False)
    results["weights-only-ran"] = os.path.exists(marker)
    engine.destroy()
    if "types" in extra:
        results.update(_type_pairs(rank, base))
    if "deepspeed" in extra:
        results.update(_deepspeed_checkpoints(rank, os.path.join(base, "deepspeed")))
    return results


def _type_pairs(rank, base):
    """The other refusals of docs/checkpoints.md: ACCO's state into CO2, a mid-round checkpoint into another type."""
    results = {}
    for name, kind, tag, pattern in (("ACCO into CO2", "CO2", "good", r"a ACCO checkpoint cannot continue as CO2"),
                                     ("mid-round ACCO into ShardedAdamW", "ShardedAdamW", "mid-round",
                                      r"saved in the middle of a round")):
        engine, model = new_engine(make_config(kind, **({"local_steps": 2} if kind == "CO2" else {})))
        feed(engine, model, rank, 0, 3)
        probe.drain(engine)
        before = probe.engine_state(engine)
        try:
            engine.load_checkpoint(os.path.join(base, "root"), tag=tag)
            error = None
        except ValueError as caught:
            error = str(caught)
        results[name] = dict(error=error, pattern=pattern,
                             changed=probe.state_differences(before, probe.engine_state(engine)))
        engine.destroy()
    return results


def _deepspeed_checkpoints(rank, root):
    """DeepSpeed's ZeRO-1 writes fp32, bf16 and fp16 (dynamic loss scale) checkpoints; ShardedAdamW in
    the same precision loads each: masters, step and loss scale as DeepSpeed held them."""
    results = {}
    for precision in ("fp32", "bf16", "fp16"):
        model = TinyNet(seed=0)
        if precision != "fp32":
            model = model.to(torch.bfloat16 if precision == "bf16" else torch.float16)
        engine, _ = new_engine(make_config("AdamW", precision=precision), model=model)
        feed(engine, model, rank, 0, 6)
        engine.save_checkpoint(root, tag=precision)
        partitions = [t.detach().clone() for t in engine.optimizer.single_partition_of_fp32_groups]
        scale = float(engine.optimizer.cur_scale) if precision == "fp16" else 1.0
        model = TinyNet(seed=4)
        if precision != "fp32":
            model = model.to(torch.bfloat16 if precision == "bf16" else torch.float16)
        ours, _ = new_engine(make_config("ShardedAdamW", precision=precision), model=model)
        ours.load_checkpoint(root, tag=precision)
        results[f"deepspeed-{precision}"] = dict(
            masters=all(torch.equal(shard.master[:partition.numel()], partition)
                        for shard, partition in zip(ours.optimizer.shards, partitions)),
            steps=(probe.adamw_step_count(ours), probe.adamw_step_count(engine)),
            scale=(probe.loss_scale(ours), scale))
        ours.destroy()
        if hasattr(engine, "destroy"):
            engine.destroy()
    return results


def _check_refusals(results, cases, world_size):
    for rank, rank_results in enumerate(results):
        for name, _, _, pattern in cases:
            outcome = rank_results["refusals"][name]
            assert outcome["error"] is not None, f"rank {rank}: {name} was loaded"
            assert re.search(pattern, outcome["error"]), (rank, name, outcome["error"])
            assert outcome["changed"] == [], f"rank {rank}: {name} changed {outcome['changed']}"
            assert not outcome["ran"], f"rank {rank}: {name} ran the payload"
        differences = probe.state_differences(rank_results["never-tried"], rank_results["after-refusals"])
        assert differences == [], f"rank {rank}: the updates after the refusals differ at {differences}"
        assert rank_results["trusted"] == Cursor(SAVE_AT)
        assert not rank_results["weights-only-ran"]
    if world_size > 1:
        # One rank's bad file: every rank refuses, naming that rank, and none waits for a timeout.
        for name in ("truncated optimizer file", "another model's optimizer file", "code in an optimizer file",
                     "incomplete round state"):
            for rank_results in results:
                assert f"rank {world_size - 1}: " in rank_results["refusals"][name]["error"], name
                assert f"refused on 1 of {world_size} ranks" in rank_results["refusals"][name]["error"], name
                assert rank_results["refusals"][name]["seconds"] < 20, name


@pytest.mark.slow
def test_refused_loads_change_nothing_on_one_rank(tmp_path):
    results = run_distributed(_refusal_worker, 1, str(tmp_path), REFUSALS, ("types", "deepspeed"), timeout_s=400)
    _check_refusals(results, REFUSALS, 1)
    rank_results = results[0]
    for name in ("ACCO into CO2", "mid-round ACCO into ShardedAdamW"):
        outcome = rank_results[name]
        assert outcome["error"] is not None and re.search(outcome["pattern"], outcome["error"]), outcome
        assert outcome["changed"] == [], (name, outcome["changed"])
    for precision in ("fp32", "bf16", "fp16"):
        outcome = rank_results[f"deepspeed-{precision}"]
        assert outcome["masters"], precision
        assert outcome["steps"][0] == outcome["steps"][1] == 3, (precision, outcome["steps"])
        assert outcome["scale"][0] == outcome["scale"][1], (precision, outcome["scale"])


@pytest.mark.slow
def test_refused_loads_change_nothing_on_two_ranks_and_every_rank_refuses(tmp_path):
    results = run_distributed(_refusal_worker, 2, str(tmp_path), REFUSALS, (), timeout_s=400)
    _check_refusals(results, REFUSALS, 2)


# ---- a failed save cleans up and tells every rank ------------------------------------------------------
def _leftovers(root):
    return sorted(os.path.relpath(os.path.join(folder, name), root) for folder, folders, files in os.walk(root)
                  for name in folders + files if ".staging" in name or ".tmp-" in name)


def _failed_save_worker(rank, world_size, root):
    import torch.distributed as dist
    from deepspeed_acco.runtime import checkpoint_files
    config = make_config("ACCO", communication_timeout_s=60)
    engine, model = new_engine(config)
    feed(engine, model, rank, 0, SAVE_AT)
    engine.save_checkpoint(root, tag="good")
    results = {}
    original_save, original_replace, original_makedirs = torch.save, checkpoint_files.replace_directory, os.makedirs

    def disk_full(obj, handle, *args, **kwargs):
        handle.write(b"half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    failures = [("disk full while writing", "full", world_size - 1, lambda: setattr(torch, "save", disk_full)),
                ("failure while publishing", "publish", 0,
                 lambda: setattr(checkpoint_files, "replace_directory", read_only)),
                ("failure while preparing", "prepare", 0, lambda: setattr(os, "makedirs", read_only))]
    for name, tag, failing_rank, install in failures:
        if rank == failing_rank:
            install()
        start = time.monotonic()
        try:
            engine.save_checkpoint(root, tag=tag)
            error = None
        except (OSError, RuntimeError) as caught:
            error = f"{type(caught).__name__}: {caught} {getattr(caught, '__notes__', '')}"
        seconds = time.monotonic() - start
        torch.save, checkpoint_files.replace_directory, os.makedirs = original_save, original_replace, original_makedirs
        dist.barrier()
        results[name] = dict(error=error, seconds=seconds, leftovers=_leftovers(root),
                             latest=open(os.path.join(root, "latest")).read(), published=os.path.exists(
                                 os.path.join(root, tag)))
    probe.drain(engine)
    before = probe.engine_state(engine)
    engine.save_checkpoint(root, tag="after")  # the engine still saves, and the save changed nothing
    results["changed"] = probe.state_differences(before, probe.engine_state(engine))
    results["after"] = sorted(os.listdir(os.path.join(root, "after")))
    engine.destroy()
    return results


@pytest.mark.slow
def test_a_failed_save_removes_its_files_and_every_rank_learns_at_once(tmp_path):
    world_size = 2
    results = run_distributed(_failed_save_worker, world_size, str(tmp_path), timeout_s=300)
    for rank, rank_results in enumerate(results):
        for name, failing_rank in (("disk full while writing", world_size - 1), ("failure while publishing", 0),
                                   ("failure while preparing", 0)):
            outcome = rank_results[name]
            assert outcome["error"] is not None, (rank, name)
            if rank == failing_rank:
                assert outcome["error"].startswith("OSError"), outcome["error"]
            else:
                assert f"rank {failing_rank}: OSError" in outcome["error"], outcome["error"]
            assert "staging files are removed" in outcome["error"], outcome["error"]
            # A barrier would have waited for the 60 s timeout (plus its grace).
            assert outcome["seconds"] < 20, (rank, name, outcome["seconds"])
            assert outcome["leftovers"] == [], (rank, name, outcome["leftovers"])
            assert outcome["latest"] == "good" and not outcome["published"], (rank, name)
        assert rank_results["changed"] == []
        assert rank_results["after"] == sorted([MODEL_FILE] + [optimizer_file(r) for r in range(world_size)])
    assert sorted(os.listdir(tmp_path / "good")) == results[0]["after"]
