"""Milliseconds per update of the example's model for each optimizer type, overlap on and off.

The end-to-end check of benchmarks/gpu_check.sh: the GPT-Neo of ``examples/train_gpt.py``
(``deepspeed_acco.bench.models``), the example's DeepSpeed configs (``examples/configs``), one
process (world size 1, a real NCCL group of one on CUDA), random byte tokens already on the
device (no data loading in the timed loop, and no per-step ``loss.item()``, which would
synchronise every step), and for ShardedAdamW, DPU, ACCO and CO2 with ``overlap`` true and false:
a warm-up, then the wall time of ``--updates`` committed updates between two device
synchronisations. CO2 counts inner steps as updates.

At world size 1 the collectives are local copies, so overlap on and off should cost about the
same; the figures show the pipeline's own overhead (jobs, events, read-backs) on top of compute.

    python benchmarks/e2e_step_time.py                          # CUDA if available, else CPU
    python benchmarks/e2e_step_time.py --model tiny --updates 5 --json /tmp/e2e.json
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TYPES = {"ShardedAdamW": "sharded.json", "DPU": "dpu.json", "ACCO": "acco.json", "CO2": "co2.json"}


def load_config(kind: str, overlap: bool, micro_batch: int, co2_local_steps: int) -> dict:
    config = json.loads((REPO / "examples" / "configs" / TYPES[kind]).read_text())
    config["optimizer"]["params"]["overlap"] = overlap
    config["train_micro_batch_size_per_gpu"] = micro_batch
    config["steps_per_print"] = 1_000_000
    if kind == "CO2":
        config["optimizer"]["params"]["local_steps"] = co2_local_steps
    return config


def time_updates(kind: str, overlap: bool, args, device: torch.device, tokens: torch.Tensor) -> dict:
    import deepspeed_acco
    from deepspeed_acco.bench.models import build_model

    model = build_model(args.model, args.ctx, seed=0)
    config = load_config(kind, overlap, args.micro_batch, args.co2_local_steps)
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.device.type == device.type, f"engine on {engine.device}, expected {device}"
    micro = 0

    def run_updates(count: int) -> None:
        nonlocal micro
        target = engine.global_steps + count
        while engine.global_steps < target:
            x = tokens[micro % len(tokens)]
            micro += 1
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()

    run_updates(args.warmup)
    samples_ms = []
    for _ in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        run_updates(args.updates)
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples_ms.append((time.perf_counter() - started) * 1e3 / args.updates)
    with engine.committed_parameters(), torch.no_grad():
        loss = float(engine(input_ids=tokens[0], labels=tokens[0]).loss)
    result = {"type": kind, "overlap": overlap, "ms_per_update": statistics.median(samples_ms),
              "samples_ms": samples_ms, "micro_batches": micro, "updates": engine.global_steps, "final_loss": loss,
              "wait_ms_per_update": 1e3 * engine.communication_wait_s / max(1, engine.global_steps)}
    engine.destroy()
    del engine, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="bench model preset (default: 125m on CUDA, tiny on CPU)")
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=4, help="updates before timing (kernels built, caches warm)")
    parser.add_argument("--updates", type=int, default=12, help="updates per timed repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--co2-local-steps", type=int, default=4)
    parser.add_argument("--types", default=",".join(TYPES), help="comma-separated subset of " + ",".join(TYPES))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    args.model = args.model or ("125m" if device.type == "cuda" else "tiny")
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (8, args.micro_batch, args.ctx), generator=generator).to(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# end-to-end ms/update: model {args.model} (ctx {args.ctx}, micro-batch {args.micro_batch}, "
          f"accumulation from examples/configs), world size 1 on {where}, torch {torch.__version__}", flush=True)
    results = []
    for kind in [t.strip() for t in args.types.split(",") if t.strip()]:
        for overlap in (True, False):
            result = time_updates(kind, overlap, args, device, tokens)
            results.append(result)
            print(f"{kind:>12} overlap={'on ' if overlap else 'off'}  {result['ms_per_update']:8.2f} ms/update  "
                  f"(repeats {', '.join(f'{s:.2f}' for s in result['samples_ms'])}; boundary wait "
                  f"{result['wait_ms_per_update']:.2f} ms/update; loss {result['final_loss']:.3f})", flush=True)
    print("\n| type | overlap on ms/update | overlap off ms/update |\n|---|---:|---:|")
    for kind in dict.fromkeys(r["type"] for r in results):
        on, off = (next(r for r in results if r["type"] == kind and r["overlap"] is flag) for flag in (True, False))
        print(f"| {kind} | {on['ms_per_update']:.2f} | {off['ms_per_update']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"device": where, "model": args.model, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
