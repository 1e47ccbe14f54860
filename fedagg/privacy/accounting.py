"""Privacy accounting of distributed and central Gaussian noise, with Google's dp-accounting.

Per round, the distributed discrete Gaussian (:mod:`fedagg.privacy.ddg`) with ``m = n_min``
noise shares of parameter ``sigma`` each (grid units), a site's rounded vector bounded by
``Delta_2`` in L2 and ``Delta_1`` in L1, and dimension ``d = d_pad`` satisfies, for every
Rényi order ``alpha > 1`` (Kairouz, Liu, Steinke, ICML 2021, Theorem 1 and its Rényi form,
Proposition 14 of the arXiv version), with ``l2 = Delta_2 / (sqrt(m) sigma)``,
``l1 = Delta_1 / (sqrt(m) sigma)`` and ``tau = 10 sum_{k=1}^{m-1} exp(-2 pi^2 sigma^2 k/(k+1))``:

``D_alpha <= min( alpha l2^2 / 2 + tau d,
                  alpha (l2^2 + 2 l1 tau + tau^2 d) / 2,
                  alpha (l2 + sqrt(d) tau)^2 / 2 )``

Each term is a zero-concentrated DP statement ``(xi, rho)``-zCDP (``D_alpha <= xi + rho alpha``,
Bun & Steinke 2016): :class:`RoundCharge` holds the three, :func:`ddg_round_charge` computes
them. ``tau`` measures how far the sum of ``m`` discrete Gaussians is from a discrete
Gaussian; at the noise levels used for training (``sigma >= 2``) it is below ``1e-15`` and
the three terms agree with the discrete (and continuous) Gaussian's ``rho = l2^2 / 2``. With
``m = 1`` (``tau = 0``) the bound is CKS 2020's for a single discrete Gaussian.

Composition and conversion are dp-accounting's, not fedagg's: :class:`PrivacyLedger` composes
every recorded round's ``dp_accounting.dp_event.ZCDpEvent`` in
``dp_accounting.rdp.RdpAccountant`` (one accountant per term; each composed bound is valid,
so the ledger reports the smallest), and ``epsilon`` at the run's ``delta`` is the
accountant's ``get_epsilon`` (the conversion of Canonne, Kamath, Steinke 2020, Prop. 12 /
Asoodeh et al. 2020). The order grid (:data:`RDP_ORDERS`) is finer and wider than
dp-accounting's default, so that any total ``rho`` is converted tightly.

Neighbouring relation: add or remove one site's contribution (its clipped update replaced by
nothing), as Flower's DP wrappers and DP-FedAvg (McMahan et al. 2018) account. Each round a
site takes part in is one participation; no amplification by sampling is claimed (sites are
not sampled in secret). With every site in every round, the run's ledger is each site's.

Central-DP baseline: :func:`gaussian_noise_multiplier` and :func:`gaussian_epsilon` give the
noise multiplier ``z`` of Flower's ``DifferentialPrivacyServerSideFixedClipping`` (noise
``N(0, (z c / n)^2)`` on the mean) for a budget, and the budget for a ``z``, with the same
accountant and ``GaussianDpEvent`` (optionally Poisson-subsampled).

References
----------
.. [KLS2021] P. Kairouz, Z. Liu, T. Steinke. "The Distributed Discrete Gaussian Mechanism for
   Federated Learning with Secure Aggregation". ICML 2021 (Theorem 1; arXiv 2102.06387,
   Proposition 14).
.. [CKS2020] C. Canonne, G. Kamath, T. Steinke. "The Discrete Gaussian for Differential
   Privacy". NeurIPS 2020 (zCDP of the discrete Gaussian; Prop. 12, zCDP/RDP to (eps, delta)).
.. [BS2016] M. Bun, T. Steinke. "Concentrated Differential Privacy: Simplifications,
   Extensions, and Lower Bounds". TCC 2016.
.. [Mironov2017] I. Mironov. "Rényi Differential Privacy". CSF 2017.
.. [Asoodeh2020] S. Asoodeh, J. Liao, F. Calmon, O. Kosut, L. Sankar. "A Better Bound Gives a
   Hundred Rounds: Enhanced Privacy Guarantees via f-Divergences". ISIT 2020.
.. [McMahan2018] H. B. McMahan, D. Ramage, K. Talwar, L. Zhang. "Learning Differentially
   Private Recurrent Language Models". ICLR 2018 (DP-FedAvg).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import dp_accounting
import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant

from fedagg.errors import CheckpointError, ConfigError, explain
from fedagg.privacy.ddg import DdgParams

__all__ = [
    "LEDGER_FORMAT",
    "RDP_ORDERS",
    "PrivacyLedger",
    "RoundCharge",
    "ZcdpBound",
    "ddg_charge",
    "ddg_epsilon",
    "ddg_round_charge",
    "ddg_tau",
    "gaussian_epsilon",
    "gaussian_noise_multiplier",
]

RDP_ORDERS: Final[tuple[float, ...]] = tuple(
    float(a) for a in 1.0 + np.geomspace(0.0101, 1e6, 1000))
"""Rényi orders of the ledger: ``alpha - 1`` from ``0.0101`` to ``10^6``, 1000 values spaced
by 1.9 % (dp-accounting's conversion needs ``alpha > 1.01``). The spacing bounds the loss
from a discrete grid to ``~1e-4`` relative at any budget, from ``rho`` in the hundreds
(optimal ``alpha`` near 1) to ``1e-6`` per run (optimal ``alpha`` in the thousands)."""
LEDGER_FORMAT: Final = "fedagg.privacy.ledger/1"
_TERMS: Final = 3


def _check_delta(delta: object, field: str = "privacy.delta") -> float:
    if isinstance(delta, bool) or not isinstance(delta, int | float | np.floating) or not (
            0.0 < float(delta) < 1.0):
        raise ConfigError(explain(field, delta, "must be a number in (0, 1)",
                                  "use e.g. 1e-5 (below 1 / number of sites)"))
    return float(delta)


def _check_epsilon(eps: object, field: str = "privacy.epsilon") -> float:
    if isinstance(eps, bool) or not isinstance(eps, int | float | np.floating) or not (
            math.isfinite(float(eps)) and float(eps) > 0):
        raise ConfigError(explain(field, eps, "must be a finite number > 0",
                                  "use e.g. 2, 4 or 8"))
    return float(eps)


def _check_count(count: object, field: str) -> int:
    if isinstance(count, bool) or not isinstance(count, int | np.integer) or int(count) < 1:
        raise ConfigError(explain(field, count, "must be a whole number >= 1",
                                  "pass the number of rounds a site takes part in"))
    return int(count)


@dataclass(frozen=True)
class ZcdpBound:
    """``(xi, rho)``-zCDP: Rényi divergence ``D_alpha <= xi + rho * alpha`` for all ``alpha > 1``.

    Attributes
    ----------
    rho, xi : float
        Non-negative; ``rho = inf`` means no privacy.
    """

    rho: float
    xi: float = 0.0

    def __post_init__(self) -> None:
        for name in ("rho", "xi"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float | np.floating) or not (
                    float(v) >= 0.0):
                raise ConfigError(explain(f"zCDP {name}", v, "must be a number >= 0",
                                          "pass a zCDP bound"))

    def event(self) -> dp_event.ZCDpEvent:
        """The bound as a dp-accounting event."""
        return dp_event.ZCDpEvent(rho=float(self.rho), xi=float(self.xi))


@dataclass(frozen=True)
class RoundCharge:
    """The privacy cost of one participation: one or more valid zCDP bounds (the mechanism
    satisfies each; the ledger composes each and keeps the best).

    Attributes
    ----------
    bounds : tuple of ZcdpBound
        One to three bounds (KLS 2021's three terms for the distributed discrete Gaussian,
        one for a continuous Gaussian).
    """

    bounds: tuple[ZcdpBound, ...]

    def __post_init__(self) -> None:
        if not (1 <= len(self.bounds) <= _TERMS) or not all(
                isinstance(b, ZcdpBound) for b in self.bounds):
            raise ConfigError(explain("round charge bounds", self.bounds,
                                      f"must be 1 to {_TERMS} ZcdpBound objects",
                                      "build it with ddg_round_charge"))

    @property
    def rho(self) -> float:
        """The smallest pure-zCDP ``rho`` the bounds give (``xi`` folded in: ``xi + rho alpha
        <= (xi + rho) alpha`` for ``alpha >= 1``)."""
        return min(b.rho + b.xi for b in self.bounds)

    def term(self, i: int) -> ZcdpBound:
        """The ``i``-th bound; charges with fewer bounds repeat their last one."""
        return self.bounds[min(i, len(self.bounds) - 1)]


def ddg_tau(sigma: float, shares: int) -> float:
    """KLS 2021's ``tau = 10 sum_{k=1}^{m-1} exp(-2 pi^2 sigma^2 k / (k + 1))``."""
    s2 = float(sigma) ** 2
    return 10.0 * sum(math.exp(-2.0 * math.pi ** 2 * s2 * k / (k + 1))
                      for k in range(1, int(shares)))


def ddg_charge(*, l2_bound: float, l1_bound: float, sigma_site: float, shares: int,
               dim: int) -> RoundCharge:
    """KLS 2021's three zCDP bounds for ``shares`` discrete Gaussians of parameter
    ``sigma_site`` summed over ``Z^dim``, for inputs within ``l2_bound`` / ``l1_bound`` (all
    in grid units; module docstring). ``sigma_site = 0`` gives ``rho = inf``."""
    sigma = float(sigma_site)
    if sigma == 0.0:
        return RoundCharge((ZcdpBound(math.inf),))
    scale = math.sqrt(shares) * sigma
    l2, l1 = l2_bound / scale, l1_bound / scale
    tau = ddg_tau(sigma, shares)
    bounds = (ZcdpBound(rho=l2 * l2 / 2.0, xi=tau * dim),
              ZcdpBound(rho=(l2 * l2 + 2.0 * l1 * tau + tau * tau * dim) / 2.0),
              ZcdpBound(rho=(l2 + math.sqrt(dim) * tau) ** 2 / 2.0))
    # A bound no better than another at every order adds nothing (typically, tau ~ 0 and
    # the second term equals the first's rho without its xi): keep the others, in order.
    kept = [b for i, b in enumerate(bounds) if not any(
        o.rho <= b.rho and o.xi <= b.xi and (o != b or j < i)
        for j, o in enumerate(bounds) if j != i)]
    return RoundCharge(tuple(kept))


def ddg_round_charge(params: DdgParams) -> RoundCharge:
    """The zCDP bounds of one round of ``params``: :func:`ddg_charge` with ``n_min`` shares,
    the conditional-rounding bounds ``Delta_2``, ``Delta_1`` and ``d = d_pad``.

    ``sigma_site = 0`` (noise off) gives ``rho = inf``: an infinite epsilon.
    """
    return ddg_charge(l2_bound=params.l2_bound, l1_bound=params.l1_bound,
                      sigma_site=float(params.sigma_site), shares=params.noise_shares,
                      dim=params.padded_dim)


class PrivacyLedger:
    """The privacy spent so far in a run (or by one site), composed by dp-accounting.

    Parameters
    ----------
    delta : float
        The run's ``delta`` in ``(0, 1)``.
    target_epsilon : float, optional
        The budget; :meth:`would_exceed` compares against it.

    Examples
    --------
    >>> ledger = PrivacyLedger(delta=1e-5, target_epsilon=1.0)
    >>> ledger.record(RoundCharge((ZcdpBound(0.001),)), count=10)
    >>> round(ledger.epsilon(), 3), ledger.participations
    (0.546, 10)
    >>> ledger.would_exceed(RoundCharge((ZcdpBound(0.1),)))
    True
    """

    def __init__(self, delta: float, target_epsilon: float | None = None) -> None:
        self.delta = _check_delta(delta)
        self.target_epsilon = None if target_epsilon is None else _check_epsilon(
            target_epsilon, "privacy.target_epsilon")
        self._entries: list[tuple[RoundCharge, int]] = []
        self._accountants = [RdpAccountant(RDP_ORDERS) for _ in range(_TERMS)]

    @property
    def participations(self) -> int:
        """Rounds recorded so far."""
        return sum(count for _, count in self._entries)

    def record(self, charge: RoundCharge, count: int = 1) -> None:
        """Compose ``count`` participations of ``charge``.

        Raises
        ------
        ConfigError
            ``charge`` is not a :class:`RoundCharge` or ``count < 1``.
        """
        if not isinstance(charge, RoundCharge):
            raise ConfigError(explain("charge", type(charge).__name__,
                                      "must be a RoundCharge", "use ddg_round_charge(params)"))
        n = _check_count(count, "count")
        for i, acc in enumerate(self._accountants):
            acc.compose(charge.term(i).event(), n)
        if self._entries and self._entries[-1][0] == charge:
            self._entries[-1] = (charge, self._entries[-1][1] + n)
        else:
            self._entries.append((charge, n))

    def epsilon(self) -> float:
        """Epsilon spent so far at :attr:`delta` (``0.0`` before any round)."""
        terms = max((len(c.bounds) for c, _ in self._entries), default=1)
        return min(float(acc.get_epsilon(self.delta)) for acc in self._accountants[:terms])

    def epsilon_after(self, charge: RoundCharge, count: int = 1) -> float:
        """Epsilon if ``count`` more participations of ``charge`` were recorded."""
        trial = PrivacyLedger(self.delta)
        for entry, n in self._entries:
            trial.record(entry, n)
        trial.record(charge, count)
        return trial.epsilon()

    def would_exceed(self, charge: RoundCharge, target_epsilon: float | None = None) -> bool:
        """Whether one more participation of ``charge`` would spend more than the budget.

        Raises
        ------
        ConfigError
            No budget: neither ``target_epsilon`` nor the ledger's own.
        """
        target = self.target_epsilon if target_epsilon is None else _check_epsilon(
            target_epsilon, "target_epsilon")
        if target is None:
            raise ConfigError(explain("privacy.target_epsilon", None,
                                      "a budget is needed to compare with",
                                      "pass target_epsilon here or to PrivacyLedger"))
        return self.epsilon_after(charge) > target

    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able) for checkpoints: the format, delta, budget and the charges
        (runs of equal charges stored once with their count)."""
        return {
            "format": LEDGER_FORMAT,
            "delta": self.delta,
            "target_epsilon": self.target_epsilon,
            "charges": [{"count": n, "bounds": [[b.rho, b.xi] for b in c.bounds]}
                        for c, n in self._entries],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace this ledger's content with :meth:`state_dict` output, every field checked.

        Raises
        ------
        CheckpointError
            A field is missing, unknown, of the wrong type or out of range (the message
            names it); the ledger is left unchanged.
        """
        fresh = PrivacyLedger.from_state(state)
        self.delta, self.target_epsilon = fresh.delta, fresh.target_epsilon
        self._entries, self._accountants = fresh._entries, fresh._accountants

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> PrivacyLedger:
        """A ledger rebuilt from :meth:`state_dict` output (see :meth:`load_state_dict`)."""
        where = "privacy ledger"
        if not isinstance(state, Mapping):
            raise CheckpointError(explain(where, type(state).__name__, "must be a mapping",
                                          "pass PrivacyLedger.state_dict() output"))
        keys = {"format", "delta", "target_epsilon", "charges"}
        if set(state) != keys:
            raise CheckpointError(explain(where + " keys", sorted(map(str, state)),
                                          f"must be exactly {sorted(keys)}",
                                          "pass PrivacyLedger.state_dict() output"))
        if state["format"] != LEDGER_FORMAT:
            raise CheckpointError(explain(where + ".format", state["format"],
                                          f"must be {LEDGER_FORMAT!r}",
                                          "load a ledger written by this version of fedagg"))
        try:
            ledger = cls(state["delta"], state["target_epsilon"])
        except ConfigError as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        charges = state["charges"]
        if not isinstance(charges, Sequence) or isinstance(charges, str | bytes):
            raise CheckpointError(explain(where + ".charges", type(charges).__name__,
                                          "must be a list", "pass state_dict() output"))
        for i, raw in enumerate(charges):
            field = f"{where}.charges[{i}]"
            if not isinstance(raw, Mapping) or set(raw) != {"count", "bounds"}:
                raise CheckpointError(explain(field, raw, "must be a mapping with exactly "
                                              "'count' and 'bounds'", "pass state_dict() output"))
            count = raw["count"]
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise CheckpointError(explain(field + ".count", count,
                                              "must be a whole number >= 1",
                                              "pass state_dict() output"))
            bounds = raw["bounds"]
            if not isinstance(bounds, Sequence) or isinstance(bounds, str | bytes) or not (
                    1 <= len(bounds) <= _TERMS):
                raise CheckpointError(explain(field + ".bounds", bounds,
                                              f"must be a list of 1 to {_TERMS} [rho, xi] pairs",
                                              "pass state_dict() output"))
            parsed = []
            for j, pair in enumerate(bounds):
                bfield = f"{field}.bounds[{j}]"
                if not isinstance(pair, Sequence) or isinstance(pair, str | bytes) or len(
                        pair) != 2:
                    raise CheckpointError(explain(bfield, pair, "must be a [rho, xi] pair",
                                                  "pass state_dict() output"))
                for name, v in zip(("rho", "xi"), pair, strict=True):
                    if isinstance(v, bool) or not isinstance(v, int | float) or not (
                            float(v) >= 0.0) or (name == "xi" and not math.isfinite(v)):
                        raise CheckpointError(explain(f"{bfield}.{name}", v,
                                                      "must be a number >= 0 (xi finite)",
                                                      "pass state_dict() output"))
                parsed.append(ZcdpBound(float(pair[0]), float(pair[1])))
            ledger.record(RoundCharge(tuple(parsed)), count)
        return ledger


def ddg_epsilon(params: DdgParams, *, delta: float, participations: int) -> float:
    """Epsilon after ``participations`` rounds of ``params`` at ``delta`` (a fresh ledger)."""
    ledger = PrivacyLedger(delta)
    ledger.record(ddg_round_charge(params),
                  _check_count(participations, "privacy.participations"))
    return ledger.epsilon()


def _gaussian_event(noise_multiplier: float, rounds: int,
                    sampling_rate: float) -> dp_event.DpEvent:
    event: dp_event.DpEvent = dp_event.GaussianDpEvent(noise_multiplier)
    if sampling_rate < 1.0:
        event = dp_event.PoissonSampledDpEvent(sampling_rate, event)
    return dp_event.SelfComposedDpEvent(event, rounds)


def _gaussian_accountant(sampling_rate: float) -> RdpAccountant:
    """The ledger's orders without sampling; dp-accounting's default orders (up to 1024) for
    the subsampled Gaussian, whose RDP has no closed form at very large orders."""
    return RdpAccountant(RDP_ORDERS if sampling_rate == 1.0 else None)


def _check_rate(rate: object) -> float:
    if isinstance(rate, bool) or not isinstance(rate, int | float | np.floating) or not (
            0.0 < float(rate) <= 1.0):
        raise ConfigError(explain("sampling_rate", rate, "must be in (0, 1]",
                                  "use 1.0 when every site takes part in every round"))
    return float(rate)


def gaussian_epsilon(noise_multiplier: float, *, delta: float, rounds: int,
                     sampling_rate: float = 1.0) -> float:
    """Epsilon of ``rounds`` Gaussian releases with noise ``z * sensitivity`` (RDP accountant).

    This is the central-DP baseline: Flower's server-side fixed clipping adds
    ``N(0, (z c / n)^2)`` to the mean of ``n`` updates clipped to ``c``.
    """
    z = noise_multiplier
    if isinstance(z, bool) or not isinstance(z, int | float | np.floating) or not (
            math.isfinite(float(z)) and float(z) > 0):
        raise ConfigError(explain("noise_multiplier", z, "must be a finite number > 0",
                                  "use e.g. 1.0"))
    q = _check_rate(sampling_rate)
    acc = _gaussian_accountant(q)
    acc.compose(_gaussian_event(float(z), _check_count(rounds, "rounds"), q))
    return float(acc.get_epsilon(_check_delta(delta)))


def gaussian_noise_multiplier(epsilon: float, *, delta: float, rounds: int,
                              sampling_rate: float = 1.0) -> float:
    """The smallest ``z`` with :func:`gaussian_epsilon` ``<= epsilon`` (dp-accounting's
    ``calibrate_dp_mechanism``, relative tolerance ``1e-6``)."""
    eps = _check_epsilon(epsilon)
    d = _check_delta(delta)
    t = _check_count(rounds, "rounds")
    q = _check_rate(sampling_rate)
    lo = 1e-3
    hi = 1.0
    while gaussian_epsilon(hi, delta=d, rounds=t, sampling_rate=q) > eps:
        lo, hi = hi, hi * 2.0
        if hi > 1e8:
            raise ConfigError(explain("privacy.epsilon", epsilon, "is out of reach of any "
                                      "noise multiplier up to 1e8", "raise epsilon"))
    z = dp_accounting.calibrate_dp_mechanism(
        lambda: _gaussian_accountant(q),
        lambda x: _gaussian_event(float(x), t, q),
        eps, d,
        bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi),
        tol=hi * 1e-6)
    return float(z)
