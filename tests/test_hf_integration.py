"""Registration in DeepSpeed, the Hugging Face Trainer and Accelerate (docs/hf.md), on real processes.

``test_registration_and_hf_trainer`` (one 2-rank job):
- ``deepspeed.initialize`` with DeepSpeed's ZeRO-1 gives bitwise the same run before and after
  ``import deepspeed_acco``; with our types it returns our engine, a ``DeepSpeedEngine``, whose
  unsupported DeepSpeed methods raise clear errors;
- the HF Trainer with ShardedAdamW logs the losses of the HF Trainer with DeepSpeed's AdamW at ZeRO
  stage 1 (every epoch ends with a short update, so caller-decided boundaries are covered);
- the HF Trainer with ACCO, DPU and CO2: ``evaluate()`` during training and ``save_model()`` see
  the committed parameters (which differ from what the model holds), saved keys are the module's
  own, and ``resume_from_checkpoint`` continues with the losses of a run that never stopped.
``test_accelerate_loop_and_caller_set_boundaries`` (one 2-rank job): DeepSpeed's caller-boundary
loop with short updates, ShardedAdamW against DeepSpeed and ACCO against ShardedAdamW; Accelerate's
own loop with ACCO against ACCO's own loop, and against ShardedAdamW when both halves of every
update hold the same data; accelerate's DummyOptim/DummyScheduler.
The launcher tests run examples/hf_trainer.py and a plain DeepSpeed script through
``-m deepspeed_acco.run``. Worker functions import deepspeed_acco themselves (the first check
needs a process that has not imported it yet).
"""
import contextlib
import copy
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from distributed_utils import free_port, run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CTX, MICRO, ACCUMULATION, LR = 32, 2, 2, 2e-3
# 10 windows per rank = 5 micro-batches: every epoch ends with an update of one micro-batch.
TRAIN_WINDOWS, EVAL_WINDOWS, MAX_STEPS, SAVE_STEP = 20, 8, 6, 2


def _environment_ready():
    try:
        import accelerate  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as error:
        return False, str(error)
    return True, ""


pytestmark = pytest.mark.skipif(not _environment_ready()[0], reason=f"needs the test extra: {_environment_ready()[1]}")


def hf_config(kind, **params):
    """A DeepSpeed config as HF users write it: batch sizes, clipping and AdamW values left to the Trainer."""
    optimizer_params = {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto", **params}
    if kind == "AdamW":
        optimizer_params["torch_adam"] = True
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": 1},
            "steps_per_print": 1000, "optimizer": {"type": kind, "params": optimizer_params}}


# ---- the workers -------------------------------------------------------------------------------
def _windows(count, seed):
    from deepspeed_acco.bench.workload.data import WindowSampler, load_corpus
    corpus = load_corpus()
    return WindowSampler(corpus.train, CTX, count, seed=seed).micro_batch_at(0)


class _Windows(torch.utils.data.Dataset):
    def __init__(self, windows):
        self.windows = windows

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, index):
        tokens = torch.from_numpy(self.windows[index])
        return {"input_ids": tokens, "labels": tokens}


def _trainer(config, output_dir, *, save_steps=None, eval_steps=None, callbacks=None):
    from transformers import Trainer, TrainingArguments

    from deepspeed_acco.bench.workload.models import build_model
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=MICRO, per_device_eval_batch_size=2,
        gradient_accumulation_steps=ACCUMULATION, max_steps=MAX_STEPS, learning_rate=LR, weight_decay=0.1,
        max_grad_norm=1.0, logging_steps=1, save_strategy="steps" if save_steps else "no", save_steps=save_steps,
        eval_strategy="steps" if eval_steps else "no", eval_steps=eval_steps, deepspeed=copy.deepcopy(config),
        report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    return Trainer(model=build_model("tiny", CTX, 0), args=args, train_dataset=_Windows(_windows(TRAIN_WINDOWS, 1)),
                   eval_dataset=_Windows(_windows(EVAL_WINDOWS, 2)), callbacks=callbacks)


def _evaluation_probe(records):
    """A TrainerCallback that, after each evaluation during training, measures the loss of the
    committed and of the held parameters (built here: transformers is imported in the workers)."""
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        trainer = None

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            engine, model = self.trainer.model_wrapped, self.trainer.model
            windows = _windows(EVAL_WINDOWS, 2)
            with engine.committed_parameters():
                committed = _eval_loss(model, windows)
            model.eval()
            with torch.enable_grad():  # a forward with autograd runs on what the model holds
                held = _eval_loss(model, windows)
            records.append((state.global_step, metrics["eval_loss"], committed, held))

    return Probe()


def _logged(trainer, key="loss"):
    return {entry["step"]: entry[key] for entry in trainer.state.log_history if key in entry}


def _eval_loss(model, windows):
    """What Trainer.evaluate computes: the mean loss over the evaluation batches."""
    losses = []
    for start in range(0, len(windows), 2):
        tokens = torch.from_numpy(windows[start:start + 2])
        losses.append(float(model(input_ids=tokens, labels=tokens).loss.detach()))
    return sum(losses) / len(losses)


def _deepspeed_zero1_run():
    """DeepSpeed's own ZeRO-1 + AdamW on TinyNet, through ``deepspeed.initialize``."""
    import deepspeed
    from reference_sim import TinyNet, batch, flat_trainable, loss_fn, param_groups
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
              "zero_optimization": {"stage": 1}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    model = TinyNet(seed=0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    for index in range(8):
        x, y = batch(0, index)
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    return type(engine), flat_trainable(model)


def _registration_and_trainer_worker(rank, world_size, directory):
    import sys
    results = {"imported_before": "deepspeed_acco" in sys.modules}
    results["plain"] = _deepspeed_zero1_run()
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine

    import deepspeed_acco
    from deepspeed_acco.registration import is_installed
    from deepspeed_acco.runtime.engine import AccoEngine
    results["installed"] = is_installed()
    results["registered"] = _deepspeed_zero1_run()

    # Our types through deepspeed.initialize; what the engine refuses, and how.
    from reference_sim import TinyNet, param_groups
    ours = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
            "optimizer": {"type": "ACCO", "params": {"lr": 1e-2, "dynamic_accumulation": True}}}
    model = TinyNet(seed=0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=ours)
    results["ours"] = (type(engine) is AccoEngine, isinstance(engine, DeepSpeedEngine), engine.config is not None,
                       engine.zero_optimization_stage(), engine.zero_optimization_partition_gradients())
    errors = {}
    for name, call in (("allreduce_gradients", lambda: engine.allreduce_gradients()),
                       ("set_gradient_accumulation_boundary", lambda: engine.set_gradient_accumulation_boundary(True)),
                       ("checkpoint_engine", lambda: engine.checkpoint_engine)):
        try:
            call()
        except Exception as error:  # noqa: BLE001 - the type and text are what is checked
            errors[name] = (type(error).__name__, str(error))
    results["errors"] = errors
    engine.destroy()

    # HF Trainer: DeepSpeed's ZeRO-1 AdamW and our ShardedAdamW on the same data.
    runs = {}
    for kind in ("AdamW", "ShardedAdamW"):
        trainer = _trainer(hf_config(kind), os.path.join(directory, kind))
        trainer.train()
        runs[kind] = {"loss": _logged(trainer), "grad_norm": _logged(trainer, "grad_norm"),
                      "engine": type(trainer.model_wrapped).__name__,
                      "normalised_by_tokens": trainer.model_accepts_loss_kwargs and trainer.args.average_tokens_across_devices}
    results["trainer"] = runs

    # HF Trainer with the overlapped types: committed weights where the trainer reads them, resume.
    for kind in ("ACCO", "DPU", "CO2"):
        params = {"local_steps": 2} if kind == "CO2" else {}
        output = os.path.join(directory, kind)
        evaluations = []
        probe = _evaluation_probe(evaluations)
        trainer = _trainer(hf_config(kind, **params), output, save_steps=SAVE_STEP, eval_steps=SAVE_STEP,
                           callbacks=[probe])
        probe.trainer = trainer
        trainer.train()
        engine, model = trainer.model_wrapped, trainer.model
        with engine.committed_parameters():
            committed = {key: value.clone() for key, value in model.state_dict().items()}
        trainer.save_model(os.path.join(output, "final"))
        run = {"loss": _logged(trainer), "evaluations": evaluations, "engine": type(engine).__name__}
        if rank == 0:
            from safetensors.torch import load_file
            saved = load_file(os.path.join(output, "final", "model.safetensors"))
            run["saved_keys"], run["module_keys"] = sorted(saved), sorted(committed)
            run["saved_vs_committed"] = max((saved[key] - committed[key]).abs().max().item() for key in saved)
        resumed = _trainer(hf_config(kind, **params), os.path.join(directory, kind + "-resumed"))
        resumed.train(resume_from_checkpoint=os.path.join(output, f"checkpoint-{SAVE_STEP}"))
        run["resumed_loss"] = _logged(resumed)
        results[kind] = run
    return results


@pytest.mark.slow
def test_registration_and_hf_trainer(tmp_path):
    results = run_distributed(_registration_and_trainer_worker, 2, str(tmp_path), timeout_s=600)
    first = results[0]
    assert not first["imported_before"], "the worker must start without deepspeed_acco imported"
    assert first["installed"]
    plain_type, plain_params = first["plain"]
    registered_type, registered_params = first["registered"]
    assert plain_type.__name__ == registered_type.__name__ == "DeepSpeedEngine"
    assert torch.equal(plain_params, registered_params), "deepspeed.initialize changed after import deepspeed_acco"
    assert first["ours"] == (True, True, True, 1, False)
    kind, message = first["errors"]["allreduce_gradients"]
    assert kind == "NotImplementedError" and "allreduce_gradients" in message, message
    kind, message = first["errors"]["set_gradient_accumulation_boundary"]
    assert kind == "ValueError" and "dynamic_accumulation" in message, message
    kind, message = first["errors"]["checkpoint_engine"]
    assert kind == "AttributeError" and "checkpoint_engine" in message, message

    runs = first["trainer"]
    assert runs["AdamW"]["engine"] == "DeepSpeedEngine" and runs["ShardedAdamW"]["engine"] == "AccoEngine"
    # transformers 5 divides each micro-batch's loss by the update's token count over all ranks
    # (times the ranks) and calls backward(scale_wrt_gas=False): that is the loss compared here.
    assert runs["ShardedAdamW"]["normalised_by_tokens"]
    assert sorted(runs["AdamW"]["loss"]) == list(range(1, MAX_STEPS + 1))
    loss_difference = max(abs(runs["AdamW"]["loss"][s] - runs["ShardedAdamW"]["loss"][s]) for s in runs["AdamW"]["loss"])
    norm_difference = max(abs(runs["AdamW"]["grad_norm"][s] / runs["ShardedAdamW"]["grad_norm"][s] - 1)
                          for s in runs["AdamW"]["grad_norm"])
    print(f"HF Trainer, ShardedAdamW vs DeepSpeed ZeRO-1 AdamW: max |loss difference| {loss_difference:.3g}, "
          f"max relative grad-norm difference {norm_difference:.3g} over {MAX_STEPS} updates")
    # Norms of about 2-5, summed in another order (DeepSpeed in fp32 per partition, ours in fp64).
    assert loss_difference <= 1e-5 and norm_difference <= 1e-5

    for kind in ("ACCO", "DPU", "CO2"):
        run = first[kind]
        assert run["engine"] == "AccoEngine"
        losses = [run["loss"][step] for step in sorted(run["loss"])]
        assert len(losses) == MAX_STEPS and all(0.5 < loss < 6.5 for loss in losses), losses
        assert losses[-1] < losses[0], f"{kind} did not train: {losses}"
        for step, evaluated, committed, held in run["evaluations"]:
            print(f"{kind} step {step}: evaluate() {evaluated:.6f}, committed parameters {committed:.6f}, "
                  f"held parameters {held:.6f}")
            assert abs(evaluated - committed) <= 1e-5, (kind, step)
        steps = [step for step, *_ in run["evaluations"]]
        assert steps == list(range(SAVE_STEP, MAX_STEPS + 1, SAVE_STEP)), steps
        assert max(abs(held - committed) for _, _, committed, held in run["evaluations"]) > 1e-4, \
            f"{kind}: the model held the committed parameters at every evaluation; the check would see nothing"
        print(f"{kind}: saved model vs committed parameters: max |difference| {run['saved_vs_committed']}")
        assert all(not key.startswith("module.") for key in run["saved_keys"])
        assert set(run["saved_keys"]) <= set(run["module_keys"])
        assert run["saved_vs_committed"] == 0.0, kind
        # The resumed Trainer's history starts with the checkpoint's entries; what it trained follows.
        resumed = {step: loss for step, loss in run["resumed_loss"].items() if step > SAVE_STEP}
        assert sorted(resumed) == list(range(SAVE_STEP + 1, MAX_STEPS + 1)), run["resumed_loss"]
        assert all(resumed[step] == run["loss"][step] for step in resumed), (kind, resumed, run["loss"])


# ---- Accelerate's own loop -----------------------------------------------------------------------
ACCELERATE_ACCUMULATION, ACCELERATE_UPDATES = 4, 4


def _micro_batches(rank, identical_halves):
    """This rank's micro-batches; with ``identical_halves`` both halves of every update hold the same windows."""
    from deepspeed_acco.bench.workload.data import WindowSampler, load_corpus
    sampler = WindowSampler(load_corpus().train, CTX, MICRO, seed=3, rank=rank)
    if not identical_halves:
        return [torch.from_numpy(sampler.micro_batch_at(i)) for i in range(ACCELERATE_UPDATES * ACCELERATE_ACCUMULATION)]
    half = ACCELERATE_ACCUMULATION // 2
    batches = []
    for update in range(ACCELERATE_UPDATES):
        first_half = [torch.from_numpy(sampler.micro_batch_at(update * half + i)) for i in range(half)]
        batches += first_half + first_half
    return batches


def _plain_config(kind):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCELERATE_ACCUMULATION,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "steps_per_print": 1000,
            "optimizer": {"type": kind, "params": {"lr": LR, "weight_decay": 0.1}}}


def _accelerate_run(accelerator, kind, batches):
    """Accelerate's documented DeepSpeed loop: prepare, accumulate, backward, optimizer.step()."""
    from accelerate.utils import DummyOptim

    from deepspeed_acco.bench.workload.models import build_model
    accelerator.state.select_deepspeed_plugin(kind)
    model = build_model("tiny", CTX, 0)
    engine, optimizer = accelerator.prepare(model, DummyOptim(model.parameters(), lr=LR, weight_decay=0.1))
    losses = []
    for tokens in batches:
        with accelerator.accumulate(engine):
            loss = engine(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
    result = {"losses": losses, "type": engine.optimizer_name(), "global_steps": engine.global_steps}
    accelerator.free_memory()  # destroys the engine, which leaves the committed parameters in the model
    result["committed"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return result


def _managed_run(kind, batches):
    """The same micro-batches through deepspeed_acco's own loop (backward and step per micro-batch)."""
    import deepspeed_acco
    from deepspeed_acco.bench.workload.models import build_model
    model = build_model("tiny", CTX, 0)
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(),
                                           config=_plain_config(kind))
    losses = []
    for tokens in batches:
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    with engine.committed_parameters():
        committed = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    engine.destroy()
    return {"losses": losses, "committed": committed}


# Micro-batches per update under caller-set boundaries (accumulation 4): short updates as at epoch ends.
SHORT_UPDATES = [4, 1, 4, 2, 4, 3, 4]
# ACCO with identical halves stays ShardedAdamW while the short updates end in the first half.
SHORT_UPDATES_FIRST_HALF = [4, 1, 4, 2, 4]


def _caller_boundary_run(kind, rank, updates, *, scale_wrt_gas, identical_halves=False):
    """DeepSpeed's documented caller-boundary loop on TinyNet: the boundary set before each micro-batch,
    step() once per update. Without ``scale_wrt_gas`` the caller normalises the loss over the update's
    micro-batches, as the HF Trainer does."""
    import deepspeed
    from reference_sim import TinyNet, batch, flat_trainable, loss_fn, param_groups
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
              "steps_per_print": 1000, "zero_optimization": {"stage": 1},
              "optimizer": {"type": kind, "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    model = TinyNet(seed=0)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config)
    index = 0
    for update, count in enumerate(updates):
        for i in range(count):
            engine.set_gradient_accumulation_boundary(i == count - 1)
            x, y = batch(rank, 2 * update + i % 2 if identical_halves else index)
            index += 1
            loss = loss_fn(engine(x), y)
            if scale_wrt_gas:
                engine.backward(loss)
            else:
                engine.backward(loss / count, scale_wrt_gas=False)
        engine.step()
    committed = getattr(engine, "committed_parameters", None)
    with committed() if committed is not None else contextlib.nullcontext():
        parameters = flat_trainable(model)
    if committed is not None:
        engine.destroy()
    return parameters


def _placeholders_check():
    """deepspeed.initialize with accelerate's DummyOptim and a DummyScheduler carrying a callable."""
    import deepspeed
    from accelerate.utils import DummyOptim, DummyScheduler

    from deepspeed_acco.runtime.engine import AccoEngine
    from reference_sim import TinyNet, param_groups
    model = TinyNet(seed=0)
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
              "optimizer": {"type": "DPU", "params": {"lr": 1e-2}}}
    halve = DummyScheduler(None, lr_scheduler_callable=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5))
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=DummyOptim(param_groups(model)),
                                                           lr_scheduler=halve, config=config)
    result = (type(engine) is AccoEngine, type(scheduler).__name__, scheduler.optimizer is optimizer,
              engine.get_lr(), len(optimizer.param_groups))
    engine.destroy()
    return result


def _accelerate_worker(rank, world_size):
    from accelerate import PartialState

    import deepspeed_acco  # noqa: F401  (registers our types in deepspeed.initialize, which Accelerate calls)
    # accelerate 1.15 finds no backend for DeepSpeed on a CPU-only machine and would run one process
    # per rank (num_processes 1); naming gloo first gives it the job's 2 ranks, as TrainingArguments does.
    PartialState(backend="gloo")
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    # One Accelerator per process: it holds a DeepSpeed plugin per config, selected before each prepare.
    accelerator = Accelerator(deepspeed_plugin={kind: DeepSpeedPlugin(hf_ds_config=_plain_config(kind))
                                                for kind in ("ACCO", "ShardedAdamW")},
                              gradient_accumulation_steps=ACCELERATE_ACCUMULATION)
    identical, ordinary = _micro_batches(rank, True), _micro_batches(rank, False)
    caller = {(kind, scale): _caller_boundary_run(kind, rank, SHORT_UPDATES, scale_wrt_gas=scale)
              for kind in ("AdamW", "ShardedAdamW") for scale in (True, False)}
    for kind in ("ShardedAdamW", "ACCO"):
        caller[(kind, "identical")] = _caller_boundary_run(kind, rank, SHORT_UPDATES_FIRST_HALF, scale_wrt_gas=False,
                                                           identical_halves=True)
    return {"caller": caller, "placeholders": _placeholders_check(),
            "ACCO identical": _accelerate_run(accelerator, "ACCO", identical),
            "ShardedAdamW identical": _accelerate_run(accelerator, "ShardedAdamW", identical),
            "ACCO": _accelerate_run(accelerator, "ACCO", ordinary), "ACCO managed": _managed_run("ACCO", ordinary)}


@pytest.mark.slow
def test_accelerate_loop_and_caller_set_boundaries():
    results = run_distributed(_accelerate_worker, 2, timeout_s=600)
    caller = results[0]["caller"]
    for scale in (True, False):
        difference = (caller[("AdamW", scale)] - caller[("ShardedAdamW", scale)]).abs().max().item()
        print(f"caller-set boundaries with short updates {SHORT_UPDATES}, scale_wrt_gas={scale}: "
              f"max |ShardedAdamW - DeepSpeed ZeRO-1| {difference:.3g}")
        assert difference <= 1e-6
    assert (caller[("AdamW", True)] - caller[("AdamW", False)]).abs().max() > 1e-3  # short updates differ
    difference = (caller[("ACCO", "identical")] - caller[("ShardedAdamW", "identical")]).abs().max().item()
    print(f"short updates ending in ACCO's first half {SHORT_UPDATES_FIRST_HALF}: max |ACCO - ShardedAdamW| "
          f"{difference:.3g}")
    assert difference <= 1e-6
    assert results[0]["placeholders"] == (True, "LambdaLR", True, [5e-3, 5e-3], 2)

    for rank_result in results:
        acco, managed = rank_result["ACCO"], rank_result["ACCO managed"]
        assert acco["type"] == "ACCO" and acco["global_steps"] == ACCELERATE_UPDATES - 1  # the last commit in flight
        assert acco["losses"][-1] < acco["losses"][0]
        # Accelerate's loop (caller-set boundaries, one step() per update) runs ACCO's own schedule.
        assert acco["losses"] == managed["losses"]
        assert torch.equal(acco["committed"], managed["committed"])
        # With identical halves the first half's gradient at the estimate is the full batch's at the
        # committed parameters, so the estimate is the next commit: ACCO is ShardedAdamW exactly.
        acco, sharded = rank_result["ACCO identical"], rank_result["ShardedAdamW identical"]
        assert (acco["type"], sharded["type"]) == ("ACCO", "ShardedAdamW")
        loss_difference = max(abs(a - b) for a, b in zip(acco["losses"], sharded["losses"]))
        parameter_difference = (acco["committed"] - sharded["committed"]).abs().max().item()
        print(f"Accelerate, ACCO vs ShardedAdamW with identical halves: max |loss difference| {loss_difference:.3g}, "
              f"max |committed parameter difference| {parameter_difference:.3g}")
        assert loss_difference <= 1e-6 and parameter_difference <= 1e-6


# ---- launchers -----------------------------------------------------------------------------------
def _launcher(name):
    """A console script of this interpreter's environment (else on PATH), or None."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.path.exists(here) else shutil.which(name)


def _launch(command, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if not env.get("TORCH_EXTENSIONS_DIR"):  # DeepSpeed's CPU shm op: build once, not per run
        from deepspeed_acco.bench.workload.data import default_cache_dir
        env["TORCH_EXTENSIONS_DIR"] = os.path.join(default_cache_dir(), "torch_extensions")
    result = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


@pytest.mark.slow
@pytest.mark.skipif(_launcher("deepspeed") is None, reason="the deepspeed launcher script is not installed")
def test_hf_trainer_example_under_the_deepspeed_launcher(tmp_path):
    """The unmodified HF Trainer script, registered by ``--module deepspeed_acco.run``."""
    output = _launch([_launcher("deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "--module",
                      "deepspeed_acco.run", os.path.join(REPO, "examples", "hf_trainer.py"),
                      "--deepspeed", os.path.join(REPO, "examples", "configs", "hf_acco.json"),
                      "--output_dir", str(tmp_path / "run"), "--model", "tiny", "--ctx", "32", "--max_steps", "4",
                      "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                      "--logging_steps", "1", "--train_windows", "64", "--eval_windows", "8", "--report_to", "none",
                      "--save_strategy", "no", "--use_cpu", "--disable_tqdm", "true"], cwd=str(tmp_path))
    assert "engine AccoEngine, optimizer ACCO, 2 ranks" in output, output[-3000:]
    losses = [float(x) for x in re.findall(r"step +\d+ loss (\d+\.\d+)", output)]
    assert len(losses) == 4 and all(0.5 < loss < 6.5 for loss in losses), output[-3000:]
    assert re.search(r"final validation loss \d+\.\d+", output)
    assert os.path.isfile(tmp_path / "run" / "model.safetensors")


_PLAIN_DEEPSPEED_SCRIPT = """
import atexit, json, os, sys
import deepspeed, torch
from reference_sim import TinyNet, batch, loss_fn

def gloo_worker_threads():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("pt_gloo_runloop")

# Registered before initialize, so it runs after deepspeed_acco's exit hooks (atexit is LIFO).
atexit.register(lambda: print(f"rank {os.environ['RANK']} gloo worker threads at exit {gloo_worker_threads()}",
                              flush=True))
config = json.loads(sys.argv[1])
model = TinyNet(seed=0)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
for index in range(8):
    x, y = batch(engine.global_rank, index)
    engine.backward(loss_fn(engine(x), y))
    engine.step()
if engine.global_rank == 0:
    print(f"engine {type(engine).__name__} name {__name__} argv {sys.argv[2:]} steps {engine.global_steps}")
print(f"rank {engine.global_rank} gloo worker threads in training {gloo_worker_threads()}", flush=True)
"""


@pytest.mark.slow
@pytest.mark.skipif(_launcher("torchrun") is None, reason="torchrun is not installed")
def test_plain_deepspeed_script_under_torchrun(tmp_path):
    """An unmodified deepspeed.initialize script, registered by ``-m deepspeed_acco.run`` (no HF)."""
    script = tmp_path / "train.py"
    script.write_text(_PLAIN_DEEPSPEED_SCRIPT)
    shutil.copy(os.path.join(REPO, "tests", "reference_sim.py"), tmp_path / "reference_sim.py")
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
              "optimizer": {"type": "DPU", "params": {"lr": 1e-2}}}
    output = _launch([_launcher("torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
                      "-m", "deepspeed_acco.run", str(script), json.dumps(config), "--flag", "value"], cwd=REPO)
    assert "engine AccoEngine name __main__ argv ['--flag', 'value'] steps 3" in output, output[-3000:]
    # Exit: the engine's process groups are torn down by its exit hook, not left to interpreter
    # finalisation (a gloo thread still releasing the last job's tensors there aborted ~1 exit in
    # 30 with "terminate called without an active exception"). torch's gloo runs 2 worker threads
    # per group: in training the default group's and the engine's (3 groups for DPU at W=2); at
    # exit at most the default group's (its threads outlive destroy_process_group() under torchrun;
    # none of the engine's collectives runs on it, so it has no job's tensors to release).
    for rank in (0, 1):
        during = int(re.search(rf"rank {rank} gloo worker threads in training (\d+)", output).group(1))
        at_exit = int(re.search(rf"rank {rank} gloo worker threads at exit (\d+)", output).group(1))
        assert during >= 6 and at_exit <= 2, (rank, during, at_exit)


def test_run_module_command_line():
    from deepspeed_acco.run import parse
    assert parse(["train.py", "--deepspeed", "c.json"]) == ("script", "train.py", ["--deepspeed", "c.json"])
    # The deepspeed launcher puts --local_rank before the script when it runs a module.
    assert parse(["--local_rank=1", "train.py", "--x"]) == ("script", "train.py", ["--local_rank=1", "--x"])
    assert parse(["--local_rank", "0", "-m", "pkg.train", "--x"]) == ("module", "pkg.train", ["--local_rank", "0", "--x"])
    for bad in ([], ["--help"], ["--verbose", "train.py"], ["-m"]):
        with pytest.raises(SystemExit):
            parse(bad)


_REGISTRATION_SCRIPT = """
import importlib, importlib.util, sys
import deepspeed_acco
from deepspeed_acco import registration
assert "deepspeed" not in sys.modules and not registration.is_installed()
assert importlib.util.find_spec("deepspeed") is not None  # an availability check does not import, nor unhook
assert "deepspeed" not in sys.modules
import deepspeed
assert registration.is_installed(), "not installed on deepspeed's import"
wrapper = deepspeed.initialize
importlib.reload(deepspeed_acco)
registration.install()
assert deepspeed.initialize is wrapper, "installed twice"
assert registration.original_initialize() is wrapper.__deepspeed_acco_original__
assert not [f for f in sys.meta_path if getattr(f, "is_deepspeed_acco_hook", False)], "the import hook stayed"
print("registration ok")
"""


def test_registration_waits_for_deepspeed_and_is_idempotent():
    env = dict(os.environ, PYTHONPATH=REPO + (os.pathsep + os.environ["PYTHONPATH"]
                                              if os.environ.get("PYTHONPATH") else ""))
    result = subprocess.run([sys.executable, "-c", _REGISTRATION_SCRIPT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=300)
    assert result.returncode == 0 and "registration ok" in result.stdout, result.stdout[-3000:]
