"""Run configuration: pydantic models, one TOML file, ``key=value`` overrides.

One :class:`RunConfig` describes a whole run. It is read from a TOML file whose tables are the
sections (``[run]``, ``[data]``, ``[model]``, ``[train]``, ``[strategy]``, ``[site]``,
``[compression]``, ``[secagg]``, ``[faults]``, ``[simulation]``, ``[asynchronous]``), overridden by dotted ``key=value`` pairs
(``train.lr=0.05``), and validated with ``extra="forbid"``. Every validation error is turned
into a :class:`~fedagg.errors.ConfigError` naming the field, the bad value, the rule and the fix.
The sections themselves are defined in :mod:`fedagg.config_sections` and (compression, secure
and asynchronous aggregation) :mod:`fedagg.config_protocols`, and re-exported here.

The same model is used by ``fedagg simulate``, by the ServerApp (from Flower's flattened run
config, ``[tool.flwr.app.config]`` in ``pyproject.toml``) and, for the site-side sections, by the
ClientApp. The reference page docs/configuration.md is generated from these models
(:func:`reference_markdown`) and a test keeps it in sync.
"""

from __future__ import annotations

import hashlib
import json
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tomllib
from pydantic import BaseModel, Field, ValidationError, model_validator

from fedagg.config_protocols import AsynchronousConfig, CompressionConfig, SecAggConfig
from fedagg.config_sections import (
    DataConfig,
    FaultsConfig,
    ModelConfig,
    RunSection,
    SimulationConfig,
    SiteConfig,
    StrategyConfig,
    TrainConfig,
    _Section,
)
from fedagg.errors import ConfigError, did_you_mean, explain

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
    "tree_strategy": "run it with Flower's own XGBoost apps, or choose a strategy that "
                     "averages tensors (e.g. 'fedavg', 'flwr:FedAdam')",
}


def _section_model(model: type[BaseModel], path: Iterable[object]) -> type[BaseModel] | None:
    """The pydantic model found at ``path`` (field names) inside ``model``, or None."""
    current: type[BaseModel] = model
    for part in path:
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        candidates = (typing.get_args(ann)
                      if typing.get_origin(ann) in (typing.Union, types.UnionType) else (ann,))
        found = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not found:
            return None
        current = found[0]
    return current


def format_validation_error(exc: ValidationError, *, prefix: str = "",
                            model: type[BaseModel] | None = None) -> str:
    """Turn a pydantic error into fedagg's one-line-per-problem field/value/rule/fix text.

    With ``model`` (the model validated), an unknown key's message names the closest known
    keys of its section (``train.lrr``: did you mean ``'lr'``?).
    """
    lines = []
    for err in exc.errors():
        field = (
            prefix + ".".join(str(p) for p in err["loc"])
            if err["loc"]
            else prefix.rstrip(".") or "config"
        )
        rule = err["msg"]
        fix = _FIXES.get(err["type"], "give a value that satisfies the rule")
        if err["type"] == "extra_forbidden":
            rule = "is not a known setting"
            section = _section_model(model, err["loc"][:-1]) if model and err["loc"] else None
            if section is not None:
                within = prefix + "".join(f"{p}." for p in err["loc"][:-1])
                hint = did_you_mean(str(err["loc"][-1]), section.model_fields, within=within)
                if hint:
                    rule += hint
                    fix = "correct the spelling, or remove it (docs/configuration.md lists every key)"
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
        raise ConfigError(format_validation_error(exc, prefix=prefix, model=model)) from None


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
