"""The sections of a run's TOML file, and the base model of every section.

``[run]``, ``[data]``, ``[model]``, ``[train]``, ``[strategy]``, ``[site]``, ``[faults]`` and
``[simulation]``.

Each section is a frozen pydantic model with ``extra="forbid"`` (:class:`Section`). The
sections of the update protocols (``[compression]``, ``[secagg]``, ``[asynchronous]``) are in
:mod:`fedagg.config.protocols`; :class:`fedagg.config.RunConfig` puts them all together, and
every name here is importable from the package :mod:`fedagg.config` as well.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

__all__ = [
    "DataConfig",
    "FaultsConfig",
    "ModelConfig",
    "RunSection",
    "Section",
    "SimulationConfig",
    "SiteConfig",
    "StrategyConfig",
    "TrainConfig",
]


_FLOWER_PREFIX = "flwr:"
_TREE_STRATEGIES = {"fedxgbbagging": "FedXgbBagging", "fedxgbcyclic": "FedXgbCyclic"}
"""Flower's strategies for XGBoost models (lower-case class name -> class name)."""


def _refuse_tree_strategy(name: str) -> None:
    """Flower's XGBoost strategies exchange trees, not the tensors fedagg's sites train."""
    cls = name.strip()
    cls = cls[len(_FLOWER_PREFIX):] if cls.lower().startswith(_FLOWER_PREFIX) else ""
    if cls.lower() in _TREE_STRATEGIES:
        raise PydanticCustomError(
            "tree_strategy",
            "is Flower's {cls}, which aggregates XGBoost models (trees serialised as bytes by "
            "Flower's XGBoost ClientApps), not the tensor models fedagg's sites train: every "
            "round would fail",
            {"cls": _TREE_STRATEGIES[cls.lower()]},
        )


class Section(BaseModel):
    """The base of every section: frozen, unknown keys refused, fields by name or alias."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class RunSection(Section):
    """Run-wide settings."""

    name: str = Field("fedagg", description="Run name, used in the run directory name.")
    rounds: int = Field(10, ge=1, le=100_000, description="Number of federated rounds.")
    sites: int = Field(
        10, ge=1, le=10_000, description="Number of sites (simulation: virtual SuperNodes)."
    )
    seed: int = Field(
        0, ge=0, description="Seed for data partitioning, model init and training order."
    )
    fraction_train: float = Field(
        1.0, gt=0.0, le=1.0, description="Fraction of sites sampled per round."
    )
    fraction_evaluate: float = Field(
        0.0, ge=0.0, le=1.0,
        description="Fraction of sites asked to evaluate the global model on their held-out "
        "split every run.evaluate_every rounds and the last (federated evaluation; 0 = only "
        "the server's centralized evaluation; Flower's FedAvg defaults to 1.0). Asynchronous "
        "modes: sites not training, every run.evaluate_every records.",
    )
    min_sites: int = Field(
        1, ge=1, description="Fewer replying sites than this aborts the round (model unchanged)."
    )
    round_timeout: float = Field(
        600.0, gt=0, description="Seconds to wait for site replies per exchange."
    )
    output_dir: str = Field("runs", description="Directory under which runs/<id>/ is written.")
    evaluate_every: int = Field(
        1, ge=1, description="Centralized and federated evaluation every N rounds (and the "
        "last); in the asynchronous modes every N records."
    )
    resume: str | None = Field(
        None,
        description="Run directory whose checkpoint to resume from (ServerApp / deployment; "
        "the CLI has --resume).",
    )
    checkpoint: bool = Field(
        True, description="Write run_dir/checkpoint.npz atomically after every round."
    )
    first_round_timeout: float | None = Field(
        None,
        gt=0,
        description="Deadline of round 1 (cold start: process start-up, data loading); "
        "None = run.round_timeout.",
    )
    wait_for_sites: float = Field(
        600.0,
        ge=0,
        description="Before round 1, wait up to this many seconds for run.sites sites to "
        "connect (deployment: SuperNodes start at their own pace); then go on with those "
        "connected, if at least run.min_sites.",
    )
    retries: int = Field(
        0, ge=0, le=10,
        description="Re-send a round's message to a site whose reply was a transient error, "
        "up to this many times within run.round_timeout (configuration / data errors are "
        "never retried).",
    )


class DataConfig(Section):
    """Data set and partitioning."""

    dataset: Literal["digits", "fashion-mnist"] = Field("digits", description="Data set name.")
    data_dir: str | None = Field(
        None,
        description="Fashion-MNIST IDX directory (default $FEDAGG_DATA_DIR or /usr/share/datasets/fashion-mnist).",
    )
    partitioner: Literal["iid", "dirichlet"] = Field(
        "dirichlet", description="How examples are split across sites."
    )
    dirichlet_alpha: float = Field(
        0.5, gt=0, description="Dirichlet concentration (smaller = more label skew)."
    )
    min_partition_size: int = Field(10, ge=1, description="Minimum examples per site.")
    test_fraction: float = Field(
        0.2, gt=0, lt=1, description="Held-out share of digits for centralized evaluation."
    )
    max_train_examples: int | None = Field(
        None, ge=1, description="Use only the first N training examples (quick runs)."
    )
    eval_fraction: float = Field(
        0.1, ge=0, lt=1,
        description="Held-out share of each site's partition, used by client-side evaluation "
        "(seeded split; 0 = no held-out split: evaluate messages are refused).",
    )


class ModelConfig(Section):
    """Model architecture."""

    name: Literal["mlp", "2nn", "cnn", "logreg", "resnet", "wide"] = Field(
        "mlp", description="Reference model name ('2nn': McMahan et al. 2017's 784-200-200-10; "
        "'resnet': a ResNet-10 with GroupNorm, 1.2M parameters, where data parallelism pays; "
        "'wide': a synthetic large model of model.params parameters, for big-model runs)."
    )
    params: int | None = Field(
        None, ge=1, le=2**34,
        description="Parameter count of the 'wide' model (one hidden layer as wide as it takes; "
        "e.g. 100000000 for a 100M-parameter, 400 MB float32 run); None = 1,000,000. Only for "
        "model.name = 'wide'.",
    )

    @model_validator(mode="after")
    def _params_for_wide(self) -> ModelConfig:
        if self.params is not None and self.name != "wide":
            raise ValueError(f"model.params ({self.params}) sets the size of the 'wide' model "
                             f"only, not of {self.name!r}; leave it unset or use "
                             "model.name = 'wide'")
        return self


class TrainConfig(Section):
    """Local training at each site."""

    local_epochs: int = Field(5, ge=1, le=1000, description="Local epochs per round.")
    batch_size: int = Field(16, ge=1, description="Mini-batch size (global batch of the site).")
    lr: float = Field(0.1, gt=0, le=100, description="Local SGD learning rate.")
    momentum: float = Field(0.0, ge=0, lt=1, description="Local SGD momentum.")


class StrategyConfig(Section):
    """Server-side aggregation strategy."""

    name: str = Field(
        "fedavg",
        description="Aggregation strategy: 'fedavg', a plugin's registered name, or one of "
        "Flower's strategies as 'flwr:<Class>' (e.g. 'flwr:FedAdam', options in "
        "[strategy.options]); 'secure' and 'compressed' are fedavg with that wrapper.",
    )
    secure: bool = Field(
        False,
        description="Wrap the strategy in secure aggregation (SecAgg+; linear strategies "
        "only). 'strategy.name = \"secure\"' is fedavg with this on.",
    )
    server_optimizer: Literal["none", "sgd", "momentum", "adam"] = Field(
        "none", description="Optimizer applied to the aggregated delta (FedOpt, Reddi et al. 2021)."
    )
    server_lr: float = Field(1.0, gt=0, description="Server learning rate on the aggregated delta.")
    server_momentum: float = Field(
        0.9, ge=0, lt=1, description="Momentum / beta1 of the server optimizer."
    )
    max_update_norm: float | None = Field(
        None, gt=0, description="Reject site updates whose delta L2 norm exceeds this."
    )
    max_weight: float | None = Field(
        None, gt=0,
        description="Reject site replies whose weight (num-examples) exceeds this; None = no "
        "absolute bound (max_weight_ratio still caps each weight).",
    )
    max_weight_ratio: float = Field(
        10.0, ge=0,
        description="Cap each site's weight at this multiple of the round's median weight "
        "before averaging (one site over-reporting its examples pulls the mean at most "
        "r / (r + n - 1) of the way); needs >= 3 replies; 0 = off.",
    )
    norm_outlier_factor: float = Field(
        10.0, ge=0,
        description="Norm-bomb guard: reject site updates whose delta L2 norm exceeds this "
        "multiple of the round's median delta norm; needs >= 3 updates (not per site under "
        "secure aggregation, where sites clip to secagg.clip); 0 = off.",
    )
    max_model_change: float | None = Field(
        None, gt=0,
        description="Commit a new global model only if its L2 distance from the old one is at "
        "most this (any strategy, also the secure aggregate); None = only the finite check.",
    )
    shards: int = Field(
        0, ge=0, le=1024,
        description="Sharded aggregation: 0 or 1 aggregates in the server process; S >= 2 "
        "splits the streamed accumulator over S Ray actors, each holding 1/S of it (the "
        "cluster of Flower's simulation, or a local one); the same bits either way.",
    )
    stream_retain: int = Field(
        2, ge=0, le=1000,
        description="Fewest updates kept per criterion (the largest delta norms and weights; "
        "on disk from 16 MiB) so that the median-relative guards can correct the streamed sum "
        "exactly; a round needing more corrections is not committed. The round keeps "
        "max(stream_retain, ceil(strategy.hostile_fraction x sites sampled)).",
    )
    hostile_fraction: float = Field(
        0.25, ge=0.0, lt=0.5,
        description="Share of a round's updates that may be refused or capped by the round "
        "guards without the round failing: a streamed round keeps that many updates (rounded "
        "up) per criterion for the exact correction (docs/reliability.md). 0 = only "
        "strategy.stream_retain.",
    )
    max_metric_keys: int | None = Field(
        64, ge=1, le=100_000,
        description="Metric keys kept per site reply (the weight and the identifiers "
        "included; the others in sorted order); the rest are dropped, named in metrics.json "
        "(metrics_dropped), and the reply still counts. Also the most keys a round's mean "
        "metrics keep (those the most sites reported). None = no bound.",
    )
    max_metric_key_length: int | None = Field(
        64, ge=1, le=100_000,
        description="Longest metric key kept, in characters (longer ones dropped, named in "
        "metrics.json). None = no bound.",
    )
    max_metric_list_length: int | None = Field(
        1024, ge=1, le=10_000_000,
        description="Longest list-valued metric kept, in elements (longer ones dropped, named "
        "in metrics.json). None = no bound.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the strategy: a plugin's (validated by its config model) or "
        "the keyword arguments of a Flower strategy (validated against its signature).",
    )


    @field_validator("name")
    @classmethod
    def _not_a_tree_strategy(cls, name: str) -> str:
        _refuse_tree_strategy(name)
        return name

    @field_validator("options")
    @classmethod
    def _inner_not_a_tree_strategy(cls, options: dict[str, Any]) -> dict[str, Any]:
        if isinstance(options.get("strategy"), str):  # the inner strategy of a Flower wrapper
            _refuse_tree_strategy(options["strategy"])
        return options

    @model_validator(mode="after")
    def _check_guards(self) -> StrategyConfig:
        for name in ("max_weight_ratio", "norm_outlier_factor"):
            value = getattr(self, name)
            if 0 < value <= 1:
                raise ValueError(
                    f"strategy.{name} ({value}) must be 0 (off) or > 1: a bound at or below the "
                    "median would refuse or cap half of the honest sites; use e.g. 10"
                )
        return self


class SiteConfig(Section):
    """Local workers of each site (intra-site data parallelism)."""

    workers: int = Field(1, ge=1, le=512, description="Local workers per site.")
    mode: Literal["inprocess", "process"] = Field(
        "inprocess",
        description="Workers as threads in the ClientApp, or real torch.distributed processes.",
    )
    algorithm: Literal["auto", "ring", "tree", "hierarchical", "native"] = Field(
        "auto", description="Intra-site all-reduce algorithm."
    )
    bucket_mb: float = Field(
        25.0, gt=0, description="Gradient bucket size in MB (overlap with backward)."
    )
    accumulation_steps: int = Field(
        1, ge=1, description="Micro-batches per all-reduce (gradient accumulation)."
    )
    comm_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Dtype of gradients on the wire."
    )
    overlap: bool = Field(True, description="Start each bucket's all-reduce during backward.")
    worker_timeout: float = Field(
        300.0, gt=0, description="Seconds before a silent worker is declared hung."
    )
    persistent: bool = Field(
        True,
        description="Keep the site's workers for the whole run (process group, model, data, "
        "reducer layout); each round sends only the global weights and the round config. "
        "False: fresh workers for every train message.",
    )
    keep_optimizer: bool = Field(
        False,
        description="Persistent workers keep the local optimizer's state (momentum, Adam "
        "moments) across rounds. Default false: a fresh optimizer every round (Flower's "
        "convention for local training).",
    )
    elastic: bool = Field(
        True,
        description="A worker that dies or hangs mid-round does not fail the site: the "
        "survivors re-form the group and redo the round; the lost worker is replaced from the "
        "next round. A worker that raises still fails the site.",
    )
    min_workers: int = Field(
        1, ge=1, description="Elastic rounds: fewest surviving workers that may finish a round."
    )
    pool_idle_timeout: float = Field(
        900.0, gt=0,
        description="Seconds a persistent worker pool may sit unused before its workers are "
        "stopped (run ended, site no longer sampled).",
    )


class FaultsConfig(Section):
    """Fault injection for tests and drills (all off by default). Sites are partition ids."""

    crash_site: int | None = Field(None, ge=0, description="This site fails (raises) in crash_round at crash_stage.")
    crash_round: int = Field(1, ge=1, description="Round of the injected crash.")
    crash_stage: Literal["train", "upload", "unmask"] = Field("train", description="Stage at which the site fails.")
    slow_site: int | None = Field(None, ge=0, description="This site sleeps slow_seconds before replying in slow_round.")
    slow_round: int = Field(1, ge=1, description="Round of the injected delay.")
    slow_seconds: float = Field(0.0, ge=0, description="Injected delay in seconds.")
    kill_worker: int | None = Field(
        None, ge=0, description="Multi-worker sites: this worker rank of worker_fault_site dies "
        "(SIGKILLs itself; in-process mode: raises) at worker_fault_step of worker_fault_round.")
    hang_worker: int | None = Field(
        None, ge=0, description="Multi-worker sites: this worker rank of worker_fault_site stops "
        "answering (sleeps) at worker_fault_step of worker_fault_round.")
    worker_fault_site: int = Field(0, ge=0, description="Site (partition id) of kill_worker / hang_worker.")
    worker_fault_round: int = Field(1, ge=1, description="Round of kill_worker / hang_worker.")
    worker_fault_step: int = Field(
        1, ge=0, description="Optimizer steps completed in the round before the worker fault strikes.")


class SimulationConfig(Section):
    """Flower simulation engine resources."""

    num_cpus: float = Field(1.0, gt=0, description="CPUs reserved per simulated ClientApp (Ray).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved per simulated ClientApp.")
