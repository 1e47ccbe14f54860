"""The sections of the update protocols: ``[compression]``, ``[secagg]`` (SecAgg+),
``[privacy]`` (distributed differential privacy in the secure sum) and ``[asynchronous]``
(FedBuff, deadline rounds).

Frozen pydantic models with ``extra="forbid"``, like the other sections
(:mod:`fedagg.config.sections`); :class:`fedagg.config.RunConfig` holds one of each, and every
name here is importable from the package :mod:`fedagg.config` as well.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from fedagg.aggregate import MEDIAN_MIN_UPDATES
from fedagg.asyncagg.guards import DEFAULT_GUARD_WINDOW
from fedagg.config.sections import Section

__all__ = ["AsynchronousConfig", "CompressionConfig", "PrivacyConfig", "SecAggConfig"]


class CompressionConfig(Section):
    """Upward / downward update compression."""

    up: str = Field(
        "none",
        description="Upward compressor spec, e.g. 'topk:0.01+ef+int8' (see docs/compression.md).",
    )
    down: Literal["none", "fp16", "bf16"] = Field("none", description="Downward model compression.")
    support: Literal["own", "reveal-indices", "random", "block", "topk-aggregate"] = Field(
        "own",
        description="Sparse support: 'reveal-indices' (alias 'own') lets each site send its own "
        "positions, revealing them to the server; 'random', 'block', 'topk-aggregate' are public.",
    )


class SecAggConfig(Section):
    """Secure aggregation, SecAgg+ (used by the 'secure' strategy; docs/protocols/secagg.md)."""

    threshold: float = Field(
        0.5,
        gt=0,
        description="Shamir threshold t. A whole number >= 1 is t itself; a fraction f in (0, 1) "
        "means t = floor(f * k) + 1, i.e. more than that fraction of a site's k neighbours.",
    )
    neighbours: int | None = Field(
        None,
        ge=1,
        description="Neighbours per site k (k-regular graph); None = min(N-1, 3*ceil(log2 N)) "
        "(SecAgg+; all other sites, classic SecAgg, while N <= 16).",
    )
    clip: float = Field(
        8.0, gt=0, description="Each entry of a site's update (model delta) is clipped to "
        "[-clip, clip] before encoding."
    )
    frac_bits: int | None = Field(
        None, ge=1, le=30,
        description="Fixed-point fractional bits; None = auto: the fewest that meet "
        "secagg.precision (or, with ring_bits set, the most that fit that ring).",
    )
    ring_bits: int | None = Field(
        None, ge=8, le=32,
        description="Width b of the ring Z_2^b of masked values (uploads are bit-packed at b bits "
        "per value); None = the smallest with headroom for sites x clip range at frac_bits.",
    )
    precision: float = Field(
        1e-6, gt=0,
        description="Target worst-case abs error of the mean at full weight, 2^-frac_bits * "
        "(1 + clip), for auto frac_bits; if it needs more than 32 bits, the 32-bit ring is used.",
    )
    weight_scale: float = Field(
        10_000.0, gt=0,
        description="Public upper bound on a site's weight (training examples); a larger "
        "weight fails the site's upload. Precision is relative to it.",
    )
    timeout: float = Field(
        120.0, gt=0, description="Seconds to wait for replies in the key-setup and unmask "
        "exchanges (the masked upload rides with training and uses run.round_timeout)."
    )
    threads: int = Field(
        0, ge=0, le=16,
        description="Server worker threads for adding uploads and expanding self masks; 0 = "
        "$FEDAGG_SECAGG_THREADS if set, else one per CPU (at most 4); 1 = none. Sites use "
        "$FEDAGG_SECAGG_THREADS or one per CPU (at most 4). Results are bit-identical for any "
        "value.",
    )
    exclude_blamed: bool = Field(
        True,
        description="Leave a site out of the run's later rounds once its own relayed shares "
        "made a round abort (ServerState.blamed_sites; docs/protocols/secagg.md, section 6); "
        "false = it is re-keyed and may take part again.",
    )

    @model_validator(mode="after")
    def _check_threshold(self) -> SecAggConfig:
        if self.threshold >= 1 and not float(self.threshold).is_integer():
            raise ValueError(
                f"secagg.threshold ({self.threshold}) must be a whole number >= 1 (t itself) "
                "or a fraction in (0, 1); use e.g. 3 or 0.5"
            )
        if self.neighbours is not None and self.threshold >= 1 and self.threshold > self.neighbours:
            raise ValueError(
                f"secagg.threshold ({int(self.threshold)}) exceeds secagg.neighbours "
                f"({self.neighbours}): a site's secrets are shared among its neighbours only, "
                "so t shares cannot exist; lower the threshold or raise neighbours"
            )
        return self

    def resolve_threshold(self, k: int) -> int:
        """The threshold ``t`` for neighbourhoods of ``k`` sites."""
        if self.threshold >= 1:
            return int(self.threshold)
        return min(k, int(self.threshold * k) + 1)


class AsynchronousConfig(Section):
    """Asynchronous and semi-asynchronous aggregation: FedBuff, deadline rounds (docs/asynchronous.md).

    With ``mode = "fedbuff"`` or ``"deadline"`` the server runs the asynchronous loop
    (``server/asynchronous.py``) instead of synchronous rounds; ``run.rounds`` is then the
    number of model versions (buffers applied; deadline mode: rounds). The ``sim_*`` keys
    describe simulated site speeds for the in-process grid with a virtual clock
    (``server.delayed.DelayedGrid``, ``benchmarks/async.py``); Flower's engines ignore them.
    """

    mode: Literal["off", "fedbuff", "deadline"] = Field(
        "off",
        description="'off': synchronous rounds; 'fedbuff': buffered asynchronous aggregation "
        "(Nguyen et al. 2022, Algorithm 1); 'deadline': synchronous rounds that close at "
        "asynchronous.deadline and fold late updates into a later round with their staleness "
        "weight.",
    )
    concurrency: int | None = Field(
        None, ge=1,
        description="FedBuff's C: sites training at once (secure: cohort members that have "
        "not uploaded yet); None = run.sites x run.fraction_train.",
    )
    buffer_size: int = Field(
        10, ge=1,
        description="FedBuff's K: updates folded before the buffer is applied, at most one per "
        "site (a site gets one job per buffer; a buffer fewer than K sites can fill is applied "
        "once every connected site has replied; K = run.sites waits for every site); secure: "
        "the cohort size, <= concurrency.",
    )
    weighting: Literal["examples", "uniform"] = Field(
        "examples",
        description="Buffer mean: 'examples' = sum w(s) n Delta / sum n (FedAvg's weights; "
        "K = C = N without delays is synchronous FedAvg), 'uniform' = sum w(s) Delta / K "
        "(the paper as written).",
    )
    staleness: Literal["constant", "polynomial", "hinge"] = Field(
        "polynomial",
        description="Staleness weight w(s): 'constant' 1, 'polynomial' (1 + s)^-a, 'hinge' 1 "
        "up to b then 1 / (a (s - b) + 1) (Xie et al. 2019).",
    )
    staleness_a: float = Field(
        0.5, ge=0, description="Exponent of 'polynomial' (0.5: FedBuff's 1/sqrt(1+s)) or slope "
        "of 'hinge'."
    )
    staleness_b: int = Field(4, ge=0, description="Knee of 'hinge' (versions).")
    max_staleness: int | None = Field(
        10, ge=0,
        description="Updates trained from a model more than this many versions old are "
        "refused (named in metrics.json) and never reach the model; None = no bound.",
    )
    guard_window: int = Field(
        DEFAULT_GUARD_WINDOW, ge=MEDIAN_MIN_UPDATES, le=100_000,
        description="Median-relative guards of the asynchronous loop: an arriving update is "
        "judged against the delta norms and weights of the latest accepted update of each of "
        "the last N sites, its own site's left out (with itself: a round of one update per "
        "site, as strategy.norm_outlier_factor / strategy.max_weight_ratio judge a synchronous "
        "round) before it is folded; the guards act once that round has "
        f"{MEDIAN_MIN_UPDATES} updates. "
        "Secure cohorts: the norm guard on the cohort's sum only, each cohort an entry.",
    )
    deadline: float = Field(
        60.0, gt=0,
        description="Deadline mode: seconds after its start at which a round aggregates what "
        "arrived (earlier when every site of the round replied).",
    )
    cohort_quorum: float = Field(
        1.0, gt=0, le=1,
        description="Secure FedBuff: a cohort closes once this fraction of its sites uploaded "
        "(the rest count as dropped and their masks are removed with Shamir shares; their "
        "late uploads are refused), or at run.round_timeout.",
    )
    cohort_grace: float = Field(
        0.0, ge=0, le=100,
        description="Secure FedBuff: once a cohort's quorum uploaded, wait up to this multiple "
        "of the time the quorum took (from the cohort's dispatch) for its other members "
        "before it closes; it closes at once when all replied. 0 = close at the quorum. "
        "A member carrying a held update (carry_late) is waited for up to max(this, 1) "
        "times that time.",
    )
    carry_late: bool = Field(
        True,
        description="Secure FedBuff, dense uploads: a member whose upload arrived after its "
        "cohort closed uploads that update again, masked for its next cohort and scaled by "
        "its extra staleness, instead of training afresh (the server proves to it that the "
        "late upload was never unmasked). false = late updates are wasted.",
    )
    max_seconds: float | None = Field(
        None, gt=0,
        description="Stop once the run's clock (simulated or wall seconds) passes this, even "
        "before run.rounds versions.",
    )
    poll: float = Field(
        0.05, gt=0, description="Seconds between pulls for replies on a real Grid (wall clock)."
    )
    sim_job_seconds: float = Field(
        10.0, ge=0,
        description="Simulated seconds of one training job at speed factor 1 (0 with "
        "sim_latency 0: zero delays).",
    )
    sim_sigma: float = Field(
        0.5, ge=0, description="Lognormal sigma of each job's simulated delay multiplier."
    )
    sim_site_sigma: float = Field(
        0.0, ge=0,
        description="Lognormal sigma of the fixed per-site speed factors drawn for sites not in "
        "sim_factors (0: all 1).",
    )
    sim_factors: list[float] = Field(
        default_factory=list,
        description="Fixed speed factors of sites 0, 1, ... (partition ids; 2 = twice as "
        "slow); a comma-separated string is accepted.",
    )
    sim_latency: float = Field(
        0.0, ge=0, description="Simulated seconds added to every message (network latency)."
    )
    sim_work: Literal["uniform", "examples"] = Field(
        "uniform",
        description="Simulated job length: the same for every site, or proportional to the "
        "site's training examples (relative to the mean).",
    )

    @field_validator("sim_factors", mode="before")
    @classmethod
    def _factors_from_text(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [float(v) for v in value.replace(" ", "").split(",") if v]
        return value


class PrivacyConfig(Section):
    """Distributed differential privacy in the secure sum (docs/privacy.md).

    With ``mode = "distributed"`` every site of a secure round clips its update to L2 norm
    ``clip``, rotates, rounds and adds its share of discrete Gaussian noise in the secure
    aggregation ring (Kairouz, Liu, Steinke, ICML 2021), so the server unmasks only a noisy
    sum of clipped updates; each round's privacy loss is counted with ``dp-accounting`` and
    written to metrics.json. Needs secure aggregation of dense updates (``strategy.name =
    "secure"``, ``compression.up = "none"``) in synchronous rounds.
    """

    mode: Literal["off", "distributed"] = Field(
        "off", description="'off': no differential privacy; 'distributed': each site adds its "
        "share of discrete Gaussian noise before masking (distributed DP under SecAgg+).")
    epsilon: float = Field(
        8.0, gt=0, le=1000,
        description="The run's budget: the noise is calibrated so that run.rounds rounds, each "
        "site in every round, spend at most this epsilon at privacy.delta.")
    delta: float = Field(1e-5, gt=0, lt=1, description="The run's delta.")
    clip: float = Field(
        1.0, gt=0, le=1e6,
        description="L2 norm to which each site clips its update (model units): the "
        "sensitivity of the sum. The decoded mean is the unweighted mean of the clipped "
        "updates.")
    ring_bits: int = Field(
        18, ge=8, le=32,
        description="Bits per coordinate of the secure sum (the secure aggregation ring); "
        "secagg.ring_bits must be unset or the same. Fewer bits: fewer bytes, coarser grid.")
    dropout_fraction: float = Field(
        0.2, ge=0, lt=1,
        description="Share of a round's sites that may drop out with the noise still at its "
        "target: each site's share is sized for ceil((1 - f) x sites) survivors, and a sum "
        "with fewer survivors is refused.")
    target_epsilon: float | None = Field(
        None, gt=0,
        description="Stop the run before a round would take the spent epsilon above this "
        "(the last round's model kept). None: privacy.epsilon.")

    @property
    def on(self) -> bool:
        """Whether distributed DP is on."""
        return self.mode != "off"

    @property
    def stop_at(self) -> float:
        """The epsilon the run must not exceed."""
        return float(self.target_epsilon if self.target_epsilon is not None else self.epsilon)

