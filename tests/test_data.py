"""The bench corpus: real text, held-out files never trained on, caching, and a method-independent data order."""
import os
import sys

import numpy as np
import pytest

from deepspeed_acco.bench.workload import data


def _write_tree(root, n=40):
    """A folder of distinct text files, each with a unique marker line."""
    for i in range(n):
        sub = os.path.join(root, f"pkg{i % 3}")
        os.makedirs(sub, exist_ok=True)
        with open(os.path.join(sub, f"mod{i}.py"), "w") as f:
            f.write(f"# marker-{i:03d}\n" + "def f(x):\n    return x * 2\n" * 20)
    with open(os.path.join(root, "blob.bin"), "wb") as f:  # binary: skipped
        f.write(b"\x00\x01\x02" * 100)
    os.makedirs(os.path.join(root, ".hidden"))
    with open(os.path.join(root, ".hidden", "x.txt"), "w") as f:
        f.write("hidden")


def test_stdlib_files_exclude_tests_and_site_packages():
    files = data.list_stdlib_files()
    assert len(files) > 100
    assert files == sorted(files)
    for f in files:
        parts = f.split("/")
        assert f.endswith(".py")
        assert not {"site-packages", "test", "tests", "__pycache__"} & set(parts[:-1]), f


def test_split_is_deterministic_disjoint_and_nonempty():
    files = data.list_stdlib_files()
    train, val = data.split_files(files)
    assert (train, val) == data.split_files(list(files))
    assert val and train and not set(train) & set(val)
    assert set(train) | set(val) == set(files)
    assert 0.01 < len(val) / len(files) < 0.15
    # The held-out choice depends on the path only, not on which other files exist.
    half = files[::2]
    _, sub_val = data.split_files(half)
    assert set(sub_val) == (set(val) & set(half) or {half[-1]})


def test_stdlib_corpus_holds_out_whole_files(tmp_path):
    corpus = data.load_corpus(None, cache_dir=str(tmp_path))
    assert len(corpus.train) > 1_000_000 and len(corpus.val) > 10_000
    assert corpus.train.dtype == np.uint8 and corpus.val.dtype == np.uint8
    root = data.stdlib_root()
    val_files = corpus.meta["val_file_list"]
    train_bytes = corpus.train.tobytes()
    # A distinctive chunk of each held-out file never appears in the training stream (files are
    # joined whole, so a 200-byte chunk would be found if the file had been trained on).
    checked = 0
    for rel in val_files[:10]:
        with open(os.path.join(root, rel), "rb") as f:
            text = f.read()
        if len(text) < 1000:
            continue
        chunk = text[len(text) // 2:len(text) // 2 + 200]
        assert chunk in corpus.val.tobytes()
        if chunk not in train_bytes:
            checked += 1
    assert checked >= 1
    assert "standard library" in corpus.describe()


def test_folder_corpus_cache_and_binary_skip(tmp_path):
    root = tmp_path / "text"
    root.mkdir()
    _write_tree(str(root))
    cache = tmp_path / "cache"
    c1 = data.load_corpus(str(root), cache_dir=str(cache))
    assert c1.meta["train_files"] + c1.meta["val_files"] == 40  # blob.bin and .hidden skipped
    assert b"\x01\x02" not in c1.train.tobytes()
    for rel in c1.meta["val_file_list"]:
        marker = open(os.path.join(root, rel), "rb").readline()
        assert marker in c1.val.tobytes() and marker not in c1.train.tobytes()
    assert os.path.isdir(c1.meta["cache"])
    c2 = data.load_corpus(str(root), cache_dir=str(cache))
    assert c2.meta["cache"] == c1.meta["cache"]
    np.testing.assert_array_equal(np.asarray(c1.train), np.asarray(c2.train))
    # Editing a file changes the cache key.
    with open(root / "pkg0" / "mod0.py", "a") as f:
        f.write("# edited\n")
    c3 = data.load_corpus(str(root), cache_dir=str(cache))
    assert c3.meta["cache"] != c1.meta["cache"]


def test_single_text_file_holds_out_the_tail(tmp_path):
    path = tmp_path / "book.txt"
    lines = [f"line {i} of the book\n" for i in range(2000)]
    path.write_text("".join(lines))
    corpus = data.load_corpus(str(path), cache_dir=None, val_fraction=0.1)
    assert corpus.train.tobytes() + corpus.val.tobytes() == path.read_bytes()
    assert corpus.val.tobytes().startswith(b"line ")  # cut at a line boundary
    assert 0.08 < len(corpus.val) / path.stat().st_size < 0.12


def test_missing_path_and_missing_datasets(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError):
        data.load_corpus(str(tmp_path / "nope.txt"), cache_dir=None)
    with pytest.raises(FileNotFoundError):
        data.load_corpus("./no/such/folder", cache_dir=None)
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(RuntimeError, match="datasets"):
        data.load_corpus("some-hf-dataset:config", cache_dir=None)


def test_sampler_depends_only_on_seed_rank_index():
    tokens = np.frombuffer(bytes(range(256)) * 200, dtype=np.uint8)
    a = data.WindowSampler(tokens, ctx=32, micro_batch=4, seed=0, rank=1)
    b = data.WindowSampler(tokens, ctx=32, micro_batch=4, seed=0, rank=1)
    later = [b.micro_batch_at(i) for i in (9, 3, 0)]  # any order, any count
    np.testing.assert_array_equal(a.micro_batch_at(0), later[2])
    np.testing.assert_array_equal(a.micro_batch_at(9), later[0])
    x = a.micro_batch_at(3)
    assert x.shape == (4, 32) and x.dtype == np.int64 and x.max() < 256
    np.testing.assert_array_equal(x, later[1])
    other_rank = data.WindowSampler(tokens, 32, 4, seed=0, rank=0).micro_batch_at(3)
    other_seed = data.WindowSampler(tokens, 32, 4, seed=1, rank=1).micro_batch_at(3)
    assert not np.array_equal(x, other_rank) and not np.array_equal(x, other_seed)
    # Windows are contiguous slices of the corpus.
    row = x[0]
    assert all((row[i + 1] - row[i]) % 256 == 1 for i in range(31))


def test_validation_windows_are_fixed_and_non_overlapping():
    val = np.arange(1000, dtype=np.uint8)
    w = data.validation_windows(val, ctx=100, n=50)
    assert w.shape == (10, 100)  # capped at non-overlapping windows
    np.testing.assert_array_equal(w, data.validation_windows(val, ctx=100, n=50))
    w4 = data.validation_windows(val, ctx=100, n=4)
    assert w4.shape == (4, 100) and w4[0, 0] == 0 and w4[-1, -1] == val[-1]
    with pytest.raises(ValueError):
        data.validation_windows(val[:50], ctx=100, n=4)


def test_folder_lists_a_symlinked_file_once(tmp_path):
    # Debian's fortunes package ships "art" and "art.u8 -> art": both names would otherwise be listed and
    # could fall on both sides of the train/validation split.
    root = tmp_path / "text"
    root.mkdir()
    for i in range(6):
        (root / f"f{i}").write_text(f"file {i}\n" * 50)
        os.symlink(f"f{i}", root / f"f{i}.u8")
    (root / "sub").mkdir()
    os.symlink("../f0", root / "sub" / "again")
    assert data.list_text_files(str(root)) == [f"f{i}" for i in range(6)]
