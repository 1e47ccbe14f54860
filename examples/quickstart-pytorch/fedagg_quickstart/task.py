"""The user's part: a CNN and the data of each site (nothing here is fedagg's).

The CNN is the one of PyTorch's 60-minute blitz, as in Flower's quickstart-pytorch; the data
is scikit-learn's digits upsampled to 3x32x32 (offline), split IID across the sites, with a
held-out 20 % per site for federated evaluation.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from fedagg.task import SiteData, SiteInfo, Task


class Net(nn.Module):
    """Simple CNN adapted from 'PyTorch: A 60 Minute Blitz'."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


@functools.lru_cache(maxsize=1)
def images() -> tuple[torch.Tensor, torch.Tensor]:
    """All digits as normalised 3x32x32 images, and their labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0)[:, None]
    x = F.interpolate(x, size=(32, 32), mode="nearest").repeat(1, 3, 1, 1)
    return (x - 0.5) / 0.5, torch.from_numpy(d.target.astype(np.int64))


def load_site(site: SiteInfo) -> SiteData:
    """This site's IID share: 80 % to train on, 20 % held out for evaluation."""
    x, y = images()
    parts = np.array_split(np.random.default_rng(42).permutation(len(y)), site.num_partitions)
    idx = torch.from_numpy(parts[site.partition_id])
    n_eval = len(idx) // 5
    return SiteData(train=TensorDataset(x[idx[n_eval:]], y[idx[n_eval:]]),
                    eval=TensorDataset(x[idx[:n_eval]], y[idx[:n_eval]]))


def adam(params, settings):  # type: ignore[no-untyped-def]
    """The user's optimizer: Adam at the round's learning rate (the server's ``lr``)."""
    return torch.optim.Adam(params, lr=settings.lr * 0.1)


TASK = Task(model=Net, data=load_site, optimizer=adam)
