"""The statistics pass of a streamed round: scalars per reply, never the updates.

Checks that need the whole round — the median-relative norm guard ("norm bombs") and the
weight cap at a multiple of the median weight (:class:`fedagg.aggregate.UpdateGuards`) —
cannot be decided while replies are still arriving. A streamed round therefore records, as
each reply is checked and folded, only its scalars (site, weight, delta L2 norm) in
:class:`RoundStatistics`, O(1) memory per site. Once the round is closed the statistics give
the same decisions as the list-based round guards (:func:`fedagg.aggregate.norm_outliers`,
:func:`fedagg.aggregate.cap_weights`, which it calls); a reply that is refused or capped
afterwards is corrected exactly in the integer accumulator by folding it again with weight
``-w`` (or ``c - w``), which needs the reply once more (docs/architecture/server-memory.md:
where it can be read again from).

:func:`delta_norm` computes ``||x - reference||_2`` block by block, without the full-size
difference that ``global_norm(subtract(x, reference))`` allocates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from fedagg.accumulate import native
from fedagg.accumulate.grid import BLOCK, Sparse, TensorUpdate
from fedagg.aggregate import MEDIAN_MIN_UPDATES, cap_weights, norm_outliers
from fedagg.errors import ConfigError, explain

__all__ = ["RoundStatistics", "delta_norm", "median_floor"]


def delta_norm(update: Sequence[TensorUpdate],
               reference: Sequence[npt.NDArray[Any]] | None = None, *,
               block: int = BLOCK) -> float:
    """L2 norm of ``update - reference`` (or of ``update``) over all tensors, in float64.

    Parameters
    ----------
    update : sequence of ndarray or Sparse
        A site's update; a :class:`~fedagg.accumulate.Sparse` tensor counts its values only
        (it is a delta: zeros elsewhere), and is not allowed with ``reference``.
    reference : sequence of ndarray, optional
        The global model, when ``update`` is a whole model.
    block : int
        Elements per step (temporaries: two float64 blocks).

    Returns
    -------
    float
        The norm (``inf`` / ``nan`` for non-finite input).
    """
    total = 0.0
    buf = np.empty(0, np.float64)
    for j, u in enumerate(update):
        if isinstance(u, Sparse):
            if reference is not None:
                raise ConfigError(explain(f"update[{j}]", "sparse",
                                          "a sparse tensor is a delta: pass no reference",
                                          "compute the norm of the delta"))
            x = np.asarray(u.values).reshape(-1)
            r = None
        else:
            x = np.asarray(u).reshape(-1)
            r = None if reference is None else np.asarray(reference[j]).reshape(-1)
        fast = native.sumsq_f32(x, r)  # one pass in C (same sum, other summation order)
        if fast is not None:
            total += fast
            continue
        for s in range(0, x.size, block):
            xb = x[s:s + block]
            if buf.size < xb.size:
                buf = np.empty(xb.size, np.float64)
            b = buf[:xb.size]
            with np.errstate(over="ignore", invalid="ignore"):
                if r is None:
                    np.copyto(b, xb, casting="unsafe")
                else:
                    np.subtract(xb, r[s:s + block], out=b, dtype=np.float64, casting="unsafe")
                total += float(np.dot(b, b))
    return math.sqrt(total) if total >= 0 else math.nan


def median_floor(known: Sequence[float], unknown: int) -> float | None:
    """A lower bound on the median of ``known`` and at most ``unknown`` more values.

    The median (NumPy's: the mean of the two middle values for an even count) of ``m``
    values is at least the ``(m // 2 + 1)``-th largest of any of them; with ``m`` at most
    ``len(known) + unknown`` that is the ``(len(known) + unknown) // 2 + 1``-th largest of
    ``known``. None when ``known`` has fewer values (the unknown ones could pull the median
    down without bound).
    """
    need = (len(known) + unknown) // 2 + 1
    if unknown < 0 or need > len(known):
        return None
    return float(np.partition(np.asarray(known, np.float64), len(known) - need)[len(known) - need])


class RoundStatistics:
    """Per-reply scalars of one round and the whole-round decisions made from them.

    Nothing but ``(site, weight, norm)`` per reply is kept. The decisions are the list-based
    round guards' (docs/reliability.md): at least :data:`MEDIAN_MIN_UPDATES` replies for the
    median-relative ones, a non-finite norm always flagged, a factor or ratio <= 0 off.
    """

    def __init__(self) -> None:
        self.sites: list[str] = []
        self.weights: list[float] = []
        self.norms: list[float] = []

    def __len__(self) -> int:
        return len(self.sites)

    def add(self, site: str | int, weight: float, norm: float) -> None:
        """Record one reply's weight and delta norm (a site may appear once)."""
        key = str(site)
        if key in self.sites:
            raise ConfigError(explain("site", key, "was already recorded this round",
                                      "record each reply once (duplicates are refused "
                                      "before folding)"))
        self.sites.append(key)
        self.weights.append(float(weight))
        self.norms.append(float(norm))

    def median_norm(self) -> float:
        """Median of the finite norms (0.0 when there are none)."""
        finite = [n for n in self.norms if math.isfinite(n)]
        return float(np.median(finite)) if finite else 0.0

    def median_weight(self) -> float:
        """Median weight (0.0 for an empty round)."""
        return float(np.median(self.weights)) if self.weights else 0.0

    def norm_outliers(self, factor: float) -> list[str]:
        """Sites whose norm is above ``factor`` x the median of the finite norms (and every
        site with a non-finite norm), in recording order (:func:`~fedagg.aggregate.
        norm_outliers`)."""
        return [self.sites[i] for i in norm_outliers(self.norms, factor)]

    def capped_weights(self, max_ratio: float, *, exclude: Sequence[str] = ()
                       ) -> dict[str, tuple[float, float]]:
        """``site -> (weight, capped weight)`` for the sites whose weight the cap lowers.

        The median is taken over the sites not in ``exclude`` (the refused ones), as the
        list-based guards cap the weights of the updates they kept.
        """
        skip = set(exclude)
        keep = [i for i, s in enumerate(self.sites) if s not in skip]
        if len(keep) < MEDIAN_MIN_UPDATES:
            return {}
        capped, over = cap_weights([self.weights[i] for i in keep], max_ratio)
        return {self.sites[keep[i]]: (self.weights[keep[i]], float(capped[i])) for i in over}

    def settled(self, site: str | int, *, norm_factor: float, weight_ratio: float,
                expected: int, exclude: Sequence[str] = ()) -> bool:
        """Whether the whole-round guards can no longer refuse or cap ``site``'s update.

        True when neither :meth:`norm_outliers` nor :meth:`capped_weights` can name the site
        at the end of the round, whatever the replies still to come are, given that the round
        has at most ``expected`` replies in all. Then the update never needs a correction and
        need not be kept aside (:class:`~fedagg.accumulate.Retainer`).

        The bound: a median of ``m`` values is at least the ``(m // 2 + 1)``-th largest of any
        subset of them, so with the ``u`` values still unknown taken as ``-inf``, the median
        at the end is at least that order statistic of the values known now (:func:`
        median_floor`). A norm at most ``norm_factor`` x the floor of the median norm is never
        an outlier. For the weights, whose median is taken over the updates that are not
        refused, the updates that might still be refused (a non-finite norm, a norm above
        ``norm_factor`` x the floor, the sites in ``exclude``) count as unknown too. The floors
        only rise as replies arrive, so a settled site stays settled.

        Parameters
        ----------
        site : str or int
            A recorded site.
        norm_factor, weight_ratio : float
            The guards' ``norm_outlier_factor`` and ``max_weight_ratio`` (``<= 0``: off).
        expected : int
            The most replies the round can have (the messages sent); fewer may come.
        exclude : sequence of str
            Recorded sites that will be refused whatever their norm (e.g. out of the
            accumulator's range).

        Returns
        -------
        bool
            False when unsure (including ``expected`` smaller than the replies recorded).
        """
        key = str(site)
        i = self.sites.index(key)
        unknown = expected - len(self)
        if unknown < 0 or key in set(exclude):
            return False
        judged = len(self) + unknown >= MEDIAN_MIN_UPDATES  # else no median guard applies
        norm, weight = self.norms[i], self.weights[i]
        limit = math.inf
        if norm_factor > 0:
            if not math.isfinite(norm):
                return False
            if judged:
                floor = median_floor([n for n in self.norms if math.isfinite(n)], unknown)
                if floor is None:
                    return False
                limit = floor * float(norm_factor)
                if not norm <= limit:
                    return False
        if weight_ratio <= 0 or not judged:
            return True
        skip = set(exclude)
        sure = [w for s, w, n in zip(self.sites, self.weights, self.norms, strict=True)
                if s not in skip and (norm_factor <= 0 or n <= limit)]
        floor = median_floor(sure, len(self) + unknown - len(sure))
        return floor is not None and weight <= floor * float(weight_ratio)

    def state_dict(self) -> dict[str, Any]:
        """Plain lists, for a checkpoint taken mid-round."""
        return {"sites": list(self.sites), "weights": list(self.weights),
                "norms": list(self.norms)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises
        ------
        ConfigError
            Lists of different lengths or non-numeric entries.
        """
        try:
            sites = [str(s) for s in state["sites"]]
            weights = [float(w) for w in state["weights"]]
            norms = [float(n) for n in state["norms"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(explain("round statistics state", type(exc).__name__,
                                      "must hold lists sites, weights, norms",
                                      "restore an intact state")) from None
        if not len(sites) == len(weights) == len(norms):
            raise ConfigError(explain("round statistics state",
                                      (len(sites), len(weights), len(norms)),
                                      "lists must have one entry per site",
                                      "restore an intact state"))
        self.sites, self.weights, self.norms = sites, weights, norms
