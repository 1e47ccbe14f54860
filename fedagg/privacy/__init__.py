"""Distributed differential privacy under secure aggregation: the distributed discrete
Gaussian mechanism (Kairouz, Liu, Steinke, ICML 2021), its calibration and its accounting.

One module per job:

* :mod:`fedagg.privacy.rotation`: the public randomized Hadamard rotation (flattening);
* :mod:`fedagg.privacy.rounding`: conditional randomized rounding and its norm bounds;
* :mod:`fedagg.privacy.discrete_gaussian`: the exact-algorithm discrete Gaussian sampler
  (Canonne, Kamath, Steinke, NeurIPS 2020), vectorised;
* :mod:`fedagg.privacy.ddg`: one round's parameters, site encoder and server decoder;
* :mod:`fedagg.privacy.accounting`: zCDP of a round, the run's ledger (dp-accounting's RDP
  accountant) and the central-DP Gaussian baseline;
* :mod:`fedagg.privacy.calibrate`: the grid step and noise for a budget and a ring;
* :mod:`fedagg.privacy.rounds`: one secure round's parameters (the same at server and
  sites, from public inputs) and its public rotation seed.

Pure numpy and dp-accounting; no Flower. See docs/privacy.md.
"""

from fedagg.privacy.accounting import (
    RDP_ORDERS,
    PrivacyLedger,
    RoundCharge,
    ZcdpBound,
    ddg_charge,
    ddg_epsilon,
    ddg_round_charge,
    ddg_tau,
    gaussian_epsilon,
    gaussian_noise_multiplier,
)
from fedagg.privacy.calibrate import DEFAULT_OVERFLOW_PROBABILITY, DdgCalibration, calibrate_ddg
from fedagg.privacy.ddg import (
    DEFAULT_BETA,
    MAX_OVERFLOW_PROBABILITY,
    DdgDecoder,
    DdgEncoder,
    DdgParams,
    DecodedSum,
    SiteEncoding,
    clip_to_norm,
    overflow_bound,
)
from fedagg.privacy.discrete_gaussian import (
    discrete_gaussian_pmf,
    discrete_gaussian_variance,
    sample_discrete_gaussian,
)
from fedagg.privacy.rotation import HadamardRotation, fwht_, next_power_of_two
from fedagg.privacy.rounding import (
    DEFAULT_MAX_TRIES,
    Rounded,
    conditional_round,
    rounded_l1_bound,
    rounded_l2_bound,
)
from fedagg.privacy.rounds import min_survivors, rotation_seed, round_params

__all__ = [
    "DEFAULT_BETA",
    "DEFAULT_MAX_TRIES",
    "DEFAULT_OVERFLOW_PROBABILITY",
    "MAX_OVERFLOW_PROBABILITY",
    "RDP_ORDERS",
    "DdgCalibration",
    "DdgDecoder",
    "DdgEncoder",
    "DdgParams",
    "DecodedSum",
    "HadamardRotation",
    "PrivacyLedger",
    "RoundCharge",
    "Rounded",
    "SiteEncoding",
    "ZcdpBound",
    "calibrate_ddg",
    "clip_to_norm",
    "conditional_round",
    "ddg_charge",
    "ddg_epsilon",
    "ddg_round_charge",
    "ddg_tau",
    "discrete_gaussian_pmf",
    "discrete_gaussian_variance",
    "fwht_",
    "gaussian_epsilon",
    "gaussian_noise_multiplier",
    "min_survivors",
    "next_power_of_two",
    "overflow_bound",
    "rotation_seed",
    "round_params",
    "rounded_l1_bound",
    "rounded_l2_bound",
    "sample_discrete_gaussian",
]
