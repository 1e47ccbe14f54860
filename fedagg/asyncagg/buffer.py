"""The update buffer of FedBuff: fold each arriving update, hand over the mean after K.

Nguyen et al. 2022, "Federated Learning with Buffered Asynchronous Aggregation" (AISTATS),
Algorithm 1, server side: every arriving update ``Delta_k`` is folded into a running sum
``Delta_bar += w(s_k) * Delta_k`` (``w``: :class:`~fedagg.asyncagg.staleness.StalenessWeight`);
after ``K`` updates the server applies ``Delta_bar / K`` with its learning rate and empties the
buffer. fedagg's sign convention is ``Delta = w_site - w_global`` (the server adds it).

Two normalisations (``weighting``):

``"examples"`` (default)
    ``sum_k w(s_k) n_k Delta_k / sum_k n_k`` with ``n_k`` the site's training examples: with no
    staleness this is FedAvg's example-weighted mean (McMahan et al. 2017), so FedBuff with
    ``K = C = N`` and zero delays *is* synchronous FedAvg. Staleness scales an update down;
    it does not renormalise the others up.
``"uniform"``
    ``sum_k w(s_k) Delta_k / K``, the paper's Algorithm 1 as written.

An entry may stand for several sites (``count``): a secure cohort hands over one unmasked
example-weighted mean of its members (``weight = sum n``), which folds in exactly as its
members' updates would (``w(s) * sum n_i Delta_i``). The sum is accumulated in float64 in
arrival order, so the result is a deterministic function of the arrival order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from fedagg.errors import ConfigError, explain

__all__ = ["BufferEntry", "BufferResult", "UpdateBuffer", "Weighting"]

Weighting = Literal["examples", "uniform"]
F64 = NDArray[np.float64]


@dataclass(frozen=True)
class BufferEntry:
    """What the buffer remembers of one folded update (no arrays).

    Attributes
    ----------
    node : int
        Flower node id of the site (``-1`` for a cohort of several).
    partition : int
        The site's ``partition-id`` (``-1`` when unknown or a cohort).
    job : int
        Dispatch number of the update (cohort number for a secure cohort).
    version : int
        Model version the update was trained from.
    staleness : int
        Versions the model moved on before the update was folded.
    scale : float
        Its staleness weight ``w(staleness)``.
    weight : float
        Its example weight (``n_k``; a cohort's ``sum n``).
    count : int
        Sites it stands for.
    """

    node: int
    partition: int
    job: int
    version: int
    staleness: int
    scale: float
    weight: float
    count: int = 1


@dataclass(frozen=True)
class BufferResult:
    """The buffer's content when it is taken: the mean delta and its entries."""

    delta: list[F64]
    entries: tuple[BufferEntry, ...]

    @property
    def count(self) -> int:
        """Site updates in the buffer."""
        return sum(e.count for e in self.entries)

    def staleness_histogram(self) -> dict[str, int]:
        """``{"<staleness>": sites}``, in increasing staleness."""
        hist: dict[int, int] = {}
        for e in self.entries:
            hist[e.staleness] = hist.get(e.staleness, 0) + e.count
        return {str(s): hist[s] for s in sorted(hist)}


class UpdateBuffer:
    """Running, staleness-weighted sum of site deltas (FedBuff Algorithm 1, server side).

    Parameters
    ----------
    size : int
        ``K``: :attr:`full` once this many site updates were folded.
    weighting : {"examples", "uniform"}
        Normalisation of the mean (module docstring).

    Raises
    ------
    ConfigError
        ``size < 1`` or an unknown weighting.
    """

    def __init__(self, size: int, weighting: str = "examples") -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(explain("asynchronous.buffer_size", size, "must be a whole number "
                                      ">= 1", "use e.g. 10 (FedBuff's K)"))
        if weighting not in ("examples", "uniform"):
            raise ConfigError(explain("asynchronous.weighting", weighting,
                                      "must be 'examples' or 'uniform'", "use 'examples'"))
        self.size = size
        self.weighting = weighting
        self._sum: list[F64] | None = None
        self._norm = 0.0
        self._entries: list[BufferEntry] = []

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def count(self) -> int:
        """Site updates folded since the buffer was last taken."""
        return sum(e.count for e in self._entries)

    @property
    def full(self) -> bool:
        """Whether ``K`` site updates are in."""
        return self.count >= self.size

    @property
    def entries(self) -> tuple[BufferEntry, ...]:
        """The folded entries, in arrival order."""
        return tuple(self._entries)

    def fold(self, delta: Sequence[NDArray[Any]], entry: BufferEntry) -> None:
        """Add ``entry.scale * n * delta`` (``n``: the example weight, or the count).

        Raises
        ------
        ConfigError
            A weight or scale that is not finite and > 0 (resp. >= 0), or a delta whose
            tensor count or shapes differ from the ones already folded.
        """
        if not (np.isfinite(entry.weight) and entry.weight > 0):
            raise ConfigError(explain("weight", entry.weight, "must be finite and > 0",
                                      "weight each update by its number of examples"))
        if not (np.isfinite(entry.scale) and entry.scale >= 0):
            raise ConfigError(explain("scale", entry.scale, "must be finite and >= 0",
                                      "use a StalenessWeight"))
        n = float(entry.weight) if self.weighting == "examples" else float(entry.count)
        factor = float(entry.scale) * n
        arrays = [np.asarray(d, np.float64) for d in delta]
        if self._sum is None:
            self._sum = [factor * a for a in arrays]
        else:
            if [a.shape for a in arrays] != [s.shape for s in self._sum]:
                raise ConfigError(explain("delta shapes", [a.shape for a in arrays][:4],
                                          f"must equal {[s.shape for s in self._sum][:4]}",
                                          "fold deltas of the same model"))
            for s, a in zip(self._sum, arrays, strict=True):
                s += factor * a
        self._norm += n
        self._entries.append(entry)

    def mean(self) -> list[F64]:
        """The buffer's mean delta (float64), without emptying it.

        Raises
        ------
        ConfigError
            The buffer is empty.
        """
        if self._sum is None or self._norm <= 0:
            raise ConfigError(explain("buffer", "empty", "holds no update",
                                      "fold at least one update before taking the buffer"))
        return [s / self._norm for s in self._sum]

    def take(self) -> BufferResult:
        """The mean delta and the entries; the buffer is empty afterwards."""
        result = BufferResult(self.mean(), tuple(self._entries))
        self.clear()
        return result

    def clear(self) -> None:
        """Drop everything folded."""
        self._sum, self._norm, self._entries = None, 0.0, []

    def state_dict(self) -> dict[str, Any]:
        """Plain data: the running sum, its normaliser and the entries."""
        return {"size": self.size, "weighting": self.weighting,
                "sum": None if self._sum is None else [s.copy() for s in self._sum],
                "norm": self._norm, "entries": [asdict(e) for e in self._entries]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (size and weighting must match)."""
        if int(state["size"]) != self.size or state["weighting"] != self.weighting:
            raise ConfigError(explain("buffer state", (state["size"], state["weighting"]),
                                      f"must match size={self.size}, weighting={self.weighting}",
                                      "resume with the run's own configuration"))
        raw = state["sum"]
        self._sum = None if raw is None else [np.asarray(s, np.float64).copy() for s in raw]
        self._norm = float(state["norm"])
        self._entries = [BufferEntry(int(e["node"]), int(e["partition"]), int(e["job"]),
                                     int(e["version"]), int(e["staleness"]), float(e["scale"]),
                                     float(e["weight"]), int(e["count"]))
                         for e in state["entries"]]
