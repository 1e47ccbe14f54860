"""Compressor specs (``"topk:0.01+ef+int8"``) and the compressor registry.

Grammar::

    spec   := stage ("+" stage)*
    stage  := name [":" arg ("," arg)*]
    arg    := value | key "=" value

At most one *sparsifier* (``none``, ``topk``, ``randk``, ``shared``, ``block``, ``aggtopk``,
the secure sparse stages ``sketch``, ``vote``, ``shared-dgc`` of
:mod:`fedagg.compression.stages`, or a plugin compressor) comes first, then at most one
*quantizer* (``fp16``, ``bf16``, ``int8`` or a plugin quantizer). ``ef`` may appear once, anywhere, and wraps the whole
pipeline in :class:`~fedagg.compression.error_feedback.ErrorFeedback`. Names are
case-insensitive; ``_`` and ``-`` are the same. See ``docs/compression.md`` for every stage.

Plugins register a factory in the entry-point group ``fedagg.compressors``. A factory takes a
:class:`StageContext` and returns a compressor (has ``compress``) or a quantizer (has
``quantize``); it raises ``ctx.error(rule, fix)`` on bad arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg._registry import Registry
from fedagg.compression import stages as _secure_stages
from fedagg.compression.base import Chain, Compressor, Identity, Quantizer
from fedagg.compression.error_feedback import ErrorFeedback
from fedagg.compression.quantize import BF16, FP16, Int8
from fedagg.compression.select import k_from_ratio
from fedagg.compression.stage_context import FIXES, StageContext, StageFactory
from fedagg.compression.support import (
    SharedSupport,
    block_support,
    random_support,
    topk_of_aggregate,
)
from fedagg.compression.topk import RandomK, TopK
from fedagg.errors import ConfigError, RegistryError, did_you_mean, explain

__all__ = ["ParsedSpec", "build_compressor", "parse_spec", "registry"]


registry: Registry[StageFactory] = Registry("compressor", group="fedagg.compressors")
"""Stage names -> factories. Plugins: entry-point group ``fedagg.compressors``."""



def _words(ctx: StageContext, allowed: tuple[str, ...], what: str) -> tuple[list[str], str | None]:
    """Split positional args into amounts (anything not a word) and at most one mode word."""
    nums = [a for a in ctx.args if not a.isalpha() or a in ("nan", "inf")]
    words = [a for a in ctx.args if a not in nums]
    if len(words) > 1 or any(w not in allowed for w in words):
        raise ctx.error(f"{what} {words} must be one of {list(allowed)}", ctx.fix())
    return nums, (words[0] if words else None)


def _amount(ctx: StageContext, nums: list[str]) -> tuple[float | None, int | None]:
    """Ratio (a number with '.' or 'e') or k (an integer) from the args / kwargs."""
    given = [*nums, *(f"{k}=" for k in ("ratio", "k") if k in ctx.kwargs)]
    if len(given) > 1:
        raise ctx.error("give one amount: a ratio or k, not both", ctx.fix())
    if "ratio" in ctx.kwargs:
        return ctx.ratio(ctx.kwargs["ratio"]), None
    if "k" in ctx.kwargs:
        return None, ctx.count(ctx.kwargs["k"])
    if not nums:
        raise ctx.error("needs a ratio (e.g. 0.01) or k=<int>", ctx.fix())
    if nums[0].isdigit():
        return None, int(nums[0])
    return ctx.ratio(nums[0]), None


def _k_total(ratio: float | None, k: int | None, dim: int) -> int:
    return min(k, dim) if k is not None else k_from_ratio(ratio or 0.0, dim)


def _none(ctx: StageContext) -> Identity:
    ctx.expect(0, set())
    return Identity()


def _topk(ctx: StageContext) -> TopK:
    ctx.expect(2, {"ratio", "k", "scope"})
    nums, word = _words(ctx, ("tensor", "global"), "scope")
    ratio, k = _amount(ctx, nums)
    scope = ctx.kwargs.get("scope", word or "tensor")
    if scope not in ("tensor", "global"):
        raise ctx.error(f"scope {scope!r} must be 'tensor' or 'global'", ctx.fix())
    return TopK(ratio, k=k, scope="global" if scope == "global" else "tensor")


def _randk(ctx: StageContext) -> RandomK:
    ctx.expect(2, {"ratio", "k"})
    nums, word = _words(ctx, ("private", "shared"), "mode")
    ratio, k = _amount(ctx, nums)
    if word != "shared":
        return RandomK(ratio, k=k)
    seed, rnd = ctx.public()
    return RandomK(ratio, k=k, seed=seed, round=rnd)


def _shared(ctx: StageContext) -> SharedSupport:
    ctx.expect(1, {"ratio", "k"})
    ratio, k = _amount(ctx, list(ctx.args))
    seed, rnd = ctx.public()
    return SharedSupport(lambda d: random_support(d, _k_total(ratio, k, d), round=rnd, seed=seed))


def _block(ctx: StageContext) -> SharedSupport:
    ctx.expect(1, {"ratio", "k"})
    ratio, k = _amount(ctx, list(ctx.args))
    seed, rnd = ctx.public()
    return SharedSupport(lambda d: block_support(d, _k_total(ratio, k, d), round=rnd, seed=seed))


def _aggtopk(ctx: StageContext) -> SharedSupport:
    ctx.expect(1, {"ratio", "k", "random"})
    ratio, k = _amount(ctx, list(ctx.args))
    frac = ctx.ratio(ctx.kwargs["random"]) if "random" in ctx.kwargs else 0.0
    seed, rnd = ctx.public()
    agg = ctx.previous_aggregate
    if agg is None:
        raise ctx.error(
            "needs the previous round's public aggregate",
            "pass previous_aggregate=..., or use 'shared:<ratio>' in the first round",
        )
    flat = np.asarray(agg, dtype=np.float64).ravel()

    def support(d: int) -> NDArray[np.int64]:
        if d != flat.shape[0]:
            raise ctx.error(
                f"previous aggregate has {flat.shape[0]} elements but the update has {d}",
                "pass the aggregate of the same model",
            )
        return topk_of_aggregate(
            flat, _k_total(ratio, k, d), random_fraction=frac, round=rnd, seed=seed
        )

    return SharedSupport(support)


def _fp16(ctx: StageContext) -> FP16:
    ctx.expect(0, set())
    return FP16()


def _bf16(ctx: StageContext) -> BF16:
    ctx.expect(0, set())
    return BF16()


def _int8(ctx: StageContext) -> Int8:
    ctx.expect(2, {"chunk", "rounding"})
    chunk, rounding = 256, "stochastic"
    for a in ctx.args:
        if a.isdigit():
            chunk = int(a)
        else:
            rounding = a
    chunk = ctx.count(ctx.kwargs["chunk"], "chunk") if "chunk" in ctx.kwargs else chunk
    rounding = ctx.kwargs.get("rounding", rounding)
    if rounding not in ("stochastic", "nearest"):
        raise ctx.error(f"rounding {rounding!r} must be 'stochastic' or 'nearest'", FIXES["int8"])
    if not 1 <= chunk <= 2**31 - 1:
        raise ctx.error(f"chunk {chunk} must be in [1, 2**31 - 1]", FIXES["int8"])
    return Int8(chunk, stochastic=rounding == "stochastic")


for _name, _factory in (
    ("none", _none),
    ("topk", _topk),
    ("randk", _randk),
    ("shared", _shared),
    ("block", _block),
    ("aggtopk", _aggtopk),
    ("fp16", _fp16),
    ("bf16", _bf16),
    ("int8", _int8),
):
    registry.register(_name, _factory)

# The secure sparse modes (sketch, vote, shared-dgc): fedagg/compression/stages.py.
for _stage_name, _stage_factory in _secure_stages.STAGES:
    registry.register(_stage_name, _stage_factory)
FIXES.update(_secure_stages.FIXES)


def _split_part(spec: str, part: str) -> tuple[str, tuple[str, ...], dict[str, str]]:
    name, _, rest = part.partition(":")
    name = name.strip().lower().replace("_", "-")
    args: list[str] = []
    kwargs: dict[str, str] = {}
    if rest.strip():
        for raw in rest.split(","):
            item = raw.strip()
            if not item:
                raise ConfigError(
                    explain(f"compression spec {spec!r}, part", part, "empty argument", "drop ','")
                )
            if "=" in item:
                key, _, value = item.partition("=")
                key = key.strip().lower()
                if key in kwargs:
                    raise ConfigError(
                        explain(f"compression spec {spec!r}, part", part, f"{key} given twice", "")
                    )
                kwargs[key] = value.strip()
            else:
                args.append(item.lower())
    elif ":" in part:
        raise ConfigError(
            explain(f"compression spec {spec!r}, part", part, "':' without arguments", "drop ':'")
        )
    return name, tuple(args), kwargs


@dataclass(frozen=True)
class ParsedSpec:
    """A spec split into stages once (syntax checked); :meth:`build` makes the compressor.

    Building needs the public round context (seed, round, previous aggregate), which changes
    every round; the text is parsed only once (:func:`parse_spec`).

    Attributes
    ----------
    spec : str
        The spec as written.
    parts : tuple of (part, name, args, kwargs)
        One entry per ``+``-separated stage, in order.
    """

    spec: str
    parts: tuple[tuple[str, str, tuple[str, ...], tuple[tuple[str, str], ...]], ...]

    @property
    def names(self) -> tuple[str, ...]:
        """Normalized stage names, in order."""
        return tuple(p[1] for p in self.parts)

    def build(
        self,
        *,
        seed: bytes | None = None,
        round: int | None = None,
        previous_aggregate: NDArray[Any] | None = None,
        rename: dict[str, str] | None = None,
    ) -> Compressor:
        """The compressor of one round (see :func:`build_compressor`).

        ``rename`` maps a stage name to another factory with the same arguments (used for the
        first round of ``aggtopk``, which falls back to ``shared``).
        """
        return _assemble(self, seed, round, previous_aggregate, rename or {})


def parse_spec(spec: str) -> ParsedSpec:
    """Split ``spec`` into stages (syntax only; the stages' arguments are checked by building).

    Raises
    ------
    ConfigError
        Empty spec, empty stage, bad argument syntax.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(
            explain("compression spec", spec, "must be a non-empty string", "e.g. 'none'")
        )
    parts = []
    for raw in spec.split("+"):
        part = raw.strip()
        if not part:
            raise ConfigError(
                explain(f"compression spec {spec!r}, part", raw, "empty stage", "remove the '+'")
            )
        name, args, kwargs = _split_part(spec, part)
        parts.append((part, name, args, tuple(kwargs.items())))
    return ParsedSpec(spec, tuple(parts))


def build_compressor(
    spec: str,
    *,
    seed: bytes | None = None,
    round: int | None = None,
    previous_aggregate: NDArray[Any] | None = None,
) -> Compressor:
    """Build a compressor from a spec string.

    Parameters
    ----------
    spec : str
        E.g. ``"none"``, ``"bf16"``, ``"topk:0.01+ef+int8"``, ``"shared:0.01+ef"``.
    seed : bytes, optional
        Public federation seed (needed by ``shared``, ``block``, ``aggtopk``,
        ``randk:...,shared``).
    round : int, optional
        Current round (same stages).
    previous_aggregate : ndarray, optional
        Previous round's public aggregate (``aggtopk``).

    Returns
    -------
    Compressor
        ``ErrorFeedback(...)`` when the spec contains ``ef`` (restore its state with
        ``load_state_dict``), else a plain compressor.

    Raises
    ------
    ConfigError
        Naming the spec, the bad part, the rule and the fix.
    """
    return parse_spec(spec).build(seed=seed, round=round, previous_aggregate=previous_aggregate)


def _assemble(
    parsed: ParsedSpec,
    seed: bytes | None,
    round: int | None,
    previous_aggregate: NDArray[Any] | None,
    rename: dict[str, str],
) -> Compressor:
    spec = parsed.spec
    ef = False
    first: Compressor | None = None
    quantizer: Quantizer | None = None
    for part, name, args, kw in parsed.parts:
        kwargs = dict(kw)
        name = rename.get(name, name)
        ctx = StageContext(spec, part, name, args, kwargs, seed, round, previous_aggregate)
        if name == "ef":
            if args or kwargs:
                raise ctx.error("ef takes no arguments", "write 'ef'")
            if ef:
                raise ctx.error("ef appears twice", "write 'ef' once")
            ef = True
            continue
        try:
            factory = registry.get(name)
        except RegistryError:
            names = ["ef", *registry.names()]
            raise ctx.error(
                f"unknown stage {name!r}{did_you_mean(name, names)}; known: {', '.join(names)}",
                "use a known stage"
            ) from None
        stage = factory(ctx)
        if isinstance(stage, Quantizer):
            if quantizer is not None:
                raise ctx.error("at most one quantizer", "keep one of fp16 / bf16 / int8")
            quantizer = stage
        elif isinstance(stage, Compressor):
            if first is not None:
                raise ctx.error("at most one sparsifier", "keep one sparsifier stage")
            if quantizer is not None:
                raise ctx.error("the sparsifier must come before the quantizer", "reorder")
            first = stage
        else:
            raise ctx.error("factory returned neither a compressor nor a quantizer", "fix plugin")
    if isinstance(first, Identity) and (ef or quantizer is not None):
        raise ConfigError(
            explain(
                f"compression spec {spec!r}, part",
                "none",
                "'none' cannot be combined with other stages",
                "write 'none' alone, or drop it (e.g. 'bf16+ef')",
            )
        )
    if ef and first is None and quantizer is None:
        raise ConfigError(
            explain(
                f"compression spec {spec!r}, part", "ef", "ef needs a lossy stage", "'topk:0.01+ef'"
            )
        )
    pipeline: Compressor
    if first is None:
        if quantizer is None:  # unreachable: spec had at least one stage
            raise ConfigError(explain("compression spec", spec, "no stage", "e.g. 'none'"))
        pipeline = quantizer if isinstance(quantizer, Compressor) else Chain(Identity(), quantizer)
    else:
        pipeline = first if quantizer is None else Chain(first, quantizer)
    return ErrorFeedback(pipeline) if ef else pipeline
