"""Strategy names -> strategies; plugins via the ``fedagg.strategies`` entry-point group.

``strategy.name`` picks the aggregation strategy; the wrappers come from the rest of the
config (:func:`build_strategy`):

* ``"fedavg"``, a plugin's registered name, or one of Flower's strategies as
  ``"flwr:<Class>"`` (:mod:`strategies.flower`);
* ``strategy.secure = true`` (or the name ``"secure"``: fedavg with it) wraps it in
  :class:`~strategies.secure.SecureAggregation`;
* otherwise any upward or downward compression (``compression.up`` / ``down`` not ``none``;
  or the name ``"compressed"``) wraps it in :class:`~strategies.compressed.Compressed`.

A registered object is a class (or factory) producing a Flower Message-API strategy. It may
declare ``Config`` (a pydantic model validating ``[strategy.options]``, ``extra="forbid"``
recommended) and ``from_config(options, run_config)`` (a classmethod); without the latter it
is called with the options as keyword arguments. Third-party packages register in their
``pyproject.toml``::

    [project.entry-points."fedagg.strategies"]
    my-median = "my_pkg.strategy:MedianStrategy"
"""

from __future__ import annotations

from typing import Any

from flwr.serverapp.strategy import Strategy
from pydantic import BaseModel

from fedagg._registry import Registry
from fedagg.config import RunConfig, validate_model
from fedagg.errors import ConfigError, RegistryError, explain
from strategies.flower import PREFIX, build_flower_strategy, flower_strategy_names

__all__ = ["STRATEGIES", "build_strategy", "known_strategies", "register_strategy"]

STRATEGIES: Registry[Any] = Registry("strategy", group="fedagg.strategies")
_ALIASES = {"secure": "fedavg", "compressed": "fedavg"}


def register_strategy(name: str, obj: Any = None, *, replace: bool = False) -> Any:
    """Register a strategy class under ``name`` (usable as a decorator when ``obj`` is None)."""
    if obj is None:
        def deco(target: Any) -> Any:
            STRATEGIES.register(name, target, replace=replace)
            return target
        return deco
    return STRATEGIES.register(name, obj, replace=replace)


def known_strategies() -> list[str]:
    """Every name ``strategy.name`` accepts: registered, the aliases, Flower's."""
    return [*STRATEGIES.names(), *_ALIASES, *flower_strategy_names()]


def build_named(name: str, cfg: RunConfig, options: dict[str, Any] | None = None) -> Strategy:
    """The aggregation strategy ``name`` (no wrappers), from ``options`` and the config.

    Raises
    ------
    ConfigError
        Unknown name (lists the known ones), bad options, or a plugin that builds something
        that is not a Flower strategy.
    """
    options = dict(options or {})
    if name.startswith(PREFIX):
        return build_flower_strategy(name, options, cfg,
                                     build_inner=lambda n: build_named(n, cfg))
    try:
        factory = STRATEGIES.get(name)
    except RegistryError:
        raise ConfigError(explain("strategy.name", name,
                                  "is not a known strategy; known: "
                                  + ", ".join(known_strategies()),
                                  "use one of the known names, 'flwr:<Class>' for Flower's "
                                  "strategies, or install the plugin that provides it")) from None
    model: type[BaseModel] | None = getattr(factory, "Config", None)
    validated: Any = None
    if model is not None:
        validated = validate_model(model, options, prefix="strategy.options.")
    elif options:
        raise ConfigError(explain("strategy.options", options,
                                  f"strategy {name!r} takes no options",
                                  "remove [strategy.options]"))
    if hasattr(factory, "from_config"):
        strategy = factory.from_config(validated, cfg)
    else:
        strategy = factory(**(validated.model_dump() if validated is not None else {}))
    if not isinstance(strategy, Strategy):
        raise ConfigError(explain("strategy.name", name,
                                  f"built a {type(strategy).__name__}, not a Flower Strategy",
                                  "make the plugin subclass flwr.serverapp.strategy.Strategy"))
    return strategy


def build_strategy(cfg: RunConfig) -> Strategy:
    """The run's strategy: ``strategy.name``, wrapped as the config asks (see module doc).

    Cheap and side-effect free (no Grid, no sites): ``fedagg config validate`` and
    ``fedagg simulate`` call it before any engine starts.

    Raises
    ------
    ConfigError
        Unknown names or options, a compression spec that does not parse, secure aggregation
        around a non-linear strategy or with too few sites per round.
    """
    from fedagg.update import UploadSpec
    from strategies.compressed import Compressed
    from strategies.guards import guards_from_config
    from strategies.secure import SecureAggregation

    name = cfg.strategy.name.strip()
    secure = cfg.strategy.secure or name == "secure"
    base = _ALIASES.get(name, name)
    inner = build_named(base, cfg, cfg.strategy.options)
    c = cfg.compression
    if secure:
        return SecureAggregation.from_config(None, cfg, inner)
    if name == "compressed" or c.up != "none" or c.down != "none":
        UploadSpec.parse(c.up, support=c.support, down=c.down)  # refuses secure-only specs
        return Compressed(inner, up=c.up, down=c.down, support=c.support, seed=cfg.run.seed,
                          max_update_norm=cfg.strategy.max_update_norm,
                          guards=guards_from_config(cfg))
    return inner


def _register_builtins() -> None:
    from strategies.fedavg import FedAvg

    STRATEGIES.register("fedavg", FedAvg)


_register_builtins()
