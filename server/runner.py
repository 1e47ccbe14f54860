"""The server's round loop: strategy rounds, centralized evaluation, metrics, outputs.

Used by the ServerApp (``server.app``) in both simulation and deployment, and by
``fedagg simulate``. One round: the strategy trains (one or more exchanges, see
:func:`strategies.loop.run_train_round`), the global model changes only when the strategy
returns new arrays, then the model is evaluated centrally on the held-out test split and a
per-round record is appended to ``metrics.json`` / ``metrics.csv``.

Two guards keep one bad round from ending the run (docs/reliability.md): any unexpected error
inside a round's training or aggregation (or its federated evaluation) leaves the global model
unchanged, is recorded in that round's record (``errors["server"]``, ``summary``) and the run
goes on with the next round; and a new global model is committed only when it is finite and
within ``strategy.max_model_change`` of the old one, whatever strategy produced it. A round
whose aggregate was refused (a secure round aborted or its unmasked sum failing a check, a
streamed round that cannot be corrected, a model that fails the backstop) says why in
``round_refused`` and is counted in ``rounds_refused``; the run goes on. A run in which no
round changed the model still ends in :class:`~fedagg.errors.RunFailed`.

A resume (``run.resume``) is validated in full before anything is written into the run
directory (:func:`load_resume`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedagg.aggregate import model_change_problem
from fedagg.config import RunConfig, config_hash
from fedagg.data import load_dataset
from fedagg.errors import CheckpointError, ConfigError, PrivacyBudgetSpent, RunFailed, explain
from fedagg.memory import PeakMemory
from fedagg.models import build_model, set_weights
from fedagg.report import atomic_write_bytes, write_metrics, write_plot
from fedagg.training import evaluate
from server.checkpoint import Checkpoint, config_diff, load_checkpoint, save_checkpoint
from strategies.base import RoundResult
from strategies.loop import run_evaluate_round, run_train_round
from strategies.registry import build_strategy
from strategies.update import RoundReport
from strategies.wire import arrays_to_record, config_to_record, record_to_arrays

__all__ = ["RoundCallback", "check_resume", "client_config", "finite_number", "initial_model",
           "load_resume", "run_server"]

_log = logging.getLogger(__name__)

RoundCallback = Callable[[dict[str, Any]], None]
ModelFn = Callable[[], Any]
"""``() -> torch.nn.Module``: the run's model (initial weights and outputs)."""
EvaluateFn = Callable[[ArrayRecord], tuple[float, float] | None]
"""``arrays -> (loss, accuracy)`` of the global model on the server's data, or None."""

_CLIENT_SECTIONS = ("data", "model", "train", "site", "compression", "secagg", "faults")


def _test_kill_point(rnd: int, phase: str) -> None:
    """Test hook: SIGKILL this process at ``$FEDAGG_TEST_KILL_AT`` (``"<round>:<phase>"``)."""
    if os.environ.get("FEDAGG_TEST_KILL_AT") == f"{rnd}:{phase}":
        os.kill(os.getpid(), signal.SIGKILL)


def wait_for_sites(grid: Grid, cfg: RunConfig, *, poll: float = 1.0) -> int:
    """Wait until ``run.sites`` nodes are connected (at most ``run.wait_for_sites`` s).

    Returns the number connected. Fewer than ``run.min_sites`` after the wait is an error.
    """
    deadline = time.monotonic() + cfg.run.wait_for_sites
    while True:
        n = len(list(grid.get_node_ids()))
        if n >= cfg.run.sites or time.monotonic() >= deadline:
            break
        _log.info("waiting for sites: %d of %d connected", n, cfg.run.sites)
        time.sleep(poll)
    if n < cfg.run.min_sites:
        raise ConfigError(
            explain(
                "run.min_sites",
                cfg.run.min_sites,
                f"only {n} site(s) connected within run.wait_for_sites = "
                f"{cfg.run.wait_for_sites} s",
                "start more SuperNodes, raise run.wait_for_sites or lower run.min_sites",
            )
        )
    if n < cfg.run.sites:
        _log.warning("starting with %d of %d sites (run.wait_for_sites elapsed)", n, cfg.run.sites)
    return n


WARMUP_ACTION = "warmup"
"""The query action of the engine warm-up (``query.warmup``; answered by fedagg's ClientApp)."""


def engine_warmup(grid: Grid, cfg: RunConfig) -> float | None:
    """Wake the simulation engine before round 1; return the seconds it took (None: skipped).

    In Flower's simulation engine the first message to each backend worker starts it (a Ray
    actor, which imports and loads the ClientApp): several seconds that would otherwise be
    counted in round 1's time. Every node gets one ``query.warmup`` message with the sites'
    config; fedagg's ClientApp loads the built-in task's model and data for that site (cached
    in the worker, as a train message would) and answers with an empty reply; another app
    answers with an error reply, which shows as well that the worker is up. The replies are
    waited for at most the first round's deadline and dropped.
    Not done in deployment (each message starts a fresh ClientApp process there, so nothing
    stays warm) nor on grids that are not Flower's simulation grid.
    """
    if type(grid).__name__ != "InMemoryGrid":
        return None
    t0 = time.perf_counter()
    nodes = list(grid.get_node_ids())
    messages = [Message(content=RecordDict({"config": client_config(cfg)}), dst_node_id=n,
                        message_type=f"{MessageType.QUERY}.{WARMUP_ACTION}") for n in nodes]
    try:
        replies = list(grid.send_and_receive(messages, timeout=round_deadline(cfg, 1)))
    except Exception as exc:  # a failed warm-up only means round 1 pays the start-up
        _log.debug("engine warm-up failed: %s", exc)
        return None
    seconds = time.perf_counter() - t0
    _log.info("simulation engine started: %d of %d sites answered in %.1f s",
              len(replies), len(nodes), seconds)
    return seconds


def round_deadline(cfg: RunConfig, rnd: int) -> float:
    """Seconds a round's exchange may take (round 1 may have a longer cold-start deadline)."""
    if rnd == 1 and cfg.run.first_round_timeout is not None:
        return cfg.run.first_round_timeout
    return cfg.run.round_timeout


def model_digest(arrays: ArrayRecord) -> str:
    """First 16 hex digits of SHA-256 over the global model's bytes (identity per round)."""
    h = hashlib.sha256()
    for key, arr in zip(*record_to_arrays(arrays), strict=True):
        h.update(key.encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()[:16]


def client_config(cfg: RunConfig) -> ConfigRecord:
    """The part of the run config that sites need, as a flat ConfigRecord."""
    dumped = cfg.model_dump(mode="json")
    nested: dict[str, Any] = {k: dumped[k] for k in _CLIENT_SECTIONS}
    nested["run"] = {"seed": cfg.run.seed, "sites": cfg.run.sites}
    return config_to_record(nested)


def initial_model(cfg: RunConfig, model_fn: ModelFn | None) -> tuple[Any, list[str], ArrayRecord]:
    """The run's model (built-in unless ``model_fn``), its keys and initial arrays."""
    if model_fn is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.run.seed)
            model = model_fn()
    else:
        ds = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir,
                          test_fraction=cfg.data.test_fraction, seed=cfg.run.seed)
        model = build_model(cfg.model.name, ds.input_shape, ds.num_classes, seed=cfg.run.seed,
                            params=cfg.model.params)
    keys = list(model.state_dict().keys())
    arrays = arrays_to_record([t.detach().cpu().numpy().copy()
                               for t in model.state_dict().values()], keys)
    return model, keys, arrays


def _model_problem(new: ArrayRecord, old: ArrayRecord, cfg: RunConfig) -> str:
    """Why ``new`` must not become the global model ('' if it may): the integrity backstop."""
    try:
        new_keys, new_arrays = record_to_arrays(new, copy=False)
        old_keys, old_arrays = record_to_arrays(old, copy=False)
    except Exception as exc:  # a strategy returned something that is not a model
        return f"the aggregated model could not be read ({type(exc).__name__}: {exc})"
    if new_keys != old_keys:
        return f"the aggregated model's tensors {new_keys[:3]} are not the model's {old_keys[:3]}"
    return model_change_problem(new_arrays, old_arrays,
                                max_change=cfg.strategy.max_model_change)


def _failed_round(rnd: int, exc: Exception) -> RoundResult:
    """The record of a round whose training / aggregation raised: nothing committed."""
    why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    _log.error("round %d: unexpected error in the round (global model unchanged, the run "
               "goes on): %s", rnd, why, exc_info=True)
    return RoundResult(arrays=None, metrics=None, report=RoundReport(
        errors={"server": f"unexpected error in the round: {why}"},
        aborted=f"unexpected error in the round's training or aggregation: {why}"))


def finite_number(value: Any) -> bool:
    """Whether ``value`` is a finite int or float (not a bool): what a record keeps."""
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and np.isfinite(value))


def load_resume(cfg: RunConfig, keys: list[str], arrays: list[np.ndarray],
                strategy: Any = None) -> Checkpoint:
    """The checkpoint ``run.resume`` points at, validated against ``cfg`` and its model.

    With ``strategy``, the saved strategy state is loaded into it (a state the strategy refuses
    is a CheckpointError too). Nothing is written and no RNG is touched (see
    :meth:`Checkpoint.restore_rng`).

    Raises
    ------
    CheckpointError
        A damaged / tampered checkpoint (the file and the field), another model, another
        configuration (every difference listed), or a strategy state the strategy refuses.
    """
    assert cfg.run.resume is not None
    ckpt = load_checkpoint(cfg.run.resume)
    diff = config_diff(ckpt.config, cfg)
    if ckpt.config_hash != config_hash(cfg) or diff:
        raise CheckpointError(
            explain(
                "--resume",
                str(cfg.run.resume),
                "was written with a different configuration: "
                + "; ".join(diff or ["(hash differs)"]),
                "resume with the run's own config (its config.json), changing only run.rounds",
            )
        )
    ckpt.check_model(keys, arrays)
    load_state = getattr(strategy, "load_state_dict", None)
    if ckpt.strategy_state is not None and callable(load_state):
        try:
            load_state(ckpt.strategy_state)
        except Exception as exc:  # a tampered state: the strategy's own checks, or any error
            raise CheckpointError(
                explain(f"{Path(cfg.run.resume) / 'checkpoint.npz'}[meta.strategy_state]",
                        type(exc).__name__, f"was refused by the strategy: {exc}",
                        "restore the run directory from a backup, or start a new run")
            ) from None
    return ckpt


def check_resume(cfg: RunConfig, *, model_fn: ModelFn | None = None) -> Checkpoint:
    """What a resume of ``cfg`` would load, checked before any engine starts (writes nothing).

    ``fedagg simulate --resume`` calls it so that a refused resume exits with status 2 and
    leaves the run directory byte-identical; :func:`run_server` runs the same checks.
    """
    _, keys, arrays = initial_model(cfg, model_fn)
    return load_resume(cfg, keys, record_to_arrays(arrays)[1], build_strategy(cfg))


def refused_reason(report: RoundReport) -> str:
    """Why a round's aggregate was refused ('' when it was not: nothing came to aggregate, or
    the round failed with an unexpected error)."""
    if "server" in report.errors:
        return ""
    why = report.aborted or report.refused.get("server") or report.refused.get("round") or ""
    return why.splitlines()[0][:500] if why else ""


def round_summary(rnd: int, result: RoundResult) -> str:
    """One line naming why a round aggregated nothing (rejections, errors, missing replies)."""
    report = result.report
    reasons = {**report.errors, **report.refused}
    if report.aborted:
        why = report.aborted
    elif not report.sampled:
        why = "no site was sampled (or the round was aborted before training)"
    elif not reasons:
        why = "the strategy returned no model"
    else:
        parts = [f"node {n}: {r.splitlines()[0][:200]}" for n, r in sorted(reasons.items())[:5]]
        more = len(reasons) - len(parts)
        why = "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
    return (f"round {rnd}: nothing aggregated ({report.replies} of {report.sampled} sites "
            f"replied): {why}")


def run_server(
    grid: Grid, cfg: RunConfig, run_dir: str | Path | None, *, on_round: RoundCallback | None = None,
    model_fn: ModelFn | None = None, evaluate_fn: EvaluateFn | None = None,
    strategy: Strategy | None = None, train_config: ConfigRecord | None = None,
) -> list[dict[str, Any]]:
    """Run ``cfg.run.rounds`` rounds; return the per-round records (also written to run_dir).

    Parameters
    ----------
    grid : Grid
        Flower's Grid (simulation or deployment).
    cfg : RunConfig
        The run.
    run_dir : path, optional
        Where metrics, checkpoints and the final model go.
    on_round : callable, optional
        Called with every round's record.
    model_fn : callable, optional
        The user's model factory (the same as the sites' ``Task.model``); default: the
        built-in ``model.name``.
    evaluate_fn : callable, optional
        Centralized evaluation of the global model; default: the built-in data set's test
        split (with the built-in model), none with ``model_fn``.
    strategy : Strategy, optional
        A strategy object of the user's (any Flower Message-API strategy, fedagg's wrappers
        around it, Flower's wrappers around those); default: the run config's
        (:func:`strategies.build_strategy`).
    train_config : ConfigRecord, optional
        Keys added to every train message's config (as ``Strategy.start``'s
        ``train_config``: what the user's ClientApp reads, e.g. ``"lr"``).

    Raises
    ------
    RunFailed
        No round aggregated anything (after writing the outputs): each round's reasons.
    """
    model, keys, arrays = initial_model(cfg, model_fn)
    strategy = strategy if strategy is not None else build_strategy(cfg)
    out = Path(run_dir) if run_dir else None
    central_eval: EvaluateFn | None = evaluate_fn
    if central_eval is None and model_fn is None:
        ds = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir,
                          test_fraction=cfg.data.test_fraction, seed=cfg.run.seed)

        def central_eval(rec: ArrayRecord) -> tuple[float, float] | None:
            _, weights = record_to_arrays(rec)
            set_weights(model, weights)
            return evaluate(model, ds.x_test, ds.y_test)

    def evaluated(rec: ArrayRecord) -> tuple[float | None, float | None]:
        res = central_eval(rec) if central_eval is not None else None
        return (None, None) if res is None else (float(res[0]), float(res[1]))

    start = 1
    records: list[dict[str, Any]]
    ckpt: Checkpoint | None = None
    if cfg.run.resume:  # validated in full before anything is written into the run directory
        ckpt = load_resume(cfg, keys, record_to_arrays(arrays)[1], strategy)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out / "config.json", cfg.model_dump_json(indent=2).encode())
    wait_for_sites(grid, cfg)
    startup = engine_warmup(grid, cfg)  # not counted in round 1's time
    if ckpt is not None:
        ckpt.restore_rng()
        arrays = arrays_to_record(ckpt.arrays, keys)
        records = ckpt.records
        start = ckpt.round + 1
        _log.info("resuming from %s after round %d", cfg.run.resume, ckpt.round)
        for old in records:
            if on_round:
                on_round(old)
    else:
        loss0, acc0 = evaluated(arrays)
        records = [
            {
                "round": 0,
                "accuracy": acc0,
                "loss": loss0,
                "bytes_up": 0,
                "bytes_down": 0,
                "seconds": 0.0,
                **({"seconds_startup": startup} if startup is not None else {}),
            }
        ]
        if on_round:
            on_round(records[0])

    def checkpoint(rnd: int) -> None:
        if out is None or not cfg.run.checkpoint:
            return
        state_fn = getattr(strategy, "state_dict", None)
        save_checkpoint(
            out,
            round=rnd,
            cfg=cfg,
            keys=keys,
            arrays=record_to_arrays(arrays)[1],
            records=records,
            strategy_state=state_fn() if callable(state_fn) else None,
        )

    if start == 1:
        checkpoint(0)
    summaries: list[str] = []
    updated_any = any(r.get("model_updated") for r in records[1:])
    refused_rounds = sum(1 for r in records[1:] if r.get("round_refused"))
    for rnd in range(start, cfg.run.rounds + 1):
        t0 = time.perf_counter()
        memory = PeakMemory()  # this round's server-process peak RSS
        memory.start()
        try:
            config = client_config(cfg)
            for key, value in (train_config or {}).items():
                config[key] = value
            result = run_train_round(strategy, grid, rnd, arrays, config,
                                     round_deadline(cfg, rnd), retries=cfg.run.retries)
        except ConfigError:  # the run cannot work as configured: no later round would either
            raise
        except PrivacyBudgetSpent as exc:  # the budget is spent: stop before this round
            _log.warning("round %d not run: %s", rnd, exc)
            if records:
                records[-1]["stopped"] = str(exc)
            if out is not None:
                write_metrics(out, records)
            break
        except Exception as exc:  # one round's failure never ends the run (docs/reliability)
            result = _failed_round(rnd, exc)
        report = result.report
        _test_kill_point(rnd, "after-train")
        problem = _model_problem(result.arrays, arrays, cfg) if result.arrays is not None else ""
        if problem:
            report.refused["server"] = (f"{problem}: the aggregated model was not committed "
                                        "(global model unchanged)")
            _log.error("round %d: %s", rnd, report.refused["server"])
            result.arrays = None
        if result.arrays is not None:
            arrays = result.arrays
            updated_any = True
        else:
            summaries.append(round_summary(rnd, result))
            _log.warning("%s", summaries[-1])
        t1 = time.perf_counter()
        rec: dict[str, Any] = {
            "round": rnd,
            "accuracy": None,
            "loss": None,
            "model_digest": model_digest(arrays),
        }
        due = rnd % cfg.run.evaluate_every == 0 or rnd == cfg.run.rounds
        if due:
            loss, acc = evaluated(arrays)
            rec.update(accuracy=acc, loss=loss)
        evaluation = RoundReport()
        try:  # federated evaluation on the same rounds as the centralized one
            fed = run_evaluate_round(strategy, grid, rnd, arrays, client_config(cfg),
                                     round_deadline(cfg, rnd), report=evaluation) if due else None
        except Exception as exc:  # like training: the round's record says why, the run goes on
            fed = None
            report.errors["server-evaluate"] = (f"unexpected error in federated evaluation: "
                                                f"{type(exc).__name__}: {exc}"[:400])
            _log.error("round %d: %s", rnd, report.errors["server-evaluate"], exc_info=True)
        if fed is not None:
            rec["federated_eval"] = {k: v for k, v in fed.items() if finite_number(v)}
        for key, notes in (("federated_eval_errors", {**evaluation.errors, **evaluation.refused}),
                           ("federated_eval_capped", evaluation.capped),
                           ("federated_eval_metrics_dropped", evaluation.metrics_dropped)):
            if notes:  # who the evaluation left out, capped or trimmed, and why
                rec[key] = dict(notes)
        span = memory.stop()  # training, aggregation and evaluation
        rec.update(server_rss_peak=span.peak, server_rss_start=span.start,
                   server_rss_method=span.method)
        rec.update(
            bytes_up=report.bytes_up,
            bytes_down=report.bytes_down,
            exchanges=max(report.exchanges, 1),
            sites_sampled=report.sampled,
            sites_replied=report.replies,
            sites_failed=max(report.sampled - report.replies, 0),
            sites_rejected=len(report.refused),
            model_updated=result.arrays is not None,
            seconds=time.perf_counter() - t0,
            seconds_train=t1 - t0,
            seconds_eval=time.perf_counter() - t1,
        )
        if result.metrics is not None:
            loss_value = result.metrics.get("train_loss", result.metrics.get("train-loss"))
            rec["train_loss"] = loss_value if finite_number(loss_value) else None
            rec.update(
                {
                    k.replace("-", "_"): v
                    for k, v in result.metrics.items()
                    if k.startswith(("secagg-", "privacy-")) and finite_number(v)
                }
            )  # secure aggregation: counted, dropped, error bound; epsilon spent so far
        for phase, sec in report.seconds.items():
            rec[f"seconds_{phase}"] = sec
        if report.site_metrics:  # per site (by node id; partition-id a label): seconds, ...
            rec["site_metrics"] = dict(report.site_metrics)
        if report.metrics_dropped:
            rec["metrics_dropped"] = dict(report.metrics_dropped)
        if report.accepted:
            rec["sites"] = list(report.accepted)
        if report.capped:
            rec["weights_capped"] = dict(report.capped)
        if report.refused:
            rec["rejected"] = dict(report.refused)
        if report.errors:
            rec["errors"] = dict(report.errors)
        if result.arrays is None:
            rec["summary"] = summaries[-1]
            why = refused_reason(report)
            if why:
                refused_rounds += 1
                rec["round_refused"] = why
        rec["rounds_refused"] = refused_rounds
        records.append(rec)
        if out is not None:
            write_metrics(out, records)
        checkpoint(rnd)
        if on_round:
            on_round(rec)
    if out is not None:
        write_metrics(out, records)
        _, final = record_to_arrays(arrays)
        named: dict[str, Any] = dict(zip(keys, final, strict=True))
        np.savez(out / "model.npz", **named)
        from fedagg.task import set_weights as load_arrays

        load_arrays(model, final)
        buf_path = out / "model.pt"
        torch.save(model.state_dict(), buf_path.with_suffix(".pt.tmp"))
        buf_path.with_suffix(".pt.tmp").replace(buf_path)
        write_plot(out, records, title=f"{cfg.run.name}: {cfg.strategy.name} on {cfg.data.dataset}")
    if not updated_any and cfg.run.rounds >= start:
        raise RunFailed("no round of the run changed the global model:\n  "
                        + "\n  ".join(summaries[-10:]), records)
    return records
