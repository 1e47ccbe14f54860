"""Fixed-point encoding, parameter validation, the neighbour graph and message dicts."""

from __future__ import annotations

import hashlib
import hmac
import struct

import numpy as np
import pytest

from fedagg.errors import AbortRound, ConfigError, ProtocolError, UpdateRejected
from fedagg.secagg import SecAggParams, default_num_neighbours
from fedagg.secagg import fixed_point as fp
from fedagg.secagg.graph import advertised_keys_digest, graph_seed, harary_graph, shuffled
from fedagg.secagg.messages import (
    KeyAdvertise,
    MaskedUpload,
    RoundRequest,
    ShareKeys,
    UnmaskResponse,
)

# -- fixed point ----------------------------------------------------------------------------


def test_encode_decode_round_trip_with_negative_values() -> None:
    x = np.array([-1.0, -0.5, 0.0, 0.25, 1.0])
    enc = fp.encode(x, 2**16, frac_bits=16, clip=1.0, rng=np.random.default_rng(0))
    assert enc.dtype == np.uint32 and enc.size == 6
    assert enc[0] == 2**32 - 2**16  # two's complement
    total, weight = fp.decode_sum(enc, 16)
    assert weight == 1.0 and np.allclose(total, x)


def test_stochastic_rounding_is_unbiased() -> None:
    x = np.full(200_000, 0.3 / 2**10)  # 0.3 of one quantum at 10 fractional bits
    enc = fp.encode(x, 2**10, frac_bits=10, clip=1.0, rng=np.random.default_rng(1))
    vals = enc[:-1].view(np.int32)
    assert set(np.unique(vals)) <= {0, 1}
    assert abs(vals.mean() - 0.3) < 0.01


def test_encode_clips_and_rejects_non_finite() -> None:
    enc = fp.encode(np.array([3.0, -3.0]), 2**8, frac_bits=8, clip=2.0, rng=np.random.default_rng())
    assert enc[:-1].view(np.int32).tolist() == [512, -512]
    with pytest.raises(UpdateRejected):
        fp.encode(np.array([np.inf]), 1, frac_bits=8, clip=1.0, rng=np.random.default_rng())


def test_headroom_resolution_and_explanations() -> None:
    assert fp.resolve_frac_bits(2, 1.0, None) == 29
    assert fp.resolve_frac_bits(20, 1.0, None) == 26
    assert fp.resolve_frac_bits(50, 1.0, None) == 25
    f = fp.resolve_frac_bits(1000, 4.0, None)
    assert fp.fits(1000, 4.0, f) and not fp.fits(1000, 4.0, f + 1)
    with pytest.raises(ConfigError, match=r"secagg.frac_bits = 28.*frac_bits <= 26"):
        fp.resolve_frac_bits(20, 1.0, 28)
    with pytest.raises(ConfigError, match=r"secagg\.clip"):
        fp.resolve_frac_bits(10**6, 100.0, None)


def test_weight_quantisation_rules() -> None:
    assert fp.quantize_weight(5.0, 10.0, 4) == 8
    with pytest.raises(ConfigError, match="weight_scale"):
        fp.quantize_weight(11.0, 10.0, 4)
    with pytest.raises(ConfigError):
        fp.quantize_weight(-1.0, 10.0, 4)
    with pytest.raises(AbortRound):
        fp.decode_sum(np.zeros(3, np.uint32), 4)


# -- params ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"threshold": 0}, "threshold"),
        ({"threshold": True}, "threshold"),
        ({"threshold": 2.0}, "threshold"),
        ({"threshold": 5, "num_neighbours": 4}, "exceeds num_neighbours=4"),
        ({"threshold": 1, "num_neighbours": 0}, "num_neighbours"),
        ({"threshold": 1, "clip": 0.0}, "clip"),
        ({"threshold": 1, "clip": float("inf")}, "clip"),
        ({"threshold": 1, "weight_scale": -1.0}, "weight_scale"),
        ({"threshold": 1, "frac_bits": 31}, "frac_bits"),
        ({"threshold": 1, "frac_bits": 30, "clip": 4.0}, "frac_bits"),
        ({"threshold": 1, "unmask_timeout_s": 0}, "unmask_timeout_s"),
    ],
)
def test_params_validation_explains(kwargs: dict, match: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ConfigError, match=match) as err:
        SecAggParams(**kwargs)
    assert "Fix:" in str(err.value)


def test_neighbours_for() -> None:
    assert default_num_neighbours(20) == 15 and default_num_neighbours(1000) == 30
    assert SecAggParams(threshold=1).neighbours_for(2) == 1
    assert SecAggParams(threshold=2, num_neighbours=3).neighbours_for(7) == 4  # 3 * 7 odd
    assert SecAggParams(threshold=2, num_neighbours=100).neighbours_for(10) == 9
    with pytest.raises(ConfigError, match="add sites"):
        SecAggParams(threshold=4).neighbours_for(4)
    with pytest.raises(ConfigError):
        SecAggParams(threshold=1).neighbours_for(1)


def test_digest_tracks_shared_fields_only() -> None:
    a = SecAggParams(threshold=2)
    assert a.digest() == SecAggParams(threshold=2, unmask_timeout_s=5.0).digest()
    assert a.digest() != SecAggParams(threshold=2, clip=2.0).digest()


# -- graph ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n, k", [(2, 1), (5, 2), (8, 3), (8, 4), (9, 8), (20, 7 + 1), (31, 10)])
def test_graph_is_k_regular_and_symmetric(n: int, k: int) -> None:
    roster = list(range(100, 100 + n))
    g = harary_graph(roster, k, graph_seed(b"r", 1, roster, keys=bytes(64 * n)))
    assert set(g) == set(roster)
    for v, nbrs in g.items():
        assert len(nbrs) == k and v not in nbrs
        assert all(v in g[u] for u in nbrs)


GOLDEN_KEYS = b"".join(bytes([i]) * 64 for i in range(8))  # site i announces c = s = i * 32


def test_graph_seed_golden_vector_recomputed_by_hand() -> None:
    """The v2 seed: HKDF-SHA256(run_id || 0x01, info = tag || 0 || ctx || H(ids) || H(keys))."""
    roster = list(range(8))
    seed = graph_seed(b"golden-run", 1, roster, keys=GOLDEN_KEYS)
    assert seed.hex() == "701a667960d10386666deb9bf484a7f9184fb01962b8c7c7bb3567535274ddb2"
    keys_h = hashlib.sha256(b"fedagg/secagg/v2/advertised-keys\x00" + (8).to_bytes(8, "big"))
    for i in roster:
        keys_h.update(i.to_bytes(8, "big") + bytes([i]) * 64)
    assert advertised_keys_digest(roster, GOLDEN_KEYS) == keys_h.digest()
    ids_h = hashlib.sha256(b"".join(i.to_bytes(8, "big") for i in roster)).digest()
    ctx = struct.pack(">H", 10) + b"golden-run" + struct.pack(">BQQQQ", 0, 1, 0, 8, 0)
    info = b"fedagg/secagg/v2/neighbour-graph\x00" + ctx + ids_h + keys_h.digest()
    prk = hmac.new(bytes(32), b"golden-run\x01", hashlib.sha256).digest()
    assert seed == hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def test_graph_golden_and_deterministic() -> None:
    roster = list(range(8))
    g = harary_graph(roster, 4, graph_seed(b"golden-run", 1, roster, keys=GOLDEN_KEYS))
    assert g[0] == (4, 5, 6, 7) and g[3] == (1, 2, 4, 7)
    assert harary_graph(roster, 4, graph_seed(b"golden-run", 2, roster, keys=GOLDEN_KEYS)) != g
    assert shuffled(list(range(50)), b"\x00" * 32) == shuffled(list(range(50)), b"\x00" * 32)
    with pytest.raises(ProtocolError, match="roster_public"):
        graph_seed(b"golden-run", 1, roster, keys=GOLDEN_KEYS[:-1])


def test_graph_rejects_impossible_degree() -> None:
    with pytest.raises(ConfigError):
        harary_graph([0, 1, 2], 1, b"\x00" * 32)  # 3 * 1 odd
    with pytest.raises(ConfigError):
        harary_graph([0, 1, 2], 3, b"\x00" * 32)


# -- messages -------------------------------------------------------------------------------


def _samples() -> list:  # type: ignore[type-arg]
    return [
        KeyAdvertise(site=1, epoch=2, c_public=b"c" * 32, s_public=b"s" * 32),
        ShareKeys(site=1, epoch=2, gen=0, recipients=(2, 3), ciphertexts=b"x" * 136),
        RoundRequest(1, 4, (0, 1, 2), 10, 3, (0, 2), (3, 1), b"k" * 64, bytes(32)),
        MaskedUpload(
            1,
            1,
            4,
            np.arange(11, dtype=np.uint32),
            b"h" * 32,
            (0, 2),
            b"c" * 136,
            4,
            b"p" * 32,
            (0, 2),
            b"n" * 136,
        ),
        UnmaskResponse(1, 1, 4, (0,), np.zeros((1, 9), np.uint32), (), np.zeros((0, 9), np.uint32)),
    ]


@pytest.mark.parametrize("msg", _samples(), ids=lambda m: type(m).__name__)
def test_message_dict_round_trip(msg) -> None:  # type: ignore[no-untyped-def]
    d = msg.to_dict()
    assert all(isinstance(v, (int, bytes, np.ndarray)) for v in d.values())
    back = type(msg).from_dict(d)
    assert back.to_dict().keys() == d.keys()
    for key, value in d.items():
        if isinstance(value, np.ndarray):
            assert np.array_equal(value, back.to_dict()[key])
        else:
            assert value == back.to_dict()[key]


def test_message_from_dict_rejects_malformed() -> None:
    good = _samples()[0].to_dict()
    for bad in (
        {k: v for k, v in good.items() if k != "epoch"},
        {**good, "extra": 1},
        {**good, "epoch": "2"},
        {**good, "epoch": True},
        {**good, "c_public": "text"},
        {**good, "secagg_version": 99},
        {**good, "secagg_type": 5},
    ):
        with pytest.raises(ProtocolError):
            KeyAdvertise.from_dict(bad)
    req = _samples()[2].to_dict()
    with pytest.raises(ProtocolError):
        RoundRequest.from_dict({**req, "neighbours": np.array([-1, 2])})
    with pytest.raises(ProtocolError):
        RoundRequest.from_dict({**req, "participants": np.array([[1, 2]])})
    up = _samples()[3].to_dict()
    with pytest.raises(ProtocolError):
        MaskedUpload.from_dict({**up, "masked": np.arange(3, dtype=np.int64)})
    resp = _samples()[4].to_dict()
    with pytest.raises(ProtocolError):
        UnmaskResponse.from_dict({**resp, "b_shares": np.zeros((1, 8), np.uint32)})
