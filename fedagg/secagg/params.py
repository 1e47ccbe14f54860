"""Public parameters of the secure-aggregation protocol, validated once.

:class:`SecAggParams` is the core's configuration; the pydantic model at the Flower edge is
built from it. Impossible combinations raise :class:`~fedagg.errors.ConfigError` naming the
field, the value, the rule and the fix.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from fedagg.errors import ConfigError, explain
from fedagg.secagg import fixed_point

__all__ = [
    "DEFAULT_MIN_NEIGHBOURS",
    "DEFAULT_THRESHOLD_FLOOR",
    "SecAggParams",
    "check_site_floor",
    "default_num_neighbours",
    "validate_site_floor",
]

DEFAULT_THRESHOLD_FLOOR = 0.5
"""A site's default floor for ``t``: it refuses ``t <= 0.5 k``, i.e. it needs ``t > k / 2``."""
DEFAULT_MIN_NEIGHBOURS = 3
"""A site's default minimum graph degree (capped at ``N - 1``, the complete graph)."""


def default_num_neighbours(num_sites: int) -> int:
    """``min(N - 1, 3 * ceil(log2 N))``: the ``O(log N)`` degree of SecAgg+ (Bell et al. 2020)."""
    if num_sites < 2:
        return 0
    return min(num_sites - 1, 3 * math.ceil(math.log2(num_sites)))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SecAggParams:
    """Secure-aggregation parameters shared by the server and every site.

    Parameters
    ----------
    threshold : int
        ``t``: shares needed to rebuild a site's secret. A site's secrets are shared among its
        ``k`` neighbours, so ``1 <= t <= k``. Recommended ``t > k / 2`` (then a server that
        lies about who dropped cannot collect both kinds of share for one site) and ``t >= 2``.
        A round aborts when a secret that is needed has fewer than ``t`` live holders.
    num_neighbours : int or None
        ``k``, the degree of the neighbour graph (SecAgg+, Bell et al. 2020). ``None`` uses
        :func:`default_num_neighbours`; values above ``N - 1`` are capped at ``N - 1``
        (classic SecAgg, Bonawitz et al. 2017); when ``k`` and ``N`` are both odd ``k`` is
        raised by one (a k-regular graph needs ``N * k`` even).
    clip : float
        Update entries are clipped to ``[-clip, clip]`` before encoding.
    frac_bits : int or None
        Fixed-point fractional bits; ``None``: auto (see ``ring_bits`` and
        :func:`fedagg.secagg.fixed_point.resolve_encoding`).
    ring_bits : int or None
        Width ``b`` of the ring ``Z_2^b`` the masked values live in (``8 <= b <= 32``); masked
        uploads travel bit-packed at ``b`` bits per value. ``None``: the smallest ring with
        headroom for the sites of the round. With both ``frac_bits`` and ``ring_bits`` unset,
        ``frac_bits`` is the fewest that meet ``precision``; with only ``ring_bits`` set, the
        most that fit it.
    precision : float
        Target worst-case absolute error of the mean when every counted site has full weight
        (``2^-frac_bits * (1 + clip)``), used when ``frac_bits`` and ``ring_bits`` are unset.
        When it would need a ring wider than 32 bits, the 32-bit ring with the most fractional
        bits that fit is used instead (the round reports its real error bound).
    weight_scale : float
        Public upper bound on a site's weight (number of examples); weights are divided by it
        so the encoded weight is in ``[0, 1]``. Keep it close to the real maximum: precision is
        relative to it.
    setup_timeout_s, upload_timeout_s, unmask_timeout_s : float
        How long the Flower edge waits for each stage (the core does not read clocks).
    """

    threshold: int
    num_neighbours: int | None = None
    clip: float = 1.0
    frac_bits: int | None = None
    ring_bits: int | None = None
    precision: float = fixed_point.DEFAULT_PRECISION
    weight_scale: float = 1.0
    setup_timeout_s: float = 60.0
    upload_timeout_s: float = 600.0
    unmask_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not _is_int(self.threshold) or self.threshold < 1:
            raise ConfigError(
                explain("secagg.threshold", self.threshold, "must be an int >= 1", "use t >= 2")
            )
        if self.num_neighbours is not None:
            if not _is_int(self.num_neighbours) or self.num_neighbours < 1:
                raise ConfigError(
                    explain(
                        "secagg.num_neighbours",
                        self.num_neighbours,
                        "must be an int >= 1 or None",
                        "leave it unset for the O(log N) default",
                    )
                )
            if self.threshold > self.num_neighbours:
                raise ConfigError(
                    explain(
                        "secagg.threshold",
                        self.threshold,
                        f"exceeds num_neighbours={self.num_neighbours}; a site's secrets are "
                        "shared among its neighbours only, so t shares cannot exist",
                        f"use threshold <= {self.num_neighbours} or raise num_neighbours",
                    )
                )
        for name in ("clip", "weight_scale", "precision", "setup_timeout_s", "upload_timeout_s"):
            self._check_positive(name)
        self._check_positive("unmask_timeout_s")
        if self.frac_bits is not None:
            lo, hi = 1, fixed_point.MAX_FRAC_BITS
            if not _is_int(self.frac_bits) or not lo <= self.frac_bits <= hi:
                raise ConfigError(
                    explain(
                        "secagg.frac_bits",
                        self.frac_bits,
                        f"must be an int in [{lo}, {hi}] or None",
                        "leave it unset to pick the most that fit",
                    )
                )
        if self.ring_bits is not None:
            lo, hi = fixed_point.MIN_RING_BITS, fixed_point.MAX_RING_BITS
            if not _is_int(self.ring_bits) or not lo <= self.ring_bits <= hi:
                raise ConfigError(
                    explain(
                        "secagg.ring_bits",
                        self.ring_bits,
                        f"must be an int in [{lo}, {hi}] or None",
                        "leave it unset for the smallest ring with headroom",
                    )
                )
        if self.frac_bits is not None or self.ring_bits is not None:
            fixed_point.resolve_encoding(1, self.clip, self.frac_bits, self.ring_bits)

    def _check_positive(self, name: str) -> None:
        value = getattr(self, name)
        if not _is_real(value) or not math.isfinite(value) or value <= 0:
            raise ConfigError(
                explain(f"secagg.{name}", value, "must be a finite number > 0", "pass e.g. 1.0")
            )

    def neighbours_for(self, num_sites: int) -> int:
        """Effective graph degree ``k`` for ``num_sites`` sites (see ``num_neighbours``).

        Raises
        ------
        ConfigError
            ``num_sites < 2`` or ``threshold > k``.
        """
        if num_sites < 2:
            raise ConfigError(
                explain("sites", num_sites, "secure aggregation needs >= 2 sites", "add sites")
            )
        k = (
            default_num_neighbours(num_sites)
            if self.num_neighbours is None
            else self.num_neighbours
        )
        k = min(k, num_sites - 1)
        if (k * num_sites) % 2:
            k += 1
        if self.threshold > k:
            raise ConfigError(
                explain(
                    "secagg.threshold",
                    self.threshold,
                    f"exceeds the {k} neighbours each of {num_sites} sites has",
                    f"use threshold <= {k}, raise num_neighbours, or add sites",
                )
            )
        return k

    def encoding_for(self, num_sites: int) -> tuple[int, int]:
        """``(frac_bits, ring_bits)`` for a round with ``num_sites`` participants.

        Raises
        ------
        ConfigError
            No encoding has headroom (see :func:`fedagg.secagg.fixed_point.resolve_encoding`).
        """
        return fixed_point.resolve_encoding(
            num_sites, self.clip, self.frac_bits, self.ring_bits, self.precision
        )

    def frac_bits_for(self, num_sites: int) -> int:
        """Fractional bits for a round with ``num_sites`` participants (headroom-checked)."""
        return self.encoding_for(num_sites)[0]

    def digest(self) -> bytes:
        """SHA-256 of the parameters both sides must agree on (timeouts excluded)."""
        text = repr(
            (
                self.threshold,
                self.num_neighbours,
                self.clip,
                self.frac_bits,
                self.weight_scale,
                self.ring_bits,
                self.precision,
            )
        )
        return hashlib.sha256(b"fedagg/secagg/v2/params\x00" + text.encode()).digest()


def check_site_floor(
    params: SecAggParams,
    num_sites: int,
    *,
    threshold_floor: float = DEFAULT_THRESHOLD_FLOOR,
    min_neighbours: int = DEFAULT_MIN_NEIGHBOURS,
) -> int:
    """A site's own floor on the parameters a server asks it to use; returns ``k``.

    The server sends the parameters, so a lying server could ask for ``t = 1`` or a graph of
    degree 2 and then unmask a site's update by telling some neighbours that the site survived
    (they reveal shares of its self-mask seed) and others that it dropped (they reveal shares
    of its mask key). Every honest neighbour reveals at most one kind, so the attack needs two
    disjoint sets of ``t`` neighbours: with ``t > k / 2`` they do not exist (Bonawitz et al.
    2017, section 4, the same argument for ``t > n / 2``). The same bound defeats re-announced
    key generations (see :class:`fedagg.secagg.ClientState`).

    Parameters
    ----------
    params : SecAggParams
        The parameters the server asked for.
    num_sites : int
        Roster size ``N`` of the epoch (the site computes ``k`` from it itself).
    threshold_floor : float
        The site refuses unless ``t > threshold_floor * k``; ``0.5`` (default) is ``t > k/2``.
        ``0`` accepts any ``t >= 1`` (no protection against a server that lies about who
        dropped: for tests only).
    min_neighbours : int
        The site refuses a graph degree ``k < min(min_neighbours, N - 1)`` (``N - 1`` is the
        complete graph, the most a roster of ``N`` allows). Default 3.

    Raises
    ------
    ConfigError
        A floor is not met (or ``t > k``); the message names the field, the value, the rule
        and the fix.
    """
    k = params.neighbours_for(num_sites)
    need_k = min(min_neighbours, num_sites - 1)
    if k < need_k:
        raise ConfigError(
            explain(
                "secagg.num_neighbours",
                k,
                f"this site requires a neighbour graph of degree >= {need_k} for {num_sites} sites",
                "raise secagg.neighbours (or leave it unset), or lower the site's min_neighbours",
            )
        )
    t = params.threshold
    if not t > threshold_floor * k:
        least = math.floor(threshold_floor * k) + 1
        raise ConfigError(
            explain(
                "secagg.threshold",
                t,
                f"this site requires t > {threshold_floor:g} x k = {threshold_floor * k:g} "
                f"(k = {k} neighbours for {num_sites} sites)",
                f"use threshold >= {least} (a fraction of 0.5 gives t > k/2), "
                "or lower the site's threshold_floor",
            )
        )
    return k


def validate_site_floor(threshold_floor: object, min_neighbours: object) -> None:
    """ConfigError unless ``0 <= threshold_floor < 1`` and ``min_neighbours`` is an int >= 1."""
    if (
        isinstance(threshold_floor, bool)
        or not isinstance(threshold_floor, (int, float))
        or not 0 <= threshold_floor < 1
    ):
        raise ConfigError(
            explain(
                "threshold_floor",
                threshold_floor,
                "must be a number in [0, 1) (the site needs t > threshold_floor x k)",
                "keep the default 0.5",
            )
        )
    if (
        isinstance(min_neighbours, bool)
        or not isinstance(min_neighbours, int)
        or min_neighbours < 1
    ):
        raise ConfigError(
            explain("min_neighbours", min_neighbours, "must be an int >= 1", "keep the default 3")
        )
