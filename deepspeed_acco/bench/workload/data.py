"""Real text, byte-level tokens, and a data order that is identical for every method.

Default corpus: the ``.py`` files of the running interpreter's standard library (always present,
offline). Tokens are the raw bytes (vocabulary 256); documents are joined with byte 0, which never
occurs in text and doubles as the end-of-document token. Validation is a fixed set of held-out
*files* (chosen by a hash of their relative path), never trained on.

Other sources (``--data``): a text file (the last ``val_fraction`` of its bytes is held out), a
folder of text files (held-out files as for the standard library), or a Hugging Face dataset name
(``name`` or ``name:config``; needs the optional ``datasets`` package and internet access).

The tokenised corpus is cached as ``.npy`` under the cache directory, keyed by the source's file
list, sizes and modification times, so reruns and the ranks of a job load it in milliseconds.

The training order is a deterministic function of ``(seed, rank, micro-batch index)`` only, so
every method sees the same batches in the same order, and a rank that consumes more micro-batches
than another (ACCO's dynamic accumulation) simply continues its own stream.
"""
import hashlib
import json
import os
import sys
import sysconfig
import zlib
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

DOC_SEPARATOR = b"\x00"
DEFAULT_VAL_FRACTION = 0.05
CACHE_VERSION = 1
# Directory names skipped in the standard library: third-party code and the test suites.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def default_cache_dir() -> str:
    """``$DEEPSPEED_ACCO_CACHE``, else ``$XDG_CACHE_HOME/deepspeed_acco``, else ``~/.cache/deepspeed_acco``."""
    if os.environ.get("DEEPSPEED_ACCO_CACHE"):
        return os.environ["DEEPSPEED_ACCO_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "deepspeed_acco")


@dataclass
class Corpus:
    """Byte tokens (``uint8``) for training and validation, plus a description of the source."""
    train: np.ndarray
    val: np.ndarray
    meta: dict = field(default_factory=dict)

    def describe(self) -> str:
        m = self.meta
        files = ""
        if "train_files" in m:
            files = f" ({m['train_files']} train files / {m['val_files']} held-out files)"
        return (f"{m.get('source', '?')}: {len(self.train) / 1e6:.2f} MB train, "
                f"{len(self.val) / 1e6:.2f} MB validation{files}")


# ----------------------------------------------------------------------------------------------
# File discovery and the train/validation split


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_stdlib_files(root: Optional[str] = None) -> List[str]:
    """Relative paths (``/``-separated, sorted) of the standard library's ``.py`` files, without
    site-packages and test directories."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return sorted(out)


def _looks_like_text(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(8192)
    except OSError:
        return False
    return b"\x00" not in head


def list_text_files(folder: str) -> List[str]:
    """Relative paths (sorted) of the regular, non-hidden files under ``folder`` that look like text.

    A file reached under several names (symbolic links, as Debian's ``fortunes`` package has ``art.u8
    -> art``) is listed once, under the first name the walk meets: listed twice, its copies could
    land on both sides of the train/validation split and leak held-out text into training.
    """
    out, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            if name.startswith(".") or not os.path.isfile(path) or not _looks_like_text(path):
                continue
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            out.append(os.path.relpath(path, folder).replace(os.sep, "/"))
    return sorted(out)


def is_validation_file(relpath: str, val_fraction: float = DEFAULT_VAL_FRACTION) -> bool:
    """Stable hash split: the same file is held out on every machine and Python version."""
    return zlib.crc32(relpath.encode("utf-8")) % 10000 < int(round(val_fraction * 10000))


def split_files(files: Sequence[str], val_fraction: float = DEFAULT_VAL_FRACTION) -> Tuple[List[str], List[str]]:
    """``(train, val)`` lists, both non-empty when there are at least two files."""
    if len(files) < 2:
        raise ValueError(f"need at least two files to hold some out for validation, got {len(files)}")
    val = [f for f in files if is_validation_file(f, val_fraction)]
    if not val:
        val = [files[-1]]
    if len(val) == len(files):
        val = val[:1]
    held = set(val)
    return [f for f in files if f not in held], val


# ----------------------------------------------------------------------------------------------
# Reading, caching


def _concat_files(root: str, relpaths: Sequence[str]) -> np.ndarray:
    parts = []
    for rel in relpaths:
        with open(os.path.join(root, rel), "rb") as f:
            parts.append(f.read().replace(DOC_SEPARATOR, b""))
    return np.frombuffer(DOC_SEPARATOR.join(parts), dtype=np.uint8).copy()


def _fingerprint(root: str, relpaths: Sequence[str]) -> list:
    out = []
    for rel in relpaths:
        st = os.stat(os.path.join(root, rel))
        out.append([rel, st.st_size, st.st_mtime_ns])
    return out


def _cache_paths(cache_dir: str, key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache_dir, f"corpus-{digest}")


def _load_cached(path: str) -> Optional[Corpus]:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        train = np.load(os.path.join(path, "train.npy"), mmap_mode="r")
        val = np.load(os.path.join(path, "val.npy"))
    except (OSError, ValueError):
        return None
    meta["cache"] = path
    return Corpus(train=train, val=val, meta=meta)


def _store(path: str, corpus: Corpus) -> Corpus:
    """Write atomically (a temporary folder renamed into place): concurrent ranks never see a half file."""
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    np.save(os.path.join(tmp, "train.npy"), corpus.train)
    np.save(os.path.join(tmp, "val.npy"), corpus.val)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(corpus.meta, f, indent=1)
    try:
        os.rename(tmp, path)
    except OSError:  # another process stored it first
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return _load_cached(path) or corpus


def _from_files(root: str, files: Sequence[str], source: str, val_fraction: float, cache_dir: Optional[str]) -> Corpus:
    train_files, val_files = split_files(files, val_fraction)
    key = dict(v=CACHE_VERSION, kind="files", root=os.path.abspath(root), val_fraction=val_fraction,
               files=_fingerprint(root, files))
    path = _cache_paths(cache_dir, key) if cache_dir else None
    if path:
        cached = _load_cached(path)
        if cached is not None:
            return cached
    corpus = Corpus(train=_concat_files(root, train_files), val=_concat_files(root, val_files),
                    meta=dict(source=source, root=os.path.abspath(root), train_files=len(train_files),
                              val_files=len(val_files), val_file_list=list(val_files),
                              val_fraction=val_fraction))
    return _store(path, corpus) if path else corpus


def _from_text_file(path: str, val_fraction: float, cache_dir: Optional[str]) -> Corpus:
    st = os.stat(path)
    key = dict(v=CACHE_VERSION, kind="file", path=os.path.abspath(path), size=st.st_size,
               mtime=st.st_mtime_ns, val_fraction=val_fraction)
    cpath = _cache_paths(cache_dir, key) if cache_dir else None
    if cpath:
        cached = _load_cached(cpath)
        if cached is not None:
            return cached
    with open(path, "rb") as f:
        data = f.read().replace(DOC_SEPARATOR, b"")
    cut = int(len(data) * (1.0 - val_fraction))
    newline = data.find(b"\n", cut)  # hold out whole lines
    cut = newline + 1 if 0 <= newline < len(data) - 1 else cut
    tokens = np.frombuffer(data, dtype=np.uint8)
    corpus = Corpus(train=tokens[:cut].copy(), val=tokens[cut:].copy(),
                    meta=dict(source=f"file {os.path.abspath(path)} (last {val_fraction:.0%} held out)",
                              val_fraction=val_fraction))
    return _store(cpath, corpus) if cpath else corpus


def _from_hf(name: str, val_fraction: float, cache_dir: Optional[str], max_bytes: int) -> Corpus:
    dataset, _, config = name.partition(":")
    key = dict(v=CACHE_VERSION, kind="hf", dataset=dataset, config=config, max_bytes=max_bytes,
               val_fraction=val_fraction)
    cpath = _cache_paths(cache_dir, key) if cache_dir else None
    if cpath:
        cached = _load_cached(cpath)
        if cached is not None:
            return cached
    try:
        import datasets  # optional dependency, only for Hugging Face dataset names
    except ImportError as exc:
        raise RuntimeError(f"--data {name!r} is not an existing file or folder, so it was taken as a Hugging Face "
                           f"dataset name, which needs the optional 'datasets' package (pip install datasets)") from exc
    ds = datasets.load_dataset(dataset, config or None)

    def text_of(split) -> bytes:
        column = "text" if "text" in split.column_names else next(
            (c for c, f in split.features.items() if getattr(f, "dtype", None) == "string"), None)
        if column is None:
            raise ValueError(f"dataset {name!r} has no string column")
        out, total = [], 0
        for row in split:
            b = (row[column] or "").encode("utf-8").replace(DOC_SEPARATOR, b"")
            if b.strip():
                out.append(b)
                total += len(b) + 1
                if total >= max_bytes:
                    break
        return DOC_SEPARATOR.join(out)

    train = text_of(ds["train"])
    held = next((s for s in ("validation", "valid", "test") if s in ds), None)
    if held is not None:
        val = text_of(ds[held])
        source = f"Hugging Face {name} (train / {held} splits)"
    else:
        cut = int(len(train) * (1.0 - val_fraction))
        train, val = train[:cut], train[cut:]
        source = f"Hugging Face {name} (train split, last {val_fraction:.0%} held out)"
    corpus = Corpus(train=np.frombuffer(train, dtype=np.uint8).copy(), val=np.frombuffer(val, dtype=np.uint8).copy(),
                    meta=dict(source=source, val_fraction=val_fraction))
    return _store(cpath, corpus) if cpath else corpus


def _looks_like_path(data: str) -> bool:
    """Hugging Face names look like ``name``, ``owner/name`` or ``name:config``; paths usually don't."""
    return (data.startswith(("/", ".", "~")) or data.count("/") > 1 or os.sep != "/" and os.sep in data
            or os.path.splitext(data)[1].lower() in (".txt", ".md", ".py", ".json", ".jsonl", ".csv", ".rst"))


def load_corpus(data: Optional[str] = None, cache_dir: Optional[str] = "default",
                val_fraction: float = DEFAULT_VAL_FRACTION, max_bytes: int = 256 * 2**20) -> Corpus:
    """Load (and cache) a corpus.

    ``data``: ``None``/``"stdlib"`` for the standard library's sources, a path to a text file or a
    folder, or a Hugging Face dataset name (``name`` or ``name:config``). ``cache_dir``: a folder,
    ``"default"`` for :func:`default_cache_dir`, or ``None`` to disable caching. ``max_bytes`` caps
    what is taken from a Hugging Face dataset.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    if cache_dir == "default":
        cache_dir = default_cache_dir()
    if data in (None, "", "stdlib"):
        root = stdlib_root()
        files = list_stdlib_files(root)
        source = f"Python {sys.version_info.major}.{sys.version_info.minor} standard library .py files ({root})"
        corpus = _from_files(root, files, source, val_fraction, cache_dir)
    elif os.path.isdir(data):
        files = list_text_files(data)
        if not files:
            raise ValueError(f"no text files found under {data!r}")
        corpus = _from_files(data, files, f"text files under {os.path.abspath(data)}", val_fraction, cache_dir)
    elif os.path.isfile(data):
        corpus = _from_text_file(data, val_fraction, cache_dir)
    elif _looks_like_path(data):
        raise FileNotFoundError(f"--data {data!r}: no such file or folder")
    else:
        corpus = _from_hf(data, val_fraction, cache_dir, max_bytes)
    return corpus


# ----------------------------------------------------------------------------------------------
# Batches


class WindowSampler:
    """Micro-batches of ``micro_batch`` random windows of ``ctx`` tokens, a pure function of
    ``(seed, rank, index)``: the same for every method, any number of micro-batches per rank."""

    def __init__(self, tokens: np.ndarray, ctx: int, micro_batch: int, seed: int = 0, rank: int = 0):
        if len(tokens) < ctx + 1:
            raise ValueError(f"corpus has {len(tokens)} tokens, fewer than one window of {ctx}")
        self.tokens, self.ctx, self.micro_batch = tokens, int(ctx), int(micro_batch)
        self.seed, self.rank = int(seed), int(rank)

    def starts(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.rank, int(index)])
        return rng.integers(0, len(self.tokens) - self.ctx + 1, size=self.micro_batch)

    def micro_batch_at(self, index: int) -> np.ndarray:
        """``int64`` array ``(micro_batch, ctx)`` for this rank's ``index``-th micro-batch."""
        return np.stack([np.asarray(self.tokens[s:s + self.ctx], dtype=np.int64) for s in self.starts(index)])


def validation_windows(val_tokens: np.ndarray, ctx: int, n: int) -> np.ndarray:
    """Up to ``n`` evenly spaced, non-overlapping windows of ``ctx`` held-out tokens (``int64``)."""
    if len(val_tokens) < ctx:
        raise ValueError(f"validation set has {len(val_tokens)} tokens, fewer than one window of {ctx}")
    n = max(1, min(int(n), len(val_tokens) // ctx))
    starts = np.linspace(0, len(val_tokens) - ctx, n).astype(np.int64)
    return np.stack([np.asarray(val_tokens[s:s + ctx], dtype=np.int64) for s in starts])
