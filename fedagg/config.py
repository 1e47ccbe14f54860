"""Run configuration: pydantic models, one TOML file, ``key=value`` overrides.

One :class:`RunConfig` describes a whole run. It is read from a TOML file whose tables are the
sections below (``[run]``, ``[data]``, ``[model]``, ``[train]``, ``[strategy]``, ``[site]``,
``[compression]``, ``[secagg]``, ``[faults]``, ``[simulation]``, ``[asynchronous]``), overridden by dotted ``key=value`` pairs
(``train.lr=0.05``), and validated with ``extra="forbid"``. Every validation error is turned
into a :class:`~fedagg.errors.ConfigError` naming the field, the bad value, the rule and the fix.

The same model is used by ``fedagg simulate``, by the ServerApp (from Flower's flattened run
config, ``[tool.flwr.app.config]`` in ``pyproject.toml``) and, for the site-side sections, by the
ClientApp. The reference page docs/configuration.md is generated from these models
(:func:`reference_markdown`) and a test keeps it in sync.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fedagg.errors import ConfigError, explain

__all__ = [
    "AsynchronousConfig",
    "CompressionConfig",
    "DataConfig",
    "FaultsConfig",
    "ModelConfig",
    "RunConfig",
    "RunSection",
    "SecAggConfig",
    "SimulationConfig",
    "SiteConfig",
    "StrategyConfig",
    "TrainConfig",
    "apply_overrides",
    "config_hash",
    "flatten",
    "format_validation_error",
    "load_config",
    "parse_value",
    "reference_markdown",
    "unflatten",
    "validate_model",
]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class RunSection(_Section):
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
        "split each round (federated evaluation; 0 = only the server's centralized evaluation; "
        "Flower's FedAvg defaults to 1.0).",
    )
    min_sites: int = Field(
        1, ge=1, description="Fewer replying sites than this aborts the round (model unchanged)."
    )
    round_timeout: float = Field(
        600.0, gt=0, description="Seconds to wait for site replies per exchange."
    )
    output_dir: str = Field("runs", description="Directory under which runs/<id>/ is written.")
    evaluate_every: int = Field(
        1, ge=1, description="Centralized evaluation every N rounds (and the last)."
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


class DataConfig(_Section):
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


class ModelConfig(_Section):
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


class TrainConfig(_Section):
    """Local training at each site."""

    local_epochs: int = Field(5, ge=1, le=1000, description="Local epochs per round.")
    batch_size: int = Field(16, ge=1, description="Mini-batch size (global batch of the site).")
    lr: float = Field(0.1, gt=0, le=100, description="Local SGD learning rate.")
    momentum: float = Field(0.0, ge=0, lt=1, description="Local SGD momentum.")


class StrategyConfig(_Section):
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
        description="Updates kept per criterion (the largest delta norms and weights; on "
        "disk from 16 MiB) so that the median-relative guards can correct the streamed sum "
        "exactly; a round needing more corrections is not committed. 0 = keep none.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the strategy: a plugin's (validated by its config model) or "
        "the keyword arguments of a Flower strategy (validated against its signature).",
    )


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


class SiteConfig(_Section):
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


class CompressionConfig(_Section):
    """Upward / downward update compression."""

    up: str = Field(
        "none",
        description="Upward compressor spec, e.g. 'topk:0.01+ef+int8' (see docs/compression.md).",
    )
    down: Literal["none", "fp16", "bf16"] = Field("none", description="Downward model compression.")
    support: Literal["own", "reveal-indices", "random", "block", "topk-aggregate"] = Field(
        "own",
        description="Sparse support: 'reveal-indices' (alias 'own') lets each site send its own "
        "positions, revealing them to the server; 'random', 'block', 'topk-aggregate' are public.",
    )


class SecAggConfig(_Section):
    """Secure aggregation, SecAgg+ (used by the 'secure' strategy; docs/protocols/secagg.md)."""

    threshold: float = Field(
        0.5,
        gt=0,
        description="Shamir threshold t. A whole number >= 1 is t itself; a fraction f in (0, 1) "
        "means t = floor(f * k) + 1, i.e. more than that fraction of a site's k neighbours.",
    )
    neighbours: int | None = Field(
        None,
        ge=1,
        description="Neighbours per site k (k-regular graph); None = min(N-1, 3*ceil(log2 N)) "
        "(SecAgg+; all other sites, classic SecAgg, while N <= 16).",
    )
    clip: float = Field(
        8.0, gt=0, description="Each entry of a site's update (model delta) is clipped to "
        "[-clip, clip] before encoding."
    )
    frac_bits: int | None = Field(
        None, ge=1, le=30,
        description="Fixed-point fractional bits; None = auto: the fewest that meet "
        "secagg.precision (or, with ring_bits set, the most that fit that ring).",
    )
    ring_bits: int | None = Field(
        None, ge=8, le=32,
        description="Width b of the ring Z_2^b of masked values (uploads are bit-packed at b bits "
        "per value); None = the smallest with headroom for sites x clip range at frac_bits.",
    )
    precision: float = Field(
        1e-6, gt=0,
        description="Target worst-case abs error of the mean at full weight, 2^-frac_bits * "
        "(1 + clip), for auto frac_bits; if it needs more than 32 bits, the 32-bit ring is used.",
    )
    weight_scale: float = Field(
        10_000.0, gt=0,
        description="Public upper bound on a site's weight (training examples); a larger "
        "weight fails the site's upload. Precision is relative to it.",
    )
    timeout: float = Field(
        120.0, gt=0, description="Seconds to wait for replies in the key-setup and unmask "
        "exchanges (the masked upload rides with training and uses run.round_timeout)."
    )
    threads: int = Field(
        0, ge=0, le=16,
        description="Server worker threads for adding uploads and expanding self masks; 0 = "
        "$FEDAGG_SECAGG_THREADS if set, else one per CPU (at most 4); 1 = none. Sites use "
        "$FEDAGG_SECAGG_THREADS or one per CPU (at most 4). Results are bit-identical for any "
        "value.",
    )
    exclude_blamed: bool = Field(
        True,
        description="Leave a site out of the run's later rounds once its own relayed shares "
        "made a round abort (ServerState.blamed_sites; docs/protocols/secagg.md, section 6); "
        "false = it is re-keyed and may take part again.",
    )

    @model_validator(mode="after")
    def _check_threshold(self) -> SecAggConfig:
        if self.threshold >= 1 and not float(self.threshold).is_integer():
            raise ValueError(
                f"secagg.threshold ({self.threshold}) must be a whole number >= 1 (t itself) "
                "or a fraction in (0, 1); use e.g. 3 or 0.5"
            )
        if self.neighbours is not None and self.threshold >= 1 and self.threshold > self.neighbours:
            raise ValueError(
                f"secagg.threshold ({int(self.threshold)}) exceeds secagg.neighbours "
                f"({self.neighbours}): a site's secrets are shared among its neighbours only, "
                "so t shares cannot exist; lower the threshold or raise neighbours"
            )
        return self

    def resolve_threshold(self, k: int) -> int:
        """The threshold ``t`` for neighbourhoods of ``k`` sites."""
        if self.threshold >= 1:
            return int(self.threshold)
        return min(k, int(self.threshold * k) + 1)


class FaultsConfig(_Section):
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


class SimulationConfig(_Section):
    """Flower simulation engine resources."""

    num_cpus: float = Field(1.0, gt=0, description="CPUs reserved per simulated ClientApp (Ray).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved per simulated ClientApp.")


class AsynchronousConfig(_Section):
    """Asynchronous and semi-asynchronous aggregation: FedBuff, deadline rounds (docs/asynchronous.md).

    With ``mode = "fedbuff"`` or ``"deadline"`` the server runs the asynchronous loop
    (``server/asynchronous.py``) instead of synchronous rounds; ``run.rounds`` is then the
    number of model versions (buffers applied; deadline mode: rounds). The ``sim_*`` keys
    describe simulated site speeds for the in-process grid with a virtual clock
    (``server.delayed.DelayedGrid``, ``benchmarks/async.py``); Flower's engines ignore them.
    """

    mode: Literal["off", "fedbuff", "deadline"] = Field(
        "off",
        description="'off': synchronous rounds; 'fedbuff': buffered asynchronous aggregation "
        "(Nguyen et al. 2022, Algorithm 1); 'deadline': synchronous rounds that close at "
        "asynchronous.deadline and fold late updates into a later round with their staleness "
        "weight.",
    )
    concurrency: int | None = Field(
        None, ge=1,
        description="FedBuff's C: sites training at once; None = run.sites x "
        "run.fraction_train.",
    )
    buffer_size: int = Field(
        10, ge=1,
        description="FedBuff's K: updates folded before the buffer is applied (secure: the "
        "cohort size, <= concurrency).",
    )
    weighting: Literal["examples", "uniform"] = Field(
        "examples",
        description="Buffer mean: 'examples' = sum w(s) n Delta / sum n (FedAvg's weights; "
        "K = C = N without delays is synchronous FedAvg), 'uniform' = sum w(s) Delta / K "
        "(the paper as written).",
    )
    staleness: Literal["constant", "polynomial", "hinge"] = Field(
        "polynomial",
        description="Staleness weight w(s): 'constant' 1, 'polynomial' (1 + s)^-a, 'hinge' 1 "
        "up to b then 1 / (a (s - b) + 1) (Xie et al. 2019).",
    )
    staleness_a: float = Field(
        0.5, ge=0, description="Exponent of 'polynomial' (0.5: FedBuff's 1/sqrt(1+s)) or slope "
        "of 'hinge'."
    )
    staleness_b: int = Field(4, ge=0, description="Knee of 'hinge' (versions).")
    max_staleness: int | None = Field(
        10, ge=0,
        description="Updates trained from a model more than this many versions old are "
        "refused (named in metrics.json) and never reach the model; None = no bound.",
    )
    deadline: float = Field(
        60.0, gt=0,
        description="Deadline mode: seconds after its start at which a round aggregates what "
        "arrived (earlier when every site of the round replied).",
    )
    cohort_quorum: float = Field(
        1.0, gt=0, le=1,
        description="Secure FedBuff: a cohort closes once this fraction of its sites uploaded "
        "(the rest count as dropped and their masks are removed with Shamir shares; their "
        "late uploads are refused), or at run.round_timeout.",
    )
    max_seconds: float | None = Field(
        None, gt=0,
        description="Stop once the run's clock (simulated or wall seconds) passes this, even "
        "before run.rounds versions.",
    )
    poll: float = Field(
        0.05, gt=0, description="Seconds between pulls for replies on a real Grid (wall clock)."
    )
    sim_job_seconds: float = Field(
        10.0, ge=0,
        description="Simulated seconds of one training job at speed factor 1 (0 with "
        "sim_latency 0: zero delays).",
    )
    sim_sigma: float = Field(
        0.5, ge=0, description="Lognormal sigma of each job's simulated delay multiplier."
    )
    sim_site_sigma: float = Field(
        0.0, ge=0,
        description="Lognormal sigma of the fixed per-site speed factors drawn for sites not in "
        "sim_factors (0: all 1).",
    )
    sim_factors: list[float] = Field(
        default_factory=list,
        description="Fixed speed factors of sites 0, 1, ... (partition ids; 2 = twice as "
        "slow); a comma-separated string is accepted.",
    )
    sim_latency: float = Field(
        0.0, ge=0, description="Simulated seconds added to every message (network latency)."
    )
    sim_work: Literal["uniform", "examples"] = Field(
        "uniform",
        description="Simulated job length: the same for every site, or proportional to the "
        "site's training examples (relative to the mean).",
    )

    @field_validator("sim_factors", mode="before")
    @classmethod
    def _factors_from_text(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [float(v) for v in value.replace(" ", "").split(",") if v]
        return value


class RunConfig(_Section):
    """The whole run configuration."""

    run: RunSection = Field(default_factory=RunSection)  # type: ignore[arg-type]
    data: DataConfig = Field(default_factory=DataConfig)  # type: ignore[arg-type]
    model: ModelConfig = Field(default_factory=ModelConfig)  # type: ignore[arg-type]
    train: TrainConfig = Field(default_factory=TrainConfig)  # type: ignore[arg-type]
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)  # type: ignore[arg-type]
    site: SiteConfig = Field(default_factory=SiteConfig)  # type: ignore[arg-type]
    compression: CompressionConfig = Field(default_factory=CompressionConfig)  # type: ignore[arg-type]
    secagg: SecAggConfig = Field(default_factory=SecAggConfig)  # type: ignore[arg-type]
    faults: FaultsConfig = Field(default_factory=FaultsConfig)  # type: ignore[arg-type]
    simulation: SimulationConfig = Field(default_factory=SimulationConfig)  # type: ignore[arg-type]
    asynchronous: AsynchronousConfig = Field(default_factory=AsynchronousConfig)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        if self.run.min_sites > self.run.sites:
            raise ValueError(
                f"run.min_sites ({self.run.min_sites}) must be <= run.sites ({self.run.sites}); "
                "lower run.min_sites or add sites"
            )
        return self


_FIXES: dict[str, str] = {
    "extra_forbidden": "remove it, or check the spelling against docs/configuration.md",
    "literal_error": "use one of the allowed values",
    "missing": "add it",
}


def format_validation_error(exc: ValidationError, *, prefix: str = "") -> str:
    """Turn a pydantic error into fedagg's one-line-per-problem field/value/rule/fix text."""
    lines = []
    for err in exc.errors():
        field = (
            prefix + ".".join(str(p) for p in err["loc"])
            if err["loc"]
            else prefix.rstrip(".") or "config"
        )
        rule = err["msg"]
        if err["type"] == "extra_forbidden":
            rule = "is not a known setting"
        fix = _FIXES.get(err["type"], "give a value that satisfies the rule")
        if err["type"].startswith(("greater", "less")):
            fix = "choose a value in the allowed range"
        if err["type"] == "value_error":
            rule = rule.removeprefix("Value error, ")
            fix = "see the rule"
        lines.append(explain(field, err.get("input"), rule, fix))
    return "\n".join(lines)


def validate_model(model: type[BaseModel], data: Mapping[str, Any], *, prefix: str = "") -> Any:
    """Validate ``data`` against ``model``; raise :class:`ConfigError` with a clear message."""
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, prefix=prefix)) from None


def parse_value(text: str) -> Any:
    """Parse an override value as TOML (numbers, booleans, strings, lists); fall back to str."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict -> ``{"section.key": value}``."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and key != "options":
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"section.key": value}`` -> nested dict; dashes in keys become underscores."""
    out: dict[str, Any] = {}
    for dotted, value in flat.items():
        parts = [p.replace("-", "_") for p in dotted.split(".")]
        node = out
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    explain(
                        dotted,
                        value,
                        f"'{p}' is a value, not a table",
                        "remove one of the two conflicting keys",
                    )
                )
            node = child
        node[parts[-1]] = value
    return out


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides to a nested dict (returns a new dict)."""
    merged: dict[str, Any] = json.loads(json.dumps(dict(data)))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                explain(
                    "override",
                    item,
                    "must look like section.key=value",
                    "write e.g. -c train.lr=0.05",
                )
            )
        key, text = item.split("=", 1)
        parts = [p.strip().replace("-", "_") for p in key.strip().split(".")]
        if len(parts) < 2 or not all(parts):
            raise ConfigError(
                explain(
                    "override",
                    item,
                    "the key must name a section and a field",
                    "write e.g. -c run.rounds=5",
                )
            )
        node = merged
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    explain(
                        "override",
                        item,
                        f"'{p}' is not a section",
                        "check the key against docs/configuration.md",
                    )
                )
        node[parts[-1]] = parse_value(text.strip())
    return merged


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> RunConfig:
    """Read a TOML file (optional), apply overrides, validate.

    Raises
    ------
    ConfigError
        Unreadable file, bad TOML, unknown keys or out-of-range values.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(
                explain(
                    "--config", str(p), "does not exist", "give the path of an existing TOML file"
                )
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(
                explain(
                    "--config",
                    str(p),
                    f"is not valid TOML ({exc})",
                    "fix the TOML syntax at the position shown",
                )
            ) from None
    data = apply_overrides(data, overrides)
    result: RunConfig = validate_model(RunConfig, data)
    return result


def config_hash(
    cfg: RunConfig,
    *,
    exclude: Iterable[str] = (
        "run.rounds", "run.output_dir", "run.name", "run.resume", "run.checkpoint",
    ),
) -> str:
    """SHA-256 of the canonical JSON of everything that changes results (for resume checks)."""
    flat = flatten(cfg.model_dump(mode="json"))
    for key in exclude:
        flat.pop(key, None)
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()


_OPS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _rule_text(meta: object) -> str:
    for attr, op in _OPS.items():
        if hasattr(meta, attr):
            return f"{op} {getattr(meta, attr)}"
    return str(meta)


def reference_markdown() -> str:
    """The configuration reference (docs/configuration.md), generated from the models."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by fedagg.config.reference_markdown(); tests/test_config.py keeps it in sync. -->",
        "",
        "One TOML file (`fedagg simulate --config run.toml`), tables as below; override any key with",
        "`-c section.key=value`. Unknown keys are errors. In `pyproject.toml`",
        "(`[tool.flwr.app.config]`, used by `flwr run .`) the same keys are written with dots,",
        'e.g. `"train.lr" = 0.1`; dashes and underscores are interchangeable.',
        "",
    ]
    for name, field in RunConfig.model_fields.items():
        section = field.annotation
        if not isinstance(section, type) or not issubclass(section, BaseModel):
            continue
        lines += [
            f"## `[{name}]`",
            "",
            (section.__doc__ or "").strip(),
            "",
            "| key | type | default | description |",
            "|---|---|---|---|",
        ]
        for key, f in section.model_fields.items():
            ann = str(f.annotation).replace("typing.", "").replace("|", "\\|")
            ann = ann.replace("<class '", "").replace("'>", "")
            default = f.get_default(call_default_factory=True)
            rules = ", ".join(_rule_text(m) for m in f.metadata)
            desc = (f.description or "") + (f" ({rules})" if rules else "")
            lines.append(f"| `{key}` | `{ann}` | `{json.dumps(default)}` | {desc} |")
        lines.append("")
    return "\n".join(lines)
