"""Secure aggregation (SecAgg+) over Flower: the server learns only the weighted mean update.

:class:`SecureAggregation` wraps an aggregation strategy (``inner``, fedagg's
:class:`~strategies.fedavg.FedAvg` by default) and drives the stages of the Flower-free core
(:class:`fedagg.secagg.ServerState`) over the :class:`~flwr.serverapp.Grid`. The sites run the
other half as a ClientApp mod (:func:`clients.secure.secure_mod`), the last step before the
upload. Each site uploads ``w * (new - global)`` and its weight ``w`` (examples), both masked;
the server unmasks only their sums and applies the weighted mean delta through the inner
strategy's server optimizer, so with ``server_optimizer = "none"`` the new model is the
plaintext FedAvg of the counted sites (up to the fixed-point error, reported per round).

Exchanges (message types; see docs/protocols/secagg.md, "Flower mapping"):

=====  ==========================  ==========================================================
S1     ``query.secagg_advertise``  key setup: first round, or when membership changes
S2     ``query.secagg_share_keys``
R1     ``train``                   global model + RoundRequest -> MaskedUpload (uint32 array)
R2     ``query.secagg_unmask``     UnmaskRequest -> UnmaskResponse (shares)
=====  ==========================  ==========================================================

A site that fails or misses the deadline before its upload is removed (its pairwise masks are
rebuilt from ``t`` shares); one that fails after uploading is still counted. When a needed
secret has fewer than ``t`` live holders the round aborts: the global model stays as it was,
and the run continues with the next round.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedagg.config import RunConfig, SecAggConfig
from fedagg.errors import AbortRound, ConfigError, ProtocolError, VerificationError, explain
from fedagg.secagg import (
    KeyAdvertise,
    MaskedUpload,
    SecAggParams,
    ServerState,
    ShareKeys,
    UnmaskResponse,
)
from fedagg.secagg import Message as SecAggMessage
from strategies._compression import (
    INSTRUCTION_KEY,
    PREVIOUS_KEY,
    Instruction,
    flat_difference,
    round_compressor,
    shared_support,
    stage_names,
)
from strategies._records import arrays_to_record, message_nbytes, record_to_arrays
from strategies._secagg_records import PARAMS_KEY, SiteIndex, pack, params_to_record, unpack
from strategies._secure_params import (
    Exchange as _Exchange,
)
from strategies._secure_params import (
    check_aggregate,
    flatten_arrays,
    resolve_params,
    secure_spec,
    unflatten_like,
)
from strategies.base import FedaggStrategy, RoundResult, exchange
from strategies.fedavg import FedAvg

__all__ = [
    "ADVERTISE",
    "SHARE_KEYS",
    "UNMASK",
    "SecureAggregation",
    "flatten_arrays",
    "resolve_params",
    "secure_spec",
    "unflatten_like",
]

_log = logging.getLogger(__name__)

ADVERTISE = f"{MessageType.QUERY}.secagg_advertise"
SHARE_KEYS = f"{MessageType.QUERY}.secagg_share_keys"
UNMASK = f"{MessageType.QUERY}.secagg_unmask"


class SecureAggregation(FedaggStrategy):
    """SecAgg+ around an aggregation strategy (``strategy.name = "secure"``).

    Parameters
    ----------
    inner : FedAvg, optional
        Samples the sites, holds the server optimizer and evaluates; fedagg's FedAvg when
        omitted. Its ``aggregate_train`` is never called: the server never sees a single
        update in the clear.
    secagg : SecAggConfig, optional
        Threshold, neighbours, clip range, fractional bits, weight bound, timeout.
    config_key : str
        Name of the ConfigRecord with the run config in every message (as the ClientApp
        expects).
    run_id : bytes, optional
        Bound into every derived key; 16 random bytes when omitted.
    up, support : str
        ``compression.up`` / ``compression.support``. With a public support (``random``,
        ``block``, ``topk-aggregate``) each site sends only its masked values on the round's
        support (``k`` values + weight, no index bytes) and keeps the rest in its
        error-feedback residual; see :func:`secure_spec` for what is refused.
    run_seed : int
        ``run.seed``: the public seed of the supports (as :class:`~strategies.compressed.
        CompressedFedAvg` uses it, so both agree on the support of a round).
    state_namespace : str
        Suffix of the sites' compression state keys in ``Context.state``.
    """

    def __init__(self, inner: FedAvg | None = None, *, secagg: SecAggConfig | None = None,
                 config_key: str = "config", run_id: bytes | None = None, up: str = "none",
                 support: str = "own", run_seed: int = 0, state_namespace: str = "") -> None:
        self.inner = inner if inner is not None else FedAvg()
        if not isinstance(self.inner, FedAvg):
            raise ConfigError(explain("inner", type(self.inner).__name__,
                                      "secure aggregation wraps fedagg's FedAvg (or a subclass)",
                                      "pass strategies.fedavg.FedAvg(...)"))
        self.secagg = secagg if secagg is not None else SecAggConfig()  # type: ignore[call-arg]
        self.config_key = config_key
        self._run_id = run_id if run_id is not None else os.urandom(16)
        self.server: ServerState | None = None
        self.params: SecAggParams | None = None
        self.sites = SiteIndex()
        self._counter = 0
        self.last_result: Any = None  # fedagg.secagg.RoundResult of the last completed round
        self.history: list[dict[str, Any]] = []
        self.spec = secure_spec(up, support)
        self.support = support
        self.run_seed = int(run_seed)
        self.state_namespace = state_namespace
        self._needs_previous = "aggtopk" in stage_names(self.spec)
        if self.spec != "none":  # a bad spec fails at start-up, not in round 1 at every site
            round_compressor(self.spec, run_seed=self.run_seed, server_round=1,
                             previous_aggregate=None)
        self._prev_sent: list[np.ndarray] | None = None  # global of the last round sent
        self._prev_keys: list[str] = []
        self._prev_round = -1
        self._fresh: set[int] = set()  # nodes that uploaded in that round (they kept it)
        self.last_support: np.ndarray | None = None

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_config(cls, options: Any, cfg: RunConfig) -> SecureAggregation:
        """Build from a run config: inner FedAvg from the same config, SecAgg+ from ``[secagg]``.

        Raises
        ------
        ConfigError
            Impossible combinations, explained (too few sites per round, ``t > k``, no
            fixed-point headroom, own-index sparsifiers or quantizers in ``compression.up``;
            see :func:`secure_spec`).
        """
        secure_spec(cfg.compression.up, cfg.compression.support)
        per_round = max(int(cfg.run.sites * cfg.run.fraction_train), 1)
        try:
            resolve_params(cfg.secagg, per_round, upload_timeout=cfg.run.round_timeout)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (strategy 'secure' with {per_round} sites per round: "
                              f"run.sites={cfg.run.sites} x run.fraction_train="
                              f"{cfg.run.fraction_train})") from None
        return cls(FedAvg.from_config(None, cfg), secagg=cfg.secagg, up=cfg.compression.up,
                   support=cfg.compression.support, run_seed=cfg.run.seed)

    # -- Flower Strategy interface (evaluation is delegated) ----------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Not used: secure rounds need several exchanges, see :meth:`train_round`."""
        raise NotImplementedError("SecureAggregation drives its exchanges in train_round()")

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Not used: see :meth:`train_round`."""
        raise NotImplementedError("SecureAggregation drives its exchanges in train_round()")

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """Federated evaluation, as the inner strategy does it."""
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        """Evaluation metrics, as the inner strategy aggregates them."""
        return self.inner.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        """Log the configuration."""
        _log.info("SecureAggregation(SecAgg+) around %s: %s", type(self.inner).__name__,
                  self.secagg)

    def state_dict(self) -> dict[str, Any]:
        """Server-optimizer state (the protocol state is not checkpointed: a restart re-keys)."""
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.inner.load_state_dict(state)

    # -- messaging helpers --------------------------------------------------------------------
    def _message(self, grid: Grid, node: int, site: int, kind: str, body: SecAggMessage,
                 config: ConfigRecord, group: str, ttl: float,
                 extra: dict[str, Any] | None = None) -> Message:
        assert self.params is not None
        content = RecordDict(dict(extra or {}))
        content[self.config_key] = config
        content[PARAMS_KEY] = params_to_record(self.params, site)
        pack(content, body)
        return grid.create_message(content, kind, node, group, ttl=ttl)

    def _exchange(self, grid: Grid, messages: list[Message], timeout: float, ex: _Exchange,
                  phase: str) -> list[Message]:
        """Send, wait until the deadline, keep only genuine replies; count bytes and failures.

        Goes through :func:`strategies.base.exchange` (deadline ``timeout`` seconds from now,
        no retries: a secure-aggregation message must not be answered twice), so replies are
        checked by :func:`strategies.base.filter_replies`: a reply to a message of an earlier
        exchange (replayed or stale), to a message addressed to another node, or a second reply
        to the same message is refused and recorded in ``rejected``. Error replies and missing
        replies are failures.
        """
        t0 = time.perf_counter()
        if messages:
            replies, refused, bytes_down, _ = exchange(self, grid, messages, timeout)
        else:
            replies, refused, bytes_down = [], {}, 0
        ex.bytes_down += bytes_down
        ex.tick(phase, t0)
        ex.exchanges += 1
        for node, why in refused.items():
            ex.rejected.setdefault(node, f"{phase}: {why}")
        answered = {r.metadata.src_node_id for r in replies}
        ok = []
        for m in messages:
            if m.metadata.dst_node_id not in answered:
                self._fail(ex, m.metadata.dst_node_id, f"{phase}: no reply within {timeout:.0f} s")
        for r in replies:
            if r.has_error():
                self._fail(ex, r.metadata.src_node_id, f"{phase}: {r.error.reason}")
            else:
                size = message_nbytes(r)
                ex.bytes_up += size
                ex.up[phase] = ex.up.get(phase, 0) + size
                ok.append(r)
        return ok

    def _fail(self, ex: _Exchange, node: int, reason: str) -> None:
        ex.failed.setdefault(node, reason)
        _log.warning("secure aggregation: node %d dropped (%s)", node, reason)

    def _receive(self, ex: _Exchange, reply: Message, cls: type[Any], site_of: dict[int, int],
                 accept: Any, phase: str) -> bool:
        """Parse one reply and hand it to the server state; protocol errors drop the site."""
        node = reply.metadata.src_node_id
        try:
            msg = unpack(reply.content, cls)
            if site_of.get(node) != msg.site:
                raise ProtocolError(explain("site", msg.site, f"node {node} has index "
                                            f"{site_of.get(node)}", "-"))
            accept(msg)
        except (ProtocolError, VerificationError) as exc:
            ex.rejected[str(node)] = f"{phase}: {exc}"
            self._fail(ex, node, f"{phase}: invalid reply: {exc}")
            return False
        return True

    # -- key setup (two exchanges) -------------------------------------------------------------
    def _setup(self, grid: Grid, nodes: Sequence[int], config: ConfigRecord, group: str,
               ex: _Exchange) -> None:
        assert self.server is not None and self.params is not None
        t = self.params.setup_timeout_s
        idx = dict(zip(nodes, self.sites.indices(nodes), strict=True))
        request = self.server.begin_setup(idx.values())
        msgs = [self._message(grid, n, i, ADVERTISE, request, config, group, t)
                for n, i in idx.items()]
        for reply in self._exchange(grid, msgs, t, ex, "setup"):
            self._receive(ex, reply, KeyAdvertise, idx, self.server.receive_advertise, "advertise")
        share_requests = self.server.close_advertise()  # AbortRound when < 2 sites advertised
        node_of = {i: n for n, i in idx.items()}
        msgs = [self._message(grid, node_of[i], i, SHARE_KEYS, req, config, group, t)
                for i, req in share_requests.items()]
        for reply in self._exchange(grid, msgs, t, ex, "setup"):
            self._receive(ex, reply, ShareKeys, idx, self.server.receive_share_keys, "share_keys")
        usable = self.server.close_share_keys()
        _log.info("secure aggregation: epoch %d keyed with %d of %d sites", self.server.epoch,
                  len(usable), len(nodes))

    def _ensure_server(self, grid: Grid, round_timeout: float) -> ServerState:
        if self.server is None:
            n = len(list(grid.get_node_ids()))
            per_round = max(int(n * self.inner.fraction_train), self.inner.min_train_nodes)
            self.params = resolve_params(self.secagg, min(per_round, n),
                                         upload_timeout=round_timeout)
            self.server = ServerState(self.params, run_id=self._run_id,
                                      threads=self.secagg.threads)
        return self.server

    # -- one round -----------------------------------------------------------------------------
    def train_round(self, grid: Grid, server_round: int, arrays: ArrayRecord,
                    config: ConfigRecord, timeout: float) -> RoundResult:
        """Key setup if needed, masked upload with training, unmask, apply the mean delta."""
        ex = _Exchange()
        t_start = time.perf_counter()
        server = self._ensure_server(grid, timeout)
        keys, current = record_to_arrays(arrays)
        dim = int(sum(np.asarray(a).size for a in current))
        config = ConfigRecord(dict(config))
        config["server-round"] = server_round
        group = str(server_round)
        nodes = self.inner.sample(grid, server_round, self.inner.fraction_train,
                                  self.inner.min_train_nodes)
        site_of = dict(zip(nodes, self.sites.indices(nodes), strict=True))
        ex.tick("configure", t_start)

        def done(new: ArrayRecord | None, metrics: MetricRecord | None, replies: int,
                 reason: str = "") -> RoundResult:
            if new is None:
                _log.warning("round %d: secure aggregation aborted, global model unchanged: %s",
                             server_round, reason)
            self.history.append({"round": server_round, "aborted": new is None, "reason": reason,
                                 "failed": dict(ex.failed), "exchanges": ex.exchanges,
                                 "bytes_up": dict(ex.up)})
            return RoundResult(arrays=new, metrics=metrics, bytes_down=ex.bytes_down,
                               bytes_up=ex.bytes_up, exchanges=ex.exchanges, sampled=len(nodes),
                               replies=replies, failures=len(ex.failed), rejected=ex.rejected,
                               seconds=ex.seconds)

        support = self._round_support(server_round, current, dim)
        masked_dim = dim if support is None else int(support.size)
        try:
            requests = self._open_round(grid, server, nodes, site_of, masked_dim, config, group,
                                        ex)
        except (AbortRound, ConfigError) as exc:
            return done(None, None, 0, str(exc))
        node_of = {i: n for n, i in site_of.items()}
        extra = self._train_records(server_round, arrays, keys)
        msgs = [self._message(grid, node_of[i], i, MessageType.TRAIN, req, config, group, timeout,
                              self._with_previous(extra, node_of[i]))
                for i, req in requests.items()]
        uploaded: set[int] = set()
        for reply in self._exchange(grid, msgs, timeout, ex, "upload"):
            if self._receive(ex, reply, MaskedUpload, site_of, server.receive_upload, "upload"):
                uploaded.add(reply.metadata.src_node_id)
        if support is not None:  # sites that uploaded now hold this round's model
            self._prev_sent, self._prev_keys, self._prev_round = list(current), keys, server_round
            self._fresh = uploaded
        t0 = time.perf_counter()
        try:
            unmask_requests = server.close_uploads()
        except AbortRound as exc:
            return done(None, None, 0, str(exc))
        ex.tick("aggregate", t0)
        counted = len(unmask_requests)
        ut = self.params.unmask_timeout_s if self.params else self.secagg.timeout
        msgs = [self._message(grid, node_of[i], i, UNMASK, req, config, group, ut)
                for i, req in unmask_requests.items()]
        for reply in self._exchange(grid, msgs, ut, ex, "unmask"):
            self._receive(ex, reply, UnmaskResponse, site_of, server.receive_unmask, "unmask")
        t0 = time.perf_counter()
        try:
            result = server.finish_round()
        except (AbortRound, VerificationError) as exc:
            ex.tick("aggregate", t0)
            return done(None, None, counted, f"unmask failed: {exc}")
        mean = result.mean
        if support is not None:  # weighted mean of the support values -> dense delta
            mean = np.zeros(dim, np.float64)
            mean[support] = result.mean
        problem = self._check_aggregate(mean)
        if problem:
            ex.tick("aggregate", t0)
            return done(None, None, counted, problem)
        delta = unflatten_like(mean, current)
        new = self.inner.optimizer.step(current, delta)
        new = [np.asarray(n).astype(np.asarray(c).dtype, copy=False)
               for n, c in zip(new, current, strict=True)]
        self.last_result = result
        metrics = MetricRecord({
            "num-examples": float(result.total_weight),
            "secagg-counted": len(result.counted), "secagg-dropped": len(result.dropped),
            "secagg-frac-bits": result.frac_bits, "secagg-error-bound": float(result.error_bound),
            "secagg-epoch": result.epoch, "secagg-values": int(result.mean.size),
        })
        ex.tick("aggregate", t0)
        _log.info("round %d: secure mean of %d sites (%d dropped before upload), error <= %.2e",
                  server_round, len(result.counted), len(result.dropped), result.error_bound)
        return done(arrays_to_record(new, keys), metrics, len(result.counted))

    # -- sparse secure uploads (public support) --------------------------------------------------
    def _round_support(self, server_round: int, current: Sequence[np.ndarray], dim: int
                       ) -> np.ndarray | None:
        """The public support of ``server_round`` (None: dense), as the sites compute it.

        ``topk-aggregate`` uses the previous public aggregate ``global_t - global_{t-1}`` (the
        model sent now minus the one sent in the last round that opened), like
        :class:`~strategies.compressed.CompressedFedAvg`; without one, the seeded random
        support of the same amount.
        """
        if self.spec == "none":
            self.last_support = None
            return None
        aggregate = (flat_difference(current, self._prev_sent)
                     if self._needs_previous and self._prev_sent is not None else None)
        support = shared_support(self.spec, run_seed=self.run_seed, server_round=server_round,
                                 previous_aggregate=aggregate, numel=dim)
        if support is None or support.size < 1:
            raise ConfigError(explain("compression.up", self.spec,
                                      "a secure sparse round needs a support of >= 1 position",
                                      "raise the ratio or k of the sparsifier"))
        self.last_support = support
        return support

    def _train_records(self, server_round: int, arrays: ArrayRecord, keys: list[str]
                       ) -> dict[str, Any]:
        """Records of the train message besides the protocol ones (model, instruction)."""
        out: dict[str, Any] = {self.inner.arrayrecord_key: arrays}
        if self.spec != "none":
            out[INSTRUCTION_KEY] = Instruction(
                up=self.spec, run_seed=self.run_seed, server_round=server_round,
                previous_round=self._prev_round if self._needs_previous else -1,
                namespace=self.state_namespace).to_record()
            if self._needs_previous and self._prev_sent is not None:
                out[PREVIOUS_KEY] = arrays_to_record(self._prev_sent, self._prev_keys)
        return out

    def _with_previous(self, extra: dict[str, Any], node: int) -> dict[str, Any]:
        """Only sites that did not upload in the last round get the previous model."""
        if PREVIOUS_KEY in extra and node in self._fresh:
            return {k: v for k, v in extra.items() if k != PREVIOUS_KEY}
        return extra

    def _open_round(self, grid: Grid, server: ServerState, nodes: Sequence[int],
                    site_of: dict[int, int], dim: int, config: ConfigRecord, group: str,
                    ex: _Exchange) -> dict[int, Any]:
        """Re-key when needed and open the round; returns ``{site: RoundRequest}``."""
        sampled = [site_of[n] for n in nodes]
        keyed = False
        if server.epoch == 0 or server.needs_rekey(sampled):
            t0 = time.perf_counter()
            self._setup(grid, list(grid.get_node_ids()), config, group, ex)
            ex.tick("setup", t0)
            keyed = True
        for attempt in (0, 1):
            part = [i for i in sampled if i in set(server.usable_sites)]
            self._counter += 1
            try:
                return server.begin_round(self._counter, part, dim)
            except AbortRound:
                # Some participant has < t neighbours among the sampled sites (sparse graph
                # over a larger roster): key a new epoch over exactly the sampled sites.
                if keyed or attempt:
                    raise
                t0 = time.perf_counter()
                self._setup(grid, list(nodes), config, group, ex)
                ex.tick("setup", t0)
                keyed = True
        raise AssertionError("unreachable")

    def _check_aggregate(self, mean: np.ndarray) -> str:
        """Reason to refuse the unmasked mean delta ('' when it is fine)."""
        return check_aggregate(mean, max_norm=self.inner.max_update_norm,
                               clip=self.params.clip if self.params is not None else None)
