"""fedagg's ClientApp: a site running a :class:`~fedagg.task.Task` (the user's, or the built-in).

:func:`make_client_app` builds a Flower ``ClientApp`` for a task; ``clients.app:app`` (the
app of ``flwr run .`` and ``fedagg simulate``) is the built-in task of the run config
(:func:`fedagg.builtin.builtin_task`: ``model.name`` on ``data.dataset``).

``train``
    trains the task from the global model for ``train.local_epochs`` (one worker, or
    ``site.workers`` as one data-parallel job, :mod:`clients.site`) and replies as Flower's
    examples do — ``"arrays"`` and ``"metrics"`` (``num-examples``, ``train_loss``, ...) — or,
    when the server's strategy asks for it (:class:`strategies.Compressed`,
    :class:`strategies.SecureAggregation`), with the compressed or masked upload
    (:mod:`clients.protocol`). Works with any Flower strategy: config keys fedagg does not
    know (FedProx's ``proximal-mu``, ...) reach the task's step (``StepContext.config``).
``query.warmup``
    loads the built-in task's model and the site's data and answers with an empty reply: the
    server wakes Flower's simulation engine with it before round 1, so that the engine's
    start-up is not counted in round 1's time.
``evaluate``
    evaluates the global model on the site's *held-out* split (``SiteData.eval``) and
    replies ``eval_loss``, ``eval_acc`` and ``num-examples``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import Mod

from clients.faults import inject_faults, worker_fault
from clients.protocol import (
    StageHook,
    answer_carry,
    answer_secagg,
    encode_reply,
    fedagg_mod,
    parse_round,
)
from clients.settings import SiteSettings
from clients.site import run_site
from clients.worker import WorkerJob
from fedagg.builtin import builtin_task
from fedagg.errors import DataError, ProtocolError, explain
from fedagg.task import EvalContext, SiteData, Task, fetch, set_weights
from strategies.wire import SECAGG_WIRE, arrays_to_record, record_to_arrays

__all__ = ["TaskSource", "app", "make_client_app"]

_log = logging.getLogger(__name__)

TaskSource = Task | Callable[[SiteSettings], Task] | None
"""A task, a function of the site's settings returning one, or None (the built-in task)."""

EVAL_BATCH = 1024


def _task(source: TaskSource, settings: SiteSettings) -> Task:
    if isinstance(source, Task):
        return source
    if source is None:
        return builtin_task(settings.cfg, data_path=settings.node.data_path)
    return source(settings)


def _model(msg: Message) -> tuple[list[str], list[np.ndarray]]:
    recs = msg.content.array_records
    if "arrays" in recs:
        return record_to_arrays(recs["arrays"])
    if len(recs) != 1:
        raise ProtocolError(explain("message array_records", sorted(recs),
                                    "must hold the global model (one ArrayRecord, e.g. 'arrays')",
                                    "send the model as ArrayRecord 'arrays'"))
    return record_to_arrays(next(iter(recs.values())))


def _eval_batches(data: SiteData) -> Iterable[Any]:
    if data.eval_loader is not None:
        return data.eval_loader()
    ds = data.eval
    assert ds is not None

    def gen() -> Iterator[Any]:
        n = len(ds)  # type: ignore[arg-type]
        for start in range(0, n, EVAL_BATCH):
            yield fetch(ds, np.arange(start, min(start + EVAL_BATCH, n), dtype=np.int64))

    return gen()


def make_client_app(task: TaskSource = None, *, mods: Sequence[Mod] = ()) -> ClientApp:
    """A Flower ClientApp running ``task`` with every fedagg site feature.

    Parameters
    ----------
    task : Task, callable or None
        The user's :class:`~fedagg.task.Task`; or ``settings -> Task`` (e.g. to pick a model
        from the run config); ``None``: fedagg's built-in models and data sets.
    mods : sequence of Flower mods
        Extra client mods (e.g. Flower's ``fixedclipping_mod``). They run inside
        :func:`~clients.protocol.fedagg_mod`, which is then added first, so they see plain
        messages and replies and act before compression and masking.

    Examples
    --------
    ::

        from fedagg.task import Task
        from clients import make_client_app
        app = make_client_app(Task(model=Net, data=load_site_data))
    """
    extra = list(mods)
    client_app = ClientApp(mods=[fedagg_mod, *extra]) if extra else ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        """Train the site from the global model; reply with the model or the upload."""
        rnd = None if extra else parse_round(msg)  # with mods, fedagg_mod did this already
        settings: SiteSettings | None = None

        def hook(stage: str) -> None:
            inject_faults(settings or SiteSettings.from_message(msg, context), stage)

        on_stage: StageHook = hook
        if rnd is not None and not rnd.trains:
            return answer_secagg(msg, context, rnd, on_stage)
        if rnd is not None and rnd.carry is not None and rnd.carry.carries:
            return answer_carry(msg, context, rnd, on_stage)
        settings = SiteSettings.from_message(msg, context)
        inject_faults(settings, "train")
        keys, weights = (rnd.keys, rnd.sent) if rnd is not None else _model(msg)
        job = WorkerJob(task=_task(task, settings), site=settings.site_info(),
                        settings=settings.train_settings(), weights=weights,
                        fault=worker_fault(settings))
        result = run_site(job, settings.cfg.site, name=settings.name,
                          server_round=settings.server_round,
                          owner=(context.run_id, context.node_id),
                          worker_service=settings.node.worker_service,
                          service_token=settings.node.worker_service_token)
        metrics: dict[str, Any] = {"num-examples": result.num_examples,
                                   "partition-id": settings.partition_id,
                                   "server-round": settings.server_round, **result.metrics}
        if rnd is not None:
            return encode_reply(msg, context, rnd, result.weights, float(result.num_examples),
                                metrics, on_stage)
        content = RecordDict({"arrays": arrays_to_record(result.weights, keys),
                              "metrics": MetricRecord(metrics)})
        return Message(content=content, reply_to=msg)

    @client_app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        """Evaluate the global model on the site's held-out split."""
        settings = SiteSettings.from_message(msg, context)
        t = _task(task, settings)
        _, weights = _model(msg)
        data = t.data(settings.site_info())
        if not data.has_eval:
            raise DataError(explain(f"{settings.name}: held-out split", "none",
                                    "client-side evaluation needs SiteData.eval (or eval_loader)",
                                    "set data.eval_fraction > 0 (built-in data), or return an "
                                    "eval split from the task's data function"))
        model = t.model()
        set_weights(model, weights)
        ctx = EvalContext(config=settings.config, server_round=settings.server_round)
        metrics: dict[str, Any] = dict(t.evaluation()(model, _eval_batches(data), ctx))
        metrics.setdefault("num-examples", float(len(data.eval)) if data.eval is not None  # type: ignore[arg-type]
                           else 0.0)
        metrics["partition-id"] = settings.partition_id
        return Message(content=RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    def refuse_v1(msg: Message, context: Context) -> Message:
        raise ProtocolError(explain(
            "message type", msg.metadata.message_type,
            "is fedagg 0.1's secure-aggregation wire (version 1); this site speaks version "
            f"{SECAGG_WIRE}, where every stage is a train message", "run the same fedagg version on the server "
            "and the sites"))

    @client_app.query("warmup")
    def warmup(msg: Message, context: Context) -> Message:
        """The server's engine warm-up before round 1 (:func:`server.runner.engine_warmup`):
        the built-in task's model and this site's data are loaded (both cached in the process);
        a user's task is only built (its data function may not cache). A first torch
        optimizer is made for any task: torch imports its compiler stack then (~1.5 s)."""
        settings = SiteSettings.from_message(msg, context)
        t = _task(task, settings)
        if task is None:
            t.data(settings.site_info())
            t.model()
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        return Message(content=RecordDict(), reply_to=msg)

    for stage in ("secagg_advertise", "secagg_share_keys", "secagg_unmask"):
        client_app.query(stage)(refuse_v1)
    return client_app


app = make_client_app()
