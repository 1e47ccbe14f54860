"""A seeded model of how long each site takes, for time-to-accuracy under stragglers.

Site ``i``'s ``j``-th job lasts (simulated seconds)

    ``latency + job_seconds * work_i * f_i * exp(sigma * z_ij)``,   ``z_ij ~ N(0, 1)``,

with a fixed per-site speed factor ``f_i`` (given, or drawn once per site from
``LogNormal(0, site_sigma)``), the site's relative amount of work ``work_i`` (e.g. its
examples over the mean) and a lognormal per-job delay: the straggler model of FedBuff's
experiments (Nguyen et al. 2022, section 6: client durations drawn from a heavy-tailed
distribution) and FedScale's (Lai et al. 2022). Every draw is a pure function of
``(seed, site, job)``, so a run's timeline is reproducible and a resumed run sees the same
durations for the same jobs. Messages that do not train (key setup, unmasking) take
``latency``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fedagg.errors import ConfigError, explain

__all__ = ["SpeedModel"]


@dataclass(frozen=True)
class SpeedModel:
    """Seeded per-site job durations (module docstring).

    Parameters
    ----------
    seed : int
        Seed of every draw.
    job_seconds : float
        Duration of one job at factor 1, work 1 and no noise (0: zero delays).
    sigma : float
        Lognormal sigma of the per-job delay (0: none).
    site_sigma : float
        Lognormal sigma of the drawn per-site factors (0: all 1), for sites not in ``factors``.
    factors : sequence of float
        Fixed factors of sites ``0, 1, ...`` (partition ids); later sites are drawn.
    latency : float
        Seconds added to every message (each way together).
    work : mapping of int to float
        Relative work per site (default 1).
    """

    seed: int = 0
    job_seconds: float = 10.0
    sigma: float = 0.5
    site_sigma: float = 0.0
    factors: Sequence[float] = ()
    latency: float = 0.0
    work: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("job_seconds", "sigma", "site_sigma", "latency"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ConfigError(explain(f"asynchronous.sim_{name}", value,
                                          "must be a finite number >= 0", "use e.g. 0 or 0.5"))
        for i, f in enumerate(self.factors):
            if not (math.isfinite(f) and f > 0):
                raise ConfigError(explain(f"asynchronous.sim_factors[{i}]", f,
                                          "must be a finite number > 0",
                                          "give each listed site a speed factor > 0 "
                                          "(2 = twice as slow)"))
        for site, w in self.work.items():
            if not (math.isfinite(w) and w >= 0):
                raise ConfigError(explain(f"work[{site}]", w, "must be finite and >= 0",
                                          "give each site's relative work (1 = average)"))

    def factor(self, site: int) -> float:
        """The fixed speed factor of ``site`` (larger = slower)."""
        if 0 <= site < len(self.factors):
            return float(self.factors[site])
        if self.site_sigma == 0:
            return 1.0
        z = np.random.default_rng([int(self.seed), int(site) % 2**63, 1]).standard_normal()
        return float(math.exp(self.site_sigma * float(z)))

    def delay(self, site: int, job: int) -> float:
        """The lognormal per-job multiplier ``exp(sigma * z)`` of ``site``'s job ``job``."""
        if self.sigma == 0:
            return 1.0
        z = np.random.default_rng([int(self.seed), int(site) % 2**63, int(job) % 2**63, 2]
                                  ).standard_normal()
        return float(math.exp(self.sigma * float(z)))

    def duration(self, site: int, job: int) -> float:
        """Simulated seconds of ``site``'s job ``job`` (from dispatch to reply)."""
        work = float(self.work.get(int(site), 1.0))
        return self.latency + self.job_seconds * work * self.factor(site) * self.delay(site, job)
