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

from fedagg.config import RunConfig, unflatten, validate_model
from server.runner import RoundCallback, run_server

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
) -> ServerApp:
    """A ServerApp bound to ``cfg`` (``fedagg simulate``), or reading Flower's run config."""
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
        run_server(grid, run_cfg, out, on_round=on_round)

    return server_app


app = make_app()
