"""Spec stages of the secure sparse modes: ``sketch``, ``vote`` and ``shared-dgc``.

Registered in :data:`fedagg.compression.spec.registry` next to the built-in stages. None
reveals per-site indices (``reveals_indices = False``): under secure aggregation the server
learns only sums (see ``docs/compression.md``, "Sparse + secure: what leaks").

=============================================================  ==================================
stage                                                          builds
=============================================================  ==================================
``sketch:<k>,rows=5,cols=<int> | size=<frac>[,momentum=0]``   :class:`~.fetchsgd.SketchCompressor`
``[,lr=1][,error=zero|subtract][,epoch=0]``
``vote:<m>[,vote=<k>],rows=3,cols=<int> | size=<frac>``        :class:`~.vote.VoteSupport`
``[,mode=bloom|count][,random=<frac>]``, or
``vote:<m>[,vote=<k>],block=<B>[,random=<frac>]``              (exact block votes)
``shared-dgc:<m>[,support=random|block|aggtopk][,momentum=``   :class:`~.dgc.DGCFeedback` over a
``0.9][,decay=1][,clip=<norm>][,random=<frac>]``               :class:`~.support.SharedSupport`
=============================================================  ==================================

Amounts are a ratio of the model size (a number with ``.``) or an absolute count (an
integer). ``sketch`` keeps its error at the server and ``shared-dgc`` has its own error
feedback, so both refuse ``ef``; ``vote`` is a shared support and wants ``+ef``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedagg.compression.dgc import DGCFeedback
from fedagg.compression.fetchsgd import SketchCompressor
from fedagg.compression.select import k_from_ratio
from fedagg.compression.stage_context import StageContext
from fedagg.compression.support import (
    SharedSupport,
    block_support,
    random_support,
    topk_of_aggregate,
)
from fedagg.compression.vote import VoteSupport

__all__ = ["FIXES", "STAGES"]

FIXES: dict[str, str] = {
    "sketch": "e.g. 'sketch:0.01,rows=5,cols=4000' or 'sketch:k=2000,rows=5,size=0.02,momentum=0.9'",
    "vote": "e.g. 'vote:0.01,rows=3,size=0.02+ef', 'vote:0.01,vote=0.005,rows=3,cols=4096+ef' "
            "or 'vote:0.02,vote=0.01,block=64+ef'",
    "shared-dgc": "e.g. 'shared-dgc:0.01,momentum=0.9' or 'shared-dgc:0.01,support=block,decay=0.99'",
}


def _has_ef(ctx: StageContext) -> bool:
    names = (p.partition(":")[0].strip().lower().replace("_", "-") for p in ctx.spec.split("+"))
    return "ef" in names


def _amount(ctx: StageContext, text: str) -> tuple[float | None, int | None]:
    """A ratio (``0.01``) or an absolute count (``2000``)."""
    if text.isdigit():
        return None, int(text)
    return ctx.ratio(text), None


def _main_amount(ctx: StageContext, key: str = "k") -> tuple[float | None, int | None]:
    given = [*ctx.args, *([ctx.kwargs[key]] if key in ctx.kwargs else [])]
    if len(given) != 1:
        raise ctx.error(f"needs exactly one amount (positional or {key}=)", ctx.fix())
    return _amount(ctx, given[0])


def _cols_size(ctx: StageContext) -> tuple[int | None, float | None]:
    if ("cols" in ctx.kwargs) == ("size" in ctx.kwargs):
        raise ctx.error("give cols=<int> or size=<fraction of the model>", ctx.fix())
    if "cols" in ctx.kwargs:
        cols = ctx.count(ctx.kwargs["cols"], "cols")
        if cols < 1:
            raise ctx.error("cols must be >= 1", ctx.fix())
        return cols, None
    size = ctx.number(ctx.kwargs["size"], "size")
    if not 0.0 < size <= 64.0:
        raise ctx.error(f"size {size} must be in (0, 64]", ctx.fix())
    return None, size


def _rows(ctx: StageContext, default: int) -> int:
    rows = ctx.count(ctx.kwargs["rows"], "rows") if "rows" in ctx.kwargs else default
    if not 1 <= rows <= 64:
        raise ctx.error(f"rows {rows} must be in [1, 64]", ctx.fix())
    return rows


def _in(ctx: StageContext, key: str, lo: float, hi: float, default: float) -> float:
    if key not in ctx.kwargs:
        return default
    x = ctx.number(ctx.kwargs[key], key)
    if not lo <= x <= hi:
        raise ctx.error(f"{key} {x} must be in [{lo}, {hi}]", ctx.fix())
    return x


def _choice(ctx: StageContext, key: str, allowed: tuple[str, ...]) -> str:
    value = ctx.kwargs.get(key, allowed[0]).lower()
    if value not in allowed:
        raise ctx.error(f"{key} {value!r} must be one of {list(allowed)}", ctx.fix())
    return value


def sketch_stage(ctx: StageContext) -> SketchCompressor:
    """``sketch``: FetchSGD count sketch of the whole update (server-side momentum + error)."""
    ctx.expect(1, {"k", "rows", "cols", "size", "momentum", "lr", "error", "epoch"})
    if _has_ef(ctx):
        raise ctx.error(
            "FetchSGD keeps the error at the server, in sketch space; 'ef' does not apply",
            "drop '+ef'",
        )
    if ctx.seed is None:
        raise ctx.error("needs the public seed (the sketch's hashes)", "pass seed=<public bytes>")
    ratio, k = _main_amount(ctx)
    cols, size = _cols_size(ctx)
    error = _choice(ctx, "error", ("zero", "subtract"))
    epoch = ctx.count(ctx.kwargs["epoch"], "epoch") if "epoch" in ctx.kwargs else 0
    return SketchCompressor(
        rows=_rows(ctx, 5),
        cols=cols,
        size=size,
        k=k,
        k_ratio=ratio,
        seed=ctx.seed,
        epoch=epoch,
        momentum=_in(ctx, "momentum", 0.0, 0.999999, 0.0),
        lr=_in(ctx, "lr", 1e-12, 1e12, 1.0),
        error_update="subtract" if error == "subtract" else "zero",
    )


def vote_stage(ctx: StageContext) -> VoteSupport:
    """``vote``: values on the support voted (securely) in the previous round."""
    ctx.expect(1, {"k", "vote", "rows", "cols", "size", "mode", "random", "block"})
    seed, rnd = ctx.public()
    ratio, m = _main_amount(ctx)
    vote_ratio, vote_k = _amount(ctx, ctx.kwargs["vote"]) if "vote" in ctx.kwargs else (None, None)
    block = ctx.count(ctx.kwargs["block"], "block") if "block" in ctx.kwargs else 1
    if block < 1:
        raise ctx.error("block must be >= 1", ctx.fix())
    cols: int | None
    size: float | None
    if block > 1:
        extra = sorted({"rows", "cols", "size", "mode"} & set(ctx.kwargs))
        if extra:
            raise ctx.error(f"block votes are exact (one counter per block); {extra} do not "
                            "apply", "drop them, or drop block=")
        cols, size = 1, None
    else:
        cols, size = _cols_size(ctx)
    mode = _choice(ctx, "mode", ("bloom", "count"))
    return VoteSupport(
        support_ratio=ratio,
        support_k=m,
        vote_ratio=vote_ratio,
        vote_k=vote_k,
        rows=_rows(ctx, 3),
        cols=cols,
        size=size,
        seed=seed,
        round=rnd,
        mode="count" if mode == "count" else "bloom",
        random_fraction=_in(ctx, "random", 0.0, 1.0, 0.0),
        block=block,
    )


def shared_dgc_stage(ctx: StageContext) -> DGCFeedback:
    """``shared-dgc``: a public support with DGC-style error feedback (no ``ef`` needed)."""
    ctx.expect(1, {"k", "support", "momentum", "decay", "clip", "random"})
    if _has_ef(ctx):
        raise ctx.error("shared-dgc has its own error feedback", "drop '+ef'")
    seed, rnd = ctx.public()
    ratio, k = _main_amount(ctx)
    kind = _choice(ctx, "support", ("random", "block", "aggtopk"))
    frac = _in(ctx, "random", 0.0, 1.0, 0.0)
    if "random" in ctx.kwargs and kind != "aggtopk":
        raise ctx.error("random= applies to support=aggtopk only", ctx.fix())

    def amount(d: int) -> int:
        return min(k, d) if k is not None else k_from_ratio(ratio or 0.0, d)

    if kind == "aggtopk":
        if ctx.previous_aggregate is None:
            raise ctx.error(
                "support=aggtopk needs the previous round's public aggregate",
                "pass previous_aggregate=..., or use support=random in the first round",
            )
        agg: NDArray[Any] = np.asarray(ctx.previous_aggregate, dtype=np.float64).ravel()

        def support(d: int) -> NDArray[np.int64]:
            if d != agg.shape[0]:
                raise ctx.error(
                    f"previous aggregate has {agg.shape[0]} elements but the update has {d}",
                    "pass the aggregate of the same model",
                )
            return topk_of_aggregate(agg, amount(d), random_fraction=frac, round=rnd, seed=seed)

    elif kind == "block":

        def support(d: int) -> NDArray[np.int64]:
            return block_support(d, amount(d), round=rnd, seed=seed)

    else:

        def support(d: int) -> NDArray[np.int64]:
            return random_support(d, amount(d), round=rnd, seed=seed)

    clip = ctx.kwargs.get("clip")
    return DGCFeedback(
        SharedSupport(support),
        momentum=_in(ctx, "momentum", 0.0, 0.999999, 0.9),
        decay=_in(ctx, "decay", 1e-9, 1.0, 1.0),
        clip_norm=None if clip is None else _in(ctx, "clip", 1e-30, 1e30, 1.0),
    )


STAGES: tuple[tuple[str, Callable[[StageContext], Any]], ...] = (
    ("sketch", sketch_stage),
    ("vote", vote_stage),
    ("shared-dgc", shared_dgc_stage),
)
"""``(name, factory)`` pairs registered by :mod:`fedagg.compression.spec`."""
