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
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedagg.config import RunConfig, SecAggConfig
from fedagg.errors import AbortRound, ConfigError, ProtocolError, VerificationError, explain
from fedagg.secagg import (
    KeyAdvertise,
    MaskedUpload,
    SecAggParams,
    ServerStage,
    ServerState,
    ShareKeys,
    UnmaskResponse,
)
from fedagg.secagg import Message as SecAggMessage
from fedagg.secagg.params import check_site_floor
from fedagg.update import MaskedLayout, RoundDecoder, SupportHistory, UploadSpec, masked_layout
from strategies.base import exchange
from strategies.fedavg import FedAvg
from strategies.secure_params import (
    check_aggregate,
    flatten_arrays,
    resolve_params,
    unflatten_like,
)
from strategies.wire import (
    INSTRUCTION_KEY,
    PARAMS_KEY,
    PREVIOUS_KEY,
    VOTES_KEY,
    Instruction,
    SiteIndex,
    arrays_to_record,
    message_nbytes,
    pack,
    params_to_record,
    record_to_arrays,
    unpack,
    votes_record,
)
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
    def _message(self, node: int, site: int, stage: str, body: SecAggMessage,
                 config: ConfigRecord, group: str, ttl: float,
                 extra: dict[str, Any] | None = None) -> Message:
        assert self.params is not None
        content = RecordDict(dict(extra or {}))
        content[self.config_key] = config
        content[PARAMS_KEY] = params_to_record(self.params, site, stage)
        pack(content, body)
        return Message(content=content, dst_node_id=node, message_type=MessageType.TRAIN,
                       group_id=group, ttl=ttl)

    def _exchange(self, messages: list[Message], timeout: float, phase: str) -> list[Message]:
        """One exchange of the wrapper's own: deadline, genuine replies only, bytes counted.

        Replies are filtered (:func:`strategies.base.exchange`): a reply to an earlier
        exchange's message, to a message addressed to another node, or a second reply is
        refused and recorded; error and missing replies are failures. No retries: a
        secure-aggregation message must not be answered twice.
        """
        log = self.round_log
        assert self._grid is not None
        t0 = time.perf_counter()
        replies, refused, bytes_down, _ = (exchange(self._grid, messages, timeout) if messages
                                           else ([], {}, 0, 0))
        log.bytes_down += bytes_down
        log.tick(phase, t0)
        log.exchanges += 1
        for node, why in refused.items():
            log.rejected.setdefault(node, f"{phase}: {why}")
        return self._sort(messages, replies, timeout, phase, count_bytes=True)

    def _sort(self, messages: Sequence[Message], replies: Iterable[Message], timeout: float,
              phase: str, *, count_bytes: bool) -> list[Message]:
        log = self.round_log
        replies = list(replies)
        answered = {r.metadata.src_node_id for r in replies}
        for m in messages:
            if m.metadata.dst_node_id not in answered:
                self._fail(m.metadata.dst_node_id, f"{phase}: no reply within {timeout:.0f} s")
        ok = []
        for r in replies:
            if r.has_error():
                self._fail(r.metadata.src_node_id, f"{phase}: {r.error.reason}")
                continue
            if count_bytes:
                size = message_nbytes(r)
                log.bytes_up += size
                log.up[phase] = log.up.get(phase, 0) + size
            ok.append(r)
        return ok

    def _fail(self, node: int, reason: str) -> None:
        self.round_log.failed.setdefault(node, reason)
        _log.warning("secure aggregation: node %d dropped (%s)", node, reason)

    def _receive(self, reply: Message, cls: type[Any], site_of: dict[int, int], accept: Any,
                 phase: str) -> bool:
        """Parse one reply and hand it to the server state; a bad one drops only its site."""
        node = reply.metadata.src_node_id
        sender = site_of.get(node)
        try:
            if sender is None:
                raise ProtocolError(explain("node", node, "is not a participant of this stage",
                                            "drop the reply"))
            msg = unpack(reply.content, cls)
            accept(msg, sender=sender)  # the core refuses a reply in another site's name
        except (ProtocolError, VerificationError, ConfigError) as exc:
            self.round_log.rejected[str(node)] = f"{phase}: {exc}"
            self._fail(node, f"{phase}: invalid reply: {exc}")
            return False
        except Exception as exc:  # never one site's reply past its own rejection
            _log.error("secure aggregation: unexpected %s from node %d's %s reply",
                       type(exc).__name__, node, phase, exc_info=True)
            self.round_log.rejected[str(node)] = f"{phase}: {type(exc).__name__}: {exc}"
            self._fail(node, f"{phase}: invalid reply: {type(exc).__name__}")
            return False
        return True

    # -- key setup (two exchanges) -------------------------------------------------------------
    def _setup(self, nodes: Sequence[int], config: ConfigRecord, group: str) -> None:
        assert self.server is not None and self.params is not None
        nodes = [n for n in nodes if n not in self._excluded_nodes()]
        self._params_for_roster(len(nodes))
        t = self.params.setup_timeout_s
        idx = dict(zip(nodes, self.sites.indices(nodes), strict=True))
        request = self.server.begin_setup(idx.values())
        msgs = [self._message(n, i, "advertise", request, config, group, t)
                for n, i in idx.items()]
        for reply in self._exchange(msgs, t, "setup"):
            self._receive(reply, KeyAdvertise, idx, self.server.receive_advertise, "advertise")
        share_requests = self.server.close_advertise()  # AbortRound when < 2 sites advertised
        node_of = {i: n for n, i in idx.items()}
        msgs = [self._message(node_of[i], i, "share-keys", req, config, group, t)
                for i, req in share_requests.items()]
        for reply in self._exchange(msgs, t, "setup"):
            self._receive(reply, ShareKeys, idx, self.server.receive_share_keys, "share_keys")
        usable = self.server.close_share_keys()
        _log.info("secure aggregation: epoch %d keyed with %d of %d sites", self.server.epoch,
                  len(usable), len(nodes))

    def _params_for_roster(self, roster: int) -> None:
        """Resolve ``t`` (and ``k``) for the roster an epoch is about to be keyed over.

        ``t`` was resolved from the sampled count, but an epoch may be keyed over every
        connected node (``run.fraction_train < 1``): its ``k`` can then exceed ``2 t``, and
        every site would refuse the setup (its floor, docs/protocols/secagg.md section 4). A
        new epoch starts with the parameters of its own roster (sites get them, and their
        digest, in the setup messages); nothing changes within an epoch.
        """
        assert self.server is not None and self.params is not None
        if roster < 2:
            return  # close_advertise aborts the setup with the reason
        k = self.params.neighbours_for(roster)
        t = self.secagg.resolve_threshold(k)
        if t != self.params.threshold:
            params = dataclasses.replace(self.params, threshold=t)
            _log.info("secure aggregation: threshold t = %d for an epoch of %d sites (k = %d)",
                      t, roster, k)
            self.params = params
            self.server.params = params

    def _roster_fits(self, roster: int, sampled: int) -> bool:
        """Whether an epoch keyed over ``roster`` sites can serve rounds of ``sampled``: its
        ``t`` (resolved for the roster's ``k``) needs ``t`` neighbours among the sampled."""
        assert self.params is not None
        if roster < 2 or roster <= sampled:
            return True
        try:
            t = self.secagg.resolve_threshold(self.params.neighbours_for(roster))
        except ConfigError:
            return False
        return t <= sampled - 1

    def _excluded_nodes(self) -> set[int]:
        """Nodes whose own shares made a round of this run abort (``secagg.exclude_blamed``).

        The protocol cannot tell such a site from one framed by more than ``k - t`` lying
        neighbours; fedagg leaves it out of the rest of the run by default (an availability
        attack costs one round, not every round), and says so in the round's ``rejected``.
        """
        if self.server is None or not self.secagg.exclude_blamed:
            return set()
        out = set()
        for i in self.server.blamed_sites:
            try:
                out.add(self.sites.node(i))
            except KeyError:
                continue
        return out

    def _ensure_server(self, grid: Grid, per_round: int, upload_timeout: float) -> ServerState:
        if self.server is None:
            n = len(list(grid.get_node_ids()))
            self.params = resolve_params(self.secagg, min(max(per_round, 1), max(n, 1)),
                                         upload_timeout=upload_timeout)
            self.server = ServerState(self.params, run_id=self._run_id,
                                      threads=self.secagg.threads)
        return self.server

    def _open_round(self, grid: Grid, server: ServerState, nodes: Sequence[int],
                    site_of: dict[int, int], dim: int | Callable[[int], int],
                    config: ConfigRecord, group: str) -> dict[int, Any]:
        """Re-key when needed and open the round; returns ``{site: RoundRequest}``.

        ``dim`` is the masked length, or a function of the number of participants (the vote
        counters' packing depends on it).
        """
        sampled = [site_of[n] for n in nodes]
        narrow = False  # keyed over exactly the sampled sites in this call
        if server.epoch == 0 or server.needs_rekey(sampled):
            roster = [n for n in grid.get_node_ids() if n not in self._excluded_nodes()]
            if not self._roster_fits(len(roster), len(sampled)):
                roster = list(nodes)  # the roster's t cannot be met by a round this size
            t0 = time.perf_counter()
            self._setup(roster, config, group)
            self.round_log.tick("setup", t0)
            narrow = set(roster) <= set(nodes)
        for attempt in (0, 1):
            part = [i for i in sampled if i in set(server.usable_sites)]
            self._counter += 1
            try:
                return server.begin_round(self._counter, part,
                                          dim if isinstance(dim, int) else dim(len(part)))
            except (AbortRound, ConfigError):
                # Some participant has < t neighbours among the sampled sites (sparse graph
                # over a larger roster), or the epoch's t does not fit a round this size: key
                # a new epoch over exactly the sampled sites.
                if narrow or attempt:
                    raise
                t0 = time.perf_counter()
                self._setup(list(nodes), config, group)
                self.round_log.tick("setup", t0)
                narrow = True
        raise AssertionError("unreachable")

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

    def _layout(self, dim: int, participants: int) -> MaskedLayout:
        """The masked vector of the round (:func:`fedagg.update.masked_layout`)."""
        assert self.params is not None
        return masked_layout(self.history, dim, num_sites=participants,
                             ring_bits=self.params.encoding_for(participants)[1])

    def _upload_records(self, server_round: int, node: int, keys: list[str]) -> dict[str, Any]:
        """The instruction (and the previous model) of a sparse round."""
        if self.spec.dense:
            return {}
        votes = self.history.votes if self.spec.votes else None
        out: dict[str, Any] = {INSTRUCTION_KEY: Instruction(
            up=self.spec.up, run_seed=self.run_seed, server_round=server_round,
            previous_round=self.history.previous_round if self.spec.needs_previous else -1,
            namespace=self.state_namespace, support=self.spec.support,
            votes_round=-1 if votes is None else votes[0]).to_record()}
        if votes is not None:  # public: the vote sum the server unmasked (counted downward)
            out[VOTES_KEY] = votes_record(votes[1])
        if (self.spec.needs_previous and self.history.previous is not None
                and node not in self.history.fresh):
            out[PREVIOUS_KEY] = arrays_to_record(self.history.previous, keys)
        return out

    def _support(self, dim: int) -> np.ndarray | None:
        """The round's public support (None: dense or sketch), as the sites compute it."""
        if self.spec.dense or self.spec.sketch:
            self.last_support = None
            return None
        support = self.history.support()
        if support is None or support.size < 1:
            raise ConfigError(explain("compression.up", self.spec.up,
                                      "a secure sparse round needs a support of >= 1 position",
                                      "raise the ratio or k of the sparsifier"))
        self.last_support = support
        return support

    def _abort(self, server_round: int, reason: str) -> None:
        self._name_blamed(server_round)
        self.round_log.aborted = f"secure aggregation aborted: {reason}"
        _log.warning("round %d: secure aggregation aborted, global model unchanged: %s",
                     server_round, reason)
        self.history_log.append({"round": server_round, "aborted": True, "reason": reason,
                                 "failed": dict(self.round_log.failed),
                                 "exchanges": self.round_log.exchanges,
                                 "bytes_up": dict(self.round_log.up)})

    def _name_blamed(self, server_round: int) -> None:
        """Name, in the round's ``rejected``, each site the core newly blamed for an abort."""
        if self.server is None:
            return
        for i in self.server.blamed_sites:
            if i in self._named_blamed:
                continue
            self._named_blamed.add(i)
            try:
                node = str(self.sites.node(i))
            except KeyError:
                continue
            self.round_log.rejected.setdefault(node, (
                f"round {server_round}: its own relayed shares could not be opened by its "
                "neighbours, so the round aborted (blamed; "
                + ("left out of the run's later rounds" if self.secagg.exclude_blamed
                   else "re-keyed before it takes part again") + ")"))

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

