"""The all-reduce benchmark's model-order report: paired vs pooled-median comparison."""

from __future__ import annotations

from fedagg.collectives.bench import _order_check
from fedagg.collectives.cost import CostModel, predict


def _result(ring: list[float], tree: list[float]) -> dict[str, object]:
    return {
        "rows": [
            {"alg": "ring", "bytes": 4096, "times": ring},
            {"alg": "tree", "bytes": 4096, "times": tree},
            {"alg": "native", "bytes": 4096, "times": [1.0] * len(ring)},
        ]
    }


def test_paired_order_follows_same_repeat_ratios_not_pooled_medians() -> None:
    model = CostModel(alpha=1e-3, beta=1e-9, gamma=0.0)
    assert predict("tree", 4, 4096, model=model) * 1.1 < predict("ring", 4, 4096, model=model)
    # ring wins 4 of 5 repeats by 10 %, but its slow calls land in different repeats than
    # tree's, so the pooled medians put tree first (bimodal times, as on the 2-core VM)
    result = _result([1.0, 1.0, 4.0, 4.0, 4.0], [1.1, 1.1, 4.4, 4.4, 0.5])
    paired = _order_check(4, result, model, "m")
    medians = _order_check(4, result, model, "m", paired=False)
    assert "measured ring < tree" in paired[0] and "DISAGREES on ring < tree" in paired[0]
    assert paired[-1].endswith(
        "0/1 separable pairs in the predicted order; 0/1 sizes without a disagreement"
    )
    assert "measured tree < ring" in medians[0] and medians[0].endswith("agrees")
    assert "1/1 separable pairs" in medians[-1]


def test_paired_order_agrees_when_the_model_is_right() -> None:
    model = CostModel(alpha=1e-3, beta=1e-9, gamma=0.0)
    result = _result([2.0, 2.2, 2.1, 9.0], [1.0, 1.1, 1.0, 8.0])
    out = _order_check(4, result, model, "m")
    assert "measured tree < ring" in out[0] and out[0].endswith("agrees"), out
