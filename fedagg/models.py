"""Small reference models, chosen by name.

``mlp``  two hidden layers (LeCun-style multilayer perceptron) over flattened pixels.
``2nn``  McMahan et al.'s "2NN": two hidden layers of 200 ReLU units (784-200-200-10 on
         28x28 images, 199,210 parameters), the standard FL baseline for (Fashion-)MNIST.
``cnn``  two 3x3 convolutions + a linear classifier (a LeNet-5-like network, LeCun et al. 1998).
``logreg`` multinomial logistic regression (a linear layer), useful for exact-math tests.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from fedagg.errors import ConfigError, explain

__all__ = ["MODELS", "build_model", "get_weights", "set_weights"]


def _mlp(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    c, h, w = input_shape
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(c * h * w, 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, num_classes),
    )


def _two_nn(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """The "2NN" of McMahan et al. (2017), Sec. 3: 2 hidden layers of 200 units with ReLU.

    References
    ----------
    .. [McMahan2017] H. B. McMahan, E. Moore, D. Ramage, S. Hampson, B. Agüera y Arcas.
       "Communication-Efficient Learning of Deep Networks from Decentralized Data".
       AISTATS 2017.
    """
    c, h, w = input_shape
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(c * h * w, 200),
        nn.ReLU(),
        nn.Linear(200, 200),
        nn.ReLU(),
        nn.Linear(200, num_classes),
    )


def _cnn(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    c, h, w = input_shape
    pool = 2 if min(h, w) >= 16 else 1
    feat_h, feat_w = h // (pool * pool), w // (pool * pool)
    return nn.Sequential(
        nn.Conv2d(c, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(pool),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(pool),
        nn.Flatten(),
        nn.Linear(32 * feat_h * feat_w, num_classes),
    )


def _logreg(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, num_classes))


MODELS: dict[str, Callable[[tuple[int, int, int], int], nn.Module]] = {
    "mlp": _mlp,
    "2nn": _two_nn,
    "cnn": _cnn,
    "logreg": _logreg,
}


def build_model(
    name: str, input_shape: tuple[int, int, int], num_classes: int, *, seed: int | None = None
) -> nn.Module:
    """Build a model by name; with ``seed`` its initial weights are reproducible."""
    key = name.strip().lower()
    if key not in MODELS:
        raise ConfigError(
            explain(
                "model",
                name,
                f"is not a known model; known: {', '.join(MODELS)}",
                "set model to one of the known names",
            )
        )
    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return MODELS[key](input_shape, num_classes)
    return MODELS[key](input_shape, num_classes)


def get_weights(model: nn.Module) -> list[npt.NDArray[np.float32]]:
    """The model's state as a list of float32 numpy arrays (state_dict order, copies)."""
    return [
        t.detach().cpu().numpy().astype(np.float32, copy=True) for t in model.state_dict().values()
    ]


def set_weights(model: nn.Module, weights: list[npt.NDArray[np.float32]]) -> None:
    """Load a list of arrays (state_dict order) into ``model``, checking count and shapes."""
    keys = list(model.state_dict().keys())
    if len(keys) != len(weights):
        raise ConfigError(
            explain(
                "weights",
                f"{len(weights)} arrays",
                f"the model has {len(keys)} tensors",
                "send weights of the same model architecture",
            )
        )
    state = {}
    for k, w, ref in zip(keys, weights, model.state_dict().values(), strict=True):
        if tuple(w.shape) != tuple(ref.shape):
            raise ConfigError(
                explain(
                    f"weights[{k}]",
                    tuple(w.shape),
                    f"must have shape {tuple(ref.shape)}",
                    "send weights of the same model architecture",
                )
            )
        state[k] = torch.as_tensor(np.asarray(w), dtype=ref.dtype)
    model.load_state_dict(state)
