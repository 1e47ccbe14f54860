"""Flower-free aggregation math: weighted means, update checks, server optimizers.

* :func:`weighted_mean` — FedAvg's example-weighted average (McMahan et al. 2017,
  "Communication-Efficient Learning of Deep Networks from Decentralized Data", Algorithm 1),
  accumulated in float64 and returned in the input dtype.
* :func:`check_update` — the server-side circuit breaker for one site update: count, shapes,
  dtypes, finite values and an optional L2-norm bound on the delta. It raises
  :class:`~fedagg.errors.UpdateRejected` with the reason; nothing is modified.
* :class:`ServerOptimizer` — FedOpt (Reddi et al. 2021, "Adaptive Federated Optimization",
  Algorithm 2): the aggregated delta is treated as a pseudo-gradient and applied with SGD,
  SGD with momentum (FedAvgM, Hsu et al. 2019) or Adam (FedAdam).
* :class:`UpdateGuards`, :func:`cap_weights`, :func:`norm_outliers`, :func:`model_change_problem`
  — the round-level robustness bounds (docs/reliability.md): a site's weight is capped at a
  multiple of the round's median weight, an update whose delta norm is far above the round's
  median is refused (a norm bomb), and a new global model is committed only when it is finite
  and within the configured distance of the old one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fedagg.errors import ConfigError, UpdateRejected, explain

__all__ = [
    "MEDIAN_MIN_UPDATES",
    "ServerOptimizer",
    "UpdateGuards",
    "cap_weights",
    "cast_update",
    "check_update",
    "global_norm",
    "model_change_problem",
    "non_finite_message",
    "norm_outliers",
    "subtract",
    "weighted_mean",
]

Arrays = list[npt.NDArray[np.floating]]


def weighted_mean(
    updates: Sequence[Sequence[npt.NDArray[np.floating]]], weights: Sequence[float]
) -> Arrays:
    """Example-weighted mean of per-site lists of arrays.

    Parameters
    ----------
    updates : sequence of sequence of ndarray
        ``updates[i][j]`` is tensor ``j`` of site ``i``; all sites share shapes.
    weights : sequence of float
        Non-negative weights (number of examples), one per site, with a positive sum.

    Returns
    -------
    list of ndarray
        ``sum_i w_i * x_i / sum_i w_i`` per tensor, in the dtype of the first site's tensor.
    """
    if len(updates) == 0:
        raise ConfigError(
            explain(
                "updates",
                [],
                "must hold at least one site update",
                "aggregate only when a site replied",
            )
        )
    if len(updates) != len(weights):
        raise ConfigError(
            explain(
                "weights",
                len(weights),
                f"must match the {len(updates)} updates",
                "pass one weight per update",
            )
        )
    w = np.asarray(weights, dtype=np.float64)
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ConfigError(
            explain(
                "weights",
                w.tolist(),
                "must be finite, >= 0, with a positive sum",
                "weight each site by its number of examples",
            )
        )
    # scale by the largest weight first: weights up to ~1.8e308 sum without overflow (two
    # sites reporting 1e308 examples must not turn the mean into 0 * x)
    w = w / w.max()
    w = w / w.sum()
    out: Arrays = []
    for j, ref in enumerate(updates[0]):
        shape = np.shape(ref)
        acc = np.zeros(shape, dtype=np.float64)
        tmp = np.empty(shape, dtype=np.float64)
        for i, site in enumerate(updates):
            # w_i * x_i computed straight into a float64 buffer: no per-site temporaries
            np.multiply(site[j], w[i], out=tmp, dtype=np.float64)
            acc += tmp
        with np.errstate(over="ignore"):  # overflow to inf is caught by the model check
            out.append(acc.astype(np.asarray(ref).dtype, copy=False))
    return out


def subtract(
    a: Sequence[npt.NDArray[np.floating]], b: Sequence[npt.NDArray[np.floating]]
) -> Arrays:
    """Element-wise ``a - b`` per tensor (float32 results for float32 inputs)."""
    return [np.asarray(x) - np.asarray(y) for x, y in zip(a, b, strict=True)]


def global_norm(arrays: Sequence[npt.NDArray[np.floating]]) -> float:
    """L2 norm over all tensors together (float64 accumulation)."""
    return float(
        np.sqrt(sum(float(np.sum(np.square(np.asarray(a, dtype=np.float64)))) for a in arrays))
    )


def cast_update(
    update: Sequence[npt.NDArray[np.generic]],
    reference: Sequence[npt.NDArray[np.generic]],
    *,
    strict: bool = False,
    site: str = "site",
) -> list[npt.NDArray[np.generic]]:
    """A site update in the global model's dtypes: floats of another precision are cast.

    Flower's FedAvg averages whatever float dtype a site sends; fedagg casts a float update to
    the model's float dtype (a float64 reply to a float32 model becomes float32), and leaves
    everything else to :func:`check_update`. With ``strict`` any dtype difference is refused.

    Raises
    ------
    UpdateRejected
        ``strict`` and a dtype differs.
    """
    out = []
    for j, (u, r) in enumerate(zip(update, reference, strict=False)):
        if u.dtype == r.dtype:
            out.append(u)
        elif strict:
            raise UpdateRejected(
                explain(
                    f"{site}.arrays[{j}].dtype",
                    str(u.dtype),
                    f"must equal {r.dtype} (strict_dtypes)",
                    "send the dtype the server sent, or turn strict_dtypes off",
                )
            )
        elif np.issubdtype(u.dtype, np.floating) and np.issubdtype(r.dtype, np.floating):
            with np.errstate(over="ignore"):
                out.append(u.astype(r.dtype))  # overflow to inf is caught by check_update
        else:
            out.append(u)
    out.extend(update[len(out):])
    return out


def _all_finite(u: npt.NDArray[np.generic]) -> bool:
    """Whether every element is finite: a finite sum says so (a NaN or Inf makes the sum
    non-finite); the sum in the array's own dtype is the fast path, one in float64 decides
    when that overflowed (no overflow below ~1e308 in total)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.sum(u))) or bool(np.isfinite(np.sum(u, dtype=np.float64)))


def non_finite_message(site: str, j: int, u: npt.NDArray[np.generic]) -> str:
    """The refusal of tensor ``j`` of ``site``'s update for holding NaN / Inf values."""
    bad = int(np.size(u) - np.count_nonzero(np.isfinite(u)))
    return explain(f"{site}.arrays[{j}]", f"{bad} non-finite values",
                   "must be finite (no NaN / Inf)",
                   "check the site's training (learning rate, data)")


def check_update(
    update: Sequence[npt.NDArray[np.generic]],
    reference: Sequence[npt.NDArray[np.generic]],
    *,
    max_norm: float | None = None,
    site: str = "site",
    check_finite: bool = True,
) -> None:
    """Check one site update against the global model before aggregation.

    Parameters
    ----------
    update : sequence of ndarray
        The site's returned model (or delta, see ``max_norm``).
    reference : sequence of ndarray
        The current global model; count, shapes and dtypes must match.
    max_norm : float, optional
        Bound on the L2 norm of ``update - reference``.
    site : str
        Name used in the message.
    check_finite : bool
        Check that float tensors hold no NaN / Inf (a pass over every value). Off only for a
        caller that folds the update into an accumulator refusing such values itself
        (:attr:`fedagg.accumulate.Accumulator.checks_finite`): a streamed FedAvg round.

    Raises
    ------
    UpdateRejected
        With the field, the offending value and the rule.
    """
    if len(update) != len(reference):
        raise UpdateRejected(
            explain(
                f"{site}.arrays",
                f"{len(update)} tensors",
                f"must hold {len(reference)} tensors like the global model",
                "send the full model of the same architecture",
            )
        )
    for j, (u, r) in enumerate(zip(update, reference, strict=True)):
        if u.shape != r.shape:
            raise UpdateRejected(
                explain(
                    f"{site}.arrays[{j}].shape",
                    tuple(u.shape),
                    f"must equal {tuple(r.shape)}",
                    "send the same architecture",
                )
            )
        if u.dtype != r.dtype:
            raise UpdateRejected(
                explain(
                    f"{site}.arrays[{j}].dtype",
                    str(u.dtype),
                    f"must equal {r.dtype}",
                    "send the dtype the server sent",
                )
            )
        if check_finite and np.issubdtype(u.dtype, np.floating) and not _all_finite(u):
            raise UpdateRejected(non_finite_message(site, j, u))
    if max_norm is not None:
        norm = global_norm(subtract(update, reference))  # type: ignore[arg-type]
        if not math.isfinite(norm):  # (check_finite off) a NaN / Inf is the better reason
            for j, u in enumerate(update):
                if np.issubdtype(u.dtype, np.floating) and not _all_finite(u):
                    raise UpdateRejected(non_finite_message(site, j, u))
        if not norm <= max_norm:
            raise UpdateRejected(
                explain(
                    f"{site}.delta_norm",
                    round(norm, 6),
                    f"must be <= strategy.max_update_norm = {max_norm}",
                    "check the site, or raise strategy.max_update_norm",
                )
            )


MEDIAN_MIN_UPDATES = 3
"""Fewest updates in a round for the median-relative guards to apply (with two, the median is
their mean, and one site could not be told from the other)."""


@dataclass(frozen=True)
class UpdateGuards:
    """Round-level robustness bounds on the site updates of one round (plain arguments).

    Parameters
    ----------
    max_weight : float, optional
        A site reporting a larger weight (``num-examples``) is refused.
    max_weight_ratio : float
        A weight above ``max_weight_ratio`` x the round's median weight is lowered to that
        cap before averaging (0: off). Bounds how far one site that over-reports its examples
        can pull the mean: with ``n`` sites at most ``r / (r + n - 1)`` of the way.
    norm_outlier_factor : float
        An update whose delta L2 norm is above ``norm_outlier_factor`` x the round's median
        delta norm is refused (a "norm bomb"; 0: off).
    max_model_change : float, optional
        The new global model is committed only within this L2 distance of the old one.

    The median-relative guards need at least :data:`MEDIAN_MIN_UPDATES` updates in the round
    and cannot act on a secure aggregate (one sum, no single update is seen).
    """

    max_weight: float | None = None
    max_weight_ratio: float = 10.0
    norm_outlier_factor: float = 10.0
    max_model_change: float | None = None


def cap_weights(
    weights: Sequence[float], max_ratio: float
) -> tuple[npt.NDArray[np.float64], list[int]]:
    """Weights with each one above ``max_ratio`` x their median lowered to that cap.

    Parameters
    ----------
    weights : sequence of float
        Finite positive weights, one per update.
    max_ratio : float
        The cap as a multiple of the median; ``<= 0`` leaves the weights as they are, and so
        do fewer than :data:`MEDIAN_MIN_UPDATES` weights.

    Returns
    -------
    (ndarray, list of int)
        The (capped) weights in float64 and the positions that were capped.
    """
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if max_ratio <= 0 or w.size < MEDIAN_MIN_UPDATES:
        return w, []
    cap = float(np.median(w)) * float(max_ratio)
    if not np.isfinite(cap):
        return w, []
    over = [int(i) for i in np.flatnonzero(w > cap)]
    if over:
        w = np.minimum(w, cap)
    return w, over


def norm_outliers(norms: Sequence[float], factor: float) -> list[int]:
    """Positions of the norms above ``factor`` x the median norm (the norm-bomb guard).

    Nothing is flagged with ``factor <= 0``, with fewer than :data:`MEDIAN_MIN_UPDATES` norms,
    or when the median is 0 and the norm is too (a round of empty updates). A non-finite norm is
    always flagged.
    """
    n = np.asarray(norms, dtype=np.float64).reshape(-1)
    bad = [int(i) for i in np.flatnonzero(~np.isfinite(n))]
    if factor <= 0 or n.size < MEDIAN_MIN_UPDATES:
        return bad
    finite = n[np.isfinite(n)]
    limit = float(np.median(finite)) * float(factor) if finite.size else 0.0
    return sorted(set(bad) | {int(i) for i in np.flatnonzero(np.isfinite(n) & (n > limit))})


def model_change_problem(
    new: Sequence[npt.NDArray[np.generic]],
    old: Sequence[npt.NDArray[np.generic]],
    *,
    max_change: float | None = None,
) -> str:
    """Why ``new`` must not replace the global model ``old`` ('' when it may).

    The model-integrity backstop: every float tensor finite, same count and shapes, and (when
    ``max_change`` is set) ``||new - old||_2 <= max_change``.
    """
    if len(new) != len(old):
        return f"the new model has {len(new)} tensors, the global model {len(old)}"
    change = 0.0
    for j, (a, b) in enumerate(zip(new, old, strict=True)):
        x, y = np.asarray(a), np.asarray(b)
        if x.shape != y.shape:
            return f"tensor {j} of the new model has shape {x.shape}, not {y.shape}"
        if np.issubdtype(x.dtype, np.floating) and not _all_finite(x):
            return f"tensor {j} of the new model is not finite (NaN / Inf)"
        if max_change is not None and np.issubdtype(x.dtype, np.number):
            d = x.astype(np.float64) - y.astype(np.float64)
            change += float(np.dot(d.reshape(-1), d.reshape(-1)))
    if max_change is not None:
        norm = float(np.sqrt(change))
        if not norm <= max_change:
            return (f"the new model is {norm:.6g} (L2) from the old one, above "
                    f"strategy.max_model_change = {max_change}")
    return ""


class ServerOptimizer:
    """Apply an aggregated delta to the global model (FedOpt, Reddi et al. 2021).

    Parameters
    ----------
    kind : {"none", "sgd", "momentum", "adam"}
        ``"none"`` replaces the model by ``global + delta`` (plain FedAvg); ``"sgd"`` uses
        ``global + lr * delta``; ``"momentum"`` is FedAvgM; ``"adam"`` is FedAdam.
    lr : float
        Server learning rate.
    beta1 : float
        Momentum / Adam first-moment decay.
    beta2, eps : float
        Adam second-moment decay and adaptivity (``tau`` in the paper).
    """

    def __init__(
        self,
        kind: str = "none",
        *,
        lr: float = 1.0,
        beta1: float = 0.9,
        beta2: float = 0.99,
        eps: float = 1e-3,
    ) -> None:
        if kind not in ("none", "sgd", "momentum", "adam"):
            raise ConfigError(
                explain(
                    "strategy.server_optimizer",
                    kind,
                    "must be one of none, sgd, momentum, adam",
                    "choose one of the listed optimizers",
                )
            )
        self.kind, self.lr, self.beta1, self.beta2, self.eps = kind, lr, beta1, beta2, eps
        self._m: Arrays | None = None
        self._v: Arrays | None = None
        self._t = 0

    def step(
        self, weights: Sequence[npt.NDArray[np.floating]], delta: Sequence[npt.NDArray[np.floating]]
    ) -> Arrays:
        """Return the new global model ``weights (+) delta`` (inputs are not modified).

        The optimizer's state advances; :meth:`snapshot` / :meth:`restore` undo a step whose
        model is then refused.

        Raises
        ------
        ConfigError
            The stored moments do not have the delta's shapes (a state of another model).
        """
        w = [np.asarray(x) for x in weights]
        d: Arrays = [np.asarray(x, dtype=np.float64) for x in delta]
        for name, moments in (("m", self._m), ("v", self._v)):
            if moments is not None and [np.shape(x) for x in moments] != [x.shape for x in d]:
                raise ConfigError(
                    explain(
                        f"server_optimizer state.{name}",
                        [np.shape(x) for x in moments][:3],
                        f"must have the model's shapes {[x.shape for x in d][:3]}",
                        "resume with the model the state was saved for, or start a new run",
                    )
                )
        self._t += 1
        if self.kind == "none":
            upd = d
        elif self.kind == "sgd":
            upd = [self.lr * x for x in d]
        elif self.kind == "momentum":
            self._m = (
                d
                if self._m is None
                else [self.beta1 * m + x for m, x in zip(self._m, d, strict=True)]
            )
            upd = [self.lr * m for m in self._m]
        else:
            m0 = self._m or [np.zeros_like(x) for x in d]
            v0 = self._v or [np.zeros_like(x) for x in d]
            m1: Arrays = [self.beta1 * m + (1 - self.beta1) * x for m, x in zip(m0, d, strict=True)]
            v1: Arrays = [
                self.beta2 * v + (1 - self.beta2) * x * x for v, x in zip(v0, d, strict=True)
            ]
            self._m, self._v = m1, v1
            upd = [self.lr * m / (np.sqrt(v) + self.eps) for m, v in zip(m1, v1, strict=True)]
        with np.errstate(over="ignore", invalid="ignore"):  # caught by the model check
            return [(x + u).astype(x.dtype, copy=False) for x, u in zip(w, upd, strict=True)]

    def snapshot(self) -> tuple[int, Arrays | None, Arrays | None]:
        """The state as it is now, for :meth:`restore` (no copies: :meth:`step` never modifies
        arrays in place)."""
        return self._t, self._m, self._v

    def restore(self, snap: tuple[int, Arrays | None, Arrays | None]) -> None:
        """Undo the steps since :meth:`snapshot` (a refused model leaves no trace)."""
        self._t, self._m, self._v = snap

    def state_dict(self) -> dict[str, object]:
        """Plain-data state (arrays and ints) for checkpoints."""
        return {
            "kind": self.kind,
            "t": self._t,
            "m": [x.copy() for x in self._m] if self._m is not None else None,
            "v": [x.copy() for x in self._v] if self._v is not None else None,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict` output."""
        if state.get("kind") != self.kind:
            raise ConfigError(
                explain(
                    "server_optimizer state",
                    state.get("kind"),
                    f"was saved for another optimizer than {self.kind!r}",
                    "resume with the same strategy.server_optimizer",
                )
            )
        t = state.get("t")
        if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= t < 2**62:
            raise ConfigError(
                explain("server_optimizer state.t", t, "must be an int >= 0",
                        "resume from an intact checkpoint")
            )
        moments: dict[str, Arrays | None] = {}
        for name in ("m", "v"):
            value = state.get(name)
            if value is None:
                moments[name] = None
                continue
            if not isinstance(value, list) or not all(
                isinstance(x, np.ndarray) and np.issubdtype(x.dtype, np.floating)
                and bool(np.all(np.isfinite(x))) for x in value
            ):
                raise ConfigError(
                    explain(f"server_optimizer state.{name}", type(value).__name__,
                            "must be a list of finite float arrays (or None)",
                            "resume from an intact checkpoint")
                )
            moments[name] = [np.asarray(x, dtype=np.float64) for x in value]
        if moments["v"] is not None and any(bool(np.any(x < 0)) for x in moments["v"]):
            raise ConfigError(
                explain("server_optimizer state.v", "negative entries",
                        "second moments must be >= 0", "resume from an intact checkpoint")
            )
        self._t = int(t)
        self._m, self._v = moments["m"], moments["v"]
