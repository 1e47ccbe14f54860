"""Secure aggregation (SecAgg+) around any linear strategy: the server learns only the sum.

``SecureAggregation(inner)`` drives the stages of the Flower-free core
(:class:`fedagg.secagg.ServerState`) over the Grid it is given, inside Flower's own protocol,
so it runs under ``Strategy.start()`` in a stock ServerApp and under fedagg's server loop:

=============  ===================  ======================================================
Flower call    stages               what travels (every message is a ``train`` message)
=============  ===================  ======================================================
configure      S1 ``advertise``,    key setup, first round or when membership changes: two
_train         S2 ``share-keys``    exchanges run here; then the train messages are returned:
                                    the inner strategy's messages + ``RoundRequest``
(Flower)       R1 ``upload``        sites train and reply with a ``MaskedUpload``
aggregate      R2 ``unmask``        one exchange run here; the unmasked weighted mean delta
_train                              goes to the inner strategy, which applies it
=============  ===================  ======================================================

Each site uploads ``w * (new - global)`` and its weight ``w`` (examples), both masked; the
server unmasks only their sums. The inner strategy samples the sites (``configure_train``) and
applies the mean (fedagg's FedAvg with its server optimizer, or a Flower strategy such as
FedAdam through one synthetic reply carrying the mean model, :mod:`strategies.wrapper`), so
the aggregate must be a weighted mean: non-linear strategies (Krum, FedMedian, a trimmed mean)
are refused with the reason (:func:`strategies.wrapper.is_linear`).

A site that fails or misses the deadline before its upload is removed (its pairwise masks are
rebuilt from ``t`` shares); one that fails after uploading is still counted. When a needed
secret has fewer than ``t`` live holders the round aborts: the global model stays as it was,
and the run continues with the next round. See docs/protocols/secagg.md.

The wrapper's own exchanges with the sites are in :mod:`strategies.secure_messages`, the key
setup (epochs, thresholds per roster, blamed sites) in :mod:`strategies.secure_setup`; both
hold methods of :class:`SecureAggregation`, bound in its class body.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import math
import os
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedagg.config import RunConfig, SecAggConfig
from fedagg.errors import AbortRound, ConfigError, ProtocolError, explain
from fedagg.secagg import (
    MaskedUpload,
    SecAggParams,
    ServerStage,
    ServerState,
    UnmaskResponse,
)
from fedagg.secagg.params import check_site_floor
from fedagg.update import RoundDecoder, SupportHistory, UploadSpec
from strategies import secure_messages, secure_setup
from strategies.fedavg import FedAvg
from strategies.secure_params import (
    check_aggregate,
    flatten_arrays,
    resolve_params,
    unflatten_like,
)
from strategies.wire import SiteIndex, record_to_arrays
from strategies.wrapper import StrategyWrapper, inner_aggregate, is_linear

__all__ = ["SecureAggregation", "flatten_arrays", "resolve_params", "unflatten_like"]

_log = logging.getLogger(__name__)


class SecureAggregation(StrategyWrapper):
    """SecAgg+ around a linear aggregation strategy.

    Parameters
    ----------
    inner : Strategy, optional
        Samples the sites, writes their config, applies the mean and evaluates: fedagg's
        :class:`~strategies.FedAvg` (default), a plugin declaring ``aggregates_linearly``, or
        one of Flower's FedAvg, FedAvgM, FedProx, FedAdam, FedYogi, FedAdagrad. It never sees
        a single update in the clear.
    secagg : SecAggConfig, optional
        Threshold, neighbours, clip range, precision, timeout, threads.
    config_key : str
        Name of the ConfigRecord with the round config in every message.
    run_id : bytes, optional
        Bound into every derived key; 16 random bytes when omitted.
    up, support : str
        ``compression.up`` / ``compression.support``: with a public support (``random``,
        ``block``, ``topk-aggregate``) each site sends only its masked values on the round's
        support (``k`` values + weight, no index bytes) and keeps the rest in its
        error-feedback residual; own-index sparsifiers and quantizers are refused (see
        :class:`fedagg.update.UploadSpec`). The secure sparse modes of issue 21 are named in
        ``up`` itself: ``sketch`` (FetchSGD: the masked sum of the sites' exact integer count
        sketches goes through the server's momentum / error tables, the top-k of the
        accumulated sketch is applied), ``vote`` (values on the support voted in the
        previous round, this round's vote packed into the same masked vector; the vote sum
        goes down with the next round) and ``shared-dgc`` (a public support with DGC error
        feedback at the sites); see docs/compression.md.
    run_seed : int
        ``run.seed``: the public seed of the supports.
    max_update_norm : float, optional
        Refuse an unmasked mean delta with a larger L2 norm (default: the inner strategy's).
    state_namespace : str
        Suffix of the sites' compression state keys in ``Context.state``.
    upload_timeout : float
        Lifetime of the upload messages (the round's deadline; fedagg's loop and
        ``Strategy.start()`` wait for the replies with their own timeout).

    Raises
    ------
    ConfigError
        ``inner`` is not linear, or the spec cannot run under secure aggregation.
    """

    allows_retries = False  # a secure-aggregation message must never be answered twice

    def __init__(self, inner: Strategy | None = None, *, secagg: SecAggConfig | None = None,
                 config_key: str = "config", run_id: bytes | None = None, up: str = "none",
                 support: str = "random", run_seed: int = 0,
                 max_update_norm: float | None = None, state_namespace: str = "",
                 upload_timeout: float = 600.0) -> None:
        super().__init__(inner if inner is not None else FedAvg())
        self.upload_timeout = float(upload_timeout)
        ok, why = is_linear(self.inner)
        if not ok:
            raise ConfigError(explain(
                "SecureAggregation(inner)", type(self.inner).__name__,
                f"secure aggregation reveals only the weighted sum of the updates; {why}",
                "wrap a linear strategy (FedAvg, FedAvgM, FedProx, FedAdam, FedYogi, "
                "FedAdagrad), or drop secure aggregation to use this one"))
        self.secagg = secagg if secagg is not None else SecAggConfig()  # type: ignore[call-arg]
        self.config_key = config_key
        self._run_id = run_id if run_id is not None else os.urandom(16)
        self.spec = UploadSpec.parse(up, support=support, secure=True)
        self.run_seed = int(run_seed)
        self.max_update_norm = (max_update_norm if max_update_norm is not None
                                else getattr(self.inner, "max_update_norm", None))
        self.state_namespace = state_namespace
        self.history = SupportHistory(self.spec, self.run_seed)
        self.decoder = RoundDecoder(self.history)  # FetchSGD state, vote sums
        self.server: ServerState | None = None
        self.params: SecAggParams | None = None
        self.sites = SiteIndex()
        self._counter = 0
        self._grid: Grid | None = None
        self._round: dict[str, Any] | None = None
        self.last_result: Any = None  # fedagg.secagg.RoundResult of the last completed round
        self.last_support: np.ndarray | None = None
        self.history_log: list[dict[str, Any]] = []
        self._named_blamed: set[int] = set()  # blamed site indices already reported

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_config(cls, options: Any, cfg: RunConfig, inner: Strategy | None = None
                    ) -> SecureAggregation:
        """Build from a run config: ``inner`` (fedagg's FedAvg by default) and ``[secagg]``.

        Raises
        ------
        ConfigError
            Impossible combinations, explained (too few sites per round, ``t > k``, no
            fixed-point headroom, own-index sparsifiers or quantizers in ``compression.up``).
        """
        UploadSpec.parse(cfg.compression.up, support=cfg.compression.support,
                         down=cfg.compression.down, secure=True)
        per_round = max(int(cfg.run.sites * cfg.run.fraction_train), 1)
        try:
            params = resolve_params(cfg.secagg, per_round, upload_timeout=cfg.run.round_timeout)
            # epochs are keyed over the sampled sites or over every node: each roster's t must
            # clear the sites' default floor (t > k/2, k >= min(3, N - 1))
            for roster in sorted({per_round, cfg.run.sites} - {0, 1}):
                k = params.neighbours_for(roster)
                check_site_floor(dataclasses.replace(
                    params, threshold=cfg.secagg.resolve_threshold(k)), roster)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (secure aggregation with {per_round} sites per round: "
                              f"run.sites={cfg.run.sites} x run.fraction_train="
                              f"{cfg.run.fraction_train})") from None
        return cls(inner if inner is not None else FedAvg.from_config(None, cfg),
                   secagg=cfg.secagg, up=cfg.compression.up, support=cfg.compression.support,
                   run_seed=cfg.run.seed, max_update_norm=cfg.strategy.max_update_norm,
                   upload_timeout=cfg.run.round_timeout)

    def summary(self) -> None:
        """Log the configuration, then the inner strategy's summary."""
        _log.info("SecureAggregation(SecAgg+, up=%r) around %s: %s", self.spec.up,
                  type(self.inner).__name__, self.secagg)
        self.inner.summary()

    @property
    def last_accepted(self) -> list[int] | None:
        """Not known under secure aggregation (no site is seen on its own)."""
        return None

    @property
    def last_site_metrics(self) -> dict[str, dict[str, float]]:
        """Nothing per site in the clear."""
        return {}

    # -- messaging ------------------------------------------------------------------------------
    # (defined in strategies.secure_messages, bound here)
    _message = secure_messages._message
    _exchange = secure_messages._exchange
    _sort = secure_messages._sort
    _fail = secure_messages._fail
    _receive = secure_messages._receive
    _layout = secure_messages._layout
    _upload_records = secure_messages._upload_records
    _support = secure_messages._support

    # -- key setup (two exchanges) -------------------------------------------------------------
    # (defined in strategies.secure_setup, bound here)
    _setup = secure_setup._setup
    _params_for_roster = secure_setup._params_for_roster
    _roster_fits = secure_setup._roster_fits
    _excluded_nodes = secure_setup._excluded_nodes
    _ensure_server = secure_setup._ensure_server
    _open_round = secure_setup._open_round
    _name_blamed = secure_setup._name_blamed

    # -- Flower's protocol ----------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Let ``inner`` sample; key the sites if needed; return the masked-upload requests.

        An abort here (too few sites keyed) returns no messages: the round trains nothing and
        the model stays as it is.
        """
        self._new_round()
        self._grid = grid
        self._round = None
        if self.server is not None and self.server.stage in (ServerStage.COLLECTING,
                                                             ServerStage.UNMASKING):
            self.server.abort_round()  # the previous round ended in an unexpected error
        t_start = time.perf_counter()
        inner_msgs = list(self.inner.configure_train(server_round, arrays, config, grid))
        excluded = self._excluded_nodes()
        for m in inner_msgs:
            if m.metadata.dst_node_id in excluded:
                self.round_log.rejected[str(m.metadata.dst_node_id)] = (
                    "excluded from this round: its own relayed shares made an earlier round "
                    "abort (ServerState.blamed_sites; secagg.exclude_blamed)")
        inner_msgs = [m for m in inner_msgs if m.metadata.dst_node_id not in excluded]
        keys, current = record_to_arrays(arrays)
        self.history.advance(server_round, current)
        if not inner_msgs:
            return []
        nodes = [m.metadata.dst_node_id for m in inner_msgs]
        by_node = {m.metadata.dst_node_id: m for m in inner_msgs}
        dim = int(sum(np.asarray(a).size for a in current))
        timeout = self.upload_timeout
        server = self._ensure_server(grid, len(nodes), timeout)
        round_config = ConfigRecord(dict(config))
        round_config["server-round"] = server_round
        group = str(server_round)
        site_of = dict(zip(nodes, self.sites.indices(nodes), strict=True))
        self.round_log.tick("configure", t_start)
        try:
            support = self._support(dim)
            requests = self._open_round(grid, server, nodes, site_of,
                                        lambda n: self._layout(dim, n).dim, round_config, group)
        except (AbortRound, ConfigError, ProtocolError) as exc:
            self._abort(server_round, str(exc))
            return []
        participants = len(next(iter(requests.values())).participants) if requests else 0
        node_of = {i: n for n, i in site_of.items()}
        ttl = self.params.upload_timeout_s if self.params is not None else timeout
        out = []
        for i, req in requests.items():
            node = node_of[i]
            extra = {k: v for k, v in by_node[node].content.items()
                     if k != getattr(self.inner, "configrecord_key", "config")}
            extra.update(self._upload_records(server_round, node, keys))
            inner_config = by_node[node].content.config_records.get(
                getattr(self.inner, "configrecord_key", "config"))
            cfg = ConfigRecord({**dict(inner_config or {}), **dict(round_config)})
            out.append(self._message(node, i, "upload", req, cfg, group, ttl, extra))
        self._round = {"round": server_round, "keys": keys, "current": current, "dim": dim,
                       "support": support, "site_of": site_of, "node_of": node_of,
                       "config": round_config, "group": group, "messages": out,
                       "layout": self._layout(dim, participants), "participants": participants}
        return out

    def _abort(self, server_round: int, reason: str) -> None:
        self._name_blamed(server_round)
        self.round_log.aborted = f"secure aggregation aborted: {reason}"
        _log.warning("round %d: secure aggregation aborted, global model unchanged: %s",
                     server_round, reason)
        self.history_log.append({"round": server_round, "aborted": True, "reason": reason,
                                 "failed": dict(self.round_log.failed),
                                 "exchanges": self.round_log.exchanges,
                                 "bytes_up": dict(self.round_log.up)})

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Take the masked uploads, unmask the sums, hand the mean delta to ``inner``."""
        r = self._round
        if r is None or r["round"] != server_round or self.server is None:
            return None, None  # the round was aborted in configure_train
        server = self.server
        site_of, node_of = r["site_of"], r["node_of"]
        # each masked upload is folded into the modular sum as it comes and released (the
        # uploads are model-sized; nothing of one is kept, replies may be a generator)
        uploaded: set[int] = set()
        answered: set[int] = set()
        some_reply: Message | None = None
        for reply in replies:
            node = reply.metadata.src_node_id
            answered.add(node)
            if reply.has_error():
                self._fail(node, f"upload: {reply.error.reason}")
                continue
            if some_reply is None:  # its metadata only: the reply inner strategies are given
                some_reply = Message(content=RecordDict(), metadata=copy.copy(reply.metadata))  # type: ignore[call-overload]
            if self._receive(reply, MaskedUpload, site_of, server.receive_upload, "upload"):
                uploaded.add(node)
            del reply
            gc.collect(1)  # Flower's self-referencing record views (strategies.streaming)
        for m in r["messages"]:
            if m.metadata.dst_node_id not in answered:
                self._fail(m.metadata.dst_node_id,
                           f"upload: no reply within {float(self.secagg.timeout):.0f} s")
        self.history.replied(uploaded)
        t0 = time.perf_counter()
        try:
            unmask_requests = server.close_uploads()
        except ProtocolError as exc:  # AbortRound: too few live holders of a needed secret
            self._abort(server_round, str(exc))
            return None, None
        self.round_log.tick("aggregate", t0)
        ut = self.params.unmask_timeout_s if self.params else self.secagg.timeout
        msgs = [self._message(node_of[i], i, "unmask", req, r["config"], r["group"], ut)
                for i, req in unmask_requests.items()]
        for reply in self._exchange(msgs, ut, "unmask"):
            self._receive(reply, UnmaskResponse, site_of, server.receive_unmask, "unmask")
        t0 = time.perf_counter()
        try:
            result = server.finish_round()
        except ProtocolError as exc:  # AbortRound / VerificationError, blaming who it can
            self.round_log.tick("aggregate", t0)
            self._abort(server_round, f"unmask failed: {exc}")
            return None, None
        weight_cap = len(result.counted) * (self.params.weight_scale if self.params else 0.0)
        if not (math.isfinite(result.total_weight) and 0 < result.total_weight
                <= weight_cap * (1 + 1e-3)):
            self.round_log.tick("aggregate", t0)
            self._abort(server_round, f"the unmasked total weight {result.total_weight!r} is not "
                        f"in (0, counted sites x secagg.weight_scale = {weight_cap:g}]")
            return None, None
        clip = self.params.clip if self.params is not None else None
        try:
            decoded = self.decoder.decode(r["layout"], result.mean, result.total, dim=r["dim"],
                                          num_sites=r["participants"], ring_bits=result.ring_bits)
            problem = (check_aggregate(decoded.values, max_norm=None, clip=clip)
                       or check_aggregate(decoded.delta, max_norm=self.max_update_norm, clip=None))
        except (ConfigError, ProtocolError) as exc:
            problem = f"undecodable aggregate: {exc}"
        if problem:
            self.decoder.reject()
            self.round_log.tick("aggregate", t0)
            self._abort(server_round, problem)
            return None, None
        mean = decoded.delta
        current = r["current"]
        delta = unflatten_like(mean, current)
        self.last_result = result
        metrics = {
            "num-examples": float(result.total_weight),
            "secagg-counted": len(result.counted), "secagg-dropped": len(result.dropped),
            "secagg-frac-bits": result.frac_bits, "secagg-error-bound": float(result.error_bound),
            "secagg-epoch": result.epoch, "secagg-values": int(result.mean.size),
        }
        some_reply = some_reply if some_reply is not None else r["messages"][0]
        new, inner_metrics = inner_aggregate(
            self.inner, server_round, [(delta, float(result.total_weight), metrics, some_reply)],
            r["keys"], current, sites=len(result.counted), rejected=self.last_rejected)
        self.round_log.tick("aggregate", t0)
        _log.info("round %d: secure mean of %d sites (%d dropped before upload), error <= %.2e",
                  server_round, len(result.counted), len(result.dropped), result.error_bound)
        self.history_log.append({"round": server_round, "aborted": new is None, "reason": "",
                                 "failed": dict(self.round_log.failed),
                                 "exchanges": self.round_log.exchanges,
                                 "bytes_up": dict(self.round_log.up)})
        if new is None:
            self.decoder.reject()
            return None, None
        self.decoder.accept()
        out = MetricRecord({k: v for k, v in metrics.items()})
        for k, v in (inner_metrics or {}).items():
            if k not in out:
                out[k] = v
        return new, out

    def state_dict(self) -> dict[str, Any]:
        """The inner strategy's state, the public support history and FetchSGD's tables (the
        protocol state is not checkpointed: a restart re-keys)."""
        return {**super().state_dict(), "history": self.history.state_dict(),
                "sketch": self.decoder.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        super().load_state_dict({k: v for k, v in state.items() if k not in ("history", "sketch")})
        if "history" in state:
            self.history.load_state_dict(state["history"])
        if "sketch" in state:
            self.decoder.load_state_dict(state["sketch"])

