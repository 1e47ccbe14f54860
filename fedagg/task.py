"""Bring your own training: what a site trains, on which data, with which loss and step.

A :class:`Task` is the public API between a user's PyTorch code and fedagg's site runtime::

    task = Task(model=Net,                         # a factory: () -> torch.nn.Module
                data=load_site_data,               # SiteInfo -> SiteData (train / eval splits)
                loss=torch.nn.functional.cross_entropy,
                optimizer=lambda params, s: torch.optim.Adam(params, lr=s.lr))

``clients.make_client_app(task)`` turns it into a Flower ``ClientApp`` with every site feature:
K local workers (threads or processes) averaging gradients after every step through the
site's bucketed all-reduce, gradient accumulation, a bf16 wire, and the upload pipeline
(compression with error feedback, secure masking). fedagg's own models and data sets are a
Task too (:mod:`fedagg.builtin`).

Data. :class:`SiteData` holds either map-style torch ``Dataset`` s — then fedagg draws the
*global* batches of ``train.batch_size`` examples in a seeded order and gives worker ``k`` of
``K`` the ``k``-th slice of each, so K workers compute exactly the step one worker would
(Goyal et al. 2017, "Accurate, Large Minibatch SGD", section 2) — or a function returning one
``DataLoader`` per worker shard (``train_loader(rank, world_size)``), as with PyTorch DDP and
a ``DistributedSampler``; then the workers' gradients are averaged (DDP's semantics, Li et
al. 2020, VLDB, section 3.2) and every worker runs as many steps as the shortest shard.

Steps. The default step is ``loss(model(x), y)`` on a batch ``(x, y)`` (plus FedProx's
proximal term ``mu/2 ||w - w_global||^2`` when the round's config carries ``proximal-mu``,
Li et al. 2020, "Federated Optimization in Heterogeneous Networks", eq. 2). A custom
``train_step(model, batch, ctx)`` returns the mean loss of its batch; fedagg scales it, runs
backward, reduces the gradients and steps the optimizer. ``ctx`` (:class:`StepContext`)
carries the round's whole config (every key the server sent, fedagg's or not), the global
model as received, the round, the worker's rank and the device.

Process mode (``site.mode = "process"``) builds the model and data inside every worker
process: ``model``, ``data``, ``loss``, ``optimizer``, ``train_step`` and ``evaluate`` must be
picklable (module-level functions or classes, as with ``torch.multiprocessing``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset, default_collate

from fedagg.errors import ConfigError, DataError, explain

__all__ = [
    "EvalContext",
    "SiteData",
    "SiteInfo",
    "StepContext",
    "Task",
    "TrainSettings",
    "batch_size_of",
    "default_evaluate",
    "default_optimizer",
    "default_train_step",
    "fetch",
    "get_weights",
    "global_batches",
    "proximal_term",
    "set_weights",
    "to_device",
]


@dataclass(frozen=True)
class SiteInfo:
    """Who a site is, for its data function.

    Attributes
    ----------
    partition_id, num_partitions : int
        The site's partition in simulation (Flower's ``node_config``), or as the operator set
        it in deployment (``--node-config "partition-id=0 num-partitions=3"``).
    node_id : int
        Flower's node id.
    name : str
        Site name for logs (``site-name`` in the node config).
    node_config : mapping
        The SuperNode's whole ``node_config`` (``data-path`` and the like).
    run_config : mapping
        The run config as this site sees it (flat keys).
    seed : int
        ``run.seed``.
    """

    partition_id: int = 0
    num_partitions: int = 1
    node_id: int = 0
    name: str = "site"
    node_config: Mapping[str, Any] = field(default_factory=dict)
    run_config: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0


@dataclass
class SiteData:
    """A site's data: training data (required) and a held-out evaluation split.

    Give ``train`` (a map-style ``Dataset``, batched by fedagg) or ``train_loader`` (a
    function ``(rank, world_size) -> iterable of batches``, one shard per worker); likewise
    ``eval`` or ``eval_loader`` (``() -> iterable``). ``num_examples`` is the site's weight
    (default: ``len(train)``, or the examples the workers saw in one epoch).
    """

    train: Dataset[Any] | None = None
    eval: Dataset[Any] | None = None
    train_loader: Callable[[int, int], Iterable[Any]] | None = None
    eval_loader: Callable[[], Iterable[Any]] | None = None
    num_examples: int | None = None

    def __post_init__(self) -> None:
        if (self.train is None) == (self.train_loader is None):
            raise ConfigError(explain("SiteData", "train / train_loader",
                                      "exactly one of them must be given",
                                      "pass a Dataset as train=..., or a function (rank, "
                                      "world_size) -> DataLoader as train_loader=..."))
        if self.eval is not None and self.eval_loader is not None:
            raise ConfigError(explain("SiteData", "eval / eval_loader",
                                      "at most one of them may be given", "drop one"))

    @property
    def has_eval(self) -> bool:
        """Whether the site has a held-out split."""
        return self.eval is not None or self.eval_loader is not None

    def train_size(self) -> int | None:
        """``num_examples``, or ``len(train)`` when the dataset has a length."""
        if self.num_examples is not None:
            return int(self.num_examples)
        if self.train is not None and hasattr(self.train, "__len__"):
            return len(self.train)
        return None


@dataclass(frozen=True)
class TrainSettings:
    """The round's training settings, as the optimizer factory and the step see them.

    Attributes
    ----------
    epochs, batch_size : int
        ``train.local_epochs`` and the global batch (``train.batch_size``).
    lr, momentum : float
        ``train.lr`` / ``train.momentum`` (a server's ``lr`` key sets ``lr``).
    seed : int
        Seed of the round's shuffling order (run seed, round and partition).
    server_round : int
        The round.
    config : mapping
        Every key of the round's config as the server sent it (fedagg's and others, e.g.
        Flower FedProx's ``proximal-mu``).
    """

    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.1
    momentum: float = 0.0
    seed: int = 0
    server_round: int = 0
    config: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepContext:
    """What a training step may use besides the model and the batch.

    Attributes
    ----------
    config : mapping
        The round's whole config (see :class:`TrainSettings`).
    global_params : sequence of torch.Tensor
        The global model's parameters as received this round (``model.parameters()`` order,
        on the device, no grad): FedProx's anchor.
    server_round, epoch, step : int
        Position in training.
    rank, world_size : int
        This worker and the site's number of workers.
    device : torch.device
        The worker's device.
    """

    config: Mapping[str, Any]
    global_params: Sequence[torch.Tensor]
    server_round: int = 0
    epoch: int = 0
    step: int = 0
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


@dataclass(frozen=True)
class EvalContext:
    """What an evaluation function may use: the round's config and the device."""

    config: Mapping[str, Any]
    server_round: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
TrainStep = Callable[[nn.Module, Any, StepContext], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter], TrainSettings], torch.optim.Optimizer]
EvaluateFn = Callable[[nn.Module, Iterable[Any], EvalContext], Mapping[str, float]]


def default_optimizer(params: Iterable[nn.Parameter], settings: TrainSettings
                      ) -> torch.optim.Optimizer:
    """Plain SGD with ``train.lr`` and ``train.momentum`` (Robbins & Monro 1951)."""
    return torch.optim.SGD(params, lr=settings.lr, momentum=settings.momentum)


def proximal_term(model: nn.Module, ctx: StepContext) -> torch.Tensor | None:
    """FedProx's ``mu/2 * ||w - w_global||^2`` when the config has ``proximal-mu > 0``.

    Li et al. 2020, "Federated Optimization in Heterogeneous Networks" (MLSys), eq. 2; the
    key is the one Flower's ``FedProx`` strategy sends (``proximal-mu``; ``proximal_mu``, the
    spelling of older Flower examples, is read too).
    """
    mu = ctx.config.get("proximal-mu", ctx.config.get("proximal_mu"))
    if not isinstance(mu, int | float) or isinstance(mu, bool) or not mu > 0:
        return None
    total = torch.zeros((), device=ctx.device)
    for p, g in zip(model.parameters(), ctx.global_params, strict=True):
        total = total + torch.sum((p - g) ** 2)
    return 0.5 * float(mu) * total


def _inputs_targets(batch: Any) -> tuple[Any, torch.Tensor]:
    if isinstance(batch, list | tuple) and len(batch) >= 2:
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        for xk, yk in (("x", "y"), ("img", "label"), ("image", "label"), ("input", "target")):
            if xk in batch and yk in batch:
                return batch[xk], batch[yk]
    raise DataError(explain("batch", type(batch).__name__,
                            "the default step takes (inputs, targets) pairs or a dict with "
                            "x/y, img/label, image/label or input/target",
                            "return such batches from the dataset, or give Task(train_step=...)"))


def default_train_step(loss: LossFn) -> TrainStep:
    """The default step: ``loss(model(x), y)`` (+ FedProx's proximal term when asked)."""
    return _DefaultStep(loss)


@dataclass(frozen=True)
class _DefaultStep:
    loss: LossFn

    def __call__(self, model: nn.Module, batch: Any, ctx: StepContext) -> torch.Tensor:
        x, y = _inputs_targets(batch)
        out = self.loss(model(x), y)
        prox = proximal_term(model, ctx)
        return out if prox is None else out + prox


def default_evaluate(loss: LossFn) -> EvaluateFn:
    """Mean loss over the evaluation batches, and the accuracy (arg-max of the outputs) when
    the task is a classification: ``[N, classes]`` outputs and integer targets. A regression
    (floating-point targets) gets ``eval_loss`` only, no ``eval_acc`` of 0."""
    return _DefaultEvaluate(loss)


@dataclass(frozen=True)
class _DefaultEvaluate:
    loss: LossFn

    @torch.no_grad()
    def __call__(self, model: nn.Module, batches: Iterable[Any], ctx: EvalContext
                 ) -> dict[str, float]:
        model.eval()
        total, correct, count = 0.0, 0, 0
        classification = True
        for batch in batches:
            x, y = _inputs_targets(to_device(batch, ctx.device))
            out = model(x)
            n = int(y.shape[0])
            total += float(self.loss(out, y)) * n
            if out.ndim == 2 and out.shape[1] > 1 and not torch.is_floating_point(y):
                correct += int((out.argmax(1) == y).sum())
            else:
                classification = False
            count += n
        result = {"eval_loss": total / max(count, 1), "num-examples": float(count)}
        if classification:
            result["eval_acc"] = correct / max(count, 1)
        return result


@dataclass(frozen=True)
class Task:
    """A user's training, as fedagg's sites run it.

    Parameters
    ----------
    model : callable
        ``() -> torch.nn.Module``; called once per worker (and per round). Its
        ``state_dict()`` order is the order of the arrays on the wire.
    data : callable
        ``SiteInfo -> SiteData``: the site's training data and held-out split.
    loss : callable
        ``(outputs, targets) -> mean loss`` of the default step and evaluation
        (default ``torch.nn.functional.cross_entropy``).
    optimizer : callable, optional
        ``(params, TrainSettings) -> torch.optim.Optimizer`` (default: SGD with ``train.lr``
        and ``train.momentum``). A new optimizer is made every round (Flower's convention:
        local optimizer state does not persist across rounds).
    train_step : callable, optional
        ``(model, batch, StepContext) -> mean loss of the batch`` replacing the default step.
    evaluate : callable, optional
        ``(model, batches, EvalContext) -> {"eval_loss": ..., "eval_acc": ..., ...}``
        replacing the default evaluation (mean loss, and accuracy for a classification:
        :func:`default_evaluate`); its keys are the metric names the sites report.
    comm_hook, hook_state : callable and object, optional
        A communication hook for the site's per-step gradient all-reduce, PyTorch DDP's
        ``register_comm_hook(state, hook)`` seam: ``hook(state, bucket) -> reduced tensor``,
        where ``bucket`` (``clients.reducer_comm.GradBucket``) holds the flat gradients of
        one bucket and ``bucket.reduce(tensor)`` is fedagg's own all-reduce (e.g. compress
        to fp16, reduce, decompress; Li et al. 2020, VLDB). ``None``: fedagg's all-reduce.
    """

    model: Callable[[], nn.Module]
    data: Callable[[SiteInfo], SiteData]
    loss: LossFn = torch.nn.functional.cross_entropy
    optimizer: OptimizerFactory | None = None
    train_step: TrainStep | None = None
    evaluate: EvaluateFn | None = None
    comm_hook: Callable[[Any, Any], Any] | None = None
    hook_state: Any = None

    def __post_init__(self) -> None:
        for name in ("model", "data", "loss"):
            if not callable(getattr(self, name)):
                raise ConfigError(explain(f"Task.{name}", type(getattr(self, name)).__name__,
                                          "must be callable", "pass a function or class"))

    def step(self) -> TrainStep:
        """The training step in use."""
        return self.train_step if self.train_step is not None else default_train_step(self.loss)

    def make_optimizer(self, params: Iterable[nn.Parameter], settings: TrainSettings
                       ) -> torch.optim.Optimizer:
        """The round's optimizer."""
        factory = self.optimizer or default_optimizer
        return factory(params, settings)

    def evaluation(self) -> EvaluateFn:
        """The evaluation function in use."""
        return self.evaluate if self.evaluate is not None else default_evaluate(self.loss)


# -- weights ----------------------------------------------------------------------------------
def get_weights(model: nn.Module) -> list[npt.NDArray[Any]]:
    """The model's ``state_dict`` as numpy arrays (copies, their own dtypes, CPU)."""
    return [t.detach().cpu().numpy().copy() for t in model.state_dict().values()]


def set_weights(model: nn.Module, weights: Sequence[npt.NDArray[Any]]) -> None:
    """Load arrays (``state_dict`` order) into ``model``, checking count and shapes.

    Values are cast to each tensor's dtype (a float64 array loads into a float32 parameter).

    Raises
    ------
    ConfigError
        Wrong number of arrays or a shape mismatch (names the tensor).
    """
    state = model.state_dict()
    if len(state) != len(weights):
        raise ConfigError(explain("weights", f"{len(weights)} arrays",
                                  f"the model has {len(state)} tensors",
                                  "send weights of the same model architecture"))
    new = {}
    for (k, ref), w in zip(state.items(), weights, strict=True):
        if tuple(np.shape(w)) != tuple(ref.shape):
            raise ConfigError(explain(f"weights[{k}]", tuple(np.shape(w)),
                                      f"must have shape {tuple(ref.shape)}",
                                      "send weights of the same model architecture"))
        new[k] = torch.as_tensor(np.asarray(w)).to(dtype=ref.dtype)
    model.load_state_dict(new)


# -- batches ----------------------------------------------------------------------------------
def global_batches(num_examples: int, batch_size: int, *, epoch: int, seed: int
                   ) -> Iterator[npt.NDArray[np.int64]]:
    """Index batches of one epoch in a seeded random order (the last batch may be short)."""
    order = np.random.default_rng([seed, epoch]).permutation(num_examples)
    for start in range(0, num_examples, batch_size):
        yield order[start:start + batch_size].astype(np.int64)


def fetch(dataset: Dataset[Any], idx: npt.NDArray[np.int64]) -> Any:
    """The batch of ``dataset`` at positions ``idx`` (tensor datasets are indexed at once)."""
    if isinstance(dataset, TensorDataset):
        ib = torch.from_numpy(np.ascontiguousarray(idx))
        return tuple(t[ib] for t in dataset.tensors)
    return default_collate([dataset[int(i)] for i in idx])


def to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors of a batch (tuple, list, dict or tensor) to ``device``."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def batch_size_of(batch: Any) -> int:
    """Number of examples in a batch (the first tensor's leading dimension)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    if isinstance(batch, Mapping):
        for v in batch.values():
            return batch_size_of(v)
    if isinstance(batch, list | tuple) and batch:
        return batch_size_of(batch[0])
    return 1
