"""The package's layers hold (docs/design.md, "Overview: where everything is"): a module imports only
its own layer and the layers below, read from the source with ``ast``, imports inside functions
included.

- ``deepspeed_acco/runtime`` (config, engine assembly, schedules, the pipeline) imports nothing of
  the package outside ``runtime`` and the kernels (``ops``): no arrow up to the entry points.
- ``deepspeed_acco/ops`` and ``op_builder`` (the kernels) import nothing of ``runtime`` or above.
- ``runtime/checks.py`` (the generic config checks every layer shares) imports only the standard
  library.
"""
import ast
import sys
from pathlib import Path

PACKAGE = "deepspeed_acco"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

RUNTIME_MAY_IMPORT = ("deepspeed_acco.runtime", "deepspeed_acco.ops")
KERNELS_MAY_IMPORT = ("deepspeed_acco.ops", "deepspeed_acco.op_builder")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
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
