"""Run a function on W real processes (gloo, CPU) and collect each rank's return value.

Used by the multi-process tests (layer 3 of docs/design.md, section 4). Each rank gets the usual launcher
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) and one thread.
"""
import multiprocessing
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(fn, rank, world_size, port, result_path, args, env):
    import faulthandler
    crash_log = open(result_path + ".crash", "w")
    faulthandler.enable(crash_log, all_threads=True)  # a native abort still leaves a traceback
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    os.environ.update(env or {})
    try:
        import torch
        torch.set_num_threads(1)
        outcome = (True, fn(rank, world_size, *args))
    except BaseException:
        outcome = (False, traceback.format_exc())
    if outcome[0]:
        import torch.distributed as dist
        if dist.is_initialized():  # a clean exit; see deepspeed_acco.runtime.initialize
            dist.destroy_process_group()
    with open(result_path + ".tmp", "wb") as handle:
        pickle.dump(outcome, handle)
    os.replace(result_path + ".tmp", result_path)
    if outcome[0]:
        # The result is written and every process group released. Interpreter finalisation of
        # torch 2.13 with gloo still aborts now and then ("terminate called without an active
        # exception": seen about once per full suite run, i.e. once in a few hundred rank exits;
        # more often with deepspeed.comm's CPU shared-memory op), after all our code has finished.
        # These tests check the math, so skip finalisation; how real training scripts exit is
        # checked by the launcher tests (tests/test_example.py) and the failure tests, which look
        # at real exit codes.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_distributed(fn, world_size, *args, timeout_s=240, env=None):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    ``fn`` must be importable (defined at module level). Raises with every failing rank's
    traceback, if a rank does not finish within ``timeout_s``, or if a process exits non-zero.
    """
    context = multiprocessing.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        paths = [os.path.join(directory, f"rank{rank}.pkl") for rank in range(world_size)]
        processes = [context.Process(target=_entry, args=(fn, rank, world_size, port, paths[rank], args, env))
                     for rank in range(world_size)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout_s
        for process in processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        failures, results = [], []
        for rank, (process, path) in enumerate(zip(processes, paths)):
            if process.is_alive():
                process.kill()
                process.join()
                failures.append(f"--- rank {rank} did not finish within {timeout_s} s")
                continue
            if not os.path.exists(path):
                failures.append(f"--- rank {rank} exited with code {process.exitcode} without a result")
                continue
            with open(path, "rb") as handle:
                ok, payload = pickle.load(handle)
            if not ok:
                failures.append(f"--- rank {rank} ---\n{payload}")
            elif process.exitcode != 0:
                with open(path + ".crash") as handle:
                    crash = handle.read()
                failures.append(f"--- rank {rank} returned a result but exited with code {process.exitcode}\n{crash}")
            results.append(payload)
    if failures:
        raise AssertionError("distributed test failed:\n" + "\n".join(failures))
    return results


def run_until_exit(target, world_size, *args, timeout_s=120):
    """Start ``target(rank, world_size, port, *args)`` on every rank and wait for all to exit.

    For tests in which ranks are meant to die (killed, crashing): returns each rank's exit code,
    or None for a rank that was still running at the deadline (it is then killed).
    """
    context = multiprocessing.get_context("spawn")
    port = free_port()
    processes = [context.Process(target=target, args=(rank, world_size, port, *args)) for rank in range(world_size)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
    codes = []
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
            codes.append(None)
        else:
            codes.append(process.exitcode)
    return codes
