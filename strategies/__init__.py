"""Flower strategies for fedagg, the wrappers, and the strategy plugin API.

* :class:`FedAvg` — a drop-in for Flower's FedAvg with per-reply checks, seeded sampling and
  a server optimizer;
* :class:`Compressed` and :class:`SecureAggregation` — wrappers around ANY Flower
  Message-API strategy (``Compressed(FedAvg())``, ``SecureAggregation(FedAdam())``) that run
  under Flower's own ``Strategy.start()`` and under fedagg's server loop;
* plugin API: :data:`STRATEGIES`, :func:`register_strategy`, :func:`build_strategy`,
  :class:`FedaggStrategy`, :class:`RoundResult`, the carrier :class:`Update`, the round's
  :class:`RoundReport`, the engine seam :class:`UpdateConsumer` (docs/plugins.md);
* :mod:`strategies.wire` — the Flower wire adapter shared with the sites.
"""

from strategies.base import FedaggStrategy, RoundResult
from strategies.compressed import Compressed
from strategies.fedavg import FedAvg
from strategies.loop import run_train_round
from strategies.registry import STRATEGIES, build_strategy, known_strategies, register_strategy
from strategies.secure import SecureAggregation
from strategies.update import RoundReport, Update
from strategies.wrapper import UpdateConsumer, is_linear

__all__ = [
    "STRATEGIES",
    "Compressed",
    "FedAvg",
    "FedaggStrategy",
    "RoundReport",
    "RoundResult",
    "SecureAggregation",
    "Update",
    "UpdateConsumer",
    "build_strategy",
    "is_linear",
    "known_strategies",
    "register_strategy",
    "run_train_round",
]
