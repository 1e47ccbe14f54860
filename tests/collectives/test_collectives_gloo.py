"""Real processes joined by torch.distributed (gloo on 127.0.0.1): oracle and error checks."""

from __future__ import annotations

import os
import time

import pytest
import torch

from fedagg.collectives import (
    TorchDistCommunicator,
    all_reduce,
    get_schedule,
    last_stats,
    plan_runner,
)
from fedagg.collectives.backends.torch_dist import run_processes
from fedagg.errors import CollectiveError, CollectiveTimeout, ConfigError

pytestmark = [pytest.mark.slow, pytest.mark.gloo]

LENGTHS = (0, 1, 2, 3, 13, 101, 40_009)


def _input(rank: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + d)
    return torch.randn(d, generator=gen, dtype=torch.float64).to(dtype)


RUNNERS = {"cpp": "require", "python": "0"}
"""``FEDAGG_PLAN_RUNNER`` per path; ``mixed``: rank 0 on the C++ runner, the others on Python."""


def _use_runner(runner: str, rank: int) -> str:
    """Set this worker's plan runner; return the ``CollectiveStats.runner`` it must report."""
    if runner == "mixed":
        runner = "cpp" if rank == 0 else "python"
    os.environ[plan_runner.ENV] = RUNNERS[runner]
    return runner


def _oracle(comm: TorchDistCommunicator, runner: str) -> list[str]:
    """Every algorithm vs torch.distributed's all_reduce and the naive sum; returns failures."""
    torch.set_num_threads(1)
    n, rank = comm.world_size, comm.rank
    expect_runner = _use_runner(runner, rank)
    failures: list[str] = []
    cases = [(d, torch.float32) for d in (*LENGTHS, n - 1, n + 1)]
    cases += [(257, torch.float64), (257, torch.bfloat16), (257, torch.float16)]
    for d, dtype in cases:
        x = _input(rank, d, dtype)
        native = x.clone()
        comm.native_all_reduce(native, "sum")
        naive = torch.stack([_input(r, d, dtype).double() for r in range(n)]).sum(0)
        tol = {torch.float32: 1e-5, torch.float64: 1e-12}.get(dtype, 5e-2)
        for alg in ("ring", "tree", "hierarchical", "native", "auto"):
            for op in ("sum", "avg") if d == 13 else ("sum",):
                t = x.clone()
                all_reduce(t, algorithm=alg, op=op, comm=comm, segment_bytes=4096)
                want = naive / n if op == "avg" else naive
                if not torch.allclose(t.double(), want, rtol=tol, atol=tol):
                    failures.append(f"{alg}/{op} n={n} d={d} {dtype}: differs from naive sum")
                if op == "sum" and not torch.allclose(
                    t.double(), native.double(), rtol=tol, atol=tol
                ):
                    failures.append(f"{alg} n={n} d={d} {dtype}: differs from dist.all_reduce")
                st = last_stats()
                if alg in ("ring", "tree", "hierarchical") and st is not None and n > 1:
                    if st.runner != expect_runner:
                        failures.append(f"{alg} n={n} d={d}: ran on {st.runner!r}")
                    sched = get_schedule(alg, n, d)
                    if st.bytes_sent != t.element_size() * sched.elements_sent(rank):
                        failures.append(f"{alg} n={n} d={d}: bytes_sent {st.bytes_sent}")
    t = _input(rank, 1000, torch.float32)
    all_reduce(t, algorithm="ring", comm=comm, wire_dtype="bf16")
    ref = torch.stack([_input(r, 1000, torch.float32) for r in range(n)]).sum(0)
    if not torch.allclose(t, ref, rtol=5e-2, atol=5e-2):
        failures.append("ring with bf16 wire differs")
    return failures


def _oracle_one_group(comm: TorchDistCommunicator, runner: str) -> list[str]:
    """The oracle with every message on the one group (``directional=False``)."""
    one = TorchDistCommunicator(timeout=comm.timeout, directional=False)
    return _oracle(one, runner)


def _errors(comm: TorchDistCommunicator) -> list[str]:
    """Mismatched inputs, then a rank that never calls (timeout); returns error types."""
    out: list[str] = []
    try:
        all_reduce(torch.ones(10 + comm.rank), algorithm="ring", comm=comm)
        out.append("no error")
    except CollectiveError as exc:
        out.append(f"{type(exc).__name__}: {exc}")
    try:
        dtype = torch.float64 if comm.rank == 0 else torch.float32
        all_reduce(torch.ones(8, dtype=dtype), algorithm="tree", comm=comm)
        out.append("no error")
    except CollectiveError as exc:
        out.append(f"{type(exc).__name__}: {exc}")
    t = all_reduce(torch.ones(4096), algorithm="ring", comm=comm)  # nothing left in flight
    out.append(f"after mismatches: {t[0].item()}")
    short = TorchDistCommunicator(timeout=1.0)
    if comm.rank == comm.world_size - 1:  # the last rank never joins this call
        time.sleep(2.0)  # but stays alive, so its peers must time out
    else:
        try:
            all_reduce(torch.ones(8), algorithm="ring", comm=short)
            out.append("no error")
        except CollectiveTimeout as exc:
            out.append(f"{type(exc).__name__}: {exc}")
    return out


def _mismatch_cases(comm: TorchDistCommunicator, runner: str) -> list[str]:
    """Mismatches whose ranks posted many data receives before the check, then good calls.

    Valid ranks post their data receives before the header check; after a failed check every
    rank fills the receives its peers posted. If one were left posted it would swallow the
    next call's messages (wrong sums, a size error or a hang): each case is followed by a
    checked call.
    """
    torch.set_num_threads(1)
    r, n = comm.rank, comm.world_size
    expect_runner = _use_runner(runner, r)
    big = 300_001
    cases: list[tuple[str, dict[str, object], torch.Tensor]] = [
        ("numel", {"algorithm": "ring"}, torch.ones(big + 1000 * r)),
        ("numel", {"algorithm": "tree"}, torch.ones(big if r else 7)),
        ("algorithm", {"algorithm": "ring" if r else "tree"}, torch.ones(big)),
        ("algorithm", {"algorithm": "native" if r == n - 1 else "ring"}, torch.ones(big)),
        ("wire_dtype", {"algorithm": "ring", "wire_dtype": "bf16" if r else None}, torch.ones(big)),
        ("segment_elems", {"algorithm": "ring", "segment_bytes": 4096 << r}, torch.ones(big)),
        (
            "dtype",
            {"algorithm": "hierarchical"},
            torch.ones(big, dtype=torch.float64 if r else torch.float32),
        ),
        (
            "input",
            {"algorithm": "ring"},
            torch.ones(big, 2)[:, 0] if r == n - 1 else torch.ones(big),
        ),
    ]
    out: list[str] = []
    for i, (field, kwargs, x) in enumerate(cases):
        try:
            all_reduce(x, comm=comm, segment_bytes=kwargs.pop("segment_bytes", 8192), **kwargs)  # type: ignore[arg-type]
            out.append(f"case {i}: no error")
        except (CollectiveError, ConfigError) as exc:
            if field not in str(exc) and not isinstance(exc, ConfigError):
                out.append(f"case {i}: {type(exc).__name__}: {exc}")
        y = torch.full((big,), float(r + i))
        all_reduce(y, algorithm="ring", comm=comm, segment_bytes=8192)
        want = float(sum(range(n)) + n * i)
        if not torch.equal(y, torch.full((big,), want)):
            out.append(f"after case {i}: wrong sum {y[:3].tolist()} (want {want})")
        st = last_stats()
        if st is None or st.runner != expect_runner:
            out.append(f"after case {i}: ran on {st.runner if st else None!r}")
    return out


@pytest.mark.parametrize(("n", "runner"), [(2, "cpp"), (3, "cpp"), (2, "python"), (3, "mixed")])
def test_gloo_group_is_clean_after_mismatches(n: int, runner: str) -> None:
    """Failed checks leave nothing posted, on the C++ runner, the Python replay and a mix."""
    results = run_processes(n, _mismatch_cases, runner, timeout=180, comm_timeout=30)
    assert results == [[]] * n, results


@pytest.mark.parametrize(
    ("n", "runner"),
    [(2, "cpp"), (3, "cpp"), (4, "cpp"), (2, "python"), (3, "python"), (4, "python"), (3, "mixed")],
)
def test_gloo_oracle(n: int, runner: str) -> None:
    """Oracle on both paths; ``mixed`` also shows that they send the same messages."""
    results = run_processes(n, _oracle, runner, timeout=120, comm_timeout=30)
    assert results == [[]] * n, results


@pytest.mark.parametrize("runner", ["cpp", "python"])
def test_gloo_oracle_on_one_group(runner: str) -> None:
    """``directional=False`` (no per-direction groups) stays correct on both paths."""
    results = run_processes(2, _oracle_one_group, runner, timeout=120, comm_timeout=30)
    assert results == [[]] * 2, results


def test_gloo_bad_input_raises_on_every_rank_and_times_out() -> None:
    results = run_processes(2, _errors, timeout=120, comm_timeout=30)
    for rank, res in enumerate(results):
        assert res[0].startswith("CollectiveError") and "numel" in res[0], res
        assert res[1].startswith("CollectiveError") and "dtype" in res[1], res
        assert res[2] == f"after mismatches: {len(results)}.0", res
        if rank != 1:
            assert res[3].startswith("CollectiveTimeout"), res
