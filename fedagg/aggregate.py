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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from fedagg.errors import ConfigError, UpdateRejected, explain

__all__ = [
    "ServerOptimizer",
    "cast_update",
    "check_update",
    "global_norm",
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


def check_update(
    update: Sequence[npt.NDArray[np.generic]],
    reference: Sequence[npt.NDArray[np.generic]],
    *,
    max_norm: float | None = None,
    site: str = "site",
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
        # a float64 sum is finite iff every element is (no overflow below ~1e308 in total)
        if np.issubdtype(u.dtype, np.floating) and not np.isfinite(np.sum(u, dtype=np.float64)):
            bad = int(np.size(u) - np.count_nonzero(np.isfinite(u)))
            raise UpdateRejected(
                explain(
                    f"{site}.arrays[{j}]",
                    f"{bad} non-finite values",
                    "must be finite (no NaN / Inf)",
                    "check the site's training (learning rate, data)",
                )
            )
    if max_norm is not None:
        norm = global_norm(subtract(update, reference))  # type: ignore[arg-type]
        if not norm <= max_norm:
            raise UpdateRejected(
                explain(
                    f"{site}.delta_norm",
                    round(norm, 6),
                    f"must be <= strategy.max_update_norm = {max_norm}",
                    "check the site, or raise strategy.max_update_norm",
                )
            )


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
        """Return the new global model ``weights (+) delta`` (inputs are not modified)."""
        w = [np.asarray(x) for x in weights]
        d: Arrays = [np.asarray(x, dtype=np.float64) for x in delta]
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
        return [(x + u).astype(x.dtype, copy=False) for x, u in zip(w, upd, strict=True)]

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
        self._t = int(state["t"])  # type: ignore[call-overload]
        m, v = state.get("m"), state.get("v")
        self._m = [np.asarray(x) for x in m] if isinstance(m, list) else None
        self._v = [np.asarray(x) for x in v] if isinstance(v, list) else None
