"""Worker threads (fedagg.secagg.threads): every threaded path is bit-identical to the serial one.

Masks are expanded over disjoint chunk-aligned ranges (keystreams started at the range's
ChaCha20 block counter) and uploads are added into private sums; these tests compare against
the serial loop and the one-shot keystream, on vectors long enough to take the threaded paths
(>= 2 chunks of 65,536 words)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagg.errors import AbortRound, ConfigError, ProtocolError
from fedagg.secagg import LocalFederation, SecAggParams, ServerState
from fedagg.secagg.masking import add_masks
from fedagg.secagg.prg import BLOCK_WORDS, CHUNK_WORDS, MaskStream, keystream, mask_words
from fedagg.secagg.threads import ENV_VAR, auto_threads, resolve_threads, run_all

KEY = bytes(range(32))


@pytest.mark.parametrize("start", [0, 16, 4096, CHUNK_WORDS, 3 * CHUNK_WORDS + 48])
def test_mask_stream_start_is_a_slice_of_the_keystream(start: int) -> None:
    whole = mask_words(KEY, start + 100)
    out = np.empty(100, np.uint32)
    MaskStream(KEY, start=start).next_into(out)
    np.testing.assert_array_equal(out, whole[start:])
    # and it is ChaCha20's block counter (RFC 8439 2.4), not a re-keyed stream
    raw = keystream(KEY, 400, counter=start // BLOCK_WORDS)
    np.testing.assert_array_equal(out, np.frombuffer(raw, "<u4"))


@pytest.mark.parametrize("start", [-16, 1, 15, 2**36])
def test_mask_stream_start_must_be_a_block_boundary_in_range(start: int) -> None:
    with pytest.raises(ProtocolError, match="start"):
        MaskStream(KEY, start=start)


def _serial(vector: np.ndarray, keys: list[tuple[int, bytes]]) -> np.ndarray:
    out = vector.astype(np.uint64)
    for sign, key in keys:
        m = mask_words(key, vector.size).astype(np.uint64)
        out = out + m if sign > 0 else out - m
    return (out % 2**32).astype(np.uint32)


@settings(max_examples=25, deadline=None)
@given(
    n=st.one_of(
        st.integers(0, 3 * CHUNK_WORDS + 17),
        st.sampled_from([CHUNK_WORDS - 1, CHUNK_WORDS, CHUNK_WORDS + 1, 2 * CHUNK_WORDS]),
    ),
    threads=st.integers(1, 5),
    signs=st.lists(st.sampled_from([-1, 1]), min_size=0, max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_threaded_add_masks_equals_the_one_shot_masks(
    n: int, threads: int, signs: list[int], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    keys = [(s, rng.bytes(32)) for s in signs]
    vector = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    expect = _serial(vector, keys)
    add_masks(vector, keys, threads=threads)
    np.testing.assert_array_equal(vector, expect)


def _round(threads: int, dim: int, *, before: set[int], after: set[int]) -> np.ndarray:
    params = SecAggParams(threshold=4, num_neighbours=6, clip=1.0, weight_scale=10.0)
    fed = LocalFederation(7, params, seed=5, threads=threads)
    fed.setup()
    rng = np.random.default_rng(1)
    ups = [rng.uniform(-1, 1, dim) for _ in range(7)]
    w = [float(i + 1) for i in range(7)]
    result = fed.run_round(ups, w, drop_before_upload=before, drop_after_upload=after)
    counted = [i for i in range(7) if i not in before]
    plain = sum(w[i] * ups[i] for i in counted) / sum(w[i] for i in counted)
    assert np.abs(result.mean - plain).max() <= result.error_bound
    assert result.ring_bits < 32  # the packed (lane) path, not the identity
    return np.asarray(result.mean)


@pytest.mark.parametrize(("before", "after"), [(set(), set()), ({2}, {5})])
def test_threaded_server_and_sites_give_the_serial_result_bit_for_bit(
    before: set[int], after: set[int]
) -> None:
    dim = 2 * CHUNK_WORDS + 333  # packed upload of > 1 chunk: threaded accumulation and masks
    serial = _round(1, dim, before=before, after=after)
    for threads in (2, 3):
        np.testing.assert_array_equal(_round(threads, dim, before=before, after=after), serial)


def test_threaded_round_aborted_after_uploads_leaves_the_next_round_exact() -> None:
    params = SecAggParams(threshold=3, num_neighbours=4, clip=1.0, weight_scale=10.0)
    fed = LocalFederation(5, params, seed=3, threads=3)
    fed.setup()
    dim = 2 * CHUNK_WORDS + 1
    rng = np.random.default_rng(0)
    ups = [rng.uniform(-1, 1, dim) for _ in range(5)]
    with pytest.raises(AbortRound):  # 3 of 5 gone: some secret has < 3 live holders
        fed.run_round(ups, [1.0] * 5, drop_before_upload={0, 1, 2})
    assert fed.server.stage.name == "READY"
    fed.setup()  # re-key after the drop, as the strategy does
    result = fed.run_round(ups, [1.0] * 5)
    assert np.abs(result.mean - np.mean(ups, axis=0)).max() <= result.error_bound


@pytest.mark.parametrize("bad", [-1, 17, 2.0, True, "2"])
def test_bad_thread_counts_are_refused_with_the_field_named(bad: object) -> None:
    with pytest.raises(ConfigError, match="threads"):
        resolve_threads(bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="threads"):
        ServerState(SecAggParams(threshold=2), run_id=b"x" * 16, threads=bad)  # type: ignore[arg-type]


def test_auto_threads_is_the_cpus_at_most_four(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert 1 <= auto_threads() <= 4
    assert resolve_threads(0) == resolve_threads(None) == auto_threads()


def test_environment_variable_sets_automatic_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "3")
    assert resolve_threads(None) == resolve_threads(0) == 3
    assert resolve_threads(2) == 2  # an explicit count wins
    for bad in ("0", "x", "-1", "99"):
        monkeypatch.setenv(ENV_VAR, bad)
        with pytest.raises(ConfigError, match=ENV_VAR):
            resolve_threads(None)


def test_run_all_runs_every_task_and_reraises_the_first_failure() -> None:
    ran: list[int] = []
    lock = threading.Lock()

    def task(i: int) -> None:
        with lock:
            ran.append(i)
        if i in (1, 3):
            raise ValueError(f"task {i}")

    with pytest.raises(ValueError, match="task 1"):
        run_all([lambda i=i: task(i) for i in range(5)], 3)
    assert sorted(ran) == [0, 1, 2, 3, 4]
