"""What an asynchronous run records and writes, and how it resumes from its checkpoint.

:class:`RunRecorder` is the part of the asynchronous loop (:class:`server.asynchronous.AsyncRun`)
that keeps its records and everything it writes:

* :class:`Tally` — what happened since the last record (bytes, sites, refusals, capped
  weights, errors, training loss, the secure cohort's figures); :meth:`RunRecorder.new_record`
  turns it into the record of one applied (or refused) buffer, with the central evaluation
  every ``run.evaluate_every`` records (:meth:`RunRecorder.evaluated`);
* :meth:`RunRecorder.record` — the ArrayRecord of a model version, one per version, shared by
  its dispatches; :meth:`RunRecorder.emit` / :meth:`RunRecorder.checkpoint` — ``metrics.json``,
  the round callback and the atomic checkpoint of the whole state after every applied buffer;
* :meth:`RunRecorder.resume` — the state, records and run id from a checkpoint
  (:meth:`RunRecorder.load_checkpoint`: every field validated first,
  :func:`server.asynchronous.check_async_resume` runs it before an engine starts), and the in-flight dispatches
  and federated evaluations sent again (at their original times on a virtual clock, so the
  run replays the same arrival order and versions; a cohort re-keys);
  :meth:`RunRecorder.finish` — ``model.npz`` / ``model.pt``, the plot, and a failed run when
  no buffer changed the model.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from flwr.serverapp import Grid

from fedagg.asyncagg import AsyncServerState, Job, VirtualClock, WallClock
from fedagg.config import RunConfig
from fedagg.data import load_dataset
from fedagg.errors import CheckpointError, RunFailed, explain
from fedagg.models import set_weights
from fedagg.privacy import PrivacyLedger
from fedagg.report import atomic_write_bytes, write_metrics, write_plot
from fedagg.training import evaluate
from server.async_dispatch import connected_nodes
from server.checkpoint import CHECKPOINT_NAME, Checkpoint, check_async_state, save_checkpoint
from server.runner import (
    EvaluateFn,
    ModelFn,
    RoundCallback,
    load_resume,
    model_digest,
    wait_for_sites,
)
from strategies.secure_privacy import DistributedPrivacy
from strategies.wire import arrays_to_record, record_to_arrays

__all__ = ["RunRecorder", "Tally"]

_log = logging.getLogger("server.asynchronous")  # the name these records had before the split


@dataclass
class Tally:
    """What happened since the last record (bytes, sites, refusals, errors)."""

    t0: float = 0.0
    wall0: float = field(default_factory=time.perf_counter)
    bytes_up: int = 0
    bytes_down: int = 0
    dispatched: int = 0
    replied: int = 0
    refused: dict[str, str] = field(default_factory=dict)
    capped: dict[str, str] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    loss: float = 0.0
    loss_weight: float = 0.0
    secagg: dict[str, Any] = field(default_factory=dict)


class RunRecorder:
    """The records of one asynchronous run, what it writes, its checkpoint and its resume.

    Owns the records (one per applied or refused buffer, ``records[0]`` the initial model),
    the :class:`Tally` since the last one, the output directory, the run id (checkpointed;
    bound into every secure cohort's keys), the ArrayRecord of each model version still in
    use and the central evaluator. Reads the run's state, clock and model; sends nothing
    itself (a resume sends through the callables it is given).

    Parameters
    ----------
    cfg : RunConfig
        The run's configuration.
    grid : Grid
        The run's Grid (a resume waits for its sites and asks which nodes are connected).
    state : AsyncServerState
        The run's state (model versions, in-flight jobs, cohorts, evaluations).
    clock : VirtualClock or WallClock
        The run's clock.
    model : torch.nn.Module
        The run's model object (central evaluation, ``model.pt``).
    keys : list of str
        The model's tensor names.
    out : Path or None
        The run directory (nothing is written without one).
    mode : str
        ``asynchronous.mode`` (``"fedbuff"`` / ``"deadline"``).
    secure : bool
        Whether the run aggregates securely (checked against the checkpoint on a resume).
    on_round : callable or None
        Called with every record (and with the checkpoint's records on a resume).
    evaluate_fn, model_fn : callable or None
        The user's central evaluation and model; with neither, the built-in data set's test
        split evaluates the run's model.
    """

    def __init__(self, cfg: RunConfig, *, grid: Grid, state: AsyncServerState,
                 clock: VirtualClock | WallClock, model: Any, keys: list[str],
                 out: Path | None, mode: str, secure: bool, on_round: RoundCallback | None,
                 evaluate_fn: EvaluateFn | None, model_fn: ModelFn | None,
                 privacy: DistributedPrivacy | None = None) -> None:
        self.cfg, self.grid, self.state, self.clock = cfg, grid, state, clock
        self.privacy = privacy
        """The run's distributed DP, whose ledger the checkpoint keeps (None: no DP)."""
        self.model, self.keys, self.out = model, keys, out
        self.mode, self.secure, self.on_round = mode, secure, on_round
        self.run_id = os.urandom(16)
        self.records: list[dict[str, Any]] = []
        self.tally = Tally()
        self._versions: dict[int, ArrayRecord] = {}
        self._central = self._evaluator(evaluate_fn, model_fn)

    # -- the model's records and its central evaluation ------------------------------------------
    def _evaluator(self, evaluate_fn: EvaluateFn | None, model_fn: ModelFn | None
                   ) -> EvaluateFn | None:
        if evaluate_fn is not None or model_fn is not None:
            return evaluate_fn
        cfg = self.cfg
        ds = load_dataset(cfg.data.dataset, data_dir=cfg.data.data_dir,
                          test_fraction=cfg.data.test_fraction, seed=cfg.run.seed)

        def central(rec: ArrayRecord) -> tuple[float, float] | None:
            set_weights(self.model, record_to_arrays(rec)[1])
            return evaluate(self.model, ds.x_test, ds.y_test)

        return central

    def evaluated(self) -> tuple[float | None, float | None]:
        """``(loss, accuracy)`` of the current version by the central evaluation, if any."""
        res = (self._central(self.record(self.state.version)) if self._central is not None
               else None)
        return (None, None) if res is None else (float(res[0]), float(res[1]))

    def record(self, version: int) -> ArrayRecord:
        """The ArrayRecord of ``version`` (one per version, shared by its dispatches)."""
        rec = self._versions.get(version)
        if rec is None:
            rec = arrays_to_record(self.state.model_of(version), self.keys)
            self._versions = {v: r for v, r in self._versions.items()
                              if v in {j.version for j in self.state.jobs.values()}}
            self._versions[version] = rec
        return rec

    # -- records, outputs, checkpoints -----------------------------------------------------------
    def write_config(self) -> None:
        """Create the run directory and write ``config.json`` (nothing without one)."""
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(self.out / "config.json",
                               self.cfg.model_dump_json(indent=2).encode())

    def start(self) -> None:
        """A new run: the record of version 0 (the initial model, centrally evaluated), a
        fresh tally, the first checkpoint."""
        loss0, acc0 = self.evaluated()
        self.emit({"round": 0, "version": 0, "mode": self.mode, "accuracy": acc0,
                   "loss": loss0, "bytes_up": 0, "bytes_down": 0, "seconds": 0.0,
                   "time": self.clock.now(), "model_updated": False,
                   "model_digest": model_digest(self.record(0))})
        self.tally = Tally(t0=self.clock.now())
        self.checkpoint()

    def checkpoint(self) -> None:
        """Write the whole state atomically (with ``run.checkpoint`` and a run directory)."""
        if self.out is None or not self.cfg.run.checkpoint:
            return
        self.state.now = self.clock.now()
        save_checkpoint(self.out, round=len(self.records) - 1, cfg=self.cfg, keys=self.keys,
                        arrays=self.state.model, records=self.records,
                        strategy_state={"asynchronous": self.state.state_dict(),
                                        "run_id": self.run_id,
                                        **({"privacy": self.privacy.state_dict()}
                                           if self.privacy is not None else {})})

    def emit(self, rec: dict[str, Any]) -> None:
        """Append ``rec``, write ``metrics.json`` and call the round callback."""
        self.records.append(rec)
        if self.out is not None:
            write_metrics(self.out, self.records)
        if self.on_round is not None:
            self.on_round(rec)

    def amend(self, rnd: int, fields: dict[str, Any]) -> None:
        """Add ``fields`` to the record of ``rnd`` (if it is there) and write ``metrics.json``
        again."""
        rec = self.records[rnd] if rnd < len(self.records) else None
        if rec is None or rec.get("round") != rnd:
            return
        rec.update(fields)
        if self.out is not None:
            write_metrics(self.out, self.records)

    def new_record(self, committed: bool, summary: str, *, in_flight: int) -> dict[str, Any]:
        """The record of one applied (or refused) buffer (not yet emitted); resets the tally.

        ``in_flight`` is the number of train messages in flight now.
        """
        t, now = self.tally, self.clock.now()
        rnd = len(self.records)
        rec: dict[str, Any] = {"round": rnd, "version": self.state.version, "mode": self.mode,
                               "accuracy": None, "loss": None,
                               "model_digest": model_digest(self.record(self.state.version)),
                               "model_updated": committed, "time": now,
                               "seconds": now - t.t0,
                               "wall_seconds": time.perf_counter() - t.wall0,
                               "bytes_up": t.bytes_up, "bytes_down": t.bytes_down,
                               "sites_sampled": t.dispatched, "sites_replied": t.replied,
                               "sites_failed": len(t.errors), "sites_rejected": len(t.refused),
                               "in_flight": in_flight}
        if rnd % self.cfg.run.evaluate_every == 0 or rnd >= self.cfg.run.rounds:
            t1 = time.perf_counter()
            loss, acc = self.evaluated()
            rec.update(accuracy=acc, loss=loss, seconds_eval=time.perf_counter() - t1)
        if t.loss_weight > 0:
            rec["train_loss"] = t.loss / t.loss_weight
        rec.update(t.secagg)
        if t.refused:
            rec["rejected"] = dict(t.refused)
        if t.capped:
            rec["weights_capped"] = dict(t.capped)
        if t.errors:
            rec["errors"] = dict(t.errors)
        if summary:
            rec["summary"] = summary
        self.tally = Tally(t0=now)
        return rec

    # -- resume -----------------------------------------------------------------------------------
    def load_checkpoint(self) -> Checkpoint:
        """The checkpoint ``run.resume`` points at, validated and loaded into the run's state.

        Nothing is sent and nothing is written: :func:`server.asynchronous.check_async_resume` runs exactly this
        before an engine starts. Every field of the asynchronous state is checked first
        (:func:`server.checkpoint.check_async_state`); a state that then fails to load is
        refused too.

        Raises
        ------
        CheckpointError
            A damaged or tampered checkpoint, another configuration or model, a synchronous
            run's checkpoint: the file, the field and the rule.
        """
        ckpt = load_resume(self.cfg, self.keys, self.state.model)
        state = ckpt.strategy_state or {}
        path = Path(self.cfg.run.resume or ".") / CHECKPOINT_NAME
        if "asynchronous" not in state:
            raise CheckpointError(explain(f"{path}[meta.strategy_state]",
                                          [str(k) for k in state][:3],
                                          "holds a synchronous run's checkpoint",
                                          "resume it with asynchronous.mode = 'off'"))
        s = self.cfg.strategy
        checked = check_async_state(ckpt, self.state, mode=self.mode, secure=self.secure,
                                    max_weight=s.max_weight, max_update_norm=s.max_update_norm)
        ledger = self._checked_ledger(state, path)
        try:
            self.state.load_state_dict(checked)
        except Exception as exc:  # a rule the checks above do not know yet: refused all the same
            raise CheckpointError(explain(f"{path}[meta.strategy_state.asynchronous]",
                                          type(exc).__name__, f"was refused by the state: {exc}",
                                          "restore the run directory from a backup, or start a "
                                          "new run")) from None
        self.run_id = bytes(state["run_id"])
        self.records = list(ckpt.records)
        if self.privacy is not None and ledger is not None:
            self.privacy.ledger = ledger
        return ckpt

    def _checked_ledger(self, state: dict[str, Any], path: Path) -> PrivacyLedger | None:
        """The checkpoint's privacy ledger, every field checked (None without DP).

        Raises
        ------
        CheckpointError
            A private run's checkpoint without a ledger, or a malformed one (named).
        """
        if self.privacy is None:
            return None
        if "privacy" not in state:
            raise CheckpointError(explain(
                f"{path}[meta.strategy_state.privacy]", None,
                "a run with privacy.mode = 'distributed' must resume with its privacy ledger "
                "(the epsilon it has spent)", "resume it with the configuration it ran with, "
                "or start a new run"))
        try:
            return PrivacyLedger.from_state(state["privacy"])
        except CheckpointError as exc:
            raise CheckpointError(f"{path}[meta.strategy_state.privacy]: {exc}") from None

    def forget_absent(self) -> dict[str, str]:
        """Resume: take out of flight what was sent to nodes that are not connected now.

        A new simulation engine (``fedagg simulate --resume``) gives its sites new Flower node
        ids, and a deployment site may not be back: dispatches to such a node are taken out of
        flight (named in the next record's ``errors``) and the loop dispatches the current
        model to the connected sites instead; a secure cohort with such a member is closed (its
        members are free again); an open federated evaluation keeps only its connected nodes.
        The version sequence goes on from the checkpoint's. Returns node -> why for the
        dispatches taken out.
        """
        wait_for_sites(self.grid, self.cfg)  # the sites the dispatches go to (run() waits too)
        live = set(connected_nodes(self.grid))
        st, gone = self.state, {}
        why = ("dispatched before the resume to a node that is not connected now (a new engine "
               "gives its sites new node ids); the current model goes to a connected site")
        for c in [c for c in st.cohorts.values() if not set(c.members) <= live]:
            for j in [j for j in st.jobs.values() if j.cohort == c.cohort]:
                st.arrive(j.job)
                gone[str(j.node)] = why
            st.close_cohort(c.cohort)
            _log.warning("resume: cohort %d had members that are not connected now; closed",
                         c.cohort)
        for j in [j for j in st.jobs.values() if j.node not in live]:
            st.arrive(j.job)
            gone[str(j.node)] = why
        for ev in list(st.evaluations.values()):
            nodes = tuple(n for n in ev.nodes if n in live)
            if not nodes:
                st.close_evaluation(ev.round)
            elif nodes != ev.nodes:
                st.evaluations[ev.round] = dataclasses.replace(ev, nodes=nodes)
        if gone:
            _log.warning("resume: %d dispatch(es) to nodes that are not connected now were "
                         "taken out of flight", len(gone))
        return gone

    def resume(self, *, send_job: Callable[[Job], None], send_cohort: Callable[[int], None],
               resend_evaluations: Callable[[], None]) -> None:
        """Load the checkpoint, call back the records, and send the in-flight work again.

        The dispatches to connected nodes go again through ``send_job`` and ``send_cohort``
        (a cohort with a new attempt: its protocol state is not checkpointed, it re-keys), in
        dispatch order and at their original times on a virtual clock; the open federated
        evaluations first (``resend_evaluations``), as a train job of a site that evaluates
        waits for its reply. The next record starts from the last one's time and names the
        dispatches taken out (:meth:`forget_absent`).
        """
        self.load_checkpoint()
        gone = self.forget_absent()
        for old in self.records:
            if self.on_round is not None:
                self.on_round(old)
        now = self.state.now
        replays: list[tuple[float, int, Any]] = []
        for job in self.state.jobs.values():
            if job.cohort < 0:
                replays.append((job.dispatched_at, job.job, job))
        for c in list(self.state.cohorts.values()):
            for j in [j for j in self.state.jobs.values() if j.cohort == c.cohort]:
                self.state.arrive(j.job)  # the protocol state is not checkpointed: re-key
            self.state.cohorts[c.cohort] = dataclasses.replace(c, attempt=c.attempt + 1)
            replays.append((c.started_at, -c.cohort, c.cohort))
        resend_evaluations()  # first: a job of a site that evaluates waits for its reply
        for t, _, item in sorted(replays, key=lambda x: (x[0], x[1] if x[1] > 0 else 0)):
            if isinstance(self.clock, VirtualClock):
                self.clock.set(t)  # the same arrival times as before the crash
            else:
                self.clock.set(now)
            if isinstance(item, Job):
                if not isinstance(self.clock, VirtualClock):
                    item = dataclasses.replace(item, dispatched_at=now)
                    self.state.jobs[item.job] = item
                send_job(item)
            else:
                send_cohort(int(item))
        self.clock.set(now)
        self.tally = Tally(t0=self.records[-1].get("time", now) if self.records else now)
        self.tally.errors.update(gone)

    def finish(self) -> None:
        """Write ``metrics.json``, ``model.npz``, ``model.pt`` and the plot.

        Raises
        ------
        RunFailed
            No buffer of the run changed the global model.
        """
        if self.out is not None:
            write_metrics(self.out, self.records)
            named: dict[str, Any] = dict(zip(self.keys, self.state.model, strict=True))
            np.savez(self.out / "model.npz", **named)
            from fedagg.task import set_weights as load_arrays

            load_arrays(self.model, self.state.model)
            path = self.out / "model.pt"
            torch.save(self.model.state_dict(), path.with_suffix(".pt.tmp"))
            path.with_suffix(".pt.tmp").replace(path)
            write_plot(self.out, self.records, title=f"{self.cfg.run.name}: {self.mode} "
                       f"({self.cfg.strategy.name}) on {self.cfg.data.dataset}")
        if not any(r.get("model_updated") for r in self.records[1:]):
            summaries = [r["summary"] for r in self.records[1:] if r.get("summary")]
            raise RunFailed("no buffer of the asynchronous run changed the global model:\n  "
                            + "\n  ".join(summaries[-10:] or ["(no update arrived)"]),
                            self.records)

