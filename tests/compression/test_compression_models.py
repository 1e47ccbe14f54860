"""The 2NN reference model (McMahan et al. 2017) used by the compression benchmark."""

from __future__ import annotations

import torch

from fedagg.models import build_model


def test_two_nn_is_784_200_200_10() -> None:
    m = build_model("2nn", (1, 28, 28), 10, seed=0)
    shapes = [tuple(p.shape) for p in m.parameters()]
    assert shapes == [(200, 784), (200,), (200, 200), (200,), (10, 200), (10,)]
    assert sum(p.numel() for p in m.parameters()) == 199_210  # as in McMahan et al. 2017
    assert m(torch.zeros(3, 1, 28, 28)).shape == (3, 10)


def test_two_nn_seeded_init_is_reproducible() -> None:
    a = build_model("2nn", (1, 28, 28), 10, seed=3).state_dict()
    b = build_model("2nn", (1, 28, 28), 10, seed=3).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
