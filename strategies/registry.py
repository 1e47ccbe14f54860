"""Strategy registry: names -> strategy classes; plugins via the ``fedagg.strategies`` group.

A registered object is a class (or factory) producing a Flower Message-API strategy. It may
declare:

``Config``
    a pydantic model validating ``[strategy] options`` (``extra="forbid"`` recommended);
``from_config(options, run_config)``
    a classmethod building the strategy from the validated options and the whole
    :class:`fedagg.config.RunConfig`. Without it the class is called with the options as
    keyword arguments.

Third-party packages register in their ``pyproject.toml``::

    [project.entry-points."fedagg.strategies"]
    my-median = "my_pkg.strategy:MedianStrategy"
"""

from __future__ import annotations

from typing import Any

from flwr.serverapp.strategy import Strategy
from pydantic import BaseModel

from fedagg._registry import Registry
from fedagg.config import RunConfig, validate_model
from fedagg.errors import ConfigError, explain

__all__ = ["STRATEGIES", "build_strategy", "register_strategy"]

STRATEGIES: Registry[Any] = Registry("strategy", group="fedagg.strategies")


def register_strategy(name: str, obj: Any = None, *, replace: bool = False) -> Any:
    """Register a strategy class under ``name`` (usable as a decorator when ``obj`` is None)."""
    if obj is None:
        def deco(target: Any) -> Any:
            STRATEGIES.register(name, target, replace=replace)
            return target
        return deco
    return STRATEGIES.register(name, obj, replace=replace)


def build_strategy(cfg: RunConfig) -> Strategy:
    """Look up ``cfg.strategy.name``, validate its options, and build it."""
    factory = STRATEGIES.get(cfg.strategy.name)
    model: type[BaseModel] | None = getattr(factory, "Config", None)
    options: Any = None
    if model is not None:
        options = validate_model(model, cfg.strategy.options, prefix="strategy.options.")
    elif cfg.strategy.options:
        raise ConfigError(explain("strategy.options", cfg.strategy.options,
                                  f"strategy {cfg.strategy.name!r} takes no options",
                                  "remove [strategy.options]"))
    if hasattr(factory, "from_config"):
        strategy = factory.from_config(options, cfg)
    else:
        strategy = factory(**(options.model_dump() if options is not None else {}))
    if not isinstance(strategy, Strategy):
        raise ConfigError(explain("strategy.name", cfg.strategy.name,
                                  f"built a {type(strategy).__name__}, not a Flower Strategy",
                                  "make the plugin subclass flwr.serverapp.strategy.Strategy"))
    return strategy


def _register_builtins() -> None:
    from strategies.fedavg import FedAvg

    STRATEGIES.register("fedavg", FedAvg)
    from strategies.secure import SecureAggregation

    STRATEGIES.register("secure", SecureAggregation)
    from strategies.compressed import CompressedFedAvg

    STRATEGIES.register("compressed", CompressedFedAvg)


_register_builtins()
