"""The reference ResNet (He et al. 2016): size, shapes on both data sets, it learns."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedagg.data import load_dataset
from fedagg.errors import ConfigError
from fedagg.models import MODELS, ResNet, build_model, get_weights, set_weights

SHAPES = {"fashion-mnist": (1, 28, 28), "digits": (1, 8, 8)}


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_resnet_is_registered_and_large_enough() -> None:
    assert "resnet" in MODELS
    model = build_model("resnet", (1, 28, 28), 10, seed=0)
    assert _params(model) >= 1_000_000
    assert _params(model) == 1_228_394  # the figure the docstring quotes
    assert sum(1 for m in model.modules() if m.__class__.__name__ == "BasicBlock") == 4


def test_group_norm_default_has_no_buffers_and_batch_norm_has() -> None:
    """GroupNorm: nothing to keep consistent across a site's workers; BatchNorm: buffers."""
    assert list(build_model("resnet", (1, 8, 8), 10).buffers()) == []
    assert any(isinstance(m, nn.GroupNorm) for m in build_model("resnet", (1, 8, 8), 10).modules())
    bn = ResNet((1, 8, 8), 10, norm="batch")
    assert len(list(bn.buffers())) > 0


@pytest.mark.parametrize("name", ["fashion-mnist", "digits"])
def test_forward_shapes_on_both_data_sets(name: str) -> None:
    ds = load_dataset(name)
    assert ds.input_shape == SHAPES[name]
    model = build_model("resnet", ds.input_shape, ds.num_classes, seed=0)
    x = torch.from_numpy(ds.x_train[:5])
    assert model(x).shape == (5, ds.num_classes)
    assert model(x[:1]).shape == (1, ds.num_classes)  # GroupNorm works at batch size 1


def test_seeded_build_is_reproducible_and_weights_round_trip() -> None:
    a = build_model("resnet", (1, 8, 8), 10, seed=4)
    b = build_model("resnet", (1, 8, 8), 10, seed=4)
    c = build_model("resnet", (1, 8, 8), 10, seed=5)
    wa, wb, wc = get_weights(a), get_weights(b), get_weights(c)
    assert all((x == y).all() for x, y in zip(wa, wb, strict=True))
    assert any((x != y).any() for x, y in zip(wa, wc, strict=True))
    set_weights(c, wa)
    assert all((x == y).all() for x, y in zip(get_weights(c), wa, strict=True))


@pytest.mark.parametrize("name", ["digits", "fashion-mnist"])
def test_a_few_sgd_steps_reduce_the_loss(name: str) -> None:
    torch.set_num_threads(1)
    ds = load_dataset(name)
    x = torch.from_numpy(ds.x_train[:64])
    y = torch.from_numpy(ds.y_train[:64])
    model = build_model("resnet", ds.input_shape, ds.num_classes, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("kw,field", [({"norm": "layer"}, "norm"),
                                      ({"widths": (8, 16), "blocks": (1,)}, "blocks")])
def test_bad_options_are_named(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ResNet((1, 8, 8), 10, **kw)  # type: ignore[arg-type]
