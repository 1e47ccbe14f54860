"""Helpers for the compression Flower-layer tests: real Message / Context / RecordDict objects."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from strategies import Compressed, FedAvg
from strategies.wire import arrays_to_record, record_to_arrays

KEYS = ["w", "b"]

_WRAPPER_ARGS = ("up", "down", "support", "state_namespace", "max_update_norm")


def compressed_fedavg(**kwargs: object) -> Compressed:
    """``Compressed(FedAvg(...))`` sampling from any number of nodes (the tests' one-node grids)."""
    wrap = {k: kwargs.pop(k) for k in list(kwargs) if k in _WRAPPER_ARGS}
    inner = FedAvg(min_train_nodes=1, min_available_nodes=1, **kwargs)  # type: ignore[arg-type]
    return Compressed(inner, **wrap)  # type: ignore[arg-type]
SHAPES = [(200, 50), (50,)]


class Grid:
    """Just enough of a Grid for configure_train's sampling (node ids only)."""

    def __init__(self, nodes: Sequence[int]) -> None:
        self.nodes = list(nodes)

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)


def site_context(node_id: int, partition: int = 0) -> Context:
    """A site's Context as Flower keeps it (empty state at first)."""
    return Context(run_id=1, node_id=node_id, node_config={"partition-id": partition},
                   state=RecordDict(), run_config={})


def model(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


def send(strategy: Compressed, arrays: list[np.ndarray], rnd: int, nodes: Sequence[int],
         config: ConfigRecord | None = None) -> dict[int, Message]:
    """configure_train -> {node id: train message}."""
    msgs = strategy.configure_train(rnd, arrays_to_record(arrays, KEYS), config or ConfigRecord(),
                                    Grid(nodes))  # type: ignore[arg-type]
    return {m.metadata.dst_node_id: m for m in msgs}


Handler = Callable[[Message, Context], Message]


def handler_adding(delta: list[np.ndarray], num_examples: int = 10,
                   seen: list[list[np.ndarray]] | None = None) -> Handler:
    """A train handler that replies ``received + delta`` with full weights (like clients.app)."""

    def handle(msg: Message, ctx: Context) -> Message:
        keys, w = record_to_arrays(msg.content.array_records["arrays"])
        if seen is not None:
            seen.append(w)
        out = [a + d for a, d in zip(w, delta, strict=True)]
        content = RecordDict({"arrays": arrays_to_record(out, keys),
                              "metrics": MetricRecord({"num-examples": num_examples,
                                                       "partition-id": ctx.node_config["partition-id"],
                                                       "train-loss": 1.0})})
        return Message(content=content, reply_to=msg)

    return handle


def ef_residual(ctx: Context, ns: str = "") -> list[np.ndarray]:
    rec: ArrayRecord = ctx.state.array_records["fedagg.ef" + ns]
    return record_to_arrays(rec)[1]
