"""Dotted ``section.key=value`` overrides and flat / nested forms of a configuration.

Values are parsed as TOML (numbers, booleans, strings, lists; anything else stays a string);
dashes in keys are underscores (Flower's run config writes ``"train.local-epochs"``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import tomllib

from fedagg.errors import ConfigError, explain

__all__ = ["apply_overrides", "flatten", "parse_value", "unflatten"]


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
