"""Wire codec: round trips, golden bytes, index-width choice, validation of bad payloads."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedagg.compression import (
    BF16,
    FP16,
    Chain,
    ErrorFeedback,
    Identity,
    Int8,
    Payload,
    SharedSupport,
    TensorPayload,
    TopK,
    WireDType,
    codec,
    float32_to_bf16_bits,
)
from fedagg.errors import CodecError

# --------------------------------------------------------------------------------------------
# golden vector
# --------------------------------------------------------------------------------------------

GOLDEN_HEX = (
    "4641474301000400000001010200000000000200000000000000020000000000000003000000000000000103"
    "0000c03f000000c00400010002000000040000000000000004000000000000007fc000030000003f0000803e"
    "030001000000000002000000000000000200000000000000803f00bf02050100000000000100000000000000"
    "03000000000000000038"
)


def golden_payload() -> Payload:
    return Payload(
        (
            TensorPayload(
                (2, 3),
                WireDType.FLOAT32,
                np.array([1.5, -2.0], np.float32),
                indices=np.array([1, 4], np.int64),
            ),
            TensorPayload(
                (4,),
                WireDType.INT8,
                np.array([127, -64, 0, 3], np.int8),
                scales=np.array([0.5, 0.25], np.float32),
                chunk_size=2,
            ),
            TensorPayload(
                (2,), WireDType.BFLOAT16, float32_to_bf16_bits(np.array([1.0, -0.5], np.float32))
            ),
            TensorPayload(
                (3,), WireDType.FLOAT16, np.array([0.5], np.float16), implicit_indices=True
            ),
        )
    )


def test_golden_bytes_encode() -> None:
    assert codec.encode(golden_payload()).hex() == GOLDEN_HEX


def test_golden_bytes_decode() -> None:
    p = codec.decode(bytes.fromhex(GOLDEN_HEX))
    assert p.equals(golden_payload())
    # flat layout: t0 -> [0, 6), t1 -> [6, 10), t2 -> [10, 12), t3 -> [12, 15)
    dense = p.with_support([13]).to_dense()
    assert dense[0].tolist() == [[0.0, 1.5, 0.0], [0.0, -2.0, 0.0]]
    assert dense[1].tolist() == [63.5, -32.0, 0.0, 0.75]
    assert dense[2].tolist() == [1.0, -0.5]


def test_golden_shared_support_attach() -> None:
    p = codec.decode(bytes.fromhex(GOLDEN_HEX)).with_support([13])
    assert p.to_dense()[3].tolist() == [0.0, 0.5, 0.0]
    with pytest.raises(CodecError):
        codec.decode(bytes.fromhex(GOLDEN_HEX)).to_dense()  # support not attached
    with pytest.raises(CodecError):
        codec.decode(bytes.fromhex(GOLDEN_HEX)).with_support([12, 13])  # 2 positions, 1 value
    with pytest.raises(CodecError):
        codec.decode(bytes.fromhex(GOLDEN_HEX)).with_support([15])  # out of range


def test_golden_header_layout() -> None:
    data = bytes.fromhex(GOLDEN_HEX)
    assert data[:4] == b"FAGC"
    assert data[4] == 1  # version
    assert struct.unpack_from("<I", data, 6)[0] == 4  # tensors
    dcode, icode, ndim, _, chunk, nnz = struct.unpack_from("<BBBBIQ", data, 10)
    assert (dcode, icode, ndim, chunk, nnz) == (1, 1, 2, 0, 2)  # float32, u8 deltas


# --------------------------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple)


@st.composite
def tensor_payloads(draw: st.DrawFn) -> TensorPayload:
    shape = draw(shapes)
    numel = int(np.prod(shape, dtype=np.int64))
    dtype = draw(st.sampled_from(list(WireDType)))
    mode = draw(st.sampled_from(["dense", "sparse", "shared"]))
    if mode == "dense":
        nnz, indices = numel, None
    else:
        nnz = draw(st.integers(0, numel))  # includes k = 0 and k = D
        seed = draw(st.integers(0, 2**32 - 1))
        indices = np.sort(np.random.default_rng(seed).choice(numel, nnz, replace=False)).astype(
            np.int64
        )
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scales, chunk = None, 0
    if dtype is WireDType.FLOAT32:
        values = rng.normal(size=nnz).astype(np.float32)
    elif dtype is WireDType.FLOAT16:
        values = rng.normal(size=nnz).astype(np.float16)
    elif dtype is WireDType.BFLOAT16:
        values = rng.integers(0, 2**16, size=nnz).astype(np.uint16)
    else:
        values = rng.integers(-128, 128, size=nnz).astype(np.int8)
        chunk = draw(st.integers(1, 9))
        scales = rng.uniform(0, 3, size=-(-nnz // chunk)).astype(np.float32)
    return TensorPayload(
        shape,
        dtype,
        values,
        indices=indices,
        scales=scales,
        chunk_size=chunk,
        implicit_indices=mode == "shared",
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(tensor_payloads(), min_size=0, max_size=4))
def test_roundtrip_arbitrary_payloads(tensors: list[TensorPayload]) -> None:
    p = Payload(tuple(tensors))
    data = codec.encode(p)
    assert len(data) == codec.encoded_size(p)
    q = codec.decode(data)
    # shared-support indices are not sent: the decoded payload has none until attached
    expected = Payload(
        tuple(
            TensorPayload(t.shape, t.dtype, t.values, None, t.scales, t.chunk_size, True)
            if t.implicit_indices
            else t
            for t in tensors
        )
    )
    assert q.equals(expected)
    assert codec.encode(q) == data
    flat = []
    offset = 0
    for t in tensors:
        if t.implicit_indices and t.indices is not None:
            flat.extend((t.indices + offset).tolist())
        offset += t.numel
    restored = q.with_support(np.array(flat, dtype=np.int64))
    for a, b in zip(restored.to_dense(), p.to_dense(), strict=True):
        np.testing.assert_array_equal(a, b)


pipelines = st.sampled_from(
    [
        lambda r: Identity(),
        lambda r: TopK(r),
        lambda r: TopK(r, scope="global"),
        lambda r: Chain(TopK(r), Int8(4)),
        lambda r: Chain(TopK(r), BF16()),
        lambda r: Chain(TopK(r), FP16()),
        lambda r: ErrorFeedback(TopK(r), quantizer=Int8(3, stochastic=False)),
        lambda r: BF16(),
        lambda r: Int8(5),
    ]
)


@settings(max_examples=150, deadline=None)
@given(
    pipelines,
    st.floats(0.0, 1.0),
    st.lists(shapes, min_size=1, max_size=3),
    st.integers(0, 2**32 - 1),
)
def test_roundtrip_compressor_outputs(make, ratio: float, shps: list, seed: int) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    x = [rng.normal(size=s).astype(np.float32) * 10 for s in shps]
    p = make(ratio).compress(x, rng=rng)
    q = codec.decode(codec.encode(p))
    assert q.equals(p)
    for a, b in zip(q.to_dense(), p.to_dense(), strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == np.float32


def test_topk_k0_and_kD_roundtrip() -> None:
    x = [np.arange(12, dtype=np.float32).reshape(3, 4) - 6]
    rng = np.random.default_rng(0)
    empty = TopK(0.0).compress(x, rng=rng)
    assert empty.nnz == 0
    assert codec.decode(codec.encode(empty)).to_dense()[0].tolist() == np.zeros((3, 4)).tolist()
    full = TopK(1.0).compress(x, rng=rng)
    assert full.tensors[0].is_dense
    np.testing.assert_array_equal(codec.decode(codec.encode(full)).to_dense()[0], x[0])


def test_shared_support_payload_has_no_index_bytes() -> None:
    x = [np.arange(1000, dtype=np.float32)]
    sup = np.arange(0, 1000, 10)
    shared = SharedSupport(sup).compress(x, rng=np.random.default_rng(0))
    explicit = Payload(
        (TensorPayload((1000,), WireDType.FLOAT32, x[0][sup], indices=sup.astype(np.int64)),)
    )
    assert codec.encoded_size(explicit) - codec.encoded_size(shared) == 100  # 100 u8 deltas
    back = codec.decode(codec.encode(shared)).with_support(sup)
    np.testing.assert_array_equal(back.to_dense()[0][sup], x[0][sup])


@pytest.mark.parametrize(
    ("gap", "width"), [(1, 1), (255, 1), (256, 2), (65535, 2), (65536, 4), (2**32, 8)]
)
def test_index_width_is_smallest_that_fits(gap: int, width: int) -> None:
    numel = gap * 2 + 1
    idx = np.array([0, gap], dtype=np.int64)
    t = TensorPayload((numel,), WireDType.FLOAT32, np.ones(2, np.float32), indices=idx)
    p = Payload((t,))
    data = codec.encode(p)
    code = data[10 + 1]
    assert {1: 1, 2: 2, 3: 4, 4: 8}[code] == width
    assert len(data) == 10 + 16 + 8 + 2 * width + 8
    back = codec.decode(data, max_elements=2**40).tensors[0]
    assert back.indices is not None
    assert back.indices.tolist() == [0, gap]


def test_max_elements_guard() -> None:
    t = TensorPayload(
        (1000,), WireDType.FLOAT32, np.zeros(0, np.float32), indices=np.zeros(0, np.int64)
    )
    data = codec.encode(Payload((t,)))
    assert codec.decode(data).numel == 1000
    with pytest.raises(CodecError, match="max_elements"):
        codec.decode(data, max_elements=999)


def test_decode_accepts_bytes_like() -> None:
    data = bytes.fromhex(GOLDEN_HEX)
    for view in (bytearray(data), memoryview(data), np.frombuffer(data, dtype=np.uint8)):
        assert codec.decode(view).equals(golden_payload())  # type: ignore[arg-type]
    for bad in ("FAGC", 12, None, np.zeros(4, dtype=np.float32)):
        with pytest.raises(CodecError):
            codec.decode(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "tensor",
    [
        # unsorted indices
        TensorPayload((5,), WireDType.FLOAT32, np.ones(2, np.float32), indices=np.array([3, 1])),
        # duplicate indices
        TensorPayload((5,), WireDType.FLOAT32, np.ones(2, np.float32), indices=np.array([1, 1])),
        # out of range
        TensorPayload((5,), WireDType.FLOAT32, np.ones(1, np.float32), indices=np.array([5])),
        # dense with the wrong count
        TensorPayload((5,), WireDType.FLOAT32, np.ones(4, np.float32)),
        # wrong values dtype
        TensorPayload((2,), WireDType.FLOAT16, np.ones(2, np.float32)),
        # NaN scale
        TensorPayload(
            (2,),
            WireDType.INT8,
            np.ones(2, np.int8),
            scales=np.array([np.nan], np.float32),
            chunk_size=2,
        ),
        # missing scales
        TensorPayload((2,), WireDType.INT8, np.ones(2, np.int8), chunk_size=2),
        # scales on a float tensor
        TensorPayload(
            (1,), WireDType.FLOAT32, np.ones(1, np.float32), scales=np.ones(1, np.float32)
        ),
    ],
)
def test_encode_rejects_invalid_payloads(tensor: TensorPayload) -> None:
    with pytest.raises(CodecError):
        codec.encode(Payload((tensor,)))


def test_dense_nbytes() -> None:
    assert codec.dense_nbytes([np.zeros((3, 4)), np.zeros(5)]) == 68
    assert codec.dense_nbytes([(3, 4), ()]) == 52
