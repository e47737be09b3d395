"""What deepspeed-acco's op builders share on top of DeepSpeed's ``OpBuilder``.

DeepSpeed's builders assume they belong to DeepSpeed: ``load()`` imports prebuilt ops from
``deepspeed.ops``, sources are relative to the deepspeed package, and a missing dependency is
printed as a warning from ``is_compatible()``. This mixin adapts them to a third-party package:

* sources are absolute paths into the kernel sources: ``deepspeed_acco/_csrc`` in an installed
  wheel (``setup.py`` copies ``csrc/`` there), else the source checkout's ``csrc/``;
* ``absolute_name()`` is ``deepspeed_acco.ops.<name>_op``, where the ahead-of-time build
  (``DS_BUILD_ACCO_OPS=1 pip install --no-build-isolation .``) puts the compiled module;
* ``load()`` uses that prebuilt module if it exists and was built from the current sources, and
  otherwise JIT-compiles with ninja through DeepSpeed's ``jit_load`` (cached by torch under
  ``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``);
* ``is_compatible()`` stays quiet unless ``verbose`` and leaves the reason in ``error_log``.
"""
import hashlib
import importlib
import logging
import os
import shutil
from pathlib import Path
from typing import List

logger = logging.getLogger(__name__)

# An installed wheel carries the kernel sources inside the package (setup.py's build_py copies
# them); a source checkout or an editable install has csrc/ next to the package.
_PACKAGED_CSRC = Path(__file__).resolve().parent.parent / "_csrc"
_CHECKOUT_CSRC = Path(__file__).resolve().parent.parent.parent / "csrc"
CSRC_DIR = _PACKAGED_CSRC if _PACKAGED_CSRC.is_dir() else _CHECKOUT_CSRC

# Op modules loaded in this process, by op name (each builder loads at most once).
_LOADED = {}

# Name of the macro (and module attribute) that carries the source digest of a compiled op.
_DIGEST_MACRO = "ACCO_OPS_SOURCE_DIGEST"


class AccoBuilderMixin:
    """Mixed in before DeepSpeed's ``OpBuilder``/``CUDAOpBuilder`` by every deepspeed-acco builder."""

    NAME: str
    BUILD_VAR: str

    def absolute_name(self) -> str:
        return f"deepspeed_acco.ops.{self.NAME}_op"

    def csrc_sources(self) -> List[str]:
        """Source files relative to ``csrc/``; ``sources()`` turns them into absolute paths."""
        raise NotImplementedError

    def sources(self) -> List[str]:
        return [str(CSRC_DIR / path) for path in self.csrc_sources()]

    def include_paths(self) -> List[str]:
        return [str(CSRC_DIR / "includes")]

    def source_digest(self) -> str:
        """Short hash of every source and header the op is built from, to detect stale prebuilt ops."""
        files = list(self.sources())
        for include_dir in self.include_paths():
            files.extend(sorted(str(p) for p in Path(include_dir).glob("*.h")))
        digest = hashlib.sha256()
        for path in files:
            digest.update(Path(path).name.encode())
            digest.update(Path(path).read_bytes())
        # A leading letter keeps the macro value a plain identifier for the preprocessor.
        return "d" + digest.hexdigest()[:16]

    def digest_define(self) -> str:
        return f"-D{_DIGEST_MACRO}={self.source_digest()}" if self._sources_present() else ""

    def _sources_present(self) -> bool:
        return all(os.path.isfile(path) for path in self.sources())

    def _missing_sources_reason(self) -> str:
        missing = [path for path in self.sources() if not os.path.isfile(path)]
        return (f"{self.NAME} sources not found ({', '.join(missing)}); reinstall deepspeed-acco (its wheel "
                "carries them in deepspeed_acco/_csrc) or build the ops ahead of time (DS_BUILD_ACCO_OPS=1)")

    def _incompatible(self, reason: str, verbose: bool) -> bool:
        self.error_log = reason
        if verbose:
            logger.warning("%s", reason)
        return False

    def _cxx_compiler(self) -> str:
        return os.environ.get("CXX", "c++")

    def _check_cxx(self, verbose: bool) -> bool:
        if shutil.which(self._cxx_compiler()) is None:
            return self._incompatible(
                f"{self.NAME} needs a C++ compiler: '{self._cxx_compiler()}' was not found on PATH "
                "(install g++, or point the CXX environment variable at one)", verbose)
        return True

    def load(self, verbose: bool = False):
        loaded = _LOADED.get(self.name)
        if loaded is not None:
            return loaded
        module = self._load_prebuilt()
        if module is None:
            # DeepSpeed's jit_load checks too, but buries the reason in a longer message.
            if not self.is_compatible(verbose):
                raise RuntimeError(self.error_log)
            module = self.jit_load(verbose)
        _LOADED[self.name] = module
        return module

    def _load_prebuilt(self):
        try:
            module = importlib.import_module(self.absolute_name())
        except ImportError:
            return None
        built_from = getattr(module, "source_digest", None)
        if self._sources_present() and built_from != self.source_digest():
            logger.info("%s: prebuilt %s does not match the current sources; rebuilding with the JIT", self.NAME,
                        getattr(module, "__file__", self.absolute_name()))
            return None
        return module
