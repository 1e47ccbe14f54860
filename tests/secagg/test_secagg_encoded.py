"""``ClientState.handle_round_encoded``: masking an input the caller has already encoded.

Oracles: (1) an encoded upload of ``fixed_point.encode(x, w_q)`` is byte-for-byte the upload
``handle_round`` makes of ``x`` (same site randomness), so the two entries share one masking
path; (2) the unmasked :attr:`RoundResult.total` is exactly the ``Z_2^b`` sum of the sites'
pre-mask vectors, with a site dropping before its upload (pairwise masks rebuilt) and one
dropping after it (still counted); (3) every precondition of ``handle_round`` also guards the
encoded entry, and a vector of the wrong size or dtype is refused.
"""

from __future__ import annotations

import numpy as np
import pytest
from secagg_net import Net

from fedagg.errors import ProtocolError
from fedagg.secagg import SecAggParams, fixed_point

PARAMS = SecAggParams(threshold=3, weight_scale=10.0)
N, DIM = 6, 37


def _vectors(net: Net, requests: dict[int, object], seed: int) -> dict[int, np.ndarray]:
    """Arbitrary ring vectors (uniform in Z_2^32), last element a valid quantised weight."""
    rng = np.random.default_rng(seed)
    out = {}
    for i, req in requests.items():
        _, _, w_q = net.clients[i].round_encoding(req, float(i + 1))  # type: ignore[arg-type]
        v = rng.integers(0, 2**32, DIM + 1, dtype=np.uint64).astype(np.uint32)
        v[-1] = w_q
        out[i] = v
    return out


def test_encoded_entry_equals_handle_round_on_the_fixed_point_vector() -> None:
    a, b = Net(N, PARAMS, seed=5), Net(N, PARAMS, seed=5)
    a.setup()
    b.setup()
    x = np.random.default_rng(0).uniform(-1.5, 1.5, DIM)  # some entries clipped
    req_a = a.server.begin_round(1, a.server.usable_sites, DIM)
    req_b = b.server.begin_round(1, b.server.usable_sites, DIM)
    for i in req_a:
        up_a = a.clients[i].handle_round(req_a[i], x, 3.0, rng=np.random.default_rng(i))
        frac_bits, ring_bits, w_q = b.clients[i].round_encoding(req_b[i], 3.0)
        assert (frac_bits, ring_bits) == PARAMS.encoding_for(N)
        vec = fixed_point.encode(x, w_q, frac_bits=frac_bits, clip=PARAMS.clip,
                                 rng=np.random.default_rng(i))
        up_b = b.clients[i].handle_round_encoded(req_b[i], vec)
        assert up_a.to_dict().keys() == up_b.to_dict().keys()
        for key, value in up_a.to_dict().items():
            other = up_b.to_dict()[key]
            assert (np.array_equal(value, other) if isinstance(value, np.ndarray)
                    else value == other), key


def test_total_is_the_exact_ring_sum_with_dropouts_before_and_after_upload() -> None:
    net = Net(N, PARAMS, seed=9)
    net.setup()
    part = net.server.usable_sites
    requests = net.server.begin_round(1, part, DIM)
    vectors = _vectors(net, requests, seed=1)
    before, after = 2, 4  # site 2 never uploads; site 4 uploads, then misses the unmask
    for i, req in requests.items():
        if i == before:
            continue
        net.server.receive_upload(net.wire(net.clients[i].handle_round_encoded(req, vectors[i])))
    for i, req in net.server.close_uploads().items():
        if i != after:
            net.server.receive_unmask(net.wire(net.clients[i].handle_unmask(net.wire(req))))
    res = net.server.finish_round()
    assert res.counted == tuple(i for i in part if i != before) and res.dropped == (before,)
    want = np.zeros(DIM + 1, np.uint64)
    for i in res.counted:
        want += vectors[i]
    bits = res.ring_bits
    assert res.total is not None and res.total.dtype == np.uint32
    low = np.uint64((1 << bits) - 1)
    assert np.array_equal(res.total.astype(np.uint64) & low, want & low)
    # the weight element decodes as the sum of the counted quantised weights
    frac_bits = res.frac_bits
    w_sum = sum(int(vectors[i][-1]) for i in res.counted)
    assert res.total_weight == pytest.approx(w_sum * 2.0**-frac_bits * PARAMS.weight_scale)


def test_total_of_float_uploads_decodes_to_the_mean() -> None:
    """``total`` is also set on ordinary rounds: its decoding is ``mean``."""
    net = Net(N, PARAMS, seed=3)
    net.setup()
    ups = [np.random.default_rng(i).uniform(-1, 1, DIM) for i in range(N)]
    res = net.round(1, ups)
    assert res.total is not None
    s, w = fixed_point.decode_sum(res.total, res.frac_bits, res.ring_bits)
    assert np.array_equal(s / w, res.mean)


@pytest.mark.parametrize("bad", ["short", "long", "dtype", "2d"])
def test_encoded_vector_of_the_wrong_size_or_dtype_is_refused(bad: str) -> None:
    net = Net(N, PARAMS, seed=2)
    net.setup()
    requests = net.server.begin_round(1, net.server.usable_sites, DIM)
    vec = np.zeros(DIM + 1, np.uint32)
    vec = {"short": vec[:-1], "long": np.zeros(DIM + 2, np.uint32),
           "dtype": vec.astype(np.int64), "2d": vec.reshape(1, -1)}[bad]
    client = net.clients[0]
    with pytest.raises(ProtocolError, match="uint32 ring elements"):
        client.handle_round_encoded(requests[0], vec)
    assert client.memory.round == 0 and client.memory.gen == 0  # nothing was used up


def test_encoded_entry_keeps_the_replay_and_generation_checks() -> None:
    net = Net(N, PARAMS, seed=4)
    net.setup()
    requests = net.server.begin_round(1, net.server.usable_sites, DIM)
    vectors = _vectors(net, requests, seed=2)
    client = net.clients[1]
    client.handle_round_encoded(requests[1], vectors[1])
    with pytest.raises(ProtocolError, match="replay"):
        client.handle_round_encoded(requests[1], vectors[1])  # the same round again
