"""The fedagg ClientApp: one site.

``train``  loads the site's data (simulation: its partition; deployment: ``node_config``),
           trains ``train.local_epochs`` epochs from the global model and replies with the new
           model and ``num-examples``. Sites with several workers (``site.workers > 1``) train
           as one data-parallel job (:mod:`clients.site`) and still reply once.
``evaluate`` evaluates the global model on the site's data.

Upward encoders (compression, secure-aggregation masking) are ClientApp mods listed in
:data:`MODS`; each acts only when the run config asks for it.
"""

from __future__ import annotations

import logging
from typing import Any

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients.local import SiteUpdate, inject_faults, local_data, local_model, train_single
from clients.settings import SiteSettings
from fedagg.training import evaluate as evaluate_model
from strategies._records import arrays_to_record, record_to_arrays

__all__ = ["MODS", "app", "compute_update"]

_log = logging.getLogger(__name__)

MODS: list = []  # type: ignore[type-arg]
# Flower runs MODS[0] outermost: the last mod in this list post-processes the reply first.
# Compression must come before secure masking (masking is the last step before upload), so
# the secure-aggregation mod goes BEFORE compression_mod here: MODS.insert(0, secure_mod).
from clients.mods import compression_mod  # noqa: E402

MODS.append(compression_mod)
from clients.secure import register as register_secure  # noqa: E402
from clients.secure import secure_mod  # noqa: E402

MODS.insert(0, secure_mod)  # outermost: masking is the last step before the upload


def compute_update(settings: SiteSettings, weights: list) -> SiteUpdate:  # type: ignore[type-arg]
    """Train the site (one worker, or K workers as one data-parallel job)."""
    if settings.cfg.site.workers > 1:
        from clients.site import run_site  # multi-worker sites

        return run_site(settings, weights)
    return train_single(settings, weights)


app = ClientApp(mods=MODS)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train on the site's data and reply with the model and ``num-examples``."""
    settings = SiteSettings.from_message(msg, context)
    inject_faults(settings, "train")
    keys, weights = record_to_arrays(msg.content.array_records["arrays"] if "arrays" in msg.content.array_records
                                     else next(iter(msg.content.array_records.values())))
    update = compute_update(settings, weights)
    metrics: dict[str, Any] = {"num-examples": update.num_examples, "partition-id": settings.partition_id,
               "server-round": settings.server_round,
               **update.metrics}
    content = RecordDict({"arrays": arrays_to_record(update.weights, keys),
                          "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the global model on the site's data."""
    settings = SiteSettings.from_message(msg, context)
    arrays: ArrayRecord = next(iter(msg.content.array_records.values()))
    _, weights = record_to_arrays(arrays)
    x, y, shape, classes = local_data(settings)
    model = local_model(settings, shape, classes, weights)
    loss, acc = evaluate_model(model, x, y)
    content = RecordDict({"metrics": MetricRecord({"num-examples": len(y), "eval-loss": loss,
                                                   "eval-acc": acc})})
    return Message(content=content, reply_to=msg)


register_secure(app)  # query.secagg_advertise / secagg_share_keys / secagg_unmask
