"""``fedagg viz schedule``: one self-contained HTML page animating real all-reduce schedules.

The page is built from :func:`fedagg.viz.schedule_view.view_data`; every panel's
``data-steps`` attribute is set by the page's script from the embedded steps, so it equals
``len(get_schedule(algorithm, N, numel).steps)`` (2 for the parameter server).
"""

from __future__ import annotations

import html
from pathlib import Path

from fedagg.collectives.cost import CostModel
from fedagg.report import atomic_write_bytes
from fedagg.viz._page import page
from fedagg.viz._schedule_js import SCHEDULE_CSS, SCHEDULE_JS
from fedagg.viz.schedule_view import view_data

__all__ = ["render_schedule_page", "write_schedule_page"]

_BODY = """
<h1>{title}</h1>
<div class="muted">Every arrow is one <code>Transfer(src, dst, chunk, op)</code> of the real schedule
(<code>fedagg.collectives.schedule</code>); a step's transfers happen at once. The bars in a rank
are its copies of the chunks: height = how many ranks' inputs are summed into that copy
(green: all {n}).</div>
<div class="legend small" style="margin:6px 0">
<span><span class="sw" style="background:var(--reduce)"></span>reduce (add into the destination)</span>
<span><span class="sw" style="background:var(--copy)"></span>copy (overwrite the destination)</span>
<span><span class="sw" style="background:var(--part)"></span>partial sum</span>
<span><span class="sw" style="background:var(--full)"></span>full sum</span>
</div>
<div id="all-controls" class="controls" hidden>
<b>all panels:</b>
<button data-action="play-all">&#9654; play all</button>
<button data-action="pause-all">pause all</button>
<button data-action="step-all">step all &#9654;</button>
<button data-action="reset-all">reset all</button>
</div>
<div id="panels" class="panels"></div>
<h2>Predicted time of one all-reduce of {size} over N = {n} ranks</h2>
<table id="cost"><thead><tr><th>algorithm</th><th>steps</th><th>max bytes sent by a rank</th>
<th>predicted (alpha-beta-gamma)</th><th>measured</th><th>model</th></tr></thead><tbody></tbody></table>
<p class="small muted">Predictions: <code>fedagg.collectives.cost.predict</code> (ring, tree,
hierarchical) with alpha = {alpha}, B = 1/beta = {bw}, gamma = {gamma}, D = {size}. The
parameter server is not a fedagg schedule: it is drawn and costed as N uploads of the whole
buffer into one server, then N downloads, all through the server's one link (about N&middot;D/B
each way there). <span id="measured-note"></span></p>
"""


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def render_schedule_page(
    algorithm: str,
    workers: int,
    nbytes: int = 1 << 20,
    *,
    model: CostModel | None = None,
    benchmarks: str | Path | None = None,
) -> str:
    """The HTML of the schedule page.

    Parameters
    ----------
    algorithm : {"ring", "tree", "hierarchical", "ps", "all"}
        Panels to animate; ``all`` shows ring, tree and the parameter server side by side.
    workers : int
        Number of ranks ``N`` (2 to :data:`~fedagg.viz.schedule_view.MAX_WORKERS`).
    nbytes : int
        Buffer size in bytes (float32 elements: ``nbytes // 4``).
    model : CostModel, optional
        Cost-model parameters (default: the process-wide default model).
    benchmarks : str or Path, optional
        ``docs/benchmarks.md``, for measured medians beside the predictions.

    Raises
    ------
    ConfigError
        Unknown algorithm, ``workers`` out of range or ``nbytes`` < 4.
    """
    data = view_data(algorithm, workers, nbytes, model=model, benchmarks=benchmarks)
    cm = data["cost_model"]
    name = "ring, tree and parameter server" if algorithm == "all" else algorithm
    title = f"fedagg all-reduce schedules: {name}, N = {workers}, {_size(nbytes)}"
    body = _BODY.format(
        title=html.escape(title), n=workers, size=_size(nbytes),
        alpha=f"{cm['alpha'] * 1e6:g} µs", bw=f"{1.0 / cm['beta'] / 1e9:g} GB/s" if cm["beta"] else "inf",
        gamma=f"{cm['gamma'] * 1e9:g} ns/B",
    )
    return page(title, body, data, SCHEDULE_JS, css=SCHEDULE_CSS)


def write_schedule_page(
    path: str | Path,
    algorithm: str,
    workers: int,
    nbytes: int = 1 << 20,
    *,
    model: CostModel | None = None,
    benchmarks: str | Path | None = None,
) -> Path:
    """Write :func:`render_schedule_page` to ``path`` atomically; returns the path."""
    text = render_schedule_page(algorithm, workers, nbytes, model=model, benchmarks=benchmarks)
    out = Path(path)
    atomic_write_bytes(out, text.encode("utf-8"))
    return out
