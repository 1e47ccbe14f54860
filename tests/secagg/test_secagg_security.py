"""Security checks: masked uploads look uniform, and no key or share material reaches reprs
or logs."""

from __future__ import annotations

import base64
import logging

import numpy as np
import pytest

import fedagg.secagg.local as local_mod
from fedagg.secagg import (
    ClientState,
    LocalFederation,
    SecAggParams,
    ServerState,
    deterministic_random_bytes,
    packing,
    run_local,
)
from fedagg.secagg import shamir as shamir_mod
from fedagg.secagg.keys import SecretKey
from fedagg.secagg.masking import canary_slots


def chi2_top_byte(words: np.ndarray) -> float:
    counts = np.bincount((words >> 24).astype(np.int64), minlength=256)
    expected = words.size / 256
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_LIMIT = 400.0  # df = 255 (mean 255, sd 22.6): 400 is > 6 sd out


def _top_byte_values(values: np.ndarray, bits: int) -> np.ndarray:
    """Values of Z_2^bits shifted so that their top 8 bits are the top byte of a word."""
    return (values.astype(np.uint32) << np.uint32(32 - bits)).astype(np.uint32)


@pytest.mark.parametrize("ring_bits", [None, 17, 31, 32])
def test_single_masked_upload_is_uniform(ring_bits: int | None) -> None:
    """An all-zero update with a weight: its masked upload (unpacked from the wire) is
    indistinguishable from uniform on Z_2^b, and so are the packed wire words, while the
    unmasked encoding is wildly non-uniform (the test can fail)."""
    params = SecAggParams(threshold=2, weight_scale=1.0, ring_bits=ring_bits)
    server = ServerState(params, run_id=b"uniformity")
    clients = {
        i: ClientState(i, params, random_bytes=deterministic_random_bytes(4, str(i)))
        for i in range(3)
    }
    adv = server.begin_setup(range(3))
    for c in clients.values():
        server.receive_advertise(c.handle_advertise(adv))
    for i, req in server.close_advertise().items():
        server.receive_share_keys(clients[i].handle_share_keys(req))
    server.close_share_keys()
    dim = 200_000
    frac_bits, bits = params.encoding_for(3)
    assert bits == (ring_bits or bits) and bits <= 32
    req = server.begin_round(1, range(3), dim)[0]
    upload = clients[0].handle_round(req, np.zeros(dim), 1.0, rng=np.random.default_rng(0))
    slots = dim + 1 + canary_slots(bits)  # values, weight, the round's canary
    assert upload.masked.shape == (packing.packed_words(slots, bits),)
    values = packing.unpack(upload.masked, slots, bits)
    assert int(values.max()) < 2**bits
    assert chi2_top_byte(_top_byte_values(values, bits)) < CHI2_LIMIT
    assert chi2_top_byte(upload.masked) < CHI2_LIMIT  # the wire words too
    # each of the b bits individually balanced too (low and high)
    bit_means = ((values[:, None] >> np.arange(bits, dtype=np.uint32)) & 1).mean(axis=0)
    assert np.all(np.abs(bit_means - 0.5) < 0.01)
    from fedagg.secagg.fixed_point import encode

    plain = encode(np.zeros(dim), 2**frac_bits, frac_bits=frac_bits, clip=1.0,
                   rng=np.random.default_rng(0))
    plain_b = plain & np.uint32((1 << bits) - 1) if bits < 32 else plain
    assert chi2_top_byte(_top_byte_values(plain_b, bits)) > 10 * CHI2_LIMIT
    assert chi2_top_byte(packing.pack(plain, bits)) > 10 * CHI2_LIMIT


def test_pairwise_masks_cancel_only_with_all_survivors() -> None:
    """Sum of uploads of a strict subset still looks uniform (only the full sum unmasks)."""
    f = LocalFederation(4, SecAggParams(threshold=2, weight_scale=1.0), seed=2)
    f.setup()
    captured: list[np.ndarray] = []
    real = f.server.receive_upload

    def spy(msg):  # type: ignore[no-untyped-def]
        captured.append(msg.masked.copy())
        real(msg)

    f.server.receive_upload = spy  # type: ignore[method-assign]
    dim = 100_000
    f.run_round([np.zeros(dim)] * 4, [1.0] * 4)
    bits = f.params.encoding_for(4)[1]
    partial = np.zeros(dim + 1 + canary_slots(bits), np.uint32)
    for words in captured[:3]:
        packing.add_unpacked(partial, words, bits)
    partial &= np.uint32((1 << bits) - 1) if bits < 32 else np.uint32(2**32 - 1)
    assert chi2_top_byte(_top_byte_values(partial, bits)) < CHI2_LIMIT
    full = partial.copy()
    packing.add_unpacked(full, captured[3], bits)  # still self-masked: uniform as well
    full &= np.uint32((1 << bits) - 1) if bits < 32 else np.uint32(2**32 - 1)
    assert chi2_top_byte(_top_byte_values(full, bits)) < CHI2_LIMIT


@pytest.fixture
def recorded_secrets(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Record every random byte string and every Shamir share made during a run."""
    secrets: list[bytes] = []
    real_rb = local_mod.deterministic_random_bytes

    def recording(seed: int, party: str):  # type: ignore[no-untyped-def]
        inner = real_rb(seed, party)

        def rb(n: int) -> bytes:
            out = inner(n)
            secrets.append(out)
            return out

        return rb

    real_split = shamir_mod.split

    def split(*args, **kwargs):  # type: ignore[no-untyped-def]
        shares = real_split(*args, **kwargs)
        secrets.extend(s.y.tobytes() for s in shares)
        return shares

    monkeypatch.setattr(local_mod, "deterministic_random_bytes", recording)
    monkeypatch.setattr(shamir_mod, "split", split)
    return secrets


def _forms(secret: bytes) -> list[str]:
    chunk = secret[:12] if len(secret) >= 12 else secret
    return [
        chunk.hex(),
        chunk.hex().upper(),
        repr(chunk)[2:-1],
        base64.b64encode(secret).decode()[:16],
    ]


def test_logs_and_reprs_hold_no_secret_material(
    recorded_secrets: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    rng = np.random.default_rng(0)
    updates = [rng.normal(size=8) for _ in range(7)]
    with caplog.at_level(logging.DEBUG, logger="fedagg"):
        f = LocalFederation(7, SecAggParams(threshold=4, weight_scale=5.0), seed=1)
        f.setup()
        res = f.run_round(updates, [1.0] * 7, drop_before_upload=[1], drop_after_upload=[4])
        run_local(updates, [1.0] * 7, threshold=4, drop_before_upload=[2])
    assert caplog.records, "the protocol should log its stages at DEBUG"
    text = "\n".join(r.getMessage() for r in caplog.records)
    clients = []
    for i, state in f.states.items():
        c = ClientState(i, f.params, random_bytes=deterministic_random_bytes(0, "x"))
        c.load_state_dict(state)
        clients.append(c)
        recorded_secrets.extend(v for k, v in state.items() if k.endswith("secret") and v)
    reprs = [repr(c) for c in clients] + [repr(f.server), repr(res), str(res)]
    reprs.append(repr(SecretKey(bytes(range(32)))))
    big = [s for s in recorded_secrets if isinstance(s, bytes) and len(s) >= 8]
    assert len(big) > 50
    haystack = text + "\n".join(reprs)
    for secret in big:
        for form in _forms(secret):
            assert form not in haystack


def test_message_reprs_hide_shares_and_ciphertexts() -> None:
    f = LocalFederation(3, SecAggParams(threshold=2), seed=0)
    f.setup()
    server = f.server
    req = server.begin_round(1, [0, 1, 2], 3)[0]
    c = ClientState(0, f.params, random_bytes=deterministic_random_bytes(0, "site-0"))
    c.load_state_dict(f.states[0])
    up = c.handle_round(req, np.zeros(3), 0.5, rng=np.random.default_rng(0))
    text = repr(up) + repr(req)
    assert up.b_ciphertexts[:8].hex() not in text and "bytes>" in text
    words = packing.packed_words(4, f.params.encoding_for(3)[1])
    assert f"masked=<array ({words},)>" in text
