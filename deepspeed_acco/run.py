"""``python -m deepspeed_acco.run SCRIPT [ARGS...]``: run an unmodified training script with our
optimizer types registered in DeepSpeed.

Importing :mod:`deepspeed_acco` registers the types (:mod:`deepspeed_acco.registration`); this
module then runs SCRIPT as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]`` and the script's folder
first on ``sys.path``, as ``python SCRIPT ARGS...`` would. ``-m MODULE`` runs a module instead.
It is meant to sit between a launcher and the script::

    deepspeed --num_gpus 2 --module deepspeed_acco.run train.py --deepspeed ds_config.json
    torchrun --nproc_per_node 2 -m deepspeed_acco.run train.py --deepspeed ds_config.json
    accelerate launch -m deepspeed_acco.run train.py

The ``deepspeed`` launcher puts ``--local_rank=N`` before the script name when it runs a module;
such leading ``--local_rank`` arguments are handed to the script right after its name, where the
launcher would have put them for ``deepspeed train.py``.
"""
import os
import runpy
import sys

import deepspeed_acco  # noqa: F401  (registers our optimizer types in deepspeed.initialize)

USAGE = "usage: python -m deepspeed_acco.run [--local_rank=N] (SCRIPT | -m MODULE) [ARGS...]"


def parse(argv):
    """``(kind, target, args)`` from the command line after ``-m deepspeed_acco.run``."""
    launcher_args = []
    argv = list(argv)
    while argv and argv[0].startswith("--local_rank"):
        option = argv.pop(0)
        launcher_args.append(option)
        if option == "--local_rank" and argv:  # the "--local_rank N" spelling
            launcher_args.append(argv.pop(0))
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(USAGE)
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(f"{USAGE}\n-m needs a module name")
        return "module", argv[1], launcher_args + argv[2:]
    if argv[0].startswith("-"):
        raise SystemExit(f"{USAGE}\nunknown option {argv[0]!r} before the script")
    return "script", argv[0], launcher_args + argv[1:]


def main(argv=None) -> None:
    kind, target, args = parse(sys.argv[1:] if argv is None else argv)
    if kind == "module":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    if not os.path.isfile(target):
        raise SystemExit(f"deepspeed_acco.run: no such script: {target}")
    sys.argv = [target, *args]
    # `python SCRIPT` puts the script's folder first on sys.path (`python -m` put the cwd there).
    sys.path[0] = os.path.dirname(os.path.abspath(target))
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
