"""Train a small GPT-Neo on real text with deepspeed_acco (or DeepSpeed's own ZeRO-1).

The model is built from a config (no downloads) and trained on the Python standard library's own
source files, byte-level (or on ``--data``: a text file, a folder, a Hugging Face dataset name).
Switching method is a config edit: the optimizer ``type`` in the DeepSpeed JSON ("ACCO", "DPU",
"CO2", "ShardedAdamW", or DeepSpeed's "AdamW" with ``zero_optimization.stage`` 1).

    deepspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/configs/acco.json
    deepspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/configs/zero1.json
    deepspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config examples/configs/acco.json --optimizer DPU

On a CPU-only machine ``--num_gpus`` counts ranks (DeepSpeed's CPU accelerator; gloo); use
``OMP_NUM_THREADS`` to share the cores. torchrun works too:
``torchrun --nproc_per_node 2 examples/train_gpt.py --deepspeed_config ...``.
"""
import argparse
import contextlib
import json
import math
import os
import time

import torch

import deepspeed_acco
from deepspeed_acco.bench.workload.data import WindowSampler, load_corpus, validation_windows
from deepspeed_acco.bench.workload.models import PRESETS, build_model, count_parameters


def parse_args():
    p = argparse.ArgumentParser(description="Train a small GPT-Neo with deepspeed_acco.initialize")
    p.add_argument("--deepspeed_config", "--config", required=True, help="DeepSpeed JSON config")
    p.add_argument("--optimizer", default=None,
                   help="override the config's optimizer type (ACCO, DPU, CO2, ShardedAdamW, AdamW)")
    p.add_argument("--steps", type=int, default=200, help="committed updates")
    p.add_argument("--model", default="3m", choices=sorted(PRESETS))
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--data", default=None, help="text file, folder, or Hugging Face dataset (default: Python stdlib)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--val-windows", type=int, default=64)
    p.add_argument("--save", default=None, help="save a checkpoint to this folder at the end")
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    return p.parse_args()


# Optimizer params each type accepts besides lr, betas, eps and weight_decay (for --optimizer overrides).
_EXTRA_PARAMS = {
    "shardedadamw": {"overlap"}, "dpu": {"overlap", "warmup_sync_updates", "sync_after_updates"},
    "acco": {"overlap", "dynamic_accumulation", "warmup_sync_updates", "sync_after_updates"},
    "co2": {"overlap", "local_steps", "outer_lr", "outer_momentum", "gap_penalty", "clip_threshold", "group_size",
            "anchor_merge_steps", "warmup_sync_updates"},
}


def load_config(args) -> dict:
    """The JSON config; ``--optimizer`` swaps the type, keeping the shared AdamW hyper-parameters."""
    with open(args.deepspeed_config) as f:
        cfg = json.load(f)
    if args.optimizer:
        kind = args.optimizer.lower()
        old = cfg.get("optimizer", {}).get("params", {})
        params = {k: v for k, v in old.items() if k in ("lr", "betas", "eps", "weight_decay")}
        params.update({k: v for k, v in old.items() if k in _EXTRA_PARAMS.get(kind, ())})
        if kind in _EXTRA_PARAMS:  # ours: the engine shards the optimizer itself
            cfg.pop("zero_optimization", None)
        else:  # DeepSpeed's own optimizer, ZeRO-1 unless the config says otherwise
            cfg.setdefault("zero_optimization", {"stage": 1})
            params["torch_adam"] = old.get("torch_adam", not torch.cuda.is_available())
        cfg["optimizer"] = {"type": args.optimizer, "params": params}
    return cfg


@torch.no_grad()
def validation_loss(model, windows, batch_size=8) -> float:
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(windows), batch_size):
        x = torch.from_numpy(windows[i:i + batch_size]).to(next(model.parameters()).device)
        total += float(model(input_ids=x, labels=x).loss) * len(x)
    model.train(was_training)
    return total / len(windows)


def main():
    args = parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cfg = load_config(args)
    corpus = load_corpus(args.data)
    model = build_model(args.model, args.ctx, args.seed)

    # The one line that changes from plain DeepSpeed: deepspeed.initialize -> deepspeed_acco.initialize.
    engine, optimizer, _, scheduler = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(),
                                                                config=cfg)

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    device = getattr(engine, "device", torch.device("cpu"))
    sampler = WindowSampler(corpus.train, args.ctx, cfg["train_micro_batch_size_per_gpu"], seed=args.seed, rank=rank)
    windows = validation_windows(corpus.val, args.ctx, args.val_windows)
    if rank == 0:
        print(f"GPT-Neo '{args.model}' ({count_parameters(model):,} parameters), optimizer "
              f"{cfg['optimizer']['type']}, {world} ranks; data: {corpus.describe()}", flush=True)

    # The evaluation view of the parameters: our engines may hold an estimate (ACCO) or a local
    # replica (CO2) in the model between updates; committed_parameters() swaps in the committed ones.
    committed = getattr(engine, "committed_parameters", contextlib.nullcontext)

    initial = validation_loss(engine.module, windows)  # every engine holds the committed weights here
    if rank == 0:
        print(f"initial validation loss {initial:.4f}", flush=True)

    micro, done, losses, t0 = 0, 0, [], time.perf_counter()
    while done < args.steps:
        x = torch.from_numpy(sampler.micro_batch_at(micro)).to(device)
        micro += 1
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if engine.global_steps == done:
            continue
        done = int(engine.global_steps)
        if rank == 0 and (done % args.log_every == 0 or done == args.steps):
            elapsed = time.perf_counter() - t0
            wait = getattr(engine, "communication_wait_s", None)
            print(f"update {done:5d}  loss {sum(losses) / len(losses):.4f}  lr {engine.get_lr()[0]:.2e}  "
                  f"{engine.global_samples / elapsed:.1f} samples/s"
                  + (f"  comm wait {wait:.1f} s" if wait is not None else ""), flush=True)
            losses = []
    with committed():
        val = validation_loss(engine.module, windows)
    if rank == 0:
        print(f"final validation loss {val:.4f} (perplexity {math.exp(val):.2f}) after {done} updates, "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
    if args.save:
        engine.save_checkpoint(args.save)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
