"""The upload spec: what a site does to its update on the way up, parsed once.

``compression.up`` (``"topk:0.01+ef+int8"``), ``compression.support`` and ``compression.down``
are checked and combined here into one typed :class:`UploadSpec`, once per run on the server
and once per spec text at a site (:meth:`UploadSpec.parse` is memoized). The per-round
compressor is built from the already-split stages (:meth:`UploadSpec.compressor`); nothing
parses the text again.

Supports (``compression.support``)
----------------------------------
``reveal-indices`` (alias ``own``)
    ``topk`` / ``randk`` run as written: each site picks its own positions and the server
    sees them (the DESIGN.md rule: an index-revealing mode says so in its name).
``random`` / ``block`` / ``topk-aggregate``
    An own-index sparsifier becomes the public-support stage of the same amount (``shared``,
    ``block``, ``aggtopk``): every site sends the values on one support derived from public
    information only (no index bytes, nothing revealed per site). Required under secure
    aggregation, where masks cancel only on a support all sites share.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.compression import Compressor, ParsedSpec, parse_spec
from fedagg.errors import ConfigError, explain

__all__ = [
    "DOWN_CODECS",
    "REVEALING_SUPPORTS",
    "SUPPORTS",
    "UploadSpec",
    "effective_spec",
    "public_seed",
]

REVEALING_SUPPORTS = ("reveal-indices", "own")
"""``compression.support`` values that let each site choose (and reveal) its own positions."""
SUPPORTS = (*REVEALING_SUPPORTS, "random", "block", "topk-aggregate")
DOWN_CODECS = ("none", "fp16", "bf16")

_SUPPORT_STAGES = {"random": "shared", "block": "block", "topk-aggregate": "aggtopk"}
_OWN_INDEX = ("topk", "randk")
_PUBLIC = ("shared", "block", "aggtopk")
_QUANTIZERS = ("int8", "fp16", "bf16")


def public_seed(run_seed: int) -> bytes:
    """The public seed of shared supports, derived from ``run.seed`` (known to every party)."""
    return f"fedagg/run-seed/{int(run_seed)}".encode()


def _stages(spec: str) -> list[tuple[str, str]]:
    out = []
    for part in spec.split("+"):
        name, _, rest = part.strip().partition(":")
        out.append((name.strip().lower().replace("_", "-"), rest))
    return out


def _amount_args(rest: str) -> str:
    """Keep only the amount of a stage's arguments (ratio, k); drop mode words and options."""
    keep = []
    for raw in rest.split(","):
        item = raw.strip()
        key = item.partition("=")[0].strip().lower()
        amount = key in ("ratio", "k") if "=" in item else bool(item) and not item.isalpha()
        if amount:
            keep.append(item)
    return ",".join(keep)


def effective_spec(up: str, support: str) -> str:
    """The upward spec the sites run, given ``compression.up`` and ``compression.support``.

    Raises
    ------
    ConfigError
        Unknown support, or a spec naming a different public-support stage than ``support``.

    Examples
    --------
    >>> effective_spec("topk:0.01,global+ef+int8", "topk-aggregate")
    'aggtopk:0.01+ef+int8'
    """
    if support in REVEALING_SUPPORTS:
        return up
    if support not in _SUPPORT_STAGES:
        raise ConfigError(explain("compression.support", support,
                                  "must be one of reveal-indices (alias own), random, block, "
                                  "topk-aggregate", "choose one of the listed supports"))
    target = _SUPPORT_STAGES[support]
    parts = up.split("+")
    for i, (name, rest) in enumerate(_stages(up)):
        if name in _OWN_INDEX:
            parts[i] = f"{target}:{_amount_args(rest)}"
            return "+".join(p.strip() for p in parts)
        if name in _PUBLIC and name != target:
            raise ConfigError(explain("compression.up", up,
                                      f"stage {name!r} contradicts compression.support={support!r}",
                                      f"write the amount as 'topk:<ratio>' and let support pick "
                                      f"{target!r}, or set compression.support='reveal-indices'"))
    return up


def _check_secure(up: str, support: str, spec: str, names: tuple[str, ...]) -> None:
    """Refuse what cannot run under secure aggregation, with the reason."""
    own = [n for n in names if n in _OWN_INDEX]
    if own:
        raise ConfigError(explain(
            "compression.support", support,
            f"'{own[0]}' chooses indices per site; under secure aggregation they cannot be "
            "masked (masks cancel only on a support all sites share) and sending them would "
            "reveal which coordinates mattered to each site",
            f"set compression.support = 'random', 'block' or 'topk-aggregate' (public supports)"
            f" with compression.up = {up!r}, or drop secure aggregation if revealing per-site "
            "indices is acceptable"))
    quant = [n for n in names if n in _QUANTIZERS]
    if quant:
        raise ConfigError(explain(
            "compression.up", up,
            f"the quantizer '{quant[0]}' is meaningless under secure aggregation: masked values "
            "are fixed point in a ring of at most 32 bits (secagg.precision / secagg.ring_bits "
            "set the width and precision), so it would only add error; secure "
            "uploads are dense or sparse on a public support",
            "drop the quantizer stage, e.g. compression.up = 'topk:0.01+ef' with "
            "compression.support = 'random'"))
    other = [n for n in names if n not in (*_PUBLIC, "ef")]
    if other or not any(n in _PUBLIC for n in names):
        raise ConfigError(explain(
            "compression.up", up,
            "secure aggregation accepts one public-support sparsifier (a topk / randk amount "
            "with compression.support = random | block | topk-aggregate) plus optional 'ef'",
            "e.g. compression.up = 'topk:0.01+ef' with compression.support = 'random'"))


@dataclass(frozen=True)
class UploadSpec:
    """What sites do to their update on the way up, and how the global model goes down.

    Build with :meth:`parse`. Immutable; equal specs compare equal.

    Attributes
    ----------
    up : str
        The effective upward spec the sites run (``"none"``: the plain trained model / dense
        delta), after the support rewrite of :func:`effective_spec`.
    requested : str
        ``compression.up`` as written.
    support : str
        ``compression.support``.
    down : str
        Downward codec of the global model: ``none``, ``fp16`` or ``bf16``.
    secure : bool
        Whether the uploads are masked (secure aggregation).
    stages : tuple of str
        The stage names of :attr:`up`, in order.
    """

    up: str
    requested: str = "none"
    support: str = "reveal-indices"
    down: str = "none"
    secure: bool = False
    stages: tuple[str, ...] = ("none",)
    _parsed: ParsedSpec | None = field(default=None, compare=False, repr=False)

    @staticmethod
    def parse(up: str = "none", *, support: str = "reveal-indices", down: str = "none",
              secure: bool = False) -> UploadSpec:
        """Check and combine the compression settings (memoized on the arguments).

        Raises
        ------
        ConfigError
            A bad spec (named part, rule, fix), an unknown support or downward codec, or a
            combination secure aggregation cannot run (own indices, quantizers).
        """
        return _parse(str(up), str(support), str(down), bool(secure))

    @property
    def dense(self) -> bool:
        """No upward compression: sites send the trained model (or, secure, the dense delta)."""
        return self.up == "none"

    @property
    def error_feedback(self) -> bool:
        """Whether sites keep an error-feedback residual."""
        return "ef" in self.stages

    @property
    def needs_previous(self) -> bool:
        """Whether the support is the top-k of the previous public aggregate (``aggtopk``)."""
        return "aggtopk" in self.stages

    @property
    def public_support(self) -> bool:
        """Whether every site sends the values on one public support (no index bytes)."""
        return any(n in _PUBLIC for n in self.stages)

    @property
    def reveals_indices(self) -> bool:
        """Whether each site sends positions it chose itself (seen by the server)."""
        return any(n in _OWN_INDEX for n in self.stages)

    @property
    def active(self) -> bool:
        """Whether sites must run the upload pipeline at all (anything but plain FedAvg)."""
        return not self.dense or self.down != "none" or self.secure

    def compressor(self, *, run_seed: int, server_round: int,
                   previous_aggregate: NDArray[Any] | None = None) -> Compressor:
        """The compressor of one round (identical at every site and on the server).

        ``aggtopk`` needs the previous public aggregate; without one (first round, or the
        previous model unknown) it is the seeded random support (``shared``) of the same
        amount.
        """
        parsed = self._parsed if self._parsed is not None else parse_spec(self.up)
        rename = {"aggtopk": "shared"} if previous_aggregate is None else None
        return parsed.build(seed=public_seed(run_seed), round=int(server_round),
                            previous_aggregate=previous_aggregate, rename=rename)


@functools.lru_cache(maxsize=64)
def _parse(up: str, support: str, down: str, secure: bool) -> UploadSpec:
    if down not in DOWN_CODECS:
        raise ConfigError(explain("compression.down", down, "must be none, fp16 or bf16",
                                  "choose one of the listed codecs"))
    if support not in SUPPORTS:
        raise ConfigError(explain("compression.support", support,
                                  "must be one of reveal-indices (alias own), random, block, "
                                  "topk-aggregate", "choose one of the listed supports"))
    spec = effective_spec(up, support)
    parsed = parse_spec(spec)
    names = parsed.names
    if secure and spec != "none":
        _check_secure(up, support, spec, names)
    if secure and down != "none":
        raise ConfigError(explain(
            "compression.down", down,
            "secure aggregation masks the delta against the model as sent; a lossy downward "
            "codec is not supported there yet", "set compression.down = 'none'"))
    out = UploadSpec(up=spec, requested=up, support=support, down=down, secure=secure,
                     stages=names, _parsed=parsed)
    # validate the arguments now: a bad spec fails at start-up, not in round 1 at every site
    out.compressor(run_seed=0, server_round=1)
    if out.needs_previous:
        out.compressor(run_seed=0, server_round=1, previous_aggregate=np.zeros(1, np.float32))
    return out
