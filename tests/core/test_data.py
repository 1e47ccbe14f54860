"""Data loaders and partitioners: sizes, seeds, class skew, clear errors."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagg.data import load_dataset, partition_dirichlet, partition_iid, read_idx
from fedagg.errors import ConfigError, DataError


def test_digits_split() -> None:
    ds = load_dataset("digits")
    assert ds.x_train.shape[1:] == (1, 8, 8) and ds.x_train.dtype == np.float32
    assert len(ds.y_train) + len(ds.y_test) == 1797
    assert ds.x_train.min() >= 0.0 and ds.x_train.max() <= 1.0


@settings(max_examples=30, deadline=None)
@given(n=st.integers(20, 2000), parts=st.integers(1, 20), seed=st.integers(0, 1000))
def test_iid_sizes_cover_everything_once(n: int, parts: int, seed: int) -> None:
    if n < parts:
        return
    out = partition_iid(n, parts, seed=seed)
    sizes = [len(p) for p in out]
    assert max(sizes) - min(sizes) <= 1
    np.testing.assert_array_equal(np.sort(np.concatenate(out)), np.arange(n))
    assert all(np.array_equal(a, b) for a, b in zip(out, partition_iid(n, parts, seed=seed), strict=True))


def test_dirichlet_seeded_disjoint_min_size_and_skewed() -> None:
    y = np.repeat(np.arange(10), 100)
    a = partition_dirichlet(y, 10, alpha=0.1, seed=1, min_size=10)
    b = partition_dirichlet(y, 10, alpha=0.1, seed=1, min_size=10)
    c = partition_dirichlet(y, 10, alpha=0.1, seed=2, min_size=10)
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    assert not all(np.array_equal(p, q) for p, q in zip(a, c, strict=True))
    allidx = np.concatenate(a)
    assert len(allidx) == len(y) == len(np.unique(allidx))
    assert min(len(p) for p in a) >= 10

    def mean_dominant_share(parts: list[np.ndarray]) -> float:
        return float(np.mean([np.bincount(y[p], minlength=10).max() / len(p) for p in parts]))

    skewed = mean_dominant_share(a)
    near_iid = mean_dominant_share(partition_dirichlet(y, 10, alpha=1000.0, seed=1))
    assert skewed > 0.4 > near_iid  # small alpha concentrates classes, large alpha does not


def test_partition_errors_explain() -> None:
    with pytest.raises(ConfigError, match="dirichlet_alpha"):
        partition_dirichlet([0, 1], 2, alpha=0, seed=0)
    with pytest.raises(ConfigError, match="num_sites"):
        partition_iid(5, 10, seed=0)
    with pytest.raises(ConfigError, match="min_partition_size"):
        partition_dirichlet(np.repeat(np.arange(2), 20), 4, alpha=0.01, seed=0, min_size=10, max_tries=5)


def _write_idx(path: Path, arr: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + arr.astype(np.uint8).tobytes())


def test_fashion_from_idx_dir_and_missing_dir(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    _write_idx(tmp_path / "train-images-idx3-ubyte.gz", rng.integers(0, 255, (12, 28, 28)))
    _write_idx(tmp_path / "train-labels-idx1-ubyte.gz", rng.integers(0, 10, 12))
    _write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", rng.integers(0, 255, (5, 28, 28)))
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", rng.integers(0, 10, 5))
    ds = load_dataset("fashion-mnist", data_dir=tmp_path)
    assert ds.x_train.shape == (12, 1, 28, 28) and ds.y_test.shape == (5,)
    with pytest.raises(DataError) as e:
        load_dataset("fashion-mnist", data_dir=tmp_path / "nope")
    assert "apt-get install dataset-fashion-mnist" in str(e.value)


def test_truncated_idx_rejected(tmp_path: Path) -> None:
    p = tmp_path / "x.gz"
    with gzip.open(p, "wb") as fh:
        fh.write(bytes([0, 0, 0x08, 1]) + struct.pack(">I", 10) + b"\x00" * 3)
    with pytest.raises(DataError, match="truncated or corrupt"):
        read_idx(p)


def test_real_fashion_mnist() -> None:
    """Needs the Debian package dataset-fashion-mnist (installed by .ci/run)."""
    ds = load_dataset("fashion-mnist")
    assert ds.x_train.shape == (60000, 1, 28, 28) and ds.x_test.shape == (10000, 1, 28, 28)


def test_digits_are_read_as_scikit_learn_loads_them_without_importing_it() -> None:
    """fedagg reads scikit-learn's bundled digits CSV itself (no ~1 s sklearn import per
    process); oracle: ``sklearn.datasets.load_digits``, compared in a fresh interpreter."""
    import subprocess
    import sys

    code = ("import sys; from fedagg.data import _digits_arrays; x, y = _digits_arrays(); "
            "assert 'sklearn' not in sys.modules, 'sklearn was imported'; "
            "from sklearn.datasets import load_digits; b = load_digits(); "
            "import numpy as np; assert np.array_equal(x, b.data) and x.dtype == b.data.dtype; "
            "assert np.array_equal(y, b.target) and y.dtype == np.int64; print(x.shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "(1797, 64)" in out.stdout, out.stderr[-2000:]
