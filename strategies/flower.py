"""Flower's own strategies by name: ``strategy.name = "flwr:FedAdam"``.

``[strategy.options]`` are the class's keyword arguments, checked against its signature
before anything starts: an unknown option lists the known ones, a missing required one is
named. Unless the options say otherwise, the run's ``run.fraction_train`` and
``run.fraction_evaluate`` are passed to strategies that take them (so one setting samples
sites for every strategy). Flower's wrapper strategies (``DifferentialPrivacy...``) take the
strategy they wrap as ``options.strategy`` (a name, default fedagg's ``fedavg``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator
from typing import Any

from flwr.serverapp import strategy as flwr_strategy
from flwr.serverapp.strategy import Strategy

from fedagg.config import RunConfig
from fedagg.errors import ConfigError, explain

__all__ = ["PREFIX", "build_flower_strategy", "flower_strategy_class", "flower_strategy_names"]

PREFIX = "flwr:"


def flower_strategy_names() -> list[str]:
    """``flwr:<Class>`` for every Message-API strategy Flower exports."""
    out = []
    for name in getattr(flwr_strategy, "__all__", dir(flwr_strategy)):
        obj = getattr(flwr_strategy, name, None)
        if inspect.isclass(obj) and issubclass(obj, Strategy) and not inspect.isabstract(obj):
            out.append(PREFIX + name)
    return sorted(out)


def flower_strategy_class(name: str) -> type[Strategy]:
    """The Flower class of ``flwr:<Class>``.

    Raises
    ------
    ConfigError
        Unknown class (lists the known ones).
    """
    cls_name = name[len(PREFIX):] if name.startswith(PREFIX) else name
    obj = getattr(flwr_strategy, cls_name, None)
    if not (inspect.isclass(obj) and issubclass(obj, Strategy)) or inspect.isabstract(obj):
        raise ConfigError(explain("strategy.name", name,
                                  "is not one of Flower's strategies; known: "
                                  + ", ".join(flower_strategy_names()),
                                  "spell the class as Flower exports it, e.g. 'flwr:FedAdam'"))
    return obj


class _DropZeroFraction(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("fraction_evaluate is set to 0.0",
                                               "fraction_train is set to 0.0"))


@contextlib.contextmanager
def _quiet_zero_fraction() -> Iterator[None]:
    """Flower warns at construction when a fraction is 0; fedagg's run config defaults
    ``run.fraction_evaluate`` to 0 on purpose (the server evaluates centrally)."""
    logger, quiet = logging.getLogger("flwr"), _DropZeroFraction()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _parameters(cls: type) -> dict[str, inspect.Parameter]:
    params = dict(inspect.signature(cls).parameters)
    params.pop("self", None)
    return {k: p for k, p in params.items()
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}


def build_flower_strategy(name: str, options: dict[str, Any], cfg: RunConfig,
                          build_inner: Any = None) -> Strategy:
    """Build Flower's strategy ``name`` from ``[strategy.options]``.

    Parameters
    ----------
    name : str
        ``flwr:<Class>``.
    options : dict
        Keyword arguments of the class.
    cfg : RunConfig
        The run config (sampling fractions).
    build_inner : callable, optional
        ``name -> Strategy`` for the ``strategy`` argument of Flower's wrapper strategies.

    Raises
    ------
    ConfigError
        Unknown class or option, a missing required option, or the class refusing a value
        (its own message, with the option named).
    """
    cls = flower_strategy_class(name)
    params = _parameters(cls)
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise ConfigError(explain(f"strategy.options.{unknown[0]}", options[unknown[0]],
                                  f"is not an argument of {cls.__name__}; known: "
                                  + ", ".join(params),
                                  f"see the documentation of flwr.serverapp.strategy."
                                  f"{cls.__name__}"))
    kwargs = dict(options)
    for key, value in (("fraction_train", cfg.run.fraction_train),
                       ("fraction_evaluate", cfg.run.fraction_evaluate)):
        if key in params and key not in kwargs:
            kwargs[key] = value
    if "strategy" in params and (params["strategy"].default is inspect.Parameter.empty
                                 or "strategy" in kwargs):
        inner_name = kwargs.pop("strategy", "fedavg")
        if not isinstance(inner_name, str) or build_inner is None:
            raise ConfigError(explain("strategy.options.strategy", inner_name,
                                      "must name the strategy to wrap", "e.g. 'fedavg'"))
        kwargs["strategy"] = build_inner(inner_name)
    missing = [k for k, p in params.items()
               if p.default is inspect.Parameter.empty and k not in kwargs]
    if missing:
        raise ConfigError(explain(f"strategy.options.{missing[0]}", None,
                                  f"is required by {cls.__name__}",
                                  f"set [strategy.options] {missing[0]} = ..."))
    try:
        with _quiet_zero_fraction():
            return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(explain("strategy.options", options,
                                  f"{cls.__name__} refused them: {exc}",
                                  f"see the documentation of flwr.serverapp.strategy."
                                  f"{cls.__name__}")) from None
