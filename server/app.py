"""The fedagg ServerApp (``server.app:app``), used by ``flwr run .`` and in deployment.

The run configuration comes from Flower's run config (``[tool.flwr.app.config]`` in
``pyproject.toml`` and ``flwr run --run-config``), whose dotted keys (``"train.lr"``) map onto
:class:`fedagg.config.RunConfig`. Outputs go to ``run.output_dir/<name>-<timestamp>/``; with
``run.resume`` set, the run continues in that directory from its checkpoint
(docs/reliability.md).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy

from fedagg.config import RunConfig, unflatten, validate_model
from server.runner import EvaluateFn, ModelFn, RoundCallback, run_server

__all__ = ["app", "config_from_run_config", "make_app", "new_run_dir"]

_log = logging.getLogger(__name__)


def config_from_run_config(run_config: Any) -> RunConfig:
    """Flower's flat run config -> validated :class:`RunConfig`."""
    # pyproject declares every key (Flower refuses undeclared overrides); "" means unset
    flat = {str(k): v for k, v in dict(run_config).items() if v != ""}
    cfg: RunConfig = validate_model(RunConfig, unflatten(flat))
    return cfg


def new_run_dir(cfg: RunConfig) -> Path:
    """A fresh ``<output_dir>/<name>-<YYYYmmdd-HHMMSS>[-n]`` directory."""
    base = Path(cfg.run.output_dir)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = base / f"{cfg.run.name}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = base / f"{cfg.run.name}-{stamp}-{n}"
    path.mkdir(parents=True)
    return path


def make_app(
    cfg: RunConfig | None = None,
    run_dir: str | Path | None = None,
    *,
    on_round: RoundCallback | None = None,
    model_fn: ModelFn | None = None,
    evaluate_fn: EvaluateFn | None = None,
    strategy: Strategy | None = None,
) -> ServerApp:
    """A ServerApp bound to ``cfg`` (``fedagg simulate``), or reading Flower's run config.

    ``model_fn`` / ``evaluate_fn``: the user's model factory and centralized evaluation (see
    :func:`server.runner.run_server`); the built-in model and test split by default.
    ``strategy``: a strategy object of the user's for fedagg's synchronous loop (default: the
    run config's).
    """
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        run_cfg = cfg if cfg is not None else config_from_run_config(context.run_config)
        if run_dir is not None:
            out: str | Path = run_dir
        elif run_cfg.run.resume:
            out = Path(run_cfg.run.resume)  # continue in the run's own directory
        else:
            out = new_run_dir(run_cfg)
        _log.info("fedagg run writing to %s", out)
        logger = on_round if on_round is not None else _round_logger(run_cfg.run.rounds)
        if run_cfg.asynchronous.mode != "off":  # FedBuff / deadline rounds (docs/asynchronous.md)
            from server.asynchronous import run_async_server

            run_async_server(grid, run_cfg, out, on_round=logger, model_fn=model_fn,
                             evaluate_fn=evaluate_fn)
            return
        run_server(grid, run_cfg, out, on_round=logger, model_fn=model_fn,
                   evaluate_fn=evaluate_fn, strategy=strategy)

    return server_app


# One INFO line per round for `flwr run .`, through Flower's logger (a child of "flwr"), so it
# shows wherever Flower's own lines do (`flwr run --stream`, `flwr log`); `fedagg simulate`
# passes its own on_round instead.
_round_log = logging.getLogger("flwr").getChild("fedagg")


def _round_logger(total: int) -> RoundCallback:
    """An ``on_round`` callback that logs a one-line summary of each round record."""

    def log_round(rec: dict[str, Any]) -> None:
        acc, loss = rec.get("accuracy"), rec.get("loss")
        _round_log.info(
            "fedagg round %s/%d: accuracy %s, loss %s, sites %s/%s, up %.3f MB, down %.3f MB, %.2f s",
            rec.get("round"), total,
            "-" if acc is None else f"{acc:.4f}", "-" if loss is None else f"{loss:.4f}",
            rec.get("sites_replied", "-"), rec.get("sites_sampled", "-"),
            (rec.get("bytes_up") or 0) / 1e6, (rec.get("bytes_down") or 0) / 1e6,
            rec.get("seconds") or 0.0,
        )

    return log_round


app = make_app()
