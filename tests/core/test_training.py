"""Local training is deterministic for a seed and actually learns."""

from __future__ import annotations

import numpy as np
import torch

from fedagg.data import load_dataset
from fedagg.models import build_model, get_weights, set_weights
from fedagg.training import evaluate, train


def test_same_seed_same_model_and_learning() -> None:
    ds = load_dataset("digits")
    outs = []
    for _ in range(2):
        m = build_model("mlp", ds.input_shape, ds.num_classes, seed=3)
        torch.manual_seed(0)
        train(m, ds.x_train, ds.y_train, epochs=2, batch_size=16, lr=0.1, seed=5)
        outs.append(get_weights(m))
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b)
    m0 = build_model("mlp", ds.input_shape, ds.num_classes, seed=3)
    _, acc0 = evaluate(m0, ds.x_test, ds.y_test)
    set_weights(m0, outs[0])
    _, acc1 = evaluate(m0, ds.x_test, ds.y_test)
    assert acc1 > acc0 + 0.3


def test_models_by_name() -> None:
    for name in ("mlp", "cnn", "logreg"):
        m = build_model(name, (1, 28, 28), 10)
        assert m(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
