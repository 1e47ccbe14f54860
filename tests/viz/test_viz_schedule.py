"""The schedule page's data is the real schedule (no browser: see test_viz_browser.py)."""

from __future__ import annotations

import json
import re

import pytest

from fedagg.collectives.cost import CostModel, predict
from fedagg.collectives.schedule import get_schedule
from fedagg.errors import ConfigError
from fedagg.viz.schedule_page import render_schedule_page
from fedagg.viz.schedule_view import ps_seconds, ps_view, schedule_view, view_data

ALGS = ("ring", "tree", "hierarchical")


def _embedded(html_text: str) -> dict:  # type: ignore[type-arg]
    m = re.search(r'<script type="application/json" id="fedagg-data">(.*?)</script>', html_text,
                  re.S)
    assert m is not None
    return json.loads(m.group(1))  # type: ignore[no-any-return]


@pytest.mark.parametrize("alg", ALGS)
@pytest.mark.parametrize("n", range(2, 10))
def test_panel_is_the_real_schedule(alg: str, n: int) -> None:
    nbytes = 4 * 1000 + 4 * n  # not a multiple of N: uneven chunks
    view = schedule_view(alg, n, nbytes)
    sched = get_schedule(alg, n, nbytes // 4)
    assert view["num_steps"] == len(sched.steps) == len(view["steps"])
    for step, real in zip(view["steps"], sched.steps, strict=True):
        assert step["transfers"] == [[t.src, t.dst, t.chunk, t.op.value] for t in real]
        assert step["bytes"] == sum(4 * sched.chunk_len(t.chunk) for t in real)
    # the replay ends with every copy of every chunk holding all N inputs (a correct all-reduce)
    assert len(view["counts"]) == len(sched.steps) + 1
    assert all(c == 1 for row in view["counts"][0] for c in row)
    assert all(c == n for row in view["counts"][-1] for c in row)


@pytest.mark.parametrize("alg", ALGS)
def test_replay_agrees_with_schedule_simulate(alg: str) -> None:
    """The page's counts after each step = whose inputs Schedule.simulate summed into each copy.

    Rank r's input is 2**r everywhere, so the bits of a simulated value name its contributors.
    """
    import numpy as np

    n = 6
    sched = get_schedule(alg, n, n)
    view = schedule_view(alg, n, 4 * n)
    data = np.array([[2.0**r] * n for r in range(n)])
    for k in range(len(sched.steps) + 1):
        partial = type(sched)(sched.algorithm, n, n, sched.chunks, sched.steps[:k])
        out = partial.simulate(data)
        for r in range(n):
            for c, (off, ln) in enumerate(sched.chunks):
                if ln:
                    assert view["counts"][k][r][c] == bin(int(out[r, off])).count("1"), (k, r, c)


def test_ps_panel_uploads_then_downloads() -> None:
    view = ps_view(4, 4096)
    assert view["num_steps"] == 2 and view["nodes"][-1] == "server"
    assert view["steps"][0]["transfers"] == [[r, 4, 0, "reduce"] for r in range(4)]
    assert view["steps"][1]["transfers"] == [[4, r, 0, "copy"] for r in range(4)]
    assert view["steps"][0]["bytes"] == 4 * 4096
    assert view["counts"][0][4] == [0] and view["counts"][1][4] == [4]
    assert all(row == [4] for row in view["counts"][2])


def test_cost_rows_use_the_cost_model() -> None:
    m = CostModel(alpha=1e-5, beta=1e-9, gamma=1e-10)
    data = view_data("all", 6, 1 << 20, model=m)
    assert [p["algorithm"] for p in data["panels"]] == ["ring", "tree", "ps"]
    rows = {r["algorithm"]: r for r in data["cost"]}
    for alg in ALGS:
        assert rows[alg]["predicted_s"] == predict(alg, 6, 1 << 20, model=m)
        assert rows[alg]["steps"] == get_schedule(alg, 6, (1 << 20) // 4).num_steps
    assert rows["ps"]["predicted_s"] == ps_seconds(6, 1 << 20, m)
    assert rows["ps"]["predicted_s"] == pytest.approx(2 * 6 * (1e-5 + (1 << 20) * 1e-9)
                                                      + 5 * (1 << 20) * 1e-10)
    ring = get_schedule("ring", 6, (1 << 20) // 4)
    assert rows["ring"]["max_bytes_sent_per_rank"] == 4 * max(ring.elements_sent(r) for r in range(6))
    assert rows["ps"]["server_link_bytes"] == 2 * 6 * (1 << 20)


BENCH = """
# Benchmarks
## Intra-site all-reduce
### Session 9 (newest)
| N | size | algorithm | median ms | busbw GB/s |
|---|---|---|---|---|
| 4 | 1 MB | ring | 5.71 | 0.3 |
| 4 | 1 MB | tree | 4.50 | 0.3 |
| 4 | 1 MB | native | 6.57 | 0.2 |
| 4 | 16 MB | ring | 34.8 | 0.7 |
| 4 | junk | ring | x | 0 |
### Session 8 (older)
| N | size | algorithm | median ms |
|---|---|---|---|
| 4 | 1 MB | ring | 99.0 |
| 2 | 1 MB | ring | 1.10 |
"""


def test_measured_figures_from_benchmarks_page(tmp_path) -> None:  # type: ignore[no-untyped-def]
    bench = tmp_path / "benchmarks.md"
    bench.write_text(BENCH)
    data = view_data("ring", 4, 900_000, benchmarks=bench)  # nearest measured size: 1 MiB
    assert data["measured"]["bytes"] == 1 << 20
    assert data["measured"]["section"] == ""  # a heading naming a work session is not cited
    assert {r["algorithm"]: r["median_ms"] for r in data["measured"]["rows"]} == {
        "ring": 5.71, "tree": 4.50, "native": 6.57}  # the newest session wins
    assert view_data("ring", 3, 1 << 20, benchmarks=bench)["measured"]["rows"] == []
    bench.write_text(BENCH.replace("Session 9 (newest)", "Ring vs tree (2 vCPUs)"))
    assert view_data("ring", 4, 1 << 20, benchmarks=bench)["measured"]["section"] == \
        "Ring vs tree (2 vCPUs)"
    assert view_data("ring", 4, 1 << 20, benchmarks=tmp_path / "missing.md")["measured"]["rows"] == []


def test_page_is_self_contained_and_embeds_the_data() -> None:
    text = render_schedule_page("all", 4, 1 << 16)
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text)  # no network reference
    assert "default-src 'none'" in text
    data = _embedded(text)
    assert [p["num_steps"] for p in data["panels"]] == [
        len(get_schedule("ring", 4, 1 << 14).steps), len(get_schedule("tree", 4, 1 << 14).steps), 2]


@pytest.mark.parametrize(("args", "field"), [
    (("ring", 1, 4096), "--workers"),
    (("ring", 65, 4096), "--workers"),
    (("ring", 4, 2), "--size"),
    (("native", 4, 4096), "--algorithm"),
])
def test_bad_arguments_name_the_field(args: tuple[str, int, int], field: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(field)):
        render_schedule_page(*args)
