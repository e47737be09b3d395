"""Registration in DeepSpeed: ``deepspeed.initialize`` builds our engine for our optimizer types.

DeepSpeed has no registry of optimizer types (an unknown type ends in ``getattr(torch.optim,
name)``), and the Hugging Face ``Trainer`` and Accelerate call ``deepspeed.initialize`` themselves
(Accelerate looks it up on the module at call time). So ``import deepspeed_acco`` replaces the
module attribute ``deepspeed.initialize`` by :func:`_registered_initialize`, a wrapper that builds
our engine when the config selects a type of ours (any type in the registry, including those added
with ``deepspeed_acco.register_optimizer_type``) and otherwise calls DeepSpeed's own function with
exactly the arguments it was given, returning its result unchanged.

Importing ``deepspeed_acco`` must stay light (no torch, no deepspeed), so the wrapper is installed

- at once, if ``deepspeed`` is already imported;
- otherwise right after ``deepspeed`` finishes importing, by a finder on ``sys.meta_path`` (the
  import system's documented extension point) that wraps the loader of the ``deepspeed`` module
  only and removes itself once it has fired.

Both paths are idempotent: the wrapper carries the original function, and a second installation
(another import, a reload of this module) finds it and does nothing. Code that bound the function
before the installation (``from deepspeed import initialize`` ahead of ``import deepspeed_acco``)
keeps DeepSpeed's original; callers that look it up at call time (Accelerate, ``deepspeed.
initialize(...)`` in scripts) get the wrapper.
"""
import functools
import importlib.abc
import importlib.util
import sys
import threading

_MODULE = "deepspeed"
_ORIGINAL_ATTRIBUTE = "__deepspeed_acco_original__"
_lock = threading.Lock()


def is_installed() -> bool:
    """Whether ``deepspeed.initialize`` is our wrapper (False while deepspeed is not imported)."""
    module = sys.modules.get(_MODULE)
    return module is not None and hasattr(getattr(module, "initialize", None), _ORIGINAL_ATTRIBUTE)


def original_initialize():
    """DeepSpeed's own ``initialize`` (imports deepspeed)."""
    import deepspeed
    function = deepspeed.initialize
    return getattr(function, _ORIGINAL_ATTRIBUTE, function)


def _selects_our_type(bound_arguments) -> bool:
    """Whether the call's config selects one of our optimizer types.

    Reads the config the way ``deepspeed.initialize`` would find it (``config``, ``config_params``
    or ``args.deepspeed_config``; a dict or a JSON file). Whatever cannot be read this way (a
    base64 string, a missing file, invalid JSON) is DeepSpeed's to accept or reject, so it counts
    as not ours.
    """
    from .runtime.config import load_config, optimizer_type
    arguments = bound_arguments.arguments
    config = arguments.get("config")
    if config is None:
        config = arguments.get("config_params")
    if config is None and arguments.get("args") is not None:
        config = getattr(arguments["args"], "deepspeed_config", None)
    if config is None:
        return False
    try:
        return optimizer_type(load_config(config)) is not None
    except (ValueError, TypeError, OSError):
        return False


def _make_wrapper(original):
    import inspect
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _registered_initialize(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)  # DeepSpeed reports the bad call itself
        if not _selects_our_type(bound):
            return original(*args, **kwargs)
        from .runtime.initialize import initialize
        return initialize(**bound.arguments)

    setattr(_registered_initialize, _ORIGINAL_ATTRIBUTE, original)
    return _registered_initialize


def _install_into(module) -> None:
    with _lock:
        current = getattr(module, "initialize", None)
        if current is None or hasattr(current, _ORIGINAL_ATTRIBUTE):
            return
        module.initialize = _make_wrapper(current)


class _WrapAfterExec(importlib.abc.Loader):
    """Runs the real loader of ``deepspeed``, then installs the wrapper into the finished module."""

    def __init__(self, loader, hook):
        self._loader = loader
        self._hook = hook

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _install_into(module)
        _remove_hook(self._hook)

    def __getattr__(self, name):  # resource readers and the like come from the real loader
        if name == "_loader":  # not set yet (an object made without __init__): no recursion
            raise AttributeError(name)
        return getattr(self._loader, name)


class _DeepSpeedImportHook(importlib.abc.MetaPathFinder):
    """A finder for ``deepspeed`` only: it delegates the search to the other finders and wraps the
    loader it gets. ``importlib.util.find_spec("deepspeed")`` (availability checks, as in
    transformers) also comes here without importing, so the hook leaves ``sys.meta_path`` only
    once deepspeed has really been imported."""

    is_deepspeed_acco_hook = True  # found by install() even after this module was reloaded

    def __init__(self):
        self._searching = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _MODULE or self._searching:
            return None
        self._searching = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching = False
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _WrapAfterExec(spec.loader, self)
        return spec


def _remove_hook(hook) -> None:
    try:
        sys.meta_path.remove(hook)
    except ValueError:
        pass


def install() -> None:
    """Install the wrapper now if deepspeed is imported, else when it gets imported (idempotent)."""
    module = sys.modules.get(_MODULE)
    if module is not None:
        # Imported already. (A deepspeed still executing its own __init__, i.e. one that imports
        # deepspeed_acco itself, has no initialize yet and is left alone.)
        _install_into(module)
        return
    with _lock:
        if not any(getattr(finder, "is_deepspeed_acco_hook", False) for finder in sys.meta_path):
            sys.meta_path.insert(0, _DeepSpeedImportHook())
