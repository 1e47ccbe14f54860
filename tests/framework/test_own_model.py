"""A user's own model and data, defined only in this file, through fedagg's public API.

The model (:class:`TinyNet`) and the data set (:class:`Blobs`, a map-style torch ``Dataset``
of dict samples) exist nowhere in fedagg. ``clients.make_client_app(Task(...))`` and
``server.app.make_app(cfg, model_fn=..., evaluate_fn=...)`` run them with 2 workers per site,
TopK + error feedback on a public support and secure aggregation, end to end on Flower's
simulation engine; the test also covers per-shard DataLoaders (DDP style), a custom train
step, and process-mode workers importing this module.
"""

from __future__ import annotations

import sys
from typing import Any

import cloudpickle
import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from clients import SiteSettings, make_client_app
from clients.site import run_site
from clients.worker import WorkerJob
from fedagg.config import SiteConfig, load_config
from fedagg.task import (
    SiteData,
    SiteInfo,
    StepContext,
    Task,
    TrainSettings,
    get_weights,
    set_weights,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's actors get it by value

FEATURES, CLASSES = 12, 4


class TinyNet(nn.Module):
    """The user's model."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Blobs(Dataset):  # type: ignore[type-arg]
    """The user's data: Gaussian blobs, one per class; samples are dicts."""

    def __init__(self, n: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        centres = np.random.default_rng(123).normal(size=(CLASSES, FEATURES)) * 1.5
        self.y = rng.integers(0, CLASSES, size=n)
        self.x = (centres[self.y] + rng.normal(size=(n, FEATURES))).astype(np.float32)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.from_numpy(self.x[i]), "y": int(self.y[i])}


def site_data(site: SiteInfo) -> SiteData:
    """The user's data function: a training split and a held-out split per site."""
    return SiteData(train=Blobs(120, seed=site.partition_id),
                    eval=Blobs(40, seed=100 + site.partition_id))


def evaluate_global(arrays: Any) -> tuple[float, float]:
    """Centralized evaluation on a test set only the server has."""
    from strategies.wire import record_to_arrays

    model = TinyNet()
    set_weights(model, record_to_arrays(arrays)[1])
    test = Blobs(400, seed=999)
    with torch.no_grad():
        out = model(torch.from_numpy(test.x))
        loss = float(nn.functional.cross_entropy(out, torch.from_numpy(test.y)))
        acc = float((out.argmax(1).numpy() == test.y).mean())
    return loss, acc


TASK = Task(model=TinyNet, data=site_data)


@pytest.mark.flower
@pytest.mark.slow
def test_own_model_two_workers_topk_ef_secure_on_the_simulation_engine(tmp_path: Any) -> None:
    from flwr.simulation import run_simulation

    from server.app import make_app

    cfg = load_config(None, ["run.sites=3", "run.rounds=3", "site.workers=2",
                             "train.local_epochs=2", "train.batch_size=16", "train.lr=0.2",
                             "strategy.secure=true", "compression.up=topk:0.2+ef",
                             "compression.support=random", f"run.output_dir={tmp_path}"])
    records: list[dict[str, Any]] = []
    run_simulation(server_app=make_app(cfg, tmp_path / "run", on_round=records.append,
                                       model_fn=TinyNet, evaluate_fn=evaluate_global),
                   client_app=make_client_app(TASK), num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"log_to_driver": False,
                                                 "include_dashboard": False}})
    assert len(records) == 4, records
    assert all(r["model_updated"] for r in records[1:])
    assert all(r["secagg_counted"] == 3 for r in records[1:])  # every site in the masked sum
    accs = [r["accuracy"] for r in records]
    assert accs[-1] > accs[0] + 0.2, accs  # 4 classes: chance is 0.25


def _job(task: Task, workers: int, mode: str = "inprocess", **config: Any
         ) -> tuple[WorkerJob, SiteConfig]:
    torch.manual_seed(0)
    w0 = get_weights(TinyNet())
    settings = TrainSettings(epochs=2, batch_size=16, lr=0.1, seed=3, server_round=1,
                             config=config)
    return (WorkerJob(task=task, site=SiteInfo(0, 3, name="own"), settings=settings,
                      weights=w0),
            SiteConfig(workers=workers, mode=mode, worker_timeout=60.0))  # type: ignore[arg-type]


def _delta(res: Any, job: WorkerJob) -> np.ndarray:
    return np.concatenate([(a - b).ravel() for a, b in zip(res.weights, job.weights,
                                                           strict=True)])


def test_two_workers_equal_one_on_the_users_dataset() -> None:
    one = run_site(*_job(TASK, 1))
    job, site = _job(TASK, 2)
    two = run_site(job, site)
    d1, d2 = _delta(one, job), _delta(two, job)
    assert np.linalg.norm(d1) > 1e-3
    assert np.linalg.norm(d1 - d2) / np.linalg.norm(d1) < 1e-5
    assert one.num_examples == two.num_examples == 120


def shard_loaders(site: SiteInfo) -> SiteData:
    """DDP style: one DataLoader per worker shard (the user's own sampler)."""
    data = Blobs(120, seed=site.partition_id)

    def loader(rank: int, world: int) -> DataLoader:  # type: ignore[type-arg]
        idx = list(range(rank, len(data), world))
        return DataLoader(torch.utils.data.Subset(data, idx), batch_size=8, shuffle=False)

    return SiteData(train_loader=loader, num_examples=len(data))


def l1_step(model: nn.Module, batch: Any, ctx: StepContext) -> torch.Tensor:
    """A custom step: cross-entropy plus an L1 penalty the round's config sets."""
    out = nn.functional.cross_entropy(model(batch["x"]), batch["y"])
    lam = float(ctx.config.get("l1", 0.0))
    return out + lam * sum(p.abs().sum() for p in model.parameters())


def test_shard_loaders_and_a_custom_step_with_two_workers() -> None:
    task = Task(model=TinyNet, data=shard_loaders, train_step=l1_step)
    plain = run_site(*_job(task, 2))
    penalised = run_site(*_job(task, 2, l1=0.05))
    assert plain.num_examples == 120 and plain.metrics["workers"] == 2
    assert plain.metrics["steps"] == 2 * 8  # ceil(60 / 8) steps per epoch per worker shard
    norm = lambda r: sum(float(np.abs(w).sum()) for w in r.weights)  # noqa: E731
    assert norm(penalised) < norm(plain)  # the step saw the round's config key


@pytest.mark.slow
@pytest.mark.gloo
def test_process_mode_workers_import_the_users_task() -> None:
    inproc = run_site(*_job(TASK, 2))
    job, site = _job(TASK, 2, mode="process")
    proc = run_site(job, site)
    d_in, d_pr = _delta(inproc, job), _delta(proc, job)
    assert np.linalg.norm(d_in - d_pr) / np.linalg.norm(d_in) < 1e-5


def test_an_unpicklable_task_is_refused_for_process_mode_with_the_fix() -> None:
    from fedagg.errors import ConfigError

    task = Task(model=lambda: TinyNet(), data=site_data)
    with pytest.raises(ConfigError, match="module level"):
        run_site(*_job(task, 2, mode="process"))


def test_task_factory_sees_the_sites_settings() -> None:
    from flwr.app import Context, Message, RecordDict

    from server.runner import client_config

    seen: list[int] = []

    def factory(settings: SiteSettings) -> Task:
        seen.append(settings.cfg.train.local_epochs)
        return TASK

    app = make_client_app(factory)
    cfg = load_config(None, ["train.local_epochs=1"])
    torch.manual_seed(0)
    from strategies.wire import arrays_to_record

    model = TinyNet()
    msg = Message(RecordDict({"arrays": arrays_to_record(get_weights(model),
                                                         list(model.state_dict())),
                              "config": client_config(cfg)}), dst_node_id=1,
                  message_type="evaluate")
    reply = app(msg, Context(run_id=1, node_id=1, node_config={"partition-id": 0,
                                                               "num-partitions": 3},
                             state=RecordDict(), run_config={}))
    assert not reply.has_error(), reply.error if reply.has_error() else None
    m = reply.content.metric_records["metrics"]
    assert m["num-examples"] == 40 and 0.0 <= m["eval_acc"] <= 1.0  # the held-out split
    assert seen == [1]


def scaled_hook(state: Any, bucket: Any) -> torch.Tensor:
    """A DDP-style comm hook: scale, fedagg's all-reduce, unscale (records what it saw)."""
    state.append((bucket.index, bucket.world_size, bucket.buffer.numel()))
    tmp = bucket.buffer * 4.0
    bucket.reduce(tmp)
    return tmp / 4.0


def test_a_comm_hook_replaces_the_all_reduce_and_gives_the_same_update() -> None:
    seen: list[tuple[int, int, int]] = []
    hooked = Task(model=TinyNet, data=site_data, comm_hook=scaled_hook, hook_state=seen)
    plain = run_site(*_job(TASK, 2))
    job, site = _job(hooked, 2)
    with_hook = run_site(job, site)
    n_params = sum(p.numel() for p in TinyNet().parameters())
    assert seen and {s[1] for s in seen} == {2}
    assert sum(s[2] for s in seen) == n_params * 2 * plain.metrics["steps"]  # 2 workers
    d0, d1 = _delta(plain, job), _delta(with_hook, job)
    assert np.linalg.norm(d0 - d1) / np.linalg.norm(d0) < 1e-5
