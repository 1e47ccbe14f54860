"""Adapter unit tests: protocol messages <-> Flower records (and Flower's wire format), node ids
<-> site indices, parameters record, config resolution and its error messages."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

from fedagg.config import SecAggConfig, load_config
from fedagg.errors import ConfigError, ProtocolError
from fedagg.secagg import (
    INLINE_BYTES,
    PROTOCOL_VERSION,
    ClientState,
    KeyAdvertise,
    KeyAdvertiseRequest,
    MaskedUpload,
    RoundRequest,
    SecAggParams,
    ServerState,
    ShareKeys,
    ShareKeysRequest,
    UnmaskRequest,
    UnmaskResponse,
    deterministic_random_bytes,
)
from fedagg.secagg.shamir import NUM_LIMBS
from server.inprocess import wire_roundtrip
from strategies.registry import build_strategy
from strategies.secure_params import flatten_arrays, resolve_params, unflatten_like
from strategies.wire import (
    ARRAYS_KEY,
    CONFIG_KEY,
    SiteIndex,
    dict_from_records,
    dict_to_records,
    pack,
    params_from_record,
    params_to_record,
    strip,
    unpack,
)

PARAMS = SecAggParams(threshold=2, clip=4.0, weight_scale=100.0)


def _through_flower(msg: object, node: int = 7) -> object:
    """Put a protocol message in a Flower Message, serialise it as Flower does, read it back."""
    flower = Message(pack(RecordDict(), msg), node, "query.secagg_test")  # type: ignore[arg-type]
    copy, size = wire_roundtrip(flower)
    assert size > 0
    return unpack(copy.content, type(msg))  # type: ignore[arg-type]


def _same(a: object, b: object) -> None:
    da, db = a.to_dict(), b.to_dict()  # type: ignore[attr-defined]
    assert set(da) == set(db)
    for key, value in da.items():
        other = db[key]
        if isinstance(value, np.ndarray):
            assert isinstance(other, np.ndarray) and other.dtype == value.dtype, key
            np.testing.assert_array_equal(other, value)
        else:
            assert type(other) is type(value) and other == value, key


def test_every_protocol_message_survives_flower_records_and_wire() -> None:
    """Drive setup + one round with 4 sites (one drops before upload), passing EVERY message
    through Flower records and Flower's serialisation; the result must still be right."""
    sites = [0, 1, 2, 3]
    server = ServerState(PARAMS, run_id=b"r" * 16)
    clients = {i: ClientState(i, PARAMS, random_bytes=deterministic_random_bytes(1, f"s{i}"))
               for i in sites}
    seen: set[type] = set()

    def hop(msg: object) -> object:
        back = _through_flower(msg)
        _same(msg, back)
        seen.add(type(msg))
        return back

    req = hop(server.begin_setup(sites))
    for i in sites:
        server.receive_advertise(hop(clients[i].handle_advertise(req)))  # type: ignore[arg-type]
    for i, r in server.close_advertise().items():
        server.receive_share_keys(hop(clients[i].handle_share_keys(hop(r))))  # type: ignore[arg-type]
    server.close_share_keys()
    rng = np.random.default_rng(0)
    updates = {i: rng.uniform(-1, 1, 50) for i in sites}
    weights = {0: 10.0, 1: 20.0, 2: 30.0, 3: 40.0}
    for i, r in server.begin_round(1, sites, 50).items():
        up = hop(clients[i].handle_round(hop(r), updates[i], weights[i], rng=rng))  # type: ignore[arg-type]
        if i != 3:  # site 3 drops before its upload arrives
            server.receive_upload(up)  # type: ignore[arg-type]
    for i, r in server.close_uploads().items():
        server.receive_unmask(hop(clients[i].handle_unmask(hop(r))))  # type: ignore[arg-type]
    result = server.finish_round()
    assert seen == {KeyAdvertiseRequest, KeyAdvertise, ShareKeysRequest, ShareKeys, RoundRequest,
                    MaskedUpload, UnmaskRequest, UnmaskResponse}
    expect = sum(weights[i] * updates[i] for i in (0, 1, 2)) / sum(weights[i] for i in (0, 1, 2))
    np.testing.assert_allclose(result.mean, expect, atol=result.error_bound)
    assert result.dropped == (3,)


def test_small_masked_vector_and_id_lists_travel_as_bytes_records() -> None:
    """Wire version 3: only a masked vector over INLINE_BYTES is an array; id lists are 4-byte
    little-endian records, share rows 9 x 4 bytes, and a message without an array has no
    ArrayRecord at all (each array would add ~0.45 kB of framing, an empty record 168 bytes)."""
    up = MaskedUpload(site=1, epoch=1, round=1, masked=np.arange(10, dtype=np.uint32),
                      b_commitment=b"c" * 32, b_recipients=(0, 2), b_ciphertexts=b"x" * 136,
                      next_gen=1, next_s_public=b"p" * 32, next_recipients=(0, 2),
                      next_ciphertexts=b"y" * 136)
    content = pack(RecordDict(), up)
    assert set(content.keys()) == {CONFIG_KEY}
    config = content.config_records[CONFIG_KEY]
    assert config["masked"] == np.arange(10, dtype="<u4").tobytes()
    assert config["b_recipients"] == np.array([0, 2], "<u4").tobytes()
    assert isinstance(config["b_ciphertexts"], bytes)
    back = unpack(content, MaskedUpload)
    assert back.masked.dtype == np.uint32 and back.b_recipients == (0, 2)
    np.testing.assert_array_equal(back.masked, np.arange(10))
    shares = np.arange(18, dtype=np.uint32).reshape(2, NUM_LIMBS)
    resp = UnmaskResponse(site=1, epoch=1, round=1, b_owners=(3, 4), b_shares=shares,
                          s_owners=(), s_shares=np.zeros((0, NUM_LIMBS), np.uint32))
    content = pack(RecordDict(), resp)
    assert set(content.keys()) == {CONFIG_KEY}
    assert content.config_records[CONFIG_KEY]["b_shares"] == shares.astype("<u4").tobytes()
    np.testing.assert_array_equal(unpack(content, UnmaskResponse).b_shares, shares)


def test_masked_vector_over_the_inline_limit_is_a_uint32_array_record() -> None:
    words = INLINE_BYTES // 4 + 1
    up = MaskedUpload(site=1, epoch=1, round=1, masked=np.arange(words, dtype=np.uint32),
                      b_commitment=b"c" * 32, b_recipients=(0, 2), b_ciphertexts=b"x" * 136,
                      next_gen=1, next_s_public=b"p" * 32, next_recipients=(0, 2),
                      next_ciphertexts=b"y" * 136)
    content = pack(RecordDict(), up)
    assert content.array_records[ARRAYS_KEY]["masked"].numpy().dtype == np.uint32
    assert "masked" not in content.config_records[CONFIG_KEY]
    np.testing.assert_array_equal(unpack(content, MaskedUpload).masked, np.arange(words))
    at_limit = dataclasses.replace(up, masked=np.zeros(INLINE_BYTES // 4, np.uint32))
    assert ARRAYS_KEY not in pack(RecordDict(), at_limit)


@pytest.mark.parametrize("field,data", [
    ("b_recipients", b"\x00\x00\x00"),                      # not a whole 4-byte record
    ("b_recipients", np.array([0, 0], "<u4").tobytes()),     # duplicate ids
    ("b_recipients", np.array([0, 2**31], "<u4").tobytes()),  # an id >= 2^31 - 2
    ("next_recipients", np.array([0], "<u4").tobytes()),     # one id for two ciphertexts
    ("masked", b"\x01\x02\x03\x04\x05"),                   # not whole uint32 words
])
def test_hostile_bytes_records_raise_protocol_error_naming_the_field(field: str,
                                                                     data: bytes) -> None:
    up = MaskedUpload(site=1, epoch=1, round=1, masked=np.arange(10, dtype=np.uint32),
                      b_commitment=b"c" * 32, b_recipients=(0, 2), b_ciphertexts=b"x" * 136,
                      next_gen=1, next_s_public=b"p" * 32, next_recipients=(0, 2),
                      next_ciphertexts=b"y" * 136)
    content = pack(RecordDict(), up)
    content.config_records[CONFIG_KEY][field] = data
    with pytest.raises(ProtocolError, match=field):
        unpack(content, MaskedUpload)


def test_an_older_version_message_is_refused_naming_both_versions() -> None:
    msg = KeyAdvertise(site=1, epoch=1, c_public=b"a" * 32, s_public=b"b" * 32)
    content = pack(RecordDict(), msg)
    content.config_records[CONFIG_KEY]["secagg_version"] = PROTOCOL_VERSION - 1
    with pytest.raises(ProtocolError, match=f"expected version {PROTOCOL_VERSION}"):
        unpack(content, KeyAdvertise)


def test_large_masked_vector_is_chunked_on_the_wire() -> None:
    masked = np.random.default_rng(0).integers(0, 2**32, 3_000_001, dtype=np.uint32)
    up = MaskedUpload(site=0, epoch=1, round=1, masked=masked, b_commitment=b"c" * 32,
                      b_recipients=(), b_ciphertexts=b"", next_gen=1, next_s_public=b"p" * 32,
                      next_recipients=(), next_ciphertexts=b"")
    msg = Message(pack(RecordDict(), up), 3, "train")
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    kinds = [type(o).__name__ for o in get_all_nested_objects(msg).values()]
    assert kinds.count("ArrayChunk") >= 3  # 12 MB in chunks of at most 5 MiB
    back, size = wire_roundtrip(msg)
    assert 4 * masked.size <= size <= 4 * masked.size * 1.01
    np.testing.assert_array_equal(unpack(back.content, MaskedUpload).masked, masked)


@pytest.mark.parametrize("broken", ["missing", "float", "str", "wrong-type", "dup"])
def test_malformed_records_raise_protocol_error(broken: str) -> None:
    msg = KeyAdvertise(site=1, epoch=1, c_public=b"a" * 32, s_public=b"b" * 32)
    config, arrays = dict_to_records(msg.to_dict())
    if broken == "missing":
        content = RecordDict({ARRAYS_KEY: arrays})
    else:
        if broken == "float":
            config["epoch"] = 1.5
        elif broken == "str":
            config["c_public"] = "text"
        elif broken == "dup":
            arrays["epoch"] = Array(np.zeros(1))
        content = RecordDict({CONFIG_KEY: config, ARRAYS_KEY: arrays})
    cls = ShareKeys if broken == "wrong-type" else KeyAdvertise
    with pytest.raises(ProtocolError):
        unpack(content, cls)  # type: ignore[type-var]


def test_state_dict_round_trips_through_records() -> None:
    client = ClientState(5, PARAMS, random_bytes=deterministic_random_bytes(0, "x"))
    server = ServerState(PARAMS, run_id=b"z" * 16)
    client.handle_advertise(server.begin_setup([5, 6, 9]))
    state = client.state_dict()
    back = dict_from_records(*dict_to_records(state))
    fresh = ClientState(5, PARAMS, random_bytes=deterministic_random_bytes(0, "x"))
    fresh.load_state_dict(back)
    assert fresh.state_dict().keys() == state.keys()
    for k, v in state.items():
        np.testing.assert_array_equal(np.asarray(fresh.state_dict()[k]), np.asarray(v))
    assert len(state["c_secret"]) == 32  # type: ignore[arg-type]  # a key was really generated


def test_strip_removes_only_secagg_records() -> None:
    content = pack(RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord({"a": 1})}),
                   KeyAdvertise(site=1, epoch=1, c_public=b"a" * 32, s_public=b"b" * 32))
    assert set(strip(content).keys()) == {"arrays", "config"}


def test_site_index_is_stable_and_small() -> None:
    idx = SiteIndex()
    nodes = [2**62 + 17, 5, 2**63 - 1, 123456789012345]
    first = idx.indices(nodes)
    assert sorted(first) == [0, 1, 2, 3] and first[nodes.index(5)] == 0
    assert idx.indices(list(reversed(nodes))) == list(reversed(first))
    assert idx.indices([2**40, 5]) == [4, first[nodes.index(5)]]  # newcomer gets the next index
    assert idx.node(4) == 2**40 and idx.index(999) is None and len(idx) == 5


def test_params_record_round_trip_and_digest() -> None:
    params = SecAggParams(threshold=3, num_neighbours=4, clip=2.0, frac_bits=20, weight_scale=50.0)
    site, back, stage = params_from_record(params_to_record(params, 12, "share-keys"))
    assert site == 12 and back.digest() == params.digest() and stage == "share-keys"
    site, back, stage = params_from_record(params_to_record(PARAMS, 0))
    assert back.num_neighbours is None and back.digest() == PARAMS.digest() and stage == "upload"
    bad = params_to_record(PARAMS, 0)
    bad["secret_option"] = 1
    with pytest.raises(ProtocolError):
        params_from_record(bad)


def test_flatten_and_unflatten() -> None:
    arrays = [np.ones((2, 3), np.float32), np.arange(4.0)]
    flat = flatten_arrays(arrays)
    assert flat.shape == (10,)
    back = unflatten_like(flat, arrays)
    for a, b in zip(arrays, back, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ProtocolError):
        unflatten_like(flat[:-1], arrays)


@pytest.mark.parametrize(("threshold", "k", "t"), [(0.5, 4, 3), (0.5, 9, 5), (0.5, 18, 10),
                                                   (0.3, 18, 6), (3, 18, 3), (0.99, 4, 4)])
def test_threshold_resolution(threshold: float, k: int, t: int) -> None:
    assert SecAggConfig(threshold=threshold).resolve_threshold(k) == t  # type: ignore[call-arg]


def test_resolve_params_defaults_for_5_and_50_sites() -> None:
    p5 = resolve_params(SecAggConfig(), 5)  # type: ignore[call-arg]
    assert (p5.neighbours_for(5), p5.threshold) == (4, 3)
    p50 = resolve_params(SecAggConfig(), 50)  # type: ignore[call-arg]
    assert (p50.neighbours_for(50), p50.threshold) == (18, 10)


@pytest.mark.parametrize(("overrides", "field", "words"), [
    (["run.sites=1"], "sites per round", "at least 2 sites"),
    (["run.sites=10", "run.fraction_train=0.1"], "sites per round", "fraction_train"),
    (["run.sites=5", "secagg.threshold=5"], "secagg.threshold", "neighbours"),
    (["run.sites=3", "secagg.threshold=3"], "secagg.threshold", "exceeds the 2 neighbours"),
    (["run.sites=4000", "secagg.clip=100000"], "secagg.clip", "32-bit ring"),
    (["run.sites=50", "secagg.frac_bits=30"], "secagg.frac_bits", "headroom"),
    (["compression.up=\"int8\""], "compression.up", "support"),
])
def test_impossible_combinations_are_explained(overrides: list[str], field: str, words: str
                                               ) -> None:
    with pytest.raises(ConfigError) as info:
        build_strategy(load_config(None, ["strategy.name=secure", *overrides]))
    text = str(info.value)
    assert text.startswith(field) and words in text and "Fix:" in text


@pytest.mark.parametrize(("overrides", "words"), [
    (["secagg.threshold=2.5"], "whole number"),
    (["secagg.threshold=5", "secagg.neighbours=3"], "exceeds secagg.neighbours"),
    (["secagg.frac_bits=31"], "secagg.frac_bits"),
    (["secagg.weight_scale=0"], "secagg.weight_scale"),
])
def test_config_section_rejects_bad_values(overrides: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(None, overrides)
