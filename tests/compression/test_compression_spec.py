"""Spec strings -> compressors; errors that name the spec, the part, the rule and the fix."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedagg.compression import (
    BF16,
    FP16,
    Chain,
    ErrorFeedback,
    Identity,
    Int8,
    RandomK,
    SharedSupport,
    StageContext,
    TopK,
    WireDType,
    build_compressor,
    codec,
    find_shared_support,
    registry,
    reveals_indices,
)
from fedagg.errors import ConfigError

SEED = b"public"


def test_none_bf16_fp16_int8() -> None:
    assert isinstance(build_compressor("none"), Identity)
    assert isinstance(build_compressor("bf16"), BF16)
    assert isinstance(build_compressor(" FP16 "), FP16)
    q = build_compressor("int8:128,nearest")
    assert isinstance(q, Int8) and q.chunk_size == 128 and not q.stochastic
    q = build_compressor("int8:chunk=64,rounding=stochastic")
    assert isinstance(q, Int8) and q.chunk_size == 64 and q.stochastic
    assert isinstance(build_compressor("int8"), Int8)


def test_topk_ef_int8() -> None:
    c = build_compressor("topk:0.01+ef+int8")
    assert isinstance(c, ErrorFeedback)
    assert isinstance(c.inner, Chain)
    first = c.inner.first
    assert isinstance(first, TopK) and first.ratio == 0.01 and first.scope == "tensor"
    assert isinstance(c.inner.quantizers[0], Int8)
    assert reveals_indices(c)
    # ef position does not matter: it always wraps the whole pipeline
    c2 = build_compressor("ef+topk:0.01+int8")
    assert repr(c2) == repr(c)


@pytest.mark.parametrize(
    ("spec", "k", "ratio", "scope"),
    [
        ("topk:1000", 1000, None, "tensor"),
        ("topk:k=5,global", 5, None, "global"),
        ("topk:global,0.25", None, 0.25, "global"),
        ("topk:ratio=0.5,scope=global", None, 0.5, "global"),
        ("topk:1.0", None, 1.0, "tensor"),
        ("TopK:0", 0, None, "tensor"),
    ],
)
def test_topk_forms(spec: str, k: int | None, ratio: float | None, scope: str) -> None:
    c = build_compressor(spec)
    assert isinstance(c, TopK)
    assert (c.k, c.ratio, c.scope) == (k, ratio, scope)


def test_shared_modes_need_public_context() -> None:
    for spec in ("shared:0.1", "block:0.1", "randk:0.1,shared", "aggtopk:0.1"):
        with pytest.raises(ConfigError, match="seed"):
            build_compressor(spec)
    c = build_compressor("shared:0.1+ef+int8", seed=SEED, round=2)
    assert isinstance(c, ErrorFeedback) and not reveals_indices(c)
    stage = find_shared_support(c)
    assert isinstance(stage, SharedSupport)
    assert stage.support_for(1000).shape == (100,)
    r = build_compressor("randk:0.1", seed=SEED, round=2)
    assert isinstance(r, RandomK) and r.seed is None  # private unless asked
    r = build_compressor("randk:0.1,shared", seed=SEED, round=2)
    assert isinstance(r, RandomK) and r.seed == SEED and r.round == 2


def test_aggtopk_uses_previous_aggregate() -> None:
    agg = np.zeros(100, np.float32)
    agg[[3, 50, 99]] = [5.0, -7.0, 1.0]
    with pytest.raises(ConfigError, match="aggregate"):
        build_compressor("aggtopk:0.03", seed=SEED, round=1)
    c = build_compressor("aggtopk:0.03+ef", seed=SEED, round=1, previous_aggregate=agg)
    stage = find_shared_support(c)
    assert stage is not None and stage.support_for(100).tolist() == [3, 50, 99]
    x = [np.ones((10, 10), np.float32)]
    p = c.compress(x, rng=np.random.default_rng(0))
    assert p.tensors[0].implicit_indices and p.nnz == 3
    plain = build_compressor("aggtopk:0.03", seed=SEED, round=1, previous_aggregate=agg)
    with pytest.raises(ConfigError, match="elements"):
        plain.compress([np.ones(5, np.float32)], rng=np.random.default_rng(0))
    mixed = build_compressor("aggtopk:k=10,random=0.5", seed=SEED, round=1, previous_aggregate=agg)
    assert isinstance(mixed, SharedSupport)
    assert {3, 50, 99} <= set(mixed.support_for(100).tolist())


def test_end_to_end_site_to_server_with_spec() -> None:
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(30, 30)).astype(np.float32), rng.normal(size=30).astype(np.float32)]
    site = build_compressor("block:0.05+ef+bf16", seed=SEED, round=7)
    data = codec.encode(site.compress(x, rng=rng))
    server = find_shared_support(build_compressor("block:0.05+ef+bf16", seed=SEED, round=7))
    assert server is not None
    payload = codec.decode(data)
    assert payload.tensors[0].dtype is WireDType.BFLOAT16
    dense = payload.with_support(server.support_for(payload.numel)).to_dense()
    assert sum(int(np.count_nonzero(d)) for d in dense) == 47  # ceil(0.05 * 930)


@pytest.mark.parametrize(
    ("spec", "part", "words"),
    [
        ("", None, "non-empty"),
        ("topk:0.01++int8", "", "empty stage"),
        ("topk:2.5", "topk:2.5", "ratio"),
        ("topk:abc", "topk:abc", "must be one of"),
        ("topk:1e-3x", "topk:1e-3x", "not a number"),
        ("topk", "topk", "needs a ratio"),
        ("topk:0.1,layer", "topk:0.1,layer", "scope"),
        ("topk:ratio=0.1,k=3", "topk:ratio=0.1,k=3", "not both"),
        ("topk:0.1,k=3", "topk:0.1,k=3", "not both"),
        ("topk:0.1,0.2", "topk:0.1,0.2", "not both"),
        ("topk:0.1,global,tensor", "topk:0.1,global,tensor", "positional"),
        ("topk:0.1,foo=1", "topk:0.1,foo=1", "unknown option"),
        ("topk:0.1,", "topk:0.1,", "empty argument"),
        ("topk:", "topk:", "without arguments"),
        ("topk:0.1+randk:0.1", "randk:0.1", "at most one sparsifier"),
        ("int8+topk:0.1", "topk:0.1", "before the quantizer"),
        ("topk:0.1+int8+bf16", "bf16", "at most one quantizer"),
        ("topk:0.1+ef+ef", "ef", "twice"),
        ("ef:1+topk:0.1", "ef:1", "no arguments"),
        ("ef", "ef", "lossy"),
        ("none+ef", "none", "cannot be combined"),
        ("none+int8", "none", "cannot be combined"),
        ("zstd", "zstd", "unknown stage"),
        ("int8:0", "int8:0", "chunk"),
        ("int8:64,fast", "int8:64,fast", "rounding"),
        ("bf16:1", "bf16:1", "positional"),
        ("randk:0.1,public", "randk:0.1,public", "mode"),
        ("shared:global", "shared:global", "not a number"),
        ("topk:nan", "topk:nan", "finite"),
    ],
)
def test_bad_specs_name_spec_part_rule_fix(spec: str, part: str | None, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_compressor(spec)
    msg = str(info.value)
    assert words in msg
    assert "Fix:" in msg
    if part is not None:
        assert repr(spec) in msg and repr(part) in msg


def test_unknown_stage_lists_known_names() -> None:
    with pytest.raises(ConfigError) as info:
        build_compressor("zstd")
    for name in ("ef", "topk", "int8", "shared", "aggtopk"):
        assert name in str(info.value)


def test_plugin_registration() -> None:
    class Halve:
        reveals_indices = False

        def compress(self, tensors: Any, *, rng: np.random.Generator) -> Any:
            return Identity().compress([np.asarray(t) / 2 for t in tensors], rng=rng)

    def factory(ctx: StageContext) -> Halve:
        ctx.expect(0, set())
        return Halve()

    registry.register("test-halve", factory)
    try:
        c = build_compressor("test_halve+ef+int8")
        assert isinstance(c, ErrorFeedback)
        out = c.compress([np.full(4, 2.0, np.float32)], rng=np.random.default_rng(0))
        assert out.tensors[0].dtype is WireDType.INT8
        assert "test-halve" in registry.names()
        with pytest.raises(ConfigError, match="positional"):
            build_compressor("test-halve:1")
    finally:
        registry._items.pop("test-halve", None)
        registry._origins.pop("test-halve", None)
