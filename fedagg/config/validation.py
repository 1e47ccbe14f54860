"""Pydantic validation errors as fedagg's one-line-per-problem field / value / rule / fix text.

An unknown key's message names the closest known keys of its section (``train.lrr``: did you
mean ``'lr'``?).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from fedagg.errors import ConfigError, did_you_mean, explain

__all__ = ["format_validation_error", "validate_model"]


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
