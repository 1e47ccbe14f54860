"""Gradient accumulation (DDP ``no_sync`` semantics) and bucketing, on real communicators."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from _site_helpers import delta_rel_diff, initial_weights, settings, train, train_single
from torch import nn

from clients.buckets import GradReducer
from fedagg.collectives import InProcessGroup, run_inprocess
from fedagg.errors import ConfigError
from fedagg.models import build_model


def _data(n: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def _large_batch_grads(x: torch.Tensor, y: torch.Tensor,
                       model: nn.Module | None = None) -> list[torch.Tensor]:
    model = copy.deepcopy(model) if model is not None else build_model("mlp", (1, 8, 8), 10, seed=3)
    nn.CrossEntropyLoss()(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("k,m", [(1, 4), (2, 3), (3, 5)])
def test_micro_batches_with_one_all_reduce_equal_the_large_batch_step(
    k: int, m: int, overlap: bool
) -> None:
    x, y = _data()
    # one model, copied: seeded construction uses torch's global RNG, which a thread left
    # over from another test in this process (e.g. a hung in-process worker) could advance
    base = build_model("mlp", (1, 8, 8), 10, seed=3)
    expected = _large_batch_grads(x, y, base)
    models = [copy.deepcopy(base) for _ in range(k)]

    def worker(comm):  # type: ignore[no-untyped-def]
        model = models[comm.rank]
        red = GradReducer(model.parameters(), comm, algorithm="ring", overlap=overlap,
                          bucket_bytes=20_000)
        loss_fn = nn.CrossEntropyLoss(reduction="sum")
        mine = np.array_split(np.arange(len(y)), comm.world_size)[comm.rank]
        micro = np.array_split(mine, m)
        red.begin_step()
        calls_before_last = None
        for j, mb in enumerate(micro):
            red.set_sync(j == m - 1)
            if j == m - 1:
                calls_before_last = red.stats.calls
            (loss_fn(model(x[mb]), y[mb]) / len(y)).backward()
        red.finish_step()
        red.close()
        return [p.grad.clone() for p in model.parameters()], calls_before_last, red.stats

    for grads, calls_before_last, stats in run_inprocess(k, worker, timeout=60):
        assert calls_before_last == 0  # nothing reduced during the first m-1 micro-batches
        assert stats.steps == 1
        # one all-reduce per bucket, once per step; 20 kB buckets: [b, W, b] [W] [b] [W]
        assert stats.calls == (4 if overlap else 1)
        for g, e in zip(grads, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_skipping_the_sync_would_be_caught() -> None:
    """Without the final all-reduce each worker holds only its part: the check above fails."""
    x, y = _data()
    expected = _large_batch_grads(x, y)
    model = build_model("mlp", (1, 8, 8), 10, seed=3)
    (nn.CrossEntropyLoss(reduction="sum")(model(x[:20]), y[:20]) / 40).backward()
    assert not torch.allclose(next(model.parameters()).grad, expected[0], rtol=1e-5)  # type: ignore[arg-type]


def test_buckets_follow_reverse_parameter_order_and_size() -> None:
    model = build_model("mlp", (1, 8, 8), 10, seed=3)  # params: 64x128, 128, 128x64, 64, 64x10, 10

    def worker(comm):  # type: ignore[no-untyped-def]
        red = GradReducer(model.parameters(), comm, bucket_bytes=35_000)
        out = [b.params for b in red.buckets]
        red.close()
        return out

    (buckets,) = run_inprocess(1, worker)
    # reverse order, greedy fill: 40+2560+256 B, then 32768+512 B, then 32768 B
    assert buckets == [[5, 4, 3], [2, 1], [0]]


@pytest.mark.parametrize("m", [2, 4])
def test_site_with_accumulation_equals_single_worker(m: int) -> None:
    s1 = settings()
    w0 = initial_weights(s1)
    ref = train_single(s1, w0)
    s = settings(site={"workers": 2, "mode": "inprocess", "accumulation_steps": m})
    up = train(s, w0)
    assert delta_rel_diff(up.weights, ref.weights, w0) < 1e-5
    assert up.metrics["allreduce_calls"] == up.metrics["steps"] * up.metrics["buckets"]


@pytest.mark.parametrize("check", ["first", "always"])
def test_each_bucket_size_is_verified_once_then_reduced_unchecked(check: str) -> None:
    """check='first': one header per bucket size, later steps unchecked, same gradients."""
    x, y = _data()
    base = build_model("mlp", (1, 8, 8), 10, seed=3)
    models = [copy.deepcopy(base) for _ in range(3)]
    steps = 3

    def worker(comm):  # type: ignore[no-untyped-def]
        model = models[comm.rank]
        red = GradReducer(model.parameters(), comm, algorithm="auto", bucket_bytes=20_000,
                          check=check)
        loss_fn = nn.CrossEntropyLoss(reduction="sum")
        mine = np.array_split(np.arange(len(y)), comm.world_size)[comm.rank]
        grads = []
        for _ in range(steps):
            model.zero_grad()
            red.begin_step()
            (loss_fn(model(x[mine]), y[mine]) / len(y)).backward()
            red.finish_step()
            grads.append([p.grad.clone() for p in model.parameters()])
        red.close()
        return grads, red.stats, sorted({b.flat.numel() for b in red.buckets})

    expected = _large_batch_grads(x, y, base)
    for grads, stats, sizes in run_inprocess(3, worker, timeout=60):
        assert stats.calls == 4 * steps  # 20 kB buckets: [b, W, b] [W] [b] [W]
        assert stats.checked_calls == (len(sizes) if check == "first" else stats.calls)
        for step in grads:
            for g, e in zip(step, expected, strict=True):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7)


def test_check_mode_is_validated() -> None:
    model = build_model("mlp", (1, 8, 8), 10, seed=3)
    with pytest.raises(ConfigError, match="check"):
        GradReducer(model.parameters(), InProcessGroup(1).communicators()[0], check="never")
