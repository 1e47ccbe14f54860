"""One run's configuration: :class:`RunConfig` (every section), read from a TOML file with
``key=value`` overrides and validated (:func:`load_config`), and its hash for resume checks.

A TOML file's tables are the sections (``[run]``, ``[data]``, ``[model]``, ``[train]``,
``[strategy]``, ``[site]``, ``[compression]``, ``[secagg]``, ``[faults]``, ``[simulation]``,
``[asynchronous]``: :mod:`fedagg.config.sections`, :mod:`fedagg.config.protocols`), overridden
by dotted ``key=value`` pairs (``train.lr=0.05``, :mod:`fedagg.config.overrides`) and validated
with ``extra="forbid"``; every validation error is a :class:`~fedagg.errors.ConfigError`
naming the field, the bad value, the rule and the fix (:mod:`fedagg.config.validation`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tomllib
from pydantic import Field, model_validator

from fedagg.config.overrides import apply_overrides, flatten
from fedagg.config.protocols import (
    AsynchronousConfig,
    CompressionConfig,
    PrivacyConfig,
    SecAggConfig,
)
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
from fedagg.config.validation import validate_model
from fedagg.errors import ConfigError, explain

__all__ = ["RunConfig", "config_hash", "load_config"]


class RunConfig(Section):
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
    privacy: PrivacyConfig = Field(default_factory=PrivacyConfig)  # type: ignore[arg-type]

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        if self.run.min_sites > self.run.sites:
            raise ValueError(
                f"run.min_sites ({self.run.min_sites}) must be <= run.sites ({self.run.sites}); "
                "lower run.min_sites or add sites"
            )
        if self.privacy.on:
            self._privacy_checks()
        return self

    def _privacy_checks(self) -> None:
        secure = self.strategy.secure or self.strategy.name == "secure"
        if not secure:
            raise ValueError(
                f"privacy.mode = '{self.privacy.mode}' needs secure aggregation (the noise is "
                "added in its ring; without it the server would see each noisy update); set "
                "strategy.name = 'secure', or use Flower's central DP wrappers "
                "(docs/privacy.md)")
        if self.compression.up != "none":
            raise ValueError(
                f"privacy.mode = '{self.privacy.mode}' with compression.up = "
                f"'{self.compression.up}': the noise is calibrated for the dense update (a "
                "sparse support, sketch or vote would need its own sensitivity); set "
                "compression.up = 'none'")
        if self.asynchronous.mode == "deadline":
            raise ValueError(
                f"privacy.mode = '{self.privacy.mode}' with asynchronous.mode = 'deadline': "
                "deadline rounds fold plaintext late updates; use synchronous rounds or "
                "secure FedBuff (asynchronous.mode = 'fedbuff')")
        quorum = self.asynchronous.cohort_quorum
        if self.asynchronous.mode == "fedbuff" and self.privacy.dropout_fraction < 1 - quorum - 1e-9:
            raise ValueError(
                f"privacy.dropout_fraction = {self.privacy.dropout_fraction} is below 1 - "
                f"asynchronous.cohort_quorum = {1 - quorum:g}: a cohort closing at its quorum "
                "would have fewer survivors than the noise is sized for, and its sum would be "
                f"refused; set privacy.dropout_fraction >= {1 - quorum:g}")
        if self.secagg.ring_bits is not None and self.secagg.ring_bits != self.privacy.ring_bits:
            raise ValueError(
                f"secagg.ring_bits = {self.secagg.ring_bits} differs from privacy.ring_bits = "
                f"{self.privacy.ring_bits}: the noise lives in the secure sum's ring; unset "
                "secagg.ring_bits or make them equal")


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
