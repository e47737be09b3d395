"""Every command README.md, docs/ and benchmarks/ pages tell a reader to run works as written (docs/design.md, section 4).

The commands are read from the documents: lines of fenced shell blocks and inline code that start
with one of :data:`ENTRY_POINTS`. Commands in the report folders under docs/results/ are records
of past runs, not instructions, and are left out. Nothing trains and nothing is launched:

- cheap commands run: ``--help`` through the real parser, ``bash benchmarks/gpu_check.sh --plan``,
  and ``make TARGET`` as a dry run (``make -n``), whose python commands are checked in turn;
- the others are parsed by the real argument parser of what they call: the launchers' own
  (``deepspeed``, ``torchrun``, ``accelerate launch``, ``python -m deepspeed_acco.run``), then the
  parser of the script or module they start, captured where it is built and given the command's
  arguments (the launcher's ``--local_rank`` included). The bench goes through ``parse_command``,
  every check it makes before anything runs (``--fault`` with DeepSpeed's ZeRO-1 among the methods
  is refused there), and its methods must be configs the engine accepts;
- a DeepSpeed config that a command names is parsed by our engine's config parser at the
  launcher's world size, after transformers fills an HF Trainer config's ``"auto"`` values from the
  Trainer's arguments as the Trainer does;
- a command with placeholders (``SCRIPT``, ``KIND@U``, ``ARGS...``, ``[--tag T]``) or a bare mention of
  a command that needs arguments is a template: its flags must exist.

A renamed flag, a refused combination or a config the engine refuses then fails here. It takes
seconds: the imports of torch, deepspeed and transformers.
"""
import argparse
import contextlib
import io
import json
import re
import runpy
import shlex
import subprocess
import sys
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"

ENTRY_POINTS = ("python -m deepspeed_acco", "python -m pytest", "python benchmarks/", "python examples/",
                ".venv/bin/python ", "deepspeed ", "torchrun ", "accelerate launch", "make ", "bash benchmarks/",
                "pytest ")
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console")
ENVIRONMENT = re.compile(r"""^(?:[A-Za-z_][A-Za-z0-9_]*=(?:"[^"]*"|'[^']*'|\S*)\s+)+""")
"""Leading variable assignments (``SIZES=4M bash ...``)."""
PLACEHOLDER = re.compile(r"\.\.\.|^[\[<]|[\]>]$|^[A-Z][A-Z0-9_]*(@[A-Z0-9]+)?(\.[a-z]+)?$")
"""A word the reader replaces: ``SCRIPT``, ``KIND@U``, ``PROBE.json``, ``ARGS...``, ``[--tag T]``,
``<node address>``."""
INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")


@dataclass
class Command:
    where: str
    """file:line of the command in its document."""
    text: str
    argv: List[str]
    """The command's words, without leading variable assignments and ``sudo``."""

    @property
    def template(self) -> bool:
        return any(PLACEHOLDER.search(word) for word in self.argv)


def _without_prefixes(words: List[str]) -> List[str]:
    """``words`` without leading variable assignments and ``sudo`` (with its options)."""
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    if words[:1] == ["sudo"]:
        words = words[1:]
        while words and words[0].startswith("-"):
            words = words[1:]
        return _without_prefixes(words)
    return words


def _commands(where: str, text: str) -> List[Command]:
    """The commands of one shell line: each part of ``a && b`` or ``a; b`` that starts with an entry
    point."""
    text = " ".join(text.split())
    if not ENVIRONMENT.sub("", text).startswith(ENTRY_POINTS):
        return []
    found, part = [], []
    for word in shlex.split(text, comments=True) + ["&&"]:
        if word not in ("&&", "||", ";", "|"):
            part.append(word)
            continue
        part = _without_prefixes(part)
        if part and " ".join(part).startswith(ENTRY_POINTS):
            found.append(Command(where, text, part))
        part = []
    return found


def commands_in(path: Path, name: str) -> List[Command]:
    """The commands of one markdown file: fenced shell blocks line by line (``\\`` continues a line;
    ``#`` starts a comment) and inline code, which may wrap across lines."""
    found, outside, fence, logical, start = [], [], None, "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip().lower()
            outside.append("")
            continue
        if fence is None:
            outside.append(line)
            continue
        outside.append("")
        if fence not in SHELL_BLOCKS:
            continue
        if not logical:
            start = number
        logical += line.rstrip()
        if logical.endswith("\\"):
            logical = logical[:-1] + " "
            continue
        found += _commands(f"{name}:{start}", logical)
        logical = ""
    text = "\n".join(outside)
    for match in INLINE.finditer(text):
        found += _commands(f"{name}:{text.count(chr(10), 0, match.start()) + 1}", match.group(1))
    return found


def documented_commands() -> List[Command]:
    pages = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").rglob("*.md") if RESULTS not in p.parents) \
        + sorted((ROOT / "benchmarks").rglob("*.md"))
    return [command for page in pages for command in commands_in(page, str(page.relative_to(ROOT)))]


# ---- running parsers without running the programs ----------------------------------------------
class _ParserBuilt(Exception):
    def __init__(self, parser):
        super().__init__("stopped where the parser was built")
        self.parser = parser


@contextlib.contextmanager
def _program(argv0: str, args: List[str]):
    """sys.argv and sys.path as ``python argv0 args`` would set them, restored afterwards."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [argv0, *args]
    try:
        yield
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


def parser_of(start) -> argparse.ArgumentParser:
    """The argparse parser that ``start()`` (running a script or module as ``__main__``) builds and
    asks to parse its command line: caught at that call, before the program does anything else."""
    methods = {name: getattr(argparse.ArgumentParser, name) for name in ("parse_args", "parse_known_args")}

    def stop(self, *args, **kwargs):
        raise _ParserBuilt(self)

    for name in methods:
        setattr(argparse.ArgumentParser, name, stop)
    try:
        start()
    except _ParserBuilt as built:
        return built.parser
    finally:
        for name, method in methods.items():
            setattr(argparse.ArgumentParser, name, method)
    raise AssertionError("the program ran to its end without parsing a command line")


def _parse(parser: argparse.ArgumentParser, args: List[str], where: str):
    """``parser`` on ``args``; a usage error fails with argparse's message. Returns the namespace."""
    error = io.StringIO()
    try:
        with contextlib.redirect_stderr(error), contextlib.redirect_stdout(io.StringIO()):
            if parser.__class__.__name__ == "HfArgumentParser":
                namespace, unused = parser.parse_known_args(args)
                assert not unused, f"{where}: the HF Trainer refuses arguments it does not use: {unused}"
                return namespace
            return parser.parse_args(args)
    except SystemExit as stopped:
        if stopped.code == 0 and {"-h", "--help"} & set(args):
            return None
        raise AssertionError(f"{where} refuses the arguments {args}: {error.getvalue().strip() or stopped}") from None


def _needs_arguments(parser: argparse.ArgumentParser) -> bool:
    return any(action.required for action in parser._actions)


def _check_flags(parser: argparse.ArgumentParser, args: List[str], where: str) -> None:
    """A template's flags exist in ``parser``."""
    flags = [word.strip("[]").split("=")[0] for word in args if word.strip("[]").startswith("-")
             and not re.match(r"^-\d", word.strip("[]"))]
    unknown = [flag for flag in flags if flag not in parser._option_string_actions]
    assert not unknown, f"{where}: no such option {unknown}"


def _check_parsed(parser, args: List[str], where: str, template: bool, world_size: int) -> None:
    if template or (not args and _needs_arguments(parser)):
        _check_flags(parser, args, where)
        return
    namespace = _parse(parser, args, where)
    if namespace is not None:
        check_config_of(namespace, parser, world_size, where)


# ---- DeepSpeed configs named by a command ------------------------------------------------------
def check_config_of(namespace, parser, world_size: int, where: str) -> None:
    """The DeepSpeed JSON a parsed command names (``--deepspeed_config`` / ``--deepspeed``), as the
    engine will read it; an HF Trainer config gets its "auto" values from the Trainer's arguments."""
    path = getattr(namespace, "deepspeed_config", None) or getattr(namespace, "deepspeed", None)
    if not isinstance(path, str) or not path.endswith(".json"):
        return
    assert (ROOT / path).is_file(), f"{where}: no such config {path}"
    config = json.loads((ROOT / path).read_text())
    if parser.__class__.__name__ == "HfArgumentParser":
        from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig
        filled = HfTrainerDeepSpeedConfig(config)
        filled.trainer_config_process(types.SimpleNamespace(**vars(namespace), world_size=world_size))
        assert not filled.mismatches, f"{where}: the Trainer's arguments contradict {path}: {filled.mismatches}"
        config = filled.config
    from deepspeed_acco.runtime.config import optimizer_type, parse_config
    if optimizer_type(config) is None:
        return  # DeepSpeed's own optimizer: DeepSpeed reads this config
    try:
        parse_config(config, world_size=world_size)
    except ValueError as error:
        raise AssertionError(f"{where}: the engine refuses {path} at {world_size} rank(s): {error}") from None


# ---- what each kind of command calls -----------------------------------------------------------
def check_bench(args: List[str], where: str, template: bool) -> None:
    from deepspeed_acco.bench.__main__ import build_parser, parse_command, refused_by_engine
    if template:
        _check_flags(build_parser(), args, where)
        return
    error = io.StringIO()
    try:
        with contextlib.redirect_stderr(error), contextlib.redirect_stdout(io.StringIO()):
            parsed, methods = parse_command(args)
    except SystemExit as stopped:
        if stopped.code == 0 and {"-h", "--help"} & set(args):
            return
        raise AssertionError(f"{where}: the bench refuses {args}: {error.getvalue().strip() or stopped}") from None
    refused = refused_by_engine(parsed, methods)
    assert not refused, f"{where}: the engine refuses these methods' configs, so the bench would skip them: {refused}"


def check_module(module: str, args: List[str], where: str, template: bool, world_size: int) -> None:
    if module == "deepspeed_acco.bench":
        check_bench(args, where, template)
    elif module == "deepspeed_acco.run":
        if template or not args:
            return  # "python -m deepspeed_acco.run SCRIPT ARGS...": the reader's own script
        from deepspeed_acco import run
        kind, target, script_args = run.parse(args)
        launch = check_module if kind == "module" else check_script
        launch(target, script_args, where, template, world_size)
    elif module == "pytest":
        check_pytest(args, where)
    elif module.startswith("deepspeed_acco"):
        try:
            with _program(module, args), warnings.catch_warnings():
                # A module the tests imported already is run again as __main__: runpy warns, harmlessly
                # here, since it is stopped at its parser.
                warnings.filterwarnings("ignore", ".*found in sys.modules", RuntimeWarning)
                parser = parser_of(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))
        except ImportError as error:
            raise AssertionError(f"{where}: {error}") from None
        _check_parsed(parser, args, where, template, world_size)
    else:
        raise AssertionError(f"{where}: no check for python -m {module}; add one to tests/test_docs_commands.py")


def check_script(script: str, args: List[str], where: str, template: bool, world_size: int) -> None:
    path = ROOT / script
    if PLACEHOLDER.search(script) or ("/" not in script and not path.exists()):
        return  # the reader's own script (SCRIPT, train.py): only the launcher's part can be checked
    assert path.is_file(), f"{where}: no such script {script}"
    with _program(str(path), args):
        sys.path.insert(0, str(path.parent))  # as `python SCRIPT` does
        parser = parser_of(lambda: runpy.run_path(str(path), run_name="__main__"))
    _check_parsed(parser, args, where, template, world_size)


def check_python(argv: List[str], where: str, template: bool, world_size: int = 1) -> None:
    """``python ...`` and ``.venv/bin/python ...``: a module of ours, pytest, or a script of the repository."""
    args = argv[1:]
    if args[:1] == ["-m"]:
        check_module(args[1], args[2:], where, template, world_size)
    elif args and not args[0].startswith("-"):
        check_script(args[0], args[1:], where, template, world_size)
    else:
        raise AssertionError(f"{where}: no check for {shlex.join(argv)}")


def check_pytest(args: List[str], where: str) -> None:
    from _pytest.config import get_config
    try:
        namespace = get_config()._parser.parse(args)
    except pytest.UsageError as error:
        raise AssertionError(f"{where}: pytest refuses {args}: {error}") from None
    missing = [target for target in namespace.file_or_dir if not (ROOT / target.split("::")[0]).exists()]
    assert not missing, f"{where}: no such test file or folder {missing}"


def check_deepspeed_launcher(argv: List[str], where: str, template: bool) -> None:
    from deepspeed.launcher.runner import parse_args
    launcher = _parse_launcher(lambda: parse_args(_launcher_args(argv[1:], template)), where)
    world_size = max(launcher.num_gpus, 1) * max(launcher.num_nodes, 1)
    # The launcher passes --local_rank=N first, unless told not to (deepspeed/launcher/launch.py).
    args = ([] if launcher.no_local_rank else ["--local_rank=0"]) + launcher.user_args
    if launcher.module:
        check_module(launcher.user_script, args, where, template, world_size)
    else:
        check_script(launcher.user_script, args, where, template, world_size)


def check_torchrun(argv: List[str], where: str, template: bool) -> None:
    from torch.distributed.run import get_args_parser
    launcher = _parse_launcher(lambda: get_args_parser().parse_args(_launcher_args(argv[1:], template)), where)
    world_size = int(launcher.nproc_per_node) * int(str(launcher.nnodes).split(":")[-1])
    launch = check_module if launcher.module else check_script
    launch(launcher.training_script, launcher.training_script_args, where, template, world_size)


def check_accelerate(argv: List[str], where: str, template: bool) -> None:
    from accelerate.commands.launch import launch_command_parser
    launcher = _parse_launcher(lambda: launch_command_parser().parse_args(_launcher_args(argv[2:], template)), where)
    world_size = launcher.num_processes or 1
    launch = check_module if launcher.module else check_script
    launch(launcher.training_script, launcher.training_script_args, where, template, world_size)


def _launcher_args(words: List[str], template: bool) -> List[str]:
    """A template's option values that are placeholders (``--node_rank K``) become 1, so that the
    launcher's own parser can check its part; positional placeholders stay for the target's check."""
    if not template:
        return list(words)
    return ["1" if PLACEHOLDER.search(word) and index and words[index - 1].startswith("-") else word
            for index, word in enumerate(words)]


def _parse_launcher(parse, where: str):
    error = io.StringIO()
    try:
        with contextlib.redirect_stderr(error):
            return parse()
    except SystemExit as stopped:
        raise AssertionError(f"{where}: the launcher refuses it: {error.getvalue().strip() or stopped}") from None


def check_make(argv: List[str], where: str) -> None:
    """A dry run of the target (``make -n``), then each python command it would run."""
    dry = subprocess.run(["make", "-n", *argv[1:]], cwd=ROOT, capture_output=True, text=True)
    assert dry.returncode == 0, f"{where}: make refuses it: {dry.stderr.strip()}"
    for line in dry.stdout.splitlines():
        for command in _commands(where, line):
            if command.argv[0].endswith("/python"):
                check_python(command.argv, f"{where} (make runs: {line.strip()})", command.template)


def check_bash(argv: List[str], where: str) -> None:
    script = ROOT / argv[1]
    assert script.is_file(), f"{where}: no such script {argv[1]}"
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert syntax.returncode == 0, f"{where}: {syntax.stderr.strip()}"
    if argv[2:] == ["--plan"]:  # documented as cheap: no GPU, no python
        plan = subprocess.run(["bash", str(script), "--plan"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert plan.returncode == 0 and "total" in plan.stdout, f"{where}: {plan.stderr.strip() or plan.stdout}"
    elif argv[2:] == ["--dry-run"]:  # runs for a minute; tests/test_gpu_study.py runs it
        assert '"--dry-run"' in script.read_text(), f"{where}: {argv[1]} has no --dry-run"
    else:
        assert not argv[2:], f"{where}: no check for the arguments {argv[2:]} of {argv[1]}"


def check(command: Command) -> None:
    argv, where, template = command.argv, command.where, command.template
    program = argv[0]
    if program == "make":
        check_make(argv, where)
    elif program == "bash":
        check_bash(argv, where)
    elif program in ("python", "python3") or program.endswith("/python"):
        check_python(argv, where, template)
    elif program == "pytest":
        check_pytest(argv[1:], where)
    elif program == "deepspeed":
        check_deepspeed_launcher(argv, where, template)
    elif program == "torchrun":
        check_torchrun(argv, where, template)
    elif argv[:2] == ["accelerate", "launch"]:
        if len(argv) > 2:  # "`accelerate launch` works the same way": a mention, not a command
            check_accelerate(argv, where, template)
    else:
        raise AssertionError(f"{where}: no check for {command.text}; add one to tests/test_docs_commands.py")


COMMANDS = documented_commands()


@pytest.mark.parametrize("command", COMMANDS, ids=[f"{c.where} {c.text[:60]}" for c in COMMANDS])
def test_documented_command_works_as_written(command):
    check(command)


# ---- the checker itself ----------------------------------------------------------------------------
def test_the_commands_of_readme_and_docs_are_found_and_records_are_not():
    texts = {c.text for c in COMMANDS}
    wheres = {c.where.split(":")[0] for c in COMMANDS}
    assert {"make demo", "make test"} <= texts
    assert any(t.startswith("deepspeed --num_gpus 2 --module deepspeed_acco.run examples/hf_trainer.py") for t in texts)
    assert any(t.startswith("python -m deepspeed_acco.bench --fault") for t in texts)  # inline, over two lines
    assert {"README.md", "docs/hf.md", "docs/bench.md", "docs/usage.md", "docs/kernels.md"} <= wheres
    assert not any(w.startswith("docs/results/") for w in wheres)


def test_extraction_of_blocks_inline_code_and_templates(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Run `make demo`, then\n`python -m deepspeed_acco.bench --updates\n10`.\n\n"
                    "```\nSIZES=4M bash benchmarks/gpu_check.sh --plan   # the plan\n"
                    "torchrun --nproc_per_node 2 -m deepspeed_acco.run x.py \\\n    --y 1\n```\n\n"
                    "```json\n{\"make \": 1}\n```\n`python -m deepspeed_acco.zero_to_fp32 DIR out.pt [--tag T]`\n")
    found = commands_in(page, "page.md")
    assert [(c.where, c.argv) for c in found] == [
        ("page.md:6", ["bash", "benchmarks/gpu_check.sh", "--plan"]),
        ("page.md:7", ["torchrun", "--nproc_per_node", "2", "-m", "deepspeed_acco.run", "x.py", "--y", "1"]),
        ("page.md:1", ["make", "demo"]),
        ("page.md:2", ["python", "-m", "deepspeed_acco.bench", "--updates", "10"]),
        ("page.md:14", ["python", "-m", "deepspeed_acco.zero_to_fp32", "DIR", "out.pt", "[--tag", "T]"]),
    ]
    assert [c.template for c in found] == [False, False, False, False, True]


def _fails(text: str, *words: str) -> None:
    with pytest.raises(AssertionError) as failed:
        check(_commands("test", text)[0])
    for word in words:
        assert word in str(failed.value), str(failed.value)


def test_a_renamed_flag_or_a_refused_combination_fails():
    _fails("python -m deepspeed_acco.bench --bandwith 300mbit", "unrecognized arguments: --bandwith")
    _fails("python -m deepspeed_acco.bench --fault link-down@2 --model tiny --updates 6",
           "--fault: zero1, zero1best run without")
    _fails("python -m deepspeed_acco.bench --grad-accum 3 --methods zero1,acco", "--grad-accum")
    _fails("python -m deepspeed_acco.zero_to_fp32 DIR out.pt --tg T", "no such option ['--tg']")
    _fails("python benchmarks/kernel_bench.py --sizez 4M", "unrecognized arguments: --sizez")
    _fails("python -m deepspeed_acco.nothing", "No module named")
    _fails("make demonstration", "make refuses it")
    _fails("bash benchmarks/gpu_check.sh --fast", "no check for the arguments")


def test_a_config_the_engine_refuses_fails_through_the_launchers():
    hf = "--module deepspeed_acco.run examples/hf_trainer.py --deepspeed examples/configs/hf_acco.json --output_dir o"
    # The Trainer's default accumulation, 1, filled into the config's "auto", is refused by ACCO.
    _fails(f"deepspeed --num_gpus 2 {hf}", "gradient_accumulation_steps", "at 2 rank(s)")
    check(_commands("test", f"deepspeed --num_gpus 2 {hf} --gradient_accumulation_steps 2")[0])
    _fails(f"deepspeed --num_gpus 2 {hf} --gradient_accumulation_steps 2 --no_such_flag 1", "--no_such_flag")
    _fails("deepspeed --gpus 2 examples/train_gpt.py --deepspeed_config examples/configs/acco.json",
           "the launcher refuses it")
    _fails("torchrun --nproc_per_node 3 examples/train_gpt.py --deepspeed_config examples/configs/missing.json",
           "no such config")
