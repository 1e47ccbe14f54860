"""Site-local data and the single-worker update (the K = 1 case of a site).

Data sets and partitions are cached per process: in simulation Flower reuses its Ray actor
processes across messages, so a site loads and partitions its data once per run.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from clients.settings import SiteSettings
from fedagg.data import Dataset, load_dataset, partition
from fedagg.errors import DataError, explain
from fedagg.models import build_model, get_weights, set_weights
from fedagg.training import train

__all__ = ["SiteUpdate", "inject_faults", "local_data", "local_model", "train_single", "training_seed"]

_log = logging.getLogger(__name__)


@dataclass
class SiteUpdate:
    """What a site returns for one round: the trained weights and its metrics."""

    weights: list[np.ndarray]
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)


@functools.lru_cache(maxsize=4)
def _dataset(name: str, data_dir: str | None, test_fraction: float, seed: int) -> Dataset:
    return load_dataset(name, data_dir=data_dir, test_fraction=test_fraction, seed=seed)


@functools.lru_cache(maxsize=8)
def _partitions(name: str, data_dir: str | None, test_fraction: float, seed: int, n: int,
                method: str, alpha: float, min_size: int, max_train: int | None) -> list[np.ndarray]:
    ds = _dataset(name, data_dir, test_fraction, seed)
    labels = ds.y_train[:max_train] if max_train else ds.y_train
    return partition(labels, n, method=method, alpha=alpha, seed=seed, min_size=min_size)


def local_data(s: SiteSettings) -> tuple[np.ndarray, np.ndarray, tuple[int, int, int], int]:
    """The site's training data ``(x, y, input_shape, num_classes)``."""
    d = s.cfg.data
    if s.node.data_path:
        path = Path(s.node.data_path)
        try:
            with np.load(path) as npz:
                x, y = npz["x_train"].astype(np.float32), npz["y_train"].astype(np.int64)
        except (OSError, KeyError, ValueError) as exc:
            raise DataError(explain(f"node {s.node_id}: node_config.data_path", str(path),
                                    f"must be an .npz with x_train and y_train ({exc})",
                                    "export the site's data with numpy.savez")) from None
        if x.ndim == 3:
            x = x[:, None]
        return x, y, (int(x.shape[1]), int(x.shape[2]), int(x.shape[3])), int(y.max()) + 1
    ds = _dataset(d.dataset, d.data_dir, d.test_fraction, s.cfg.run.seed)
    parts = _partitions(d.dataset, d.data_dir, d.test_fraction, s.cfg.run.seed, s.num_partitions,
                        d.partitioner, d.dirichlet_alpha, d.min_partition_size, d.max_train_examples)
    if not 0 <= s.partition_id < len(parts):
        raise DataError(explain(f"node {s.node_id}: partition_id", s.partition_id,
                                f"must be in [0, {len(parts)})", "set partition-id below num-partitions"))
    idx = parts[s.partition_id]
    return ds.x_train[idx], ds.y_train[idx], ds.input_shape, ds.num_classes


def local_model(s: SiteSettings, input_shape: tuple[int, int, int], num_classes: int,
                weights: list[np.ndarray]) -> nn.Module:
    """Build the run's model and load the global weights into it."""
    model = build_model(s.cfg.model.name, input_shape, num_classes)
    set_weights(model, weights)
    return model


def training_seed(s: SiteSettings) -> int:
    """Seed of the site's shuffling order: run seed, round and partition."""
    return (s.cfg.run.seed * 1_000_003 + s.server_round * 7919 + s.partition_id) % (2**31)


def train_single(s: SiteSettings, weights: list[np.ndarray]) -> SiteUpdate:
    """Train one worker on the whole site partition for ``train.local_epochs``."""
    x, y, shape, classes = local_data(s)
    model = local_model(s, shape, classes, weights)
    torch.manual_seed(training_seed(s))
    t0 = time.perf_counter()
    t = s.cfg.train
    res = train(model, x, y, epochs=t.local_epochs, batch_size=t.batch_size, lr=t.lr,
                momentum=t.momentum, seed=training_seed(s))
    seconds = time.perf_counter() - t0
    return SiteUpdate(get_weights(model), res.num_examples,
                      {"train-loss": res.loss, "compute-seconds": seconds, "workers": 1.0})


def inject_faults(s: SiteSettings, stage: str) -> None:
    """Apply ``[faults]`` from the run config (testing aid): crash or delay this site."""
    f = s.cfg.faults
    if f.slow_site == s.partition_id and f.slow_round == s.server_round and stage == "train":
        _log.warning("%s: injected delay of %.1f s (faults.slow_site)", s.name, f.slow_seconds)
        time.sleep(f.slow_seconds)
    if f.crash_site == s.partition_id and f.crash_round == s.server_round and f.crash_stage == stage:
        raise RuntimeError(f"{s.name}: injected crash at stage {stage!r} in round {s.server_round} "
                           "(faults.crash_site)")
