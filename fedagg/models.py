"""Small reference models, chosen by name.

``mlp``  two hidden layers (LeCun-style multilayer perceptron) over flattened pixels.
``2nn``  McMahan et al.'s "2NN": two hidden layers of 200 ReLU units (784-200-200-10 on
         28x28 images, 199,210 parameters), the standard FL baseline for (Fashion-)MNIST.
``cnn``  two 3x3 convolutions + a linear classifier (a LeNet-5-like network, LeCun et al. 1998).
``logreg`` multinomial logistic regression (a linear layer), useful for exact-math tests.
``resnet`` a ResNet-10 of BasicBlocks with GroupNorm (He et al. 2016; 1.23M parameters), the
         model on which data-parallel sites pay (see :class:`ResNet`).
``wide``   a synthetic large model: one hidden layer as wide as it takes to reach
         ``params`` parameters (``model.params``; 100M+ for the server's big-model runs,
         docs/architecture/server-memory.md), see :func:`wide_width`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from fedagg.errors import ConfigError, explain

__all__ = ["MODELS", "WIDE_DEFAULT_PARAMS", "build_model", "get_weights", "set_weights",
           "wide_width"]

WIDE_DEFAULT_PARAMS = 1_000_000
"""Parameters of the ``wide`` model when ``params`` is not given."""


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


class BasicBlock(nn.Module):
    """The two-layer residual block of He et al. (2016), section 3.3 / figure 2 (left).

    ``out = relu(norm(conv3x3(relu(norm(conv3x3(x))))) + shortcut(x))``; the shortcut is the
    identity, or a strided 1x1 convolution + norm where the shape changes ("option B",
    section 3.3 "Residual Network").
    """

    def __init__(
        self, c_in: int, c_out: int, stride: int, norm: Callable[[int], nn.Module]
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = norm(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), norm(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet for 1-channel images (He et al. 2016, section 4.2's CIFAR-style layout).

    A 3x3 stem at full resolution, one stage of ``blocks[s]`` :class:`BasicBlock` s per width
    (every stage after the first halves the resolution with a stride-2 first block), global
    average pooling and one linear classifier. The defaults (widths 32-64-128-256, one block
    per stage: a "ResNet-10") have 1,228,394 parameters for 10 classes -- large enough that a
    step's backward takes longer than all-reducing its 4.9 MB of gradients, which is what
    makes data-parallel sites pay (Li et al. 2020, section 3.2.4) -- and run on 28x28
    (Fashion-MNIST: 28, 14, 7, 4 pixels per stage) as on 8x8 (digits: 8, 4, 2, 1).

    Normalisation: ``norm="group"`` (default) is GroupNorm with 8 groups (Wu & He 2018,
    "Group Normalization", ECCV): it normalises each example on its own and has no buffers,
    so a K-worker site computes exactly what one worker computes with the same global batch
    and there are no running statistics to keep consistent across workers. ``norm="batch"``
    is BatchNorm as in He et al. (2016); its statistics then come from each worker's slice of
    the batch and its running-stat buffers differ across workers unless they are broadcast
    from worker 0 before every step (DDP ``broadcast_buffers=True``, Li et al. 2020 section
    4.1; :class:`clients.buckets.GradReducer` does it when given ``buffers=``).

    References
    ----------
    .. [He2016] K. He, X. Zhang, S. Ren, J. Sun. "Deep Residual Learning for Image
       Recognition". CVPR 2016.
    """

    def __init__(
        self,
        input_shape: tuple[int, int, int],
        num_classes: int,
        *,
        widths: tuple[int, ...] = (32, 64, 128, 256),
        blocks: tuple[int, ...] = (1, 1, 1, 1),
        norm: str = "group",
    ) -> None:
        super().__init__()
        if norm not in ("group", "batch"):
            raise ConfigError(
                explain("norm", norm, "must be 'group' or 'batch'", "pass one of those")
            )
        if len(widths) != len(blocks) or not widths or min(blocks) < 1:
            raise ConfigError(
                explain(
                    "blocks",
                    blocks,
                    f"need one count >= 1 per width {widths}",
                    "pass as many block counts as widths",
                )
            )

        def make_norm(c: int) -> nn.Module:
            return nn.GroupNorm(min(8, c), c) if norm == "group" else nn.BatchNorm2d(c)

        c = input_shape[0]
        self.stem = nn.Sequential(
            nn.Conv2d(c, widths[0], 3, padding=1, bias=False), make_norm(widths[0]), nn.ReLU()
        )
        layers: list[nn.Module] = []
        c_in = widths[0]
        for s, (width, count) in enumerate(zip(widths, blocks, strict=True)):
            for b in range(count):
                layers.append(BasicBlock(c_in, width, 2 if s > 0 and b == 0 else 1, make_norm))
                c_in = width
        self.stages = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)
        for m in self.modules():  # as torchvision's ResNet (He et al. 2015, "Delving Deep")
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))
        return out


def _resnet(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """The reference ResNet of :class:`ResNet` (GroupNorm, 1.23M parameters)."""
    return ResNet(input_shape, num_classes)


def wide_width(input_shape: tuple[int, int, int], num_classes: int, params: int) -> int:
    """Hidden width of the ``wide`` model with at least ``params`` parameters.

    The model is ``Flatten -> Linear(d, h) -> ReLU -> Linear(h, c)`` with ``d`` inputs and
    ``c`` classes: ``h (d + 1 + c) + c`` parameters, so ``h = ceil((params - c) / (d + 1 +
    c))`` (at least 1). On digits (8x8, 10 classes) 100M parameters take ``h = 1,333,334``.
    """
    c_in, h, w = input_shape
    d = c_in * h * w
    return max(1, -(-(int(params) - num_classes) // (d + 1 + num_classes)))


def _wide(input_shape: tuple[int, int, int], num_classes: int,
          params: int = WIDE_DEFAULT_PARAMS) -> nn.Module:
    """The synthetic large model (see :func:`wide_width`): a two-layer perceptron whose
    hidden layer holds nearly all of ``params``; it trains like the ``mlp`` (a few steps per
    round are enough for a server-side memory run) and costs ~2 x params FLOPs per example."""
    c, h, w = input_shape
    width = wide_width(input_shape, num_classes, params)
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, width), nn.ReLU(),
                         nn.Linear(width, num_classes))


MODELS: dict[str, Callable[[tuple[int, int, int], int], nn.Module]] = {
    "mlp": _mlp,
    "2nn": _two_nn,
    "cnn": _cnn,
    "logreg": _logreg,
    "resnet": _resnet,
    "wide": _wide,
}


def build_model(
    name: str, input_shape: tuple[int, int, int], num_classes: int, *, seed: int | None = None,
    params: int | None = None,
) -> nn.Module:
    """Build a model by name; with ``seed`` its initial weights are reproducible.

    ``params`` sets the parameter count of the ``wide`` model (``model.params``); the other
    models have a fixed size and refuse it.
    """
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
    if params is not None and key != "wide":
        raise ConfigError(explain("model.params", params,
                                  f"sets the size of the 'wide' model only, not of {key!r}",
                                  "leave model.params unset, or use model.name = 'wide'"))
    if params is not None and (isinstance(params, bool) or not isinstance(params, int)
                               or params < 1):
        raise ConfigError(explain("model.params", params, "must be an int >= 1",
                                  "give the wide model's parameter count, e.g. 100000000"))

    def make() -> nn.Module:
        if key == "wide" and params is not None:
            return _wide(input_shape, num_classes, params)
        return MODELS[key](input_shape, num_classes)

    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return make()
    return make()


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
