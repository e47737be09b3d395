"""The package's layers hold (docs/design.md, "Overview: where everything is"): a module imports only
its own layer and the layers below, read from the source with ``ast``, imports inside functions
included.

- ``deepspeed_acco/runtime`` (config, engine assembly, schedules, the pipeline) imports nothing of
  the package outside ``runtime`` and the kernels (``ops``): no arrow up to the entry points.
- ``deepspeed_acco/ops`` and ``op_builder`` (the kernels) import nothing of ``runtime`` or above.
- ``runtime/checks.py`` (the generic config checks every layer shares) imports only the standard
  library.
- Imports go one way everywhere, inside a package too: no module reaches itself through the
  package's imports. Importing ``P.M`` from outside package ``P`` runs ``P/__init__.py`` first, so it
  counts as importing ``P`` as well.
- The bench (``deepspeed_acco/bench``): its command line (``bench/__main__.py``) calls its parts and no
  part imports it back; its rooms (sub-packages) import only the rooms below them, in the order of
  :data:`BENCH_ROOMS`.
"""
import ast
import sys
from pathlib import Path

PACKAGE = "deepspeed_acco"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

RUNTIME_MAY_IMPORT = ("deepspeed_acco.runtime", "deepspeed_acco.ops")
KERNELS_MAY_IMPORT = ("deepspeed_acco.ops", "deepspeed_acco.op_builder")
BENCH = "deepspeed_acco.bench"
# The bench's rooms from the ground up (docs/design.md, "Overview"): each may import the rooms before it.
BENCH_ROOMS = ("workload", "network", "reporting", "running", "gpu_study")


def module_name(path: Path, root: Path = ROOT.parent) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool):
    """(line, absolute module name) of every import in ``source``; ``from X import name`` also
    yields ``X.name`` so that ``from .. import ops`` names ``deepspeed_acco.ops``."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            if node.module:
                yield node.lineno, target
            for alias in node.names:
                if not node.module:
                    yield node.lineno, f"{target}.{alias.name}"


def package_imports(directory: str):
    """(file, line, module) of every import of a ``deepspeed_acco`` module by a module under ``directory``."""
    found = []
    for path in sorted((ROOT / directory).rglob("*.py")):
        name = module_name(path)
        for line, target in imported_modules(path.read_text(encoding="utf-8"), name, path.name == "__init__.py"):
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                found.append((str(path.relative_to(ROOT.parent)), line, target))
    return found


def all_modules():
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def import_graph(modules):
    """``{module: {imported module: first line}}`` over the package's own modules.

    A target that is not a module (``from .x import name``) counts as its module; importing ``P.M``
    from a module outside package ``P`` also counts as importing ``P`` (its ``__init__`` runs first).
    """
    graph = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        is_package = path.name == "__init__.py"
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + (2 if is_package else 1))}
        for line, target in imported_modules(path.read_text(encoding="utf-8"), name, is_package):
            parts = target.split(".")
            known = [".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules]
            if not known:
                continue
            target_parts = known[0].split(".")
            for i in range(1, len(target_parts) + 1):
                imported = ".".join(target_parts[:i])
                if imported in modules and imported not in own_packages and imported != name:
                    edges.setdefault(imported, line)
    return graph


def cycles(graph):
    """Each strongly connected group of two or more modules (Tarjan), as a sorted list of names."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def describe_cycle(graph, group):
    members = set(group)
    return "; ".join(f"{source} line {line} imports {target}" for source in group
                     for target, line in sorted(graph[source].items()) if target in members)


def outside(imports, allowed):
    return [f"{path}:{line} imports {target}" for path, line, target in imports
            if not any(target == prefix or target.startswith(prefix + ".") for prefix in allowed)]


def test_runtime_imports_nothing_above_it():
    imports = package_imports("runtime")
    assert any(target == "deepspeed_acco.runtime.config" for _, _, target in imports)
    wrong = outside(imports, RUNTIME_MAY_IMPORT)
    assert not wrong, "runtime/ may import only runtime/ and ops/:\n" + "\n".join(wrong)


def test_kernels_import_nothing_above_them():
    imports = package_imports("ops") + package_imports("op_builder")
    wrong = outside(imports, KERNELS_MAY_IMPORT)
    assert not wrong, "ops/ and op_builder/ may import only each other:\n" + "\n".join(wrong)


def test_checks_import_only_the_standard_library():
    path = ROOT / "runtime" / "checks.py"
    targets = [target for _, target in imported_modules(path.read_text(encoding="utf-8"),
                                                         "deepspeed_acco.runtime.checks", False)]
    assert targets
    wrong = [t for t in targets if t.split(".")[0] not in sys.stdlib_module_names]
    assert not wrong, f"runtime/checks.py must import only the standard library, imports {wrong}"


def test_config_lives_in_runtime_only():
    assert not (ROOT / "config.py").exists()
    assert (ROOT / "runtime" / "config.py").is_file()


def test_import_reader_resolves_relative_and_lazy_imports():
    source = ("from .. import ops\nfrom ..config import X\nimport torch\n"
              "def f():\n    from ...registration import y\n")
    found = [t for _, t in imported_modules(source, "deepspeed_acco.runtime.optimizers.acco", False)]
    assert sorted(found) == ["deepspeed_acco.registration", "deepspeed_acco.runtime.config",
                             "deepspeed_acco.runtime.ops", "torch"]
    assert outside([("x.py", 5, "deepspeed_acco.registration")], RUNTIME_MAY_IMPORT)
    assert not outside([("x.py", 1, "deepspeed_acco.ops.quantization")], RUNTIME_MAY_IMPORT)
    assert outside([("x.py", 1, "deepspeed_acco.opsx")], RUNTIME_MAY_IMPORT)


def test_imports_go_one_way():
    graph = import_graph(all_modules())
    assert "deepspeed_acco.runtime.schedule" in graph["deepspeed_acco.runtime.optimizers.acco"]
    found = cycles(graph)
    assert not found, "import cycles (move what both sides need into a module of its own):\n" + "\n".join(
        describe_cycle(graph, group) for group in found)


def test_no_bench_part_imports_its_command_line():
    """``bench/__main__.py`` is the top: the parts it calls never import it (what they need of it lives
    in a room). ``bench/__init__.py`` is the console script's door to it, not a part."""
    graph = import_graph(all_modules())
    top = f"{BENCH}.__main__"
    assert f"{BENCH}.running.train" in graph[top]
    parts = [name for name in graph if name.startswith(BENCH + ".") and name != top]
    assert f"{BENCH}.workload.methods" in parts
    wrong = [f"{name} line {graph[name][top]} imports {top}" for name in parts if top in graph[name]]
    assert not wrong, "a part of the bench imports its command line:\n" + "\n".join(wrong)


def room_of(module: str):
    """The bench room (sub-package) ``module`` lies in, or None (``bench/__init__``, ``bench/__main__``)."""
    rest = module[len(BENCH) + 1:].split(".") if module.startswith(BENCH + ".") else []
    return rest[0] if len(rest) >= 1 and (ROOT / "bench" / rest[0]).is_dir() else None


def test_bench_rooms_import_only_rooms_below():
    rooms = sorted(path.parent.name for path in (ROOT / "bench").glob("*/__init__.py"))
    assert sorted(BENCH_ROOMS) == rooms, f"list each room of bench/ in BENCH_ROOMS, from the ground up: {rooms}"
    graph = import_graph(all_modules())
    wrong = []
    for name, edges in graph.items():
        room = room_of(name)
        if room is None:
            continue
        for target, line in sorted(edges.items()):
            if target == BENCH or (target.startswith(BENCH + ".") and room_of(target) is None):
                wrong.append(f"{name} line {line} imports {target} (the bench's top)")
            elif room_of(target) not in (None, room) and BENCH_ROOMS.index(room_of(target)) > BENCH_ROOMS.index(room):
                wrong.append(f"{name} line {line} imports {target} (room {room_of(target)} stands above {room})")
    assert not wrong, "bench rooms import only the rooms below them (BENCH_ROOMS):\n" + "\n".join(wrong)


def test_cycle_finder_counts_a_package_init_and_ignores_siblings(tmp_path):
    sources = {"p/__init__.py": "from .a import A\n", "p/a.py": "from . import b\nA = 1\n", "p/b.py": "X = 1\n",
               "q.py": "import os\n\ndef f():\n    from p.b import X\n"}
    for relative, source in sources.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(source, encoding="utf-8")
    modules = {module_name(path, tmp_path): path for path in sorted(tmp_path.rglob("*.py"))}
    graph = import_graph(modules)
    # p.a is inside p: importing its sibling does not run p's __init__ again.
    assert graph == {"p": {"p.a": 1}, "p.a": {"p.b": 1}, "p.b": {}, "q": {"p.b": 4, "p": 4}}
    assert cycles(graph) == []
    # From outside the package, p.b brings p (and so p.a) along: a cycle through p's __init__.
    (tmp_path / "p/a.py").write_text("import q\nA = 1\n", encoding="utf-8")
    graph = import_graph(modules)
    assert cycles(graph) == [["p", "p.a", "q"]]
    assert describe_cycle(graph, ["p", "p.a", "q"]) == "p line 1 imports p.a; p.a line 1 imports q; q line 4 imports p"
