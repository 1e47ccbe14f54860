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

__all__ = ["SecAggParams", "default_num_neighbours"]


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
