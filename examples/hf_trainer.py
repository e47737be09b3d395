"""A plain Hugging Face ``Trainer`` script: GPT-Neo from a config, trained on the Python standard library.

Nothing in it knows about deepspeed_acco. The optimizer comes from the DeepSpeed JSON given with
``--deepspeed`` (``"optimizer": {"type": "ACCO"}`` in examples/configs/hf_acco.json), and the
launch line registers our optimizer types in DeepSpeed by running the script through
``deepspeed_acco.run``:

    deepspeed --num_gpus 2 --module deepspeed_acco.run examples/hf_trainer.py \\
        --deepspeed examples/configs/hf_acco.json --output_dir runs/hf_acco --gradient_accumulation_steps 2
    torchrun --nproc_per_node 2 -m deepspeed_acco.run examples/hf_trainer.py \\
        --deepspeed examples/configs/hf_acco.json --output_dir runs/hf_acco --gradient_accumulation_steps 2
    accelerate launch --use_deepspeed --num_processes 2 -m deepspeed_acco.run examples/hf_trainer.py \\
        --deepspeed examples/configs/hf_acco.json --output_dir runs/hf_acco --gradient_accumulation_steps 2

(``import deepspeed_acco`` at the top of the script does the same as ``deepspeed_acco.run``.) Every
``TrainingArguments`` flag works (``--max_steps``, ``--eval_steps``, ``--save_steps``,
``--resume_from_checkpoint``, ...); the model and data flags are below. The model is built from a
config (no downloads); tokens are bytes. On a CPU-only machine ``--num_gpus``/``--nproc_per_node``
count ranks (gloo); pass ``--use_cpu`` there, or the Trainer counts one process (accelerate finds no
DeepSpeed backend on CPUs) and its batch sizes disagree with the job's.
"""
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import HfArgumentParser, Trainer, TrainingArguments

from deepspeed_acco.bench.workload.data import WindowSampler, load_corpus, validation_windows
from deepspeed_acco.bench.workload.models import PRESETS, build_model, count_parameters


@dataclass
class ModelAndDataArguments:
    model: str = field(default="3m", metadata={"help": f"GPT-Neo preset: {', '.join(sorted(PRESETS))}"})
    ctx: int = field(default=256, metadata={"help": "tokens per training window"})
    data: str = field(default=None, metadata={"help": "text file or folder (default: the Python standard library)"})
    train_windows: int = field(default=4096, metadata={"help": "training windows per epoch"})
    eval_windows: int = field(default=64, metadata={"help": "held-out validation windows"})


class Windows(torch.utils.data.Dataset):
    """Causal-LM examples from an array of token windows: the labels are the inputs (the model shifts them)."""

    def __init__(self, windows: np.ndarray):
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int):
        tokens = torch.from_numpy(self.windows[index])
        return {"input_ids": tokens, "labels": tokens}


def training_windows(tokens: np.ndarray, ctx: int, count: int, seed: int) -> np.ndarray:
    """``count`` windows at positions fixed by ``seed`` (the Trainer shuffles and shards them)."""
    sampler = WindowSampler(tokens, ctx, micro_batch=count, seed=seed)
    return sampler.micro_batch_at(0)


def main() -> None:
    parser = HfArgumentParser((ModelAndDataArguments, TrainingArguments))
    data_args, training_args = parser.parse_args_into_dataclasses()
    corpus = load_corpus(data_args.data)
    train = Windows(training_windows(corpus.train, data_args.ctx, data_args.train_windows, training_args.seed))
    evaluation = Windows(validation_windows(corpus.val, data_args.ctx, data_args.eval_windows))
    model = build_model(data_args.model, data_args.ctx, training_args.seed)

    trainer = Trainer(model=model, args=training_args, train_dataset=train, eval_dataset=evaluation)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    engine = trainer.model_wrapped
    optimizer = engine.config.get("optimizer", {}).get("type") if hasattr(engine, "config") else None
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(f"engine {type(engine).__name__}, optimizer {optimizer}, {training_args.world_size} ranks, "
              f"{count_parameters(model):,} parameters, {corpus.describe()}")
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step']:5d} loss {entry['loss']:.4f} lr {entry['learning_rate']:.3g}")
        print(f"final validation loss {metrics['eval_loss']:.4f} (perplexity {math.exp(metrics['eval_loss']):.2f})")
    trainer.save_model()  # every rank takes part; rank 0 writes
    if trainer.is_world_process_zero():
        print(f"model saved to {os.path.abspath(training_args.output_dir)}")


if __name__ == "__main__":
    main()
