"""What a site knows for one message: fedagg's settings, the round's whole config, the node.

Sources, later ones win:

1. fedagg's defaults (:class:`fedagg.config.RunConfig`);
2. Flower's run config (``context.run_config``: ``[tool.flwr.app.config]`` of the app and
   ``flwr run --run-config``) — its fedagg keys (dotted, ``"train.lr"``; ``""`` = unset);
3. the message's ConfigRecord ``"config"``: fedagg's dotted keys as fedagg's server sends
   them, and the conventional keys of Flower's examples: ``lr`` -> ``train.lr``,
   ``local-epochs`` / ``local_epochs`` -> ``train.local_epochs``, ``batch-size`` /
   ``batch_size`` -> ``train.batch_size``, ``momentum`` -> ``train.momentum``;
4. the SuperNode's ``node_config`` for the site keys an operator sets (``workers``, ``mode``,
   ``algorithm``, ``data-path``, ``site-name``, the secure-aggregation floors
   ``secagg-threshold-floor`` / ``secagg-min-neighbours``; :class:`NodeConfig`).

Every other key (Flower FedProx's ``proximal-mu``, client-side DP's ``clipping_norm``, a
user's own) is not an error: it reaches the user's training step unchanged in
:attr:`SiteSettings.config` (``StepContext.config``). Only a *fedagg* key with a bad value is
refused, naming the node, the field, the value, the rule and the fix.

In simulation Flower gives each virtual SuperNode only ``partition-id`` and
``num-partitions``; in deployment an operator starts ``flower-supernode --node-config
"site-name='lab-a' data-path='/data/site.npz' workers=4"``.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from flwr.app import Context, Message
from pydantic import BaseModel, ConfigDict, Field

from fedagg.config import RunConfig, unflatten, validate_model
from fedagg.errors import ConfigError, explain
from fedagg.secagg.params import DEFAULT_MIN_NEIGHBOURS, DEFAULT_THRESHOLD_FLOOR
from fedagg.task import SiteInfo, TrainSettings

__all__ = ["ALIASES", "NodeConfig", "SiteSettings"]

ALIASES: dict[str, str] = {
    "lr": "train.lr",
    "learning_rate": "train.lr",
    "local-epochs": "train.local_epochs",
    "local_epochs": "train.local_epochs",
    "batch-size": "train.batch_size",
    "batch_size": "train.batch_size",
    "momentum": "train.momentum",
}
"""Keys of Flower's examples that set fedagg settings."""

_SECTIONS = frozenset(RunConfig.model_fields)
_NOT_FOR_SITES = ("server-round",)


class NodeConfig(BaseModel):
    """Keys fedagg reads from a SuperNode's ``--node-config`` (dashes or underscores).

    Other keys are allowed (a user's data function reads them from ``SiteInfo.node_config``),
    except near-misses of fedagg's own keys (``worker=4``), which are refused as typos.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    partition_id: int | None = Field(None, ge=0, description="This site's partition of the run's data set.")
    num_partitions: int | None = Field(None, ge=1, description="Number of partitions of the data set.")
    data_path: str | None = Field(None, description="An .npz file with arrays x_train, y_train (the site's own data).")
    site_name: str | None = Field(None, description="Human-readable site name, used in logs and metrics.")
    workers: int | None = Field(None, ge=1, le=512, description="Local workers (overrides site.workers).")
    mode: Literal["inprocess", "process"] | None = Field(None, description="Worker mode (overrides site.mode).")
    algorithm: Literal["auto", "ring", "tree", "hierarchical", "native"] | None = Field(None, description="All-reduce algorithm (overrides site.algorithm).")
    worker_service: str | None = Field(None, description="Socket of the site's worker service (`fedagg site-workers --socket PATH`): the site trains on its persistent workers.")
    worker_service_token: str | None = Field(None, description="Token file of the worker service (default: the socket path + '.token').")
    secagg_threshold_floor: float | None = Field(
        None, ge=0, lt=1,
        description="Secure aggregation: this site refuses a setup whose threshold t is not "
        "above this fraction of its k neighbours (default 0.5: t > k/2; 0 turns the protection "
        "off). The site's own setting: never taken from the server.")
    secagg_min_neighbours: int | None = Field(
        None, ge=1,
        description="Secure aggregation: this site refuses a neighbour graph of degree "
        "k < min(this, N - 1) (default 3). The site's own setting: never taken from the server.")

    @classmethod
    def from_context(cls, context: Context) -> NodeConfig:
        """The SuperNode's node config of ``context``, validated (dashes or underscores).

        Raises
        ------
        ConfigError
            A fedagg key with a bad value (names the node and the field).
        """
        raw = {str(k).replace("-", "_"): v for k, v in dict(context.node_config).items()}
        node: NodeConfig = validate_model(cls, raw,
                                          prefix=f"node {context.node_id}: node_config.")
        return node

    def secagg_floors(self) -> tuple[float, int]:
        """``(threshold_floor, min_neighbours)`` this site enforces on the server's SecAgg+
        parameters (:class:`fedagg.secagg.ClientState`; docs/protocols/secagg.md section 4)."""
        return (DEFAULT_THRESHOLD_FLOOR if self.secagg_threshold_floor is None
                else float(self.secagg_threshold_floor),
                DEFAULT_MIN_NEIGHBOURS if self.secagg_min_neighbours is None
                else int(self.secagg_min_neighbours))


def _fedagg_key(key: str) -> bool:
    return "." in key and key.split(".", 1)[0] in _SECTIONS


def _split(flat: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(fedagg dotted keys, other keys)``; aliases become fedagg keys ("" = unset)."""
    ours: dict[str, Any] = {}
    other: dict[str, Any] = {}
    for key, value in flat.items():
        k = str(key)
        if _fedagg_key(k):
            if value != "":
                ours[k] = value
        elif k in ALIASES:
            ours[ALIASES[k]] = value
        elif k not in _NOT_FOR_SITES:
            other[k] = value
    return ours, other


@dataclass(frozen=True)
class SiteSettings:
    """Validated settings for one message at one site.

    Attributes
    ----------
    cfg : RunConfig
        fedagg's settings.
    node : NodeConfig
        The SuperNode's node config.
    server_round : int
        The round the server named (0 when it named none).
    node_id : int
        Flower's node id.
    config : dict
        The round's whole config as sent (every key, for the user's step), plus the
        run config's non-fedagg keys under it.
    node_config, run_config : dict
        Flower's raw ``node_config`` and ``run_config``.
    """

    cfg: RunConfig
    node: NodeConfig
    server_round: int
    node_id: int
    config: dict[str, Any] = field(default_factory=dict)
    node_config: dict[str, Any] = field(default_factory=dict)
    run_config: dict[str, Any] = field(default_factory=dict)

    @property
    def partition_id(self) -> int:
        """The site's partition (0 when it brings its own data)."""
        return self.node.partition_id if self.node.partition_id is not None else 0

    @property
    def num_partitions(self) -> int:
        """Number of partitions (the run's number of sites unless the node says otherwise)."""
        return self.node.num_partitions or self.cfg.run.sites

    @property
    def name(self) -> str:
        """Site name for logs."""
        return self.node.site_name or f"site-{self.partition_id}"

    def site_info(self) -> SiteInfo:
        """The :class:`~fedagg.task.SiteInfo` a task's data function gets."""
        return SiteInfo(partition_id=self.partition_id, num_partitions=self.num_partitions,
                        node_id=self.node_id, name=self.name, node_config=dict(self.node_config),
                        run_config=dict(self.run_config), seed=self.cfg.run.seed)

    def training_seed(self) -> int:
        """Seed of the site's shuffling order: run seed, round and partition."""
        return (self.cfg.run.seed * 1_000_003 + self.server_round * 7919
                + self.partition_id) % (2**31)

    def train_settings(self) -> TrainSettings:
        """The round's :class:`~fedagg.task.TrainSettings`."""
        t = self.cfg.train
        return TrainSettings(epochs=t.local_epochs, batch_size=t.batch_size, lr=t.lr,
                             momentum=t.momentum, seed=self.training_seed(),
                             server_round=self.server_round, config=dict(self.config))

    @classmethod
    def from_message(cls, message: Message, context: Context, *,
                     config_key: str = "config") -> SiteSettings:
        """Validate the run config, the message's config record and the node config.

        Raises
        ------
        ConfigError
            A fedagg key with a bad value (names the node and the field).
        """
        node_id = context.node_id
        node_raw = {str(k): v for k, v in dict(context.node_config).items()}
        known = list(NodeConfig.model_fields)
        for key, value in node_raw.items():
            name = key.replace("-", "_")
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
            if name not in known and close:
                raise ConfigError(explain(
                    f"node {node_id}: node_config.{key}", value,
                    f"is not a fedagg node setting (did you mean {close[0].replace('_', '-')!r}?)",
                    "fix the spelling in --node-config; keys far from fedagg's are passed to the "
                    "task's data function unchanged"))
        node: NodeConfig = validate_model(
            NodeConfig, {k.replace("-", "_"): v for k, v in node_raw.items()},
            prefix=f"node {node_id}: node_config.")
        run_raw = {str(k): v for k, v in dict(context.run_config).items()}
        record = message.content.config_records.get(config_key) if message.has_content() else None
        if record is None and message.has_content() and len(message.content.config_records) == 1:
            record = next(iter(message.content.config_records.values()))
        sent: dict[str, Any] = dict(record) if record is not None else {}
        rnd = sent.get("server-round", 0)
        server_round = int(rnd) if isinstance(rnd, int) and not isinstance(rnd, bool) else 0
        base, run_other = _split(run_raw)
        ours, other = _split(sent)
        flat = {**base, **ours}
        nested = unflatten(flat)
        site = dict(nested.get("site", {}))
        for key in ("workers", "mode", "algorithm"):
            if getattr(node, key) is not None:
                site[key] = getattr(node, key)
        nested["site"] = site
        try:
            cfg: RunConfig = validate_model(RunConfig, nested)
        except ConfigError as exc:
            raise ConfigError(f"node {node_id}: invalid fedagg setting from the server or the "
                              f"run config: {exc}") from None
        config = {**run_other, **sent}
        del other
        return cls(cfg=cfg, node=node, server_round=server_round, node_id=node_id,
                   config=config, node_config=node_raw, run_config=run_raw)
