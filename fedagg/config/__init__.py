"""Run configuration: pydantic models, one TOML file, ``key=value`` overrides.

One :class:`RunConfig` describes a whole run. It is read from a TOML file whose tables are the
sections (``[run]``, ``[data]``, ``[model]``, ``[train]``, ``[strategy]``, ``[site]``,
``[compression]``, ``[secagg]``, ``[faults]``, ``[simulation]``, ``[asynchronous]``), overridden
by dotted ``key=value`` pairs (``train.lr=0.05``), and validated with ``extra="forbid"``. Every
validation error is turned into a :class:`~fedagg.errors.ConfigError` naming the field, the bad
value, the rule and the fix.

The package's modules, each one job: :mod:`~fedagg.config.sections` (the base
:class:`Section` and the run's own sections), :mod:`~fedagg.config.protocols` (compression,
secure and asynchronous aggregation), :mod:`~fedagg.config.run_config` (:class:`RunConfig`,
:func:`load_config`, :func:`config_hash`), :mod:`~fedagg.config.overrides`,
:mod:`~fedagg.config.validation`, :mod:`~fedagg.config.reference` (docs/configuration.md,
kept in sync by a test). This package face exports their public names.

The same model is used by ``fedagg simulate``, by the ServerApp (from Flower's flattened run
config, ``[tool.flwr.app.config]`` in ``pyproject.toml``) and, for the site-side sections, by the
ClientApp.
"""

from fedagg.config.overrides import apply_overrides, flatten, parse_value, unflatten
from fedagg.config.protocols import (
    AsynchronousConfig,
    CompressionConfig,
    PrivacyConfig,
    SecAggConfig,
)
from fedagg.config.reference import reference_markdown
from fedagg.config.run_config import RunConfig, config_hash, load_config
from fedagg.config.sections import (
    DataConfig,
    FaultsConfig,
    ModelConfig,
    RunSection,
    Section,
    SimulationConfig,
    SiteConfig,
    StrategyConfig,
    TrainConfig,
)
from fedagg.config.validation import format_validation_error, validate_model

__all__ = [
    "AsynchronousConfig",
    "CompressionConfig",
    "DataConfig",
    "FaultsConfig",
    "ModelConfig",
    "PrivacyConfig",
    "RunConfig",
    "RunSection",
    "SecAggConfig",
    "Section",
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
