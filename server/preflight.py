"""Checks of a run config that need no engine: everything that would otherwise fail in round 1.

``fedagg config validate`` and ``fedagg simulate`` call :func:`preflight` before any engine
starts, so a bad strategy name, a bad option, a compression spec the strategy cannot run, a
missing data set or more sites than the data can feed is one error naming the field, the
value, the rule and the fix (exit status 2), not a traceback 20 s into Ray.
"""

from __future__ import annotations

from fedagg.config import RunConfig
from fedagg.errors import ConfigError, DataError, explain

__all__ = ["preflight"]


def preflight(cfg: RunConfig, *, data: bool = True) -> None:
    """Raise the first problem of ``cfg`` that does not need a running federation.

    Parameters
    ----------
    cfg : RunConfig
        The run.
    data : bool
        Also check the built-in data set (present, and enough examples for ``run.sites``
        partitions of ``data.min_partition_size``). Off for runs that bring their own data.

    Raises
    ------
    ConfigError
        Unknown strategy or option (known ones listed), a compression spec that does not
        parse or cannot run under the strategy, secure aggregation around a non-linear
        strategy or with too few sites per round, too many sites for the data, an
        ``[asynchronous]`` combination the asynchronous loop cannot run.
    DataError
        The data set's files are missing.
    """
    from strategies.registry import build_strategy

    build_strategy(cfg)  # names, options, wrappers, compression spec, SecAgg+ parameters
    if cfg.asynchronous.mode != "off":
        from server.async_dispatch import check_asynchronous

        check_asynchronous(cfg)  # what the asynchronous loop cannot run (docs/asynchronous.md)
    if not data:
        return
    from fedagg.builtin import _dataset, _partitions

    d = cfg.data
    ds = _dataset(d.dataset, d.data_dir, d.test_fraction, cfg.run.seed)
    available = len(ds.y_train[:d.max_train_examples] if d.max_train_examples else ds.y_train)
    need = cfg.run.sites * d.min_partition_size
    if available < need:
        raise ConfigError(explain(
            "run.sites", cfg.run.sites,
            f"{d.dataset} has {available} training examples, fewer than run.sites x "
            f"data.min_partition_size = {need}",
            f"use at most {max(available // d.min_partition_size, 1)} sites, lower "
            "data.min_partition_size, or use a larger data set"))
    try:
        _partitions(d.dataset, d.data_dir, d.test_fraction, cfg.run.seed, cfg.run.sites,
                    d.partitioner, d.dirichlet_alpha, d.min_partition_size,
                    d.max_train_examples)
    except (ConfigError, DataError):
        raise
    except ValueError as exc:
        raise ConfigError(explain("data.partitioner", d.partitioner, str(exc),
                                  "use fewer sites or data.partitioner = 'iid'")) from None
