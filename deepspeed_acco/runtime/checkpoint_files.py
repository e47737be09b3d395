"""The files of a checkpoint (docs/checkpoints.md): atomic writes and the directory exchange that
publishes a save, the recovery of a save interrupted between its renames, what a file may hold when
it is loaded (tensors, plain data and named classes only: :func:`load_file`), and tag names that stay
inside the save directory. :mod:`~deepspeed_acco.runtime.checkpoint` writes and reads through these.
"""
import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import pickle
import re
import shutil
from typing import Any, Callable, List, Optional, Sequence

import torch

MODEL_STATES_NAME = "mp_rank_00_model_states.pt"
LATEST_NAME = "latest"
logger = logging.getLogger("DeepSpeed").getChild("acco")


# ---- files and directories ---------------------------------------------------------------------
def atomic_save(obj: Any, path: str) -> None:
    atomic_write(path, "wb", lambda handle: torch.save(obj, handle))


def atomic_write_text(path: str, text: str) -> None:
    atomic_write(path, "w", lambda handle: handle.write(text))


def atomic_write(path: str, mode: str, write: Callable[[Any], Any]) -> None:
    """Write ``path.tmp-PID``, fsync it and rename it to ``path``; on failure the temporary file is removed."""
    temporary = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temporary, mode) as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise


def fsync_directory(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange_directories(first: str, second: str) -> bool:
    """Swap two directories atomically (Linux renameat2); False where the OS or filesystem cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"renameat2({first!r}, {second!r}, RENAME_EXCHANGE) failed: {os.strerror(code)}")


def retired_name(save_dir: str, tag: str) -> str:
    return os.path.join(save_dir, f".{tag}.retired")


def replace_directory(staging: str, final: str, retired: str) -> None:
    """Make ``staging`` the tag's directory; the old one (if any) is removed afterwards."""
    if not os.path.exists(final):
        os.rename(staging, final)
        shutil.rmtree(retired, ignore_errors=True)  # left by an interrupted earlier save, if any
        return
    if exchange_directories(staging, final):
        shutil.rmtree(staging, ignore_errors=True)  # now holds the old checkpoint
        return
    # No atomic exchange here: retire the old directory first. A crash between the two renames
    # leaves ``retired`` complete; resolve_directory() loads it in that case.
    shutil.rmtree(retired, ignore_errors=True)
    os.rename(final, retired)
    os.rename(staging, final)
    shutil.rmtree(retired, ignore_errors=True)


def resolve_directory(load_dir: str, tag: str) -> str:
    final = os.path.join(load_dir, tag)
    if os.path.isdir(final):
        return final
    retired = retired_name(load_dir, tag)
    if os.path.isfile(os.path.join(retired, MODEL_STATES_NAME)):
        logger.warning("load_checkpoint: %s is missing but its previous version %s is complete (a save was "
                       "interrupted while replacing it); loading that", final, retired)
        return retired
    return final


# ---- load: what a file may hold ---------------------------------------------------------------
def checkpoint_classes() -> List[Any]:
    """The classes a ZeRO-1 checkpoint file holds besides tensors and plain data, ours and
    DeepSpeed's, in every precision: DeepSpeed's loss scalers (``loss_scaler``; fp16 with dynamic
    scaling writes a ``DynamicLossScaler``), ``ZeroStageEnum`` (``zero_stage``) and
    ``fragment_address`` (``param_slice_mappings``). Nothing else is unpickled without being named."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


TRUST_HINT = "pass load_checkpoint(..., trusted_classes=[...]) with them"


def load_file(path: str, trusted_classes: Sequence = (), caller: str = "load_checkpoint",
              trust_hint: str = TRUST_HINT, mmap: bool = True) -> Any:
    """``torch.load`` of one checkpoint file with ``weights_only=True``: tensors, plain Python data,
    :func:`checkpoint_classes` and ``trusted_classes`` (what ``torch.serialization.safe_globals``
    accepts). A file that needs anything else is refused with a ``ValueError`` naming the file and
    what it holds, before any of it runs; so is a file torch cannot read (truncated, not a
    checkpoint). Memory-mapped by default: only the bytes that are used get read."""
    allowed = checkpoint_classes() + list(trusted_classes or ())
    with torch.serialization.safe_globals(allowed):
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as error:
            names = _unsafe_globals(path) or re.findall(r"GLOBAL ([\w.]+)", str(error))[:1]
            held = ", ".join(names) if names else f"something torch refuses to unpickle ({first_line(error)})"
            raise ValueError(
                f"{caller}: {path} holds {held}, which a checkpoint file may not hold unless you trust it (nothing "
                f"in the file was run). Checkpoints hold tensors, plain Python data and DeepSpeed's checkpoint "
                f"classes (docs/usage.md, Checkpoints). If you trust this file, for example because your "
                f"client_state holds these objects, {trust_hint}") from None
        except Exception as error:  # truncated or damaged file, or not one torch.save wrote
            raise ValueError(f"{caller}: {path} cannot be read as a checkpoint file ({type(error).__name__}: "
                             f"{first_line(error)}); it is truncated or damaged: load another checkpoint, or "
                             f"save again") from None


def _unsafe_globals(path: str) -> List[str]:
    """The classes and functions in ``path`` that the active allowlist refuses (static: runs nothing)."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:
        return []


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# ---- load: tags stay inside the directory ------------------------------------------------------
def check_tag(tag: Any, caller: str, source: str = "tag") -> str:
    """``tag`` as a checkpoint name inside the save directory: one non-empty path component that does
    not start with "." (no "..", separators or absolute paths), as ``save_checkpoint`` writes them."""
    text = str(tag)
    separators = [sep for sep in (os.sep, os.altsep, "/") if sep]
    if not text or text.startswith(".") or any(sep in text for sep in separators) or "\0" in text \
            or os.path.isabs(text):
        raise ValueError(f"{caller}: {source} {text!r} is not a checkpoint name inside the directory; a tag is one "
                         f"non-empty name without path separators that does not start with '.' (as save_checkpoint "
                         f"writes them): pass the tag of a checkpoint in that directory")
    return text


def read_latest(directory: str, caller: str) -> Optional[str]:
    """The tag named by ``directory/latest`` (checked with :func:`check_tag`), or None without one."""
    latest = os.path.join(directory, LATEST_NAME)
    if not os.path.isfile(latest):
        return None
    with open(latest) as handle:
        return check_tag(handle.read().strip(), caller, source=f"the tag in {latest}")
