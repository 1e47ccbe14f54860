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

Secure sparse modes of issue 21 (named in ``compression.up`` itself, any support setting)
--------------------------------------------------------------------------------------------
``sketch``
    FetchSGD (Rothchild et al. 2020): each site sends the count sketch of its whole update;
    the server keeps momentum and error in sketch space and applies the top-k of the summed
    sketch. Allowed in plaintext too (the server then sees each site's sketch).
``vote``
    Secure index voting: values on the support voted (securely) by all sites in the previous
    round, plus this round's vote. **Secure aggregation only**: a site's vote table is a
    Bloom filter of its own top-k indices, so a plaintext run refuses it.
``shared-dgc``
    A public support with DGC-style error feedback (Lin et al. 2018).
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
_SHARED_MODES = ("vote", "shared-dgc")
"""Issue 21's stages that send values on a shared support (no index bytes)."""
_SECURE_SPARSE = (*_PUBLIC, *_SHARED_MODES, "sketch")
"""Sparsifiers secure aggregation accepts: their masks cancel (one shared vector space)."""
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
    other = [n for n in names if n not in (*_SECURE_SPARSE, "ef")]
    if other or sum(n in _SECURE_SPARSE for n in names) != 1:
        raise ConfigError(explain(
            "compression.up", up,
            "secure aggregation accepts one sparsifier whose masks cancel: a public support "
            "(a topk / randk amount with compression.support = random | block | "
            "topk-aggregate), 'vote', 'shared-dgc' or 'sketch', plus optional 'ef'",
            "e.g. compression.up = 'topk:0.01+ef' with compression.support = 'random', "
            "'vote:0.0075,vote=0.0025,rows=2,cols=2048+ef' or 'sketch:k=2000,rows=3,cols=750'"))


def _check_plaintext(up: str, comp: object) -> None:
    """Refuse stages whose upload must only ever travel masked (``requires_secure_aggregation``).

    The flag is read from every stage of the built pipeline (through ``inner`` / ``first``),
    so a plugin stage can declare it too.
    """
    node, seen = comp, 0
    while node is not None and seen < 16:
        if getattr(node, "requires_secure_aggregation", False):
            name = type(node).__name__
            raise ConfigError(explain(
                "compression.up", up,
                f"{name} casts each site's vote table in the clear without secure "
                "aggregation: a site's vote is a Bloom filter of its own top-k, i.e. which "
                "coordinates mattered most to that site (its indices); it may only travel "
                "masked, where the server learns nothing but the sum of all votes",
                "set strategy.name = 'secure' (secure aggregation), or, in plaintext, use a "
                "public support ('topk:0.01+ef' with compression.support = 'random') or "
                "'topk:0.01+ef' with compression.support = 'reveal-indices' if revealing "
                "per-site indices is acceptable"))
        node = getattr(node, "inner", None) or getattr(node, "first", None)
        seen += 1


def _kwarg(parsed: ParsedSpec, stage: str, key: str) -> str | None:
    for _, name, _, kwargs in parsed.parts:
        if name == stage:
            return dict(kwargs).get(key)
    return None


def _dgc_on_aggregate(parsed: ParsedSpec) -> bool:
    """Whether a ``shared-dgc`` stage takes its support from the previous aggregate."""
    value = _kwarg(parsed, "shared-dgc", "support")
    return value is not None and value.strip().lower() == "aggtopk"


def _first_round_spec(parsed: ParsedSpec) -> ParsedSpec:
    """The spec without a previous aggregate: ``aggtopk:<amount>[,random=…]`` is the seeded
    random support of the same amount (``shared:<amount>``), ``shared-dgc:…,support=aggtopk``
    its default random support (``support`` and ``random`` only apply to an aggregate)."""
    dgc = _dgc_on_aggregate(parsed)
    parts = []
    for part, name, _, _ in parsed.parts:
        if name == "aggtopk" or (name == "shared-dgc" and dgc):
            stage, _, rest = part.partition(":")
            keep = [a for a in rest.split(",")
                    if a.partition("=")[0].strip().lower() not in ("support", "random")]
            part = f"{'shared' if name == 'aggtopk' else stage}:{','.join(keep)}"
        parts.append(part)
    return parse_spec("+".join(parts))


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
    _first: ParsedSpec | None = field(default=None, compare=False, repr=False)

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
        """Whether sites keep an error-feedback state (``ef``, or ``shared-dgc``'s own)."""
        return "ef" in self.stages or "shared-dgc" in self.stages

    @property
    def needs_previous(self) -> bool:
        """Whether the support is the top-k of the previous public aggregate (``aggtopk``,
        or ``shared-dgc:…,support=aggtopk``)."""
        return "aggtopk" in self.stages or self._first is not None

    @property
    def public_support(self) -> bool:
        """Whether every site sends the values on one shared support (no index bytes):
        ``shared``, ``block``, ``aggtopk``, ``vote`` or ``shared-dgc``."""
        return any(n in (*_PUBLIC, *_SHARED_MODES) for n in self.stages)

    @property
    def sketch(self) -> bool:
        """Whether sites send a count sketch of their update (FetchSGD, ``sketch``)."""
        return "sketch" in self.stages

    @property
    def votes(self) -> bool:
        """Whether sites vote for the next round's support (``vote``; secure only)."""
        return "vote" in self.stages

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
        if previous_aggregate is None and self._first is not None:
            parsed = self._first
        return parsed.build(seed=public_seed(run_seed), round=int(server_round),
                            previous_aggregate=previous_aggregate)


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
    first = (_first_round_spec(parsed) if "aggtopk" in names or _dgc_on_aggregate(parsed)
             else None)
    out = UploadSpec(up=spec, requested=up, support=support, down=down, secure=secure,
                     stages=names, _parsed=parsed, _first=first)
    # validate the arguments now: a bad spec fails at start-up, not in round 1 at every site
    built = out.compressor(run_seed=0, server_round=1)
    if not secure:
        _check_plaintext(up, built)
    if out.needs_previous:
        out.compressor(run_seed=0, server_round=1, previous_aggregate=np.zeros(1, np.float32))
    return out
