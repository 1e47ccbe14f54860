"""Shared test helpers (real Flower objects; nothing mocked)."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Error, Message, Metadata, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")

# Flower sets the run id when it starts a ServerApp; unit tests that build instruction
# messages outside a run set one themselves.
TaskIdentity.run_id = 1
TaskIdentity.node_id = 0
TaskIdentity.task_id = 1


_PLAN_RUNNER_READY = False


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Build the collectives' C++ plan runner before the first selected test that needs it.

    Tests marked ``gloo`` start torch.distributed processes whose all-reduce runs on the
    runner; built inside them, the compiler (about a minute on 2 cores, the first time) would
    run inside their communication timeout, so it is built here, in the pytest process, in the
    test's setup. Only those tests need it: the fast lane (``-m "not slow"``, no ``gloo``
    test) never compiles it. Cached by torch afterwards; with no compiler this logs a warning
    and the tests that require the runner fail with the build error.
    """
    global _PLAN_RUNNER_READY
    if _PLAN_RUNNER_READY or item.get_closest_marker("gloo") is None:
        return
    _PLAN_RUNNER_READY = True
    from fedagg.collectives import plan_runner

    if not plan_runner.disabled():
        plan_runner.load()


def process_cmdlines() -> dict[int, str]:
    """``{pid: command line}`` of every live process other than this one (from /proc).

    Tests use it to find the processes they started (matched by a private temp path in the
    command line) and to check that none are left behind.
    """
    out: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                out[int(d.name)] = (
                    (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
            except OSError:
                continue
    return out


def reply_message(
    node_id: int,
    content: RecordDict | None = None,
    *,
    error: str | None = None,
    message_type: str = "train",
    group_id: str = "",
) -> Message:
    """A reply as the server receives it from ``node_id`` (real Message + Metadata)."""
    md = Metadata(
        run_id=1,
        message_id=uuid.uuid4().hex,
        src_node_id=node_id,
        dst_node_id=0,
        reply_to_message_id=uuid.uuid4().hex,
        group_id=group_id,
        created_at=time.time(),
        ttl=3600.0,
        message_type=message_type,
    )
    if error is not None:
        return Message(error=Error(code=0, reason=error), metadata=md)
    return Message(content=content if content is not None else RecordDict(), metadata=md)


def train_reply(
    node_id: int,
    arrays: list[np.ndarray],
    num_examples: float,
    keys: list[str] | None = None,
    **metrics: float,
) -> Message:
    """A train reply carrying ``arrays`` and ``num-examples``."""
    names = keys or [str(i) for i in range(len(arrays))]
    rec = ArrayRecord(
        {k: Array(np.ascontiguousarray(a)) for k, a in zip(names, arrays, strict=True)}
    )
    return reply_message(
        node_id,
        RecordDict(
            {"arrays": rec, "metrics": MetricRecord({"num-examples": num_examples, **metrics})}
        ),
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group heavy tests for ``pytest -n 2 --dist loadgroup`` (see pyproject addopts).

    Flower simulation runs (each starts a Ray cluster) run one after another in one worker,
    deployment tests (real SuperLink / SuperNodes, mostly waiting on 3 s polls) in another, and
    the kill / resume tests share their module fixture in a third group; everything else is
    spread freely.
    """
    for item in items:
        if item.get_closest_marker("deploy"):
            item.add_marker(pytest.mark.xdist_group("deploy"))
        elif item.get_closest_marker("flower"):
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif item.path.name == "test_resume.py":
            item.add_marker(pytest.mark.xdist_group("resume"))


GUARDED = {"max_weight_ratio": 10.0, "norm_outlier_factor": 10.0, "isolate_replies": True}
"""fedagg's protections as ``fedagg simulate`` turns them on (the run config's defaults); a
FedAvg built by hand has them off, as Flower's."""


def guarded_fedavg(**kwargs: object) -> object:
    """fedagg's FedAvg with the run config's protections on (``kwargs`` win), its metrics
    averaged as in fedagg's runs (identifiers and broken keys left out)."""
    from strategies.fedavg import FedAvg
    from strategies.metrics import site_metrics_mean

    return FedAvg(**{**GUARDED, "train_metrics_aggr_fn": site_metrics_mean,  # type: ignore[arg-type]
                     "evaluate_metrics_aggr_fn": site_metrics_mean, **kwargs})
