"""Local training and evaluation loops (single worker).

Plain mini-batch SGD (Robbins & Monro 1951) with a seeded shuffling order, so the same seed,
data and starting weights give the same trained model. Multi-worker sites use
``clients/worker.py``, which shares :func:`batches` and :func:`evaluate`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

__all__ = ["TrainResult", "batches", "evaluate", "train"]


@dataclass(frozen=True)
class TrainResult:
    """What one local training call produced."""

    num_examples: int
    loss: float
    steps: int


def batches(
    num_examples: int, batch_size: int, *, epoch: int, seed: int
) -> Iterator[npt.NDArray[np.int64]]:
    """Yield index batches of one epoch in a seeded random order (last batch may be short)."""
    order = np.random.default_rng([seed, epoch]).permutation(num_examples)
    for start in range(0, num_examples, batch_size):
        yield order[start : start + batch_size].astype(np.int64)


def train(
    model: nn.Module,
    x: npt.NDArray[np.float32],
    y: npt.NDArray[np.int64],
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float = 0.0,
    seed: int = 0,
) -> TrainResult:
    """Train ``model`` in place with SGD; returns the number of examples and the mean loss."""
    xt = torch.from_numpy(np.ascontiguousarray(x))
    yt = torch.from_numpy(np.ascontiguousarray(y))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    total, count, steps = 0.0, 0, 0
    for epoch in range(epochs):
        for idx in batches(len(yt), batch_size, epoch=epoch, seed=seed):
            ib = torch.from_numpy(idx)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(xt[ib]), yt[ib])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
            count += len(idx)
            steps += 1
    return TrainResult(num_examples=len(yt), loss=total / max(count, 1), steps=steps)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: npt.NDArray[np.float32],
    y: npt.NDArray[np.int64],
    *,
    batch_size: int = 1024,
) -> tuple[float, float]:
    """Return ``(mean cross-entropy loss, accuracy)`` of ``model`` on ``(x, y)``."""
    model.eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    total, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        xb = torch.from_numpy(np.ascontiguousarray(x[start : start + batch_size]))
        yb = torch.from_numpy(np.ascontiguousarray(y[start : start + batch_size]))
        out = model(xb)
        total += float(loss_fn(out, yb))
        correct += int((out.argmax(1) == yb).sum())
    n = max(len(y), 1)
    return total / n, correct / n
