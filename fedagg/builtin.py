"""fedagg's built-in models and data sets, as a :class:`~fedagg.task.Task` like any user's.

``fedagg simulate`` and the default ClientApp (``clients.app:app``) train
``builtin_task(cfg)``: the model ``model.name`` of :mod:`fedagg.models` on the site's
partition of ``data.dataset`` (:mod:`fedagg.data`), split into a training part and a held-out
part of ``data.eval_fraction`` for client-side evaluation. In deployment a site brings its
own data as an ``.npz`` (``--node-config "data-path='/data/site.npz'"``) with ``x_train``,
``y_train`` and optionally ``x_eval`` / ``y_eval``.

The callables are frozen dataclasses, so the task pickles by value for process-mode workers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
from torch.utils.data import TensorDataset

from fedagg.config import RunConfig
from fedagg.data import Dataset, load_dataset, partition
from fedagg.errors import DataError, explain
from fedagg.models import build_model
from fedagg.task import SiteData, SiteInfo, Task

__all__ = ["BuiltinData", "BuiltinModel", "builtin_task", "held_out_split", "npz_data"]


@functools.lru_cache(maxsize=4)
def _dataset(name: str, data_dir: str | None, test_fraction: float, seed: int) -> Dataset:
    return load_dataset(name, data_dir=data_dir, test_fraction=test_fraction, seed=seed)


@functools.lru_cache(maxsize=8)
def _partitions(name: str, data_dir: str | None, test_fraction: float, seed: int, n: int,
                method: str, alpha: float, min_size: int, max_train: int | None
                ) -> list[npt.NDArray[np.int64]]:
    ds = _dataset(name, data_dir, test_fraction, seed)
    labels = ds.y_train[:max_train] if max_train else ds.y_train
    return partition(labels, n, method=method, alpha=alpha, seed=seed, min_size=min_size)


@functools.lru_cache(maxsize=8)
def npz_data(path: str) -> dict[str, npt.NDArray[np.generic]]:
    """A site's own data from an ``.npz`` (``x_train``, ``y_train``, optional ``x_eval`` /
    ``y_eval``); images get a channel axis when they have none.

    Raises
    ------
    DataError
        Missing file or arrays (names the path and the fix).
    """
    try:
        with np.load(Path(path)) as npz:
            out = {k: npz[k] for k in npz.files}
        x, y = out["x_train"].astype(np.float32), out["y_train"].astype(np.int64)
    except (OSError, KeyError, ValueError) as exc:
        raise DataError(explain("node_config.data_path", str(path),
                                f"must be an .npz with x_train and y_train ({exc})",
                                "export the site's data with numpy.savez")) from None
    res: dict[str, npt.NDArray[np.generic]] = {"x_train": x if x.ndim != 3 else x[:, None],
                                               "y_train": y}
    if "x_eval" in out and "y_eval" in out:
        xe = out["x_eval"].astype(np.float32)
        res["x_eval"], res["y_eval"] = (xe if xe.ndim != 3 else xe[:, None],
                                        out["y_eval"].astype(np.int64))
    return res


def held_out_split(n: int, fraction: float, seed: int, partition_id: int
                   ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Seeded ``(train, eval)`` positions of a partition of ``n`` examples.

    ``round(fraction * n)`` examples are held out (none when ``fraction`` is 0 or ``n < 2``);
    the rest keep their original order.
    """
    if fraction <= 0 or n < 2:
        return np.arange(n, dtype=np.int64), np.zeros(0, np.int64)
    k = min(max(round(fraction * n), 1), n - 1)
    perm = np.random.default_rng([seed, 7_919, partition_id]).permutation(n)
    held = np.sort(perm[:k]).astype(np.int64)
    keep = np.setdiff1d(np.arange(n, dtype=np.int64), held, assume_unique=True)
    return keep, held


def _tensors(x: npt.NDArray[np.generic], y: npt.NDArray[np.generic]) -> TensorDataset:
    return TensorDataset(torch.from_numpy(np.ascontiguousarray(x, np.float32)),
                         torch.from_numpy(np.ascontiguousarray(y, np.int64)))


@dataclass(frozen=True)
class BuiltinData:
    """``SiteInfo -> SiteData`` for a built-in data set (or a site's own ``.npz``)."""

    dataset: str = "digits"
    data_dir: str | None = None
    test_fraction: float = 0.2
    seed: int = 0
    partitioner: str = "dirichlet"
    alpha: float = 0.5
    min_size: int = 10
    max_train: int | None = None
    eval_fraction: float = 0.1
    data_path: str | None = None

    def arrays(self, site: SiteInfo) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64],
                                              npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """``(x_train, y_train, x_eval, y_eval)`` of the site."""
        if self.data_path:
            try:
                d = npz_data(self.data_path)
            except DataError as exc:
                raise DataError(f"node {site.node_id}: {exc}") from None
            x, y = d["x_train"], d["y_train"]
            if "x_eval" in d:
                return x, y, d["x_eval"], d["y_eval"]  # type: ignore[return-value]
        else:
            ds = _dataset(self.dataset, self.data_dir, self.test_fraction, self.seed)
            parts = _partitions(self.dataset, self.data_dir, self.test_fraction, self.seed,
                                site.num_partitions, self.partitioner, self.alpha,
                                self.min_size, self.max_train)
            if not 0 <= site.partition_id < len(parts):
                raise DataError(explain(f"node {site.node_id}: partition_id", site.partition_id,
                                        f"must be in [0, {len(parts)})",
                                        "set partition-id below num-partitions"))
            idx = parts[site.partition_id]
            x, y = ds.x_train[idx], ds.y_train[idx]
        keep, held = held_out_split(len(y), self.eval_fraction, self.seed, site.partition_id)
        return x[keep], y[keep], x[held], y[held]  # type: ignore[return-value]

    def __call__(self, site: SiteInfo) -> SiteData:
        x, y, xe, ye = self.arrays(site)
        return SiteData(train=_tensors(x, y), eval=_tensors(xe, ye) if len(ye) else None)

    def shape(self) -> tuple[tuple[int, int, int], int]:
        """``(input_shape, num_classes)`` of the data."""
        if self.data_path:
            d = npz_data(self.data_path)
            x, y = d["x_train"], d["y_train"]
            return (int(x.shape[1]), int(x.shape[2]), int(x.shape[3])), int(np.max(y)) + 1
        ds = _dataset(self.dataset, self.data_dir, self.test_fraction, self.seed)
        return ds.input_shape, ds.num_classes


@dataclass(frozen=True)
class BuiltinModel:
    """``() -> nn.Module``: the reference model ``name`` for the data's shape."""

    name: str
    data: BuiltinData
    params: int | None = None
    """Parameter count of the ``wide`` model (``model.params``)."""

    def __call__(self) -> nn.Module:
        shape, classes = self.data.shape()
        return build_model(self.name, shape, classes, params=self.params)


def builtin_task(cfg: RunConfig, *, data_path: str | None = None) -> Task:
    """The built-in task of a run config (model ``model.name`` on ``data.dataset``)."""
    d = cfg.data
    data = BuiltinData(dataset=d.dataset, data_dir=d.data_dir, test_fraction=d.test_fraction,
                       seed=cfg.run.seed, partitioner=d.partitioner, alpha=d.dirichlet_alpha,
                       min_size=d.min_partition_size, max_train=d.max_train_examples,
                       eval_fraction=d.eval_fraction, data_path=data_path)
    return Task(model=BuiltinModel(cfg.model.name, data, cfg.model.params), data=data)
