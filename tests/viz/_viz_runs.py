"""A hand-made run directory for the report tests (every section of the report has data)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

PARAMS = 1000 + 24  # model.npz: a (40, 25) weight and a 24-vector


def make_run(path: Path) -> list[dict[str, Any]]:
    """Write metrics.json, config.json and model.npz under ``path``; returns the records."""
    path.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = [
        {"round": 0, "accuracy": 0.1, "loss": 2.3, "bytes_up": 0, "bytes_down": 0, "seconds": 0.0,
         "seconds_startup": 13.7},
        {"round": 1, "accuracy": 0.5, "loss": 1.5, "bytes_up": 2100, "bytes_down": 12300,
         "sites_sampled": 3, "sites_replied": 3, "sites_failed": 0, "sites_rejected": 1,
         "seconds": 3.5, "seconds_train": 3.0, "seconds_eval": 0.5, "seconds_exchange": 2.9,
         "train_loss": 1.8, "secagg_counted": 2, "secagg_dropped": 1, "sites": [0, 2],
         "rejected": {"98765": "update norm 1e9 exceeds max_update_norm 10"},
         "site_metrics": {
             # dash spelling (what sites send today) ...
             "0": {"workers": 2.0, "num-examples": 100.0, "compute-seconds": 1.0,
                   "comm-seconds": 0.5, "comm-wait-seconds": 0.2, "bytes-allreduced": 4.0e6,
                   "algorithm_ring": 1.0},
             # ... and underscore spelling (after the metric-key rename)
             "2": {"workers": 4.0, "num_examples": 50.0, "compute_seconds": 2.0,
                   "comm_seconds": 1.0, "comm_wait_seconds": 0.25, "bytes_allreduced": 8.0e6}}},
        {"round": 2, "accuracy": None, "loss": None, "bytes_up": 2800, "bytes_down": 12300,
         "sites_sampled": 3, "sites_replied": 2, "sites_failed": 1, "sites_rejected": 0,
         "seconds": 1.25, "seconds_train": 1.0, "seconds_eval": 0.0, "seconds_exchange": 0.9,
         "train_loss": 1.2, "secagg_counted": 2, "secagg_dropped": 0, "sites": [0, 1]},
        {"round": 3, "accuracy": 0.75, "loss": 0.9, "bytes_up": 2800, "bytes_down": 12300,
         "sites_sampled": 3, "sites_replied": 3, "sites_failed": 0, "sites_rejected": 0,
         "seconds": 1.0, "seconds_train": 0.75, "seconds_eval": 0.25, "seconds_exchange": 0.7,
         "train_loss": 0.95, "secagg_counted": 3, "secagg_dropped": 0, "sites": [0, 1, 2],
         "site_metrics": {"0": {"workers": 2.0, "num-examples": 100.0, "compute-seconds": 1.0,
                                "comm-seconds": 0.5, "comm-wait-seconds": 0.3,
                                "bytes-allreduced": 4.0e6, "algorithm_native": 1.0,
                                "algorithm_tree": 0.0}}},
    ]
    (path / "metrics.json").write_text(json.dumps(records, indent=2))
    config = {"run": {"name": "handmade", "rounds": 3, "sites": 3},
              "data": {"dataset": "digits", "partitioner": "iid"}, "model": {"name": "mlp"},
              "strategy": {"name": "secure"}, "site": {"algorithm": "ring"},
              "compression": {"up": "topk:0.1", "down": "none"}, "note": "</script><b>x</b>"}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    np.savez(path / "model.npz", w=np.zeros((40, 25), np.float32), b=np.zeros(24, np.float32))
    return records
