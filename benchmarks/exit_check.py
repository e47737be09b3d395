"""Count unclean exits of jobs whose engines are never destroyed (docs/failures.md, "Exit").

Each run starts W ranks (gloo, CPU) that train a small MLP for 48 micro-batches with one optimizer
type and end without ``engine.destroy()``, the way most training scripts end:

* ``--ending return``: the engine is a local of the rank function, which returns (reference
  counting frees the engine before the interpreter exits);
* ``--ending global``: the engine stays in a module global until the interpreter exits;
* ``--ending destroy-group``: the rank function returns, then the script calls
  ``dist.destroy_process_group()``.

``--launcher spawn`` starts the ranks with ``torch.multiprocessing.start_processes`` (what
``torch.multiprocessing.spawn`` runs; every rank's exit code is read, not only the first
failure), ``deepspeed`` with ``deepspeed --num_gpus W`` and ``torchrun`` with
``torchrun --nproc_per_node W`` (both run this file as ``__main__``). A run fails when a rank (or
the launcher) exits non-zero; the output of failed runs is kept under ``--log-dir``.

    python benchmarks/exit_check.py --runs 20 --types ShardedAdamW DPU ACCO CO2
    python benchmarks/exit_check.py --runs 5 --launcher deepspeed --ending global
"""
import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

TYPES = ["ShardedAdamW", "DPU", "ACCO", "CO2"]
MICRO_BATCHES = 48
_KEPT = []
"""The engine under ``--ending global``."""


def _config(kind: str) -> dict:
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10 ** 9}
    if kind == "DeepSpeedAdamW":  # DeepSpeed's own ZeRO-1, for comparison
        config.update(optimizer={"type": "AdamW", "params": {"lr": 1e-3}}, zero_optimization={"stage": 1})
    else:
        config.update(optimizer={"type": kind, "params": {"lr": 1e-3}})
    return config


def _train(kind: str, rank: int, keep: bool) -> None:
    import torch

    import deepspeed_acco
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 8))
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=model.parameters(), config=_config(kind))
    generator = torch.Generator().manual_seed(rank)
    for _ in range(MICRO_BATCHES):
        engine.backward(engine(torch.randn(4, 32, generator=generator)).square().mean())
        engine.step()
    if keep:
        _KEPT.append(engine)


def _rank(kind: str, ending: str) -> None:
    import torch
    torch.set_num_threads(1)
    _train(kind, int(os.environ["RANK"]), keep=ending == "global")
    if ending == "destroy-group":
        import torch.distributed as dist
        dist.destroy_process_group()


def _spawned(rank: int, world_size: int, port: int, kind: str, ending: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    _rank(kind, ending)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_spawn(kind: str, world_size: int, ending: str, log_path: str) -> list:
    """One job under torch.multiprocessing; returns every rank's exit code."""
    import torch.multiprocessing as mp
    with open(log_path, "w") as log:
        # The children inherit the parent's stdout and stderr: point them at the log for this run.
        saved = os.dup(1), os.dup(2)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            context = mp.start_processes(_spawned, args=(world_size, _free_port(), kind, ending), nprocs=world_size,
                                         join=False, start_method="spawn")
            for process in context.processes:
                process.join(300)
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    codes = []
    for process in context.processes:
        if process.is_alive():
            process.kill()
            process.join()
            codes.append(None)
        else:
            codes.append(process.exitcode)
    return codes


def _launcher_command(launcher: str, world_size: int, kind: str, ending: str) -> list:
    script = [os.path.abspath(__file__), "--rank-of", kind, "--ending", ending]
    bin_dir = os.path.dirname(sys.executable)
    if launcher == "deepspeed":
        program = os.path.join(bin_dir, "deepspeed")
        return [program if os.path.exists(program) else "deepspeed", "--num_gpus", str(world_size),
                "--master_port", str(_free_port()), *script]
    program = os.path.join(bin_dir, "torchrun")
    return [program if os.path.exists(program) else "torchrun", "--nproc_per_node", str(world_size),
            "--master_port", str(_free_port()), *script]


def _run_launcher(launcher: str, kind: str, world_size: int, ending: str, log_path: str) -> list:
    """One job under a launcher; returns the launcher's exit code."""
    import deepspeed_acco
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # The ranks import the package this process imports (a PYTHONPATH given to compare two trees included).
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(deepspeed_acco.__file__)))
    env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(log_path, "w") as log, tempfile.TemporaryDirectory() as directory:
        try:
            result = subprocess.run(_launcher_command(launcher, world_size, kind, ending), cwd=directory, env=env,
                                    stdout=log, stderr=subprocess.STDOUT, timeout=600)
            return [result.returncode]
        except subprocess.TimeoutExpired:
            return [None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", nargs="+", default=TYPES, help="optimizer types (DeepSpeedAdamW: DeepSpeed's own)")
    parser.add_argument("--runs", type=int, default=20, help="jobs per type")
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--launcher", choices=["spawn", "deepspeed", "torchrun"], default="spawn")
    parser.add_argument("--ending", choices=["return", "global", "destroy-group"], default="return")
    parser.add_argument("--log-dir", default=None, help="where the output of failed runs is kept (default: a new "
                        "temporary folder)")
    parser.add_argument("--rank-of", default=None, help=argparse.SUPPRESS)  # a rank started by a launcher
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed's argument
    args = parser.parse_args()
    if args.rank_of is not None:
        _rank(args.rank_of, args.ending)
        return
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="exit_check_")
    os.makedirs(log_dir, exist_ok=True)
    print(f"launcher={args.launcher} ending={args.ending} W={args.world_size} runs={args.runs}; logs of failed "
          f"runs in {log_dir}", flush=True)
    for kind in args.types:
        failed, started = 0, time.perf_counter()
        for run in range(args.runs):
            log_path = os.path.join(log_dir, f"{args.launcher}_{args.ending}_{kind}_{run}.log")
            if args.launcher == "spawn":
                codes = _run_spawn(kind, args.world_size, args.ending, log_path)
            else:
                codes = _run_launcher(args.launcher, kind, args.world_size, args.ending, log_path)
            if any(code != 0 for code in codes):
                failed += 1
                with open(log_path, errors="replace") as handle:
                    aborted = "terminate called" in handle.read()
                print(f"  {kind} run {run}: exit codes {codes}{' (terminate called ...)' if aborted else ''}",
                      flush=True)
            else:
                os.remove(log_path)
        print(f"{kind}: {failed} of {args.runs} runs failed ({time.perf_counter() - started:.0f} s)", flush=True)
    if not os.listdir(log_dir) and args.log_dir is None:
        shutil.rmtree(log_dir)


if __name__ == "__main__":
    main()
