"""A ClientApp in the shape of Flower's quickstart-pytorch example (Flower 1.42, Message API).

The same contract as the example: the CNN of PyTorch's 60-minute blitz on 3x32x32 images,
``msg.content["arrays"].to_torch_state_dict()`` in, SGD with momentum 0.9 at the server's
``msg.content["config"]["lr"]`` for ``context.run_config["local-epochs"]`` epochs on the
partition named by ``node_config["partition-id"] / ["num-partitions"]``, 80 / 20 train / test
split per partition, and replies ``{"arrays": ArrayRecord(model.state_dict()), "metrics":
{"train_loss", "num-examples"}}`` (evaluate: ``eval_loss``, ``eval_acc``, ``num-examples``).
Written here from Flower's documented Message-API pattern (the example's own file is not
copied into this repository); only the data loading differs: a small local data set
(scikit-learn's digits, upsampled to 3x32x32) instead of CIFAR-10 from the Hub, and a seeded
shuffle so two runs of the same round train identically (the comparisons need that).

fedagg features come from one mod: ``ClientApp(mods=[fedagg_mod])`` (:func:`with_fedagg`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    """Model (simple CNN adapted from 'PyTorch: A 60 Minute Blitz')."""

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
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


@functools.lru_cache(maxsize=1)
def _images() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0)[:, None]  # [n, 1, 8, 8]
    x = F.interpolate(x, size=(32, 32), mode="nearest").repeat(1, 3, 1, 1)
    return (x - 0.5) / 0.5, torch.from_numpy(d.target.astype(np.int64))


def load_data(partition_id: int, num_partitions: int, batch_size: int
              ) -> tuple[DataLoader, DataLoader]:  # type: ignore[type-arg]
    """IID partition ``partition_id`` of ``num_partitions``, 80 % train / 20 % test."""
    x, y = _images()
    x, y = x[:600], y[:600]  # a small local data set
    part = np.array_split(np.random.default_rng(42).permutation(len(y)), num_partitions)
    idx = torch.from_numpy(part[partition_id])
    n_test = len(idx) // 5
    test, train = idx[:n_test], idx[n_test:]
    shuffle = torch.Generator().manual_seed(1000 + partition_id)
    trainloader = DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size,
                             shuffle=True, generator=shuffle)
    testloader = DataLoader(TensorDataset(x[test], y[test]), batch_size=batch_size)
    return trainloader, testloader


def train_fn(net: nn.Module, trainloader: DataLoader, epochs: int, lr: float,  # type: ignore[type-arg]
             device: torch.device) -> float:
    """Train the model on the training set (the example's loop)."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test_fn(net: nn.Module, testloader: DataLoader, device: torch.device  # type: ignore[type-arg]
            ) -> tuple[float, float]:
    """Loss and accuracy on the test set."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for images, labels in testloader:
            outputs = net(images.to(device))
            loss += criterion(outputs, labels.to(device)).item()
            correct += int((torch.max(outputs.data, 1)[1] == labels.to(device)).sum().item())
    return loss / len(testloader), correct / len(testloader.dataset)  # type: ignore[arg-type]


def _run_config(context: Context, key: str, default: int) -> int:
    value = context.run_config.get(key, default)
    return int(value) if isinstance(value, int | float) else default


def make_app(mods: list | None = None) -> ClientApp:  # type: ignore[type-arg]
    """The quickstart ClientApp (optionally with client mods)."""
    app = ClientApp(mods=mods or [])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        """Train the model on local data."""
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        device = torch.device("cpu")
        partition_id = int(context.node_config["partition-id"])
        num_partitions = int(context.node_config["num-partitions"])
        batch_size = _run_config(context, "batch-size", 32)
        trainloader, _ = load_data(partition_id, num_partitions, batch_size)
        train_loss = train_fn(model, trainloader, _run_config(context, "local-epochs", 1),
                              float(msg.content["config"]["lr"]), device)
        model_record = ArrayRecord(model.state_dict())
        metrics = {"train_loss": train_loss, "num-examples": len(trainloader.dataset)}  # type: ignore[arg-type]
        content = RecordDict({"arrays": model_record, "metrics": MetricRecord(metrics)})
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        """Evaluate the model on local data."""
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        partition_id = int(context.node_config["partition-id"])
        num_partitions = int(context.node_config["num-partitions"])
        _, valloader = load_data(partition_id, num_partitions, _run_config(context, "batch-size", 32))
        eval_loss, eval_acc = test_fn(model, valloader, torch.device("cpu"))
        metrics = {"eval_loss": eval_loss, "eval_acc": eval_acc,
                   "num-examples": len(valloader.dataset)}  # type: ignore[arg-type]
        return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


app = make_app()


def with_fedagg() -> ClientApp:
    """The same app with fedagg's compression and secure aggregation: one mod, nothing else."""
    from clients import fedagg_mod

    return make_app([fedagg_mod])
