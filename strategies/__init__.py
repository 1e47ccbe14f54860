"""Flower strategies for fedagg, and the strategy plugin API.

Plugin authors import from here: :data:`STRATEGIES`, :func:`register_strategy`,
:func:`build_strategy`, :class:`FedaggStrategy`, :class:`RoundResult`, :class:`FedAvg`.
See docs/plugins.md.
"""

from strategies.base import FedaggStrategy, RoundResult, run_train_round
from strategies.fedavg import FedAvg
from strategies.registry import STRATEGIES, build_strategy, register_strategy

__all__ = [
    "STRATEGIES",
    "FedAvg",
    "FedaggStrategy",
    "RoundResult",
    "build_strategy",
    "register_strategy",
    "run_train_round",
]
