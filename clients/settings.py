"""What a site needs to know for one message: the run config sent by the server, plus the
SuperNode's own ``node_config`` (deployment) or partition id (simulation).

In simulation Flower gives each virtual SuperNode only ``partition-id`` and
``num-partitions``. In deployment an operator starts ``flower-supernode --node-config
"site-name='lab-a' data-path='/data/site.npz' workers=4"``; those keys are validated here by
:class:`NodeConfig` and errors name the node and the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from flwr.app import Context, Message
from pydantic import BaseModel, ConfigDict, Field

from fedagg.config import RunConfig, validate_model
from fedagg.errors import ConfigError
from strategies._records import record_to_config

__all__ = ["NodeConfig", "SiteSettings"]


class NodeConfig(BaseModel):
    """Keys accepted in a SuperNode's ``--node-config`` (dashes or underscores)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    partition_id: int | None = Field(None, ge=0, description="This site's partition of the run's data set.")
    num_partitions: int | None = Field(None, ge=1, description="Number of partitions of the data set.")
    data_path: str | None = Field(None, description="An .npz file with arrays x_train, y_train (the site's own data).")
    site_name: str | None = Field(None, description="Human-readable site name, used in logs and metrics.")
    workers: int | None = Field(None, ge=1, le=512, description="Local workers (overrides site.workers).")
    mode: Literal["inprocess", "process"] | None = Field(None, description="Worker mode (overrides site.mode).")
    algorithm: Literal["auto", "ring", "tree", "hierarchical", "native"] | None = Field(None, description="All-reduce algorithm (overrides site.algorithm).")


@dataclass(frozen=True)
class SiteSettings:
    """Validated settings for one message at one site."""

    cfg: RunConfig
    node: NodeConfig
    server_round: int
    node_id: int

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

    @classmethod
    def from_message(cls, message: Message, context: Context) -> SiteSettings:
        """Validate the message's config record and the node config."""
        node_id = context.node_id
        raw_node = {str(k).replace("-", "_"): v for k, v in dict(context.node_config).items()}
        node: NodeConfig = validate_model(NodeConfig, raw_node, prefix=f"node {node_id}: node_config.")
        config = message.content.config_records.get("config")
        flat: dict[str, Any] = dict(config) if config is not None else {}
        server_round = int(flat.pop("server-round", 0))
        nested = record_to_config(flat)
        site = dict(nested.get("site", {}))
        for key in ("workers", "mode", "algorithm"):
            if getattr(node, key) is not None:
                site[key] = getattr(node, key)
        nested["site"] = site
        try:
            cfg: RunConfig = validate_model(RunConfig, nested)
        except ConfigError as exc:
            raise ConfigError(f"node {node_id}: invalid run config from the server: {exc}") from None
        return cls(cfg=cfg, node=node, server_round=server_round, node_id=node_id)
