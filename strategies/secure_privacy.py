"""Distributed differential privacy of a secure run, the server's side: budget, rounds, ledger.

With ``privacy.mode = "distributed"`` (docs/privacy.md) :class:`~strategies.SecureAggregation`
holds one :class:`DistributedPrivacy`. For each round it

* derives the round's distributed discrete Gaussian parameters from public inputs
  (:func:`fedagg.privacy.round_params`; the sites derive the same from the
  :class:`~strategies.wire.privacy.PrivacyRequest` sent with the upload request) and refuses
  to open a round that would take the spent epsilon above the budget
  (:class:`fedagg.errors.PrivacyBudgetSpent`);
* lays out the masked vector: the ``padded_dim`` ring elements of each site's encoding, then
  the weight (every site's weight is 1: the decoded mean is the unweighted mean of the
  clipped updates, as the privacy analysis assumes);
* decodes the unmasked ring sum (:class:`fedagg.privacy.DdgDecoder`: centre, rescale, rotate
  back) into the mean update, and charges the ledger for every round whose sum was unmasked
  (a sum refused after unmasking was still seen);
* reports epsilon spent so far, and keeps the ledger in the strategy's checkpoint.

Kairouz, Liu, Steinke, "The Distributed Discrete Gaussian Mechanism for Federated Learning
with Secure Aggregation", ICML 2021.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.config import PrivacyConfig
from fedagg.errors import PrivacyBudgetSpent, ProtocolError, explain
from fedagg.privacy import (
    DdgDecoder,
    DdgParams,
    PrivacyLedger,
    ddg_round_charge,
    min_survivors,
    rotation_seed,
    round_params,
)
from fedagg.update import MaskedLayout
from strategies.wire.privacy import PrivacyRequest

__all__ = ["DistributedPrivacy", "PrivateRound"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrivateRound:
    """One round's parameters, request and seed."""

    params: DdgParams
    request: PrivacyRequest

    @property
    def layout(self) -> MaskedLayout:
        """``[padded_dim ring elements | weight]``: no fixed-point values, no metric slots."""
        return MaskedLayout(values=self.params.padded_dim, private=True)


class DistributedPrivacy:
    """The server's side of distributed DP (see the module docstring).

    Parameters
    ----------
    config : PrivacyConfig
        The run's ``[privacy]`` section (``mode = "distributed"``).
    rounds : int
        ``run.rounds``: the participations the budget is spread over.
    """

    def __init__(self, config: PrivacyConfig, rounds: int) -> None:
        self.config = config
        self.rounds = max(int(rounds), 1)
        self.ledger = PrivacyLedger(config.delta, config.stop_at)

    def check_budget(self, server_round: int, *, dim: int, num_sites: int) -> None:
        """Refuse to open a round that would spend more than the budget.

        Raises
        ------
        PrivacyBudgetSpent
            One more round would take the spent epsilon above ``privacy.target_epsilon``.
        ConfigError
            The round cannot be calibrated (e.g. a ring too small: the fix names the bits).
        """
        c = self.config
        charge = ddg_round_charge(self._params(dim, num_sites))
        if self.ledger.would_exceed(charge):
            after = self.ledger.epsilon_after(charge)
            raise PrivacyBudgetSpent(explain(
                "privacy.target_epsilon", c.stop_at,
                f"round {server_round} would take the epsilon spent from "
                f"{self.ledger.epsilon():.4g} to {after:.4g} (delta = {c.delta:g}); the run "
                "stops here with the model of its last round",
                "raise privacy.target_epsilon (or privacy.epsilon, which also lowers the "
                "noise), or run fewer rounds"))

    def round_for(self, server_round: int, *, dim: int, num_sites: int,
                  binding: bytes) -> PrivateRound:
        """The round's parameters and the request its ``num_sites`` participants are sent."""
        c = self.config
        params = self._params(dim, num_sites)
        request = PrivacyRequest(epsilon=c.epsilon, delta=c.delta,
                                 participations=self.rounds, clip=c.clip,
                                 ring_bits=c.ring_bits, num_sites=int(num_sites),
                                 min_sites=params.min_sites, dim=int(dim),
                                 seed=rotation_seed(binding, server_round))
        return PrivateRound(params, request)

    def _params(self, dim: int, num_sites: int) -> DdgParams:
        c = self.config
        return round_params(epsilon=c.epsilon, delta=c.delta, participations=self.rounds,
                            clip=c.clip, ring_bits=c.ring_bits, num_sites=int(num_sites),
                            min_sites=min_survivors(num_sites, c.dropout_fraction),
                            dim=int(dim))

    def decode(self, rnd: PrivateRound, total: NDArray[Any] | None,
               survivors: int) -> NDArray[np.float64]:
        """The mean of the survivors' clipped updates, noised, from the unmasked ring sum.

        Raises
        ------
        AbortRound
            Fewer survivors than the noise is sized for (the sum must not be used).
        ProtocolError
            No ring sum, or one of the wrong length.
        """
        if total is None:
            raise ProtocolError(explain("RoundResult.total", None,
                                        "a private round is decoded from the ring sum", "-"))
        # only the low ring_bits bits of each summed element count (RoundResult.total)
        ring = np.bitwise_and(np.asarray(total, np.uint64)[:rnd.params.padded_dim],
                              np.uint64(rnd.params.modulus - 1))
        decoded = DdgDecoder(rnd.params).decode(ring, survivors=int(survivors),
                                                seed=rnd.request.seed)
        if decoded.peak > 0.9:
            _log.warning("private round: the ring sum reaches %.0f %% of the ring's half "
                         "range; a coordinate may have wrapped (raise privacy.ring_bits)",
                         100 * decoded.peak)
        return decoded.mean

    def charge(self, rnd: PrivateRound) -> float:
        """Record one unmasked round; the epsilon spent so far."""
        self.ledger.record(ddg_round_charge(rnd.params))
        eps = self.ledger.epsilon()
        _log.info("privacy: epsilon spent %.4g of %.4g (delta %g) after %d rounds", eps,
                  self.config.stop_at, self.config.delta, self.ledger.participations)
        return eps

    def metrics(self, rnd: PrivateRound) -> dict[str, float]:
        """What the round's metrics say about privacy (all public)."""
        p = rnd.params
        return {"privacy-epsilon": float(self.ledger.epsilon()),
                "privacy-delta": float(self.config.delta),
                "privacy-rounds": float(self.ledger.participations),
                "privacy-noise-std": float(p.mean_noise_std(p.min_sites)),
                "privacy-ring-bits": float(p.ring_bits)}

    def state_dict(self) -> dict[str, Any]:
        """The ledger, for checkpoints."""
        return self.ledger.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (every field checked)."""
        self.ledger.load_state_dict(state)
