"""Offline data sets and partitioners.

Data sets
---------
``digits``
    scikit-learn's 8x8 handwritten digits (1,797 images, embedded in the package; the default).
``fashion-mnist``
    Fashion-MNIST (Xiao, Rasul & Vollgraf 2017) read from IDX files, by default from the Debian
    package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist``). Override the
    directory with the ``data_dir`` argument or the ``FEDAGG_DATA_DIR`` environment variable.

Nothing is ever downloaded at run time.

Partitioners
------------
``iid``
    A seeded random permutation cut into near-equal parts.
``dirichlet``
    Per-class Dirichlet(alpha) label skew (Hsu, Qi & Brown 2019, "Measuring the effects of
    non-identical data distribution for federated visual classification"): for every class the
    share of each site is drawn from Dir(alpha); smaller alpha means more skew. Draws are
    repeated until every site holds at least ``min_size`` examples.
"""

from __future__ import annotations

import gzip
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from fedagg.errors import ConfigError, DataError, explain

__all__ = [
    "DATASETS",
    "DEFAULT_FASHION_DIR",
    "Dataset",
    "dataset_shape",
    "load_dataset",
    "partition",
    "partition_dirichlet",
    "partition_iid",
    "read_idx",
]

DEFAULT_FASHION_DIR = "/usr/share/datasets/fashion-mnist"
DATASETS = ("digits", "fashion-mnist")

FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Dataset:
    """A train / test split with images as float32 ``[n, c, h, w]`` in ``[0, 1]``."""

    name: str
    x_train: FloatArray
    y_train: IntArray
    x_test: FloatArray
    y_test: IntArray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(channels, height, width)`` of one example."""
        c, h, w = self.x_train.shape[1:]
        return int(c), int(h), int(w)


def load_dataset(
    name: str,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> Dataset:
    """Load a data set by name.

    Parameters
    ----------
    name : str
        ``"digits"`` or ``"fashion-mnist"``.
    data_dir : path, optional
        Directory of the Fashion-MNIST IDX files; default ``$FEDAGG_DATA_DIR`` or
        :data:`DEFAULT_FASHION_DIR`.
    test_fraction : float
        Held-out share for ``digits`` (Fashion-MNIST has its own test split).
    seed : int
        Seed of the ``digits`` train / test split.

    Raises
    ------
    ConfigError
        Unknown data set name.
    DataError
        Files missing or malformed.
    """
    key = name.strip().lower().replace("_", "-")
    if key == "digits":
        return _load_digits(test_fraction, seed)
    if key in ("fashion-mnist", "fashionmnist", "fmnist"):
        return _load_fashion(data_dir)
    raise ConfigError(
        explain(
            "dataset",
            name,
            f"is not a known data set; known: {', '.join(DATASETS)}",
            "set dataset to one of the known names",
        )
    )


_SHAPES: dict[str, tuple[tuple[int, int, int], int]] = {
    "digits": ((1, 8, 8), 10),
    "fashion-mnist": ((1, 28, 28), 10),
}


def dataset_shape(name: str) -> tuple[tuple[int, int, int], int] | None:
    """``(input_shape, num_classes)`` of a built-in data set, without loading it; None for a
    name that is not one (spelled as :func:`load_dataset` accepts it)."""
    key = name.strip().lower().replace("_", "-")
    key = "fashion-mnist" if key in ("fashionmnist", "fmnist") else key
    return _SHAPES.get(key)


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (1,797 x 64 pixel values, labels), as ``load_digits`` returns them.

    Read straight from the CSV that scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``,
    the file ``load_digits`` parses) without importing scikit-learn: that import costs ~1 s of
    CPU in every process that loads the data (each deployed ClientApp, each Ray actor, each
    site worker). Falls back to ``load_digits`` when the file is not where it used to be.
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # locates the package without importing it
    if spec is not None and spec.origin:
        path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt") as f:
                table = np.loadtxt(f, delimiter=",")
            if table.ndim == 2 and table.shape[1] == 65:
                return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return np.asarray(bunch.data), np.asarray(bunch.target)


def _load_digits(test_fraction: float, seed: int) -> Dataset:
    data, target = _digits_arrays()
    x = (np.asarray(data, dtype=np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = np.asarray(target, dtype=np.int64)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    n_test = round(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return Dataset("digits", x[train], y[train], x[test], y[test], 10)


def _load_fashion(data_dir: str | os.PathLike[str] | None) -> Dataset:
    root = Path(data_dir or os.environ.get("FEDAGG_DATA_DIR") or DEFAULT_FASHION_DIR)
    files = {
        "x_train": "train-images-idx3-ubyte.gz",
        "y_train": "train-labels-idx1-ubyte.gz",
        "x_test": "t10k-images-idx3-ubyte.gz",
        "y_test": "t10k-labels-idx1-ubyte.gz",
    }
    missing = [f for f in files.values() if not (root / f).is_file()]
    if missing:
        raise DataError(
            explain(
                "data_dir",
                str(root),
                f"does not hold the Fashion-MNIST IDX files (missing: {', '.join(missing)})",
                "install them with `apt-get install dataset-fashion-mnist` (Debian), or point "
                "data_dir / FEDAGG_DATA_DIR at a directory with the four *-ubyte.gz files",
            )
        )
    arrays = {k: read_idx(root / f) for k, f in files.items()}
    x_train = (arrays["x_train"].astype(np.float32) / 255.0)[:, None, :, :]
    x_test = (arrays["x_test"].astype(np.float32) / 255.0)[:, None, :, :]
    return Dataset(
        "fashion-mnist",
        x_train,
        arrays["y_train"].astype(np.int64),
        x_test,
        arrays["y_test"].astype(np.int64),
        10,
    )


_IDX_RAW: dict[int, Any] = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_DTYPES: dict[int, np.dtype[Any]] = {k: np.dtype(v) for k, v in _IDX_RAW.items()}


def read_idx(path: str | os.PathLike[str]) -> npt.NDArray[np.generic]:
    """Read an IDX file (LeCun's MNIST format), gzip-compressed or not.

    Raises
    ------
    DataError
        Bad magic, unknown type code, or a length that does not match the header.
    """
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    try:
        with opener(p, "rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise DataError(
            explain(
                "path",
                str(p),
                f"cannot be read ({exc})",
                "check the file exists and is a valid (gzip) IDX file",
            )
        ) from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(
            explain(
                "path",
                str(p),
                "is not an IDX file (bad magic)",
                "use the original *-ubyte(.gz) files",
            )
        )
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(explain("path", str(p), "is truncated (header)", "re-install the files"))
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = _IDX_DTYPES[raw[2]]
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - header != expected:
        raise DataError(
            explain(
                "path",
                str(p),
                f"holds {len(raw) - header} data bytes but its header says {expected}",
                "re-install the files; this one is truncated or corrupt",
            )
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)


def partition_iid(num_examples: int, num_partitions: int, *, seed: int) -> list[IntArray]:
    """Split ``range(num_examples)`` into ``num_partitions`` near-equal random parts."""
    _check_parts(num_examples, num_partitions, 1)
    order = np.random.default_rng(seed).permutation(num_examples).astype(np.int64)
    return [np.sort(part) for part in np.array_split(order, num_partitions)]


def partition_dirichlet(
    labels: npt.ArrayLike,
    num_partitions: int,
    *,
    alpha: float,
    seed: int,
    min_size: int = 10,
    max_tries: int = 1000,
) -> list[IntArray]:
    """Per-class Dirichlet(alpha) label-skew partition (Hsu et al. 2019).

    Parameters
    ----------
    labels : array of int
        Class label of every example.
    num_partitions : int
        Number of sites.
    alpha : float
        Concentration; ``> 0``. Small values give strongly skewed sites.
    seed : int
        Seed; the same inputs and seed give the same partition.
    min_size : int
        Every site receives at least this many examples (draws are repeated until it holds).
    max_tries : int
        Give up after this many draws with a :class:`ConfigError` explaining the fix.
    """
    y = np.asarray(labels, dtype=np.int64)
    if not alpha > 0:
        raise ConfigError(
            explain(
                "dirichlet_alpha", alpha, "must be > 0", "use e.g. 0.5 (skewed) or 100 (near IID)"
            )
        )
    _check_parts(len(y), num_partitions, min_size)
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    by_class = [rng.permutation(np.flatnonzero(y == c)) for c in classes]
    for _ in range(max_tries):
        parts: list[list[IntArray]] = [[] for _ in range(num_partitions)]
        for idx in by_class:
            props = rng.dirichlet(np.full(num_partitions, alpha))
            cuts = (np.cumsum(props)[:-1] * len(idx)).astype(np.int64)
            for site, chunk in enumerate(np.split(idx, cuts)):
                parts[site].append(chunk.astype(np.int64))
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in out) >= min_size:
            return out
    raise ConfigError(
        explain(
            "min_partition_size",
            min_size,
            f"could not be met for {num_partitions} sites with alpha={alpha} "
            f"after {max_tries} draws",
            "lower min_partition_size, raise dirichlet_alpha or use fewer sites",
        )
    )


def partition(
    labels: npt.ArrayLike,
    num_partitions: int,
    *,
    method: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    min_size: int = 10,
) -> list[IntArray]:
    """Dispatch to :func:`partition_iid` or :func:`partition_dirichlet` by ``method``."""
    y = np.asarray(labels)
    if method == "iid":
        return partition_iid(len(y), num_partitions, seed=seed)
    if method == "dirichlet":
        return partition_dirichlet(y, num_partitions, alpha=alpha, seed=seed, min_size=min_size)
    raise ConfigError(
        explain(
            "partitioner",
            method,
            "must be 'iid' or 'dirichlet'",
            "set partitioner to 'iid' or 'dirichlet'",
        )
    )


def _check_parts(num_examples: int, num_partitions: int, min_size: int) -> None:
    if num_partitions < 1:
        raise ConfigError(
            explain("num_sites", num_partitions, "must be >= 1", "use at least one site")
        )
    if num_examples < num_partitions * max(min_size, 1):
        raise ConfigError(
            explain(
                "num_sites",
                num_partitions,
                f"is too many for {num_examples} examples with at least "
                f"{max(min_size, 1)} per site",
                "use fewer sites or a larger data set",
            )
        )
