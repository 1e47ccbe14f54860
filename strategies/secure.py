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

Secure sparse updates are the composition ``SecureAggregation(Compressed(inner, up=...,
support="random"))``: the sites send only their masked values on a public support (or a
count sketch, or votes, docs/compression.md) and the compressed wrapper's spec says which.

A site that fails or misses the deadline before its upload is removed (its pairwise masks are
rebuilt from ``t`` shares); one that fails after uploading is still counted. When a needed
secret has fewer than ``t`` live holders the round aborts: the global model stays as it was,
and the run continues with the next round. See docs/protocols/secagg.md.

The strategy is three objects: this one (the round: messages to train, uploads folded into
the masked sum, the unmask, the mean handed over), :class:`strategies.secure_setup.KeySetup`
(the key epochs, thresholds and blamed sites) and :class:`strategies.secure_exchange.
SiteExchange` (its own messages and exchanges with the sites).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedagg.config import RunConfig, SecAggConfig
from fedagg.errors import AbortRound, ConfigError, ProtocolError, explain
from fedagg.privacy import next_power_of_two
from fedagg.secagg import (
    MaskedUpload,
    SecAggParams,
    ServerStage,
    ServerState,
    UnmaskResponse,
)
from fedagg.secagg.keys import round_binding
from fedagg.secagg.params import check_site_floor
from fedagg.update import (
    Decoded,
    MaskedLayout,
    RoundDecoder,
    SupportHistory,
    UploadSpec,
    masked_layout,
)
from strategies.compressed import Compressed
from strategies.fedavg import FedAvg, gc_young
from strategies.secure_exchange import SiteExchange
from strategies.secure_params import check_aggregate, resolve_params, unflatten_like
from strategies.secure_privacy import DistributedPrivacy, PrivateRound
from strategies.secure_setup import KeySetup
from strategies.update import Update, node_of
from strategies.wire import (
    INSTRUCTION_KEY,
    PREVIOUS_KEY,
    PRIVACY_KEY,
    VOTES_KEY,
    Instruction,
    SiteIndex,
    arrays_to_record,
    model_digest,
    model_key,
    record_to_arrays,
    votes_record,
)
from strategies.wrapper import StrategyWrapper, inner_aggregate, is_linear, record_keys

__all__ = ["SecureAggregation"]

_log = logging.getLogger(__name__)


def _one_model(messages: Sequence[Message]) -> bytes:
    """The digest of the one model every message sends (the round's masks are bound to it).

    Raises
    ------
    ConfigError
        The inner strategy sends different models to different sites: a secure round sums
        updates from one model.
    """
    seen: dict[int, bytes] = {}
    for m in messages:
        record = m.content.array_records[model_key(m.content)]
        if id(record) not in seen:
            seen[id(record)] = model_digest(record)
    digests = set(seen.values())
    if len(digests) != 1:
        raise ConfigError(explain(
            "secure round", f"{len(digests)} different models",
            "every participant of a secure round is sent the same model (the masks are bound "
            "to it)", "use an inner strategy that sends one global model"))
    return digests.pop()


@dataclass
class _SecureRound:
    """What one secure round keeps between ``configure_train`` and ``aggregate_train``."""

    round: int
    keys: list[str]
    current: list[np.ndarray]
    dim: int
    site_of: dict[int, int]
    node_of: dict[int, int]
    config: ConfigRecord
    group: str
    messages: list[Message]
    layout: MaskedLayout
    participants: int
    private: PrivateRound | None = None


class SecureAggregation(StrategyWrapper):
    """SecAgg+ around a linear aggregation strategy.

    Parameters
    ----------
    inner : Strategy, optional
        Samples the sites, writes their config, applies the mean and evaluates: fedagg's
        :class:`~strategies.FedAvg` (default), a plugin declaring ``aggregates_linearly``, or
        one of Flower's FedAvg, FedAvgM, FedProx, FedAdam, FedYogi, FedAdagrad. It never sees
        a single update in the clear. A :class:`~strategies.Compressed` around one of them
        makes the round a secure sparse one: its spec (``up``, ``support``) is what the sites
        upload, masked (a public support, a sketch or votes; own-index sparsifiers and
        quantizers are refused, :class:`fedagg.update.UploadSpec`).
    secagg : SecAggConfig, optional
        Threshold, neighbours, clip range, precision, timeout, threads.
    config_key : str
        Name of the ConfigRecord with the round config in every message.
    run_id : bytes, optional
        Bound into every derived key; 16 random bytes when omitted.
    run_seed : int
        ``run.seed``: the public seed of the supports (default: the compressed wrapper's).
    max_update_norm : float, optional
        Refuse an unmasked mean delta with a larger L2 norm (default: the inner strategy's).
    upload_timeout : float
        Lifetime of the upload messages (the round's deadline; fedagg's loop and
        ``Strategy.start()`` wait for the replies with their own timeout).
    privacy : DistributedPrivacy, optional
        Distributed differential privacy in the secure sum (dense uploads only): each site
        clips, rotates, rounds and noises its update in the ring; the server decodes the
        unweighted mean of the clipped updates and counts every unmasked round
        (:mod:`strategies.secure_privacy`, docs/privacy.md).

    Raises
    ------
    ConfigError
        ``inner`` is not linear, or its compressed spec cannot run under secure aggregation.
    """

    allows_retries = False  # a secure-aggregation message must never be answered twice
    aggregator: Strategy
    upload_timeout: float
    secagg: SecAggConfig
    config_key: str
    spec: UploadSpec
    run_seed: int
    max_update_norm: float | None
    state_namespace: str
    history: SupportHistory
    decoder: RoundDecoder
    sites: SiteIndex
    link: SiteExchange
    keys: KeySetup
    _round: _SecureRound | None
    last_result: Any
    last_support: np.ndarray | None
    history_log: list[dict[str, Any]]

    def __init__(self, inner: Strategy | None = None, *, secagg: SecAggConfig | None = None,
                 config_key: str = "config", run_id: bytes | None = None,
                 run_seed: int | None = None, max_update_norm: float | None = None,
                 upload_timeout: float = 600.0,
                 privacy: DistributedPrivacy | None = None) -> None:
        super().__init__(inner if inner is not None else FedAvg())
        compressed = self.inner if isinstance(self.inner, Compressed) else None
        self.aggregator = compressed.inner if compressed is not None else self.inner
        ok, why = is_linear(self.aggregator)
        if not ok:
            raise ConfigError(explain(
                "SecureAggregation(inner)", type(self.aggregator).__name__,
                f"secure aggregation reveals only the weighted sum of the updates; {why}",
                "wrap a linear strategy (FedAvg, FedAvgM, FedProx, FedAdam, FedYogi, "
                "FedAdagrad), or drop secure aggregation to use this one"))
        self.upload_timeout = float(upload_timeout)
        self.secagg = secagg if secagg is not None else SecAggConfig()  # type: ignore[call-arg]
        self.config_key = config_key
        up, support, namespace = ("none", "random", "")
        if compressed is not None:
            up, support, namespace = (compressed.spec.up, compressed.spec.support,
                                      compressed.state_namespace)
        self.spec = UploadSpec.parse(up, support=support, secure=True)
        if privacy is not None and not self.spec.dense:
            raise ConfigError(explain(
                "SecureAggregation(privacy=...)", self.spec.up,
                "distributed DP is calibrated for the dense update (a sparse support, sketch "
                "or vote would need its own sensitivity)", "drop the Compressed wrapper"))
        self.privacy = privacy
        seed = run_seed if run_seed is not None else (compressed.seed if compressed else 0)
        self.run_seed = int(seed)
        inner_norm = self.aggregator.max_update_norm if isinstance(self.aggregator, FedAvg) \
            else None
        self.max_update_norm = max_update_norm if max_update_norm is not None else inner_norm
        self.state_namespace = namespace
        self.history = SupportHistory(self.spec, self.run_seed)
        self.decoder = RoundDecoder(self.history)  # FetchSGD state, vote sums
        self.sites = SiteIndex()
        self.link = SiteExchange(config_key)
        self.keys = KeySetup(self.secagg, run_id if run_id is not None else os.urandom(16),
                             self.sites, self.link)
        self._round = None
        self.last_result = None  # fedagg.secagg.RoundResult of the last completed round
        self.last_private: PrivateRound | None = None
        """The distributed-DP parameters of the last round whose sum was unmasked."""
        self.last_support = None
        self.history_log = []

    @property
    def server(self) -> ServerState | None:
        """The protocol state (None before the first round)."""
        return self.keys.server

    @property
    def params(self) -> SecAggParams | None:
        """The public protocol parameters of the current epoch."""
        return self.keys.params

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_config(cls, options: Any, cfg: RunConfig, inner: Strategy | None = None
                    ) -> SecureAggregation:
        """Build from a run config: ``inner`` (fedagg's FedAvg by default), ``[secagg]`` and
        ``[compression]`` (a compressed spec makes it ``SecureAggregation(Compressed(inner))``).

        Raises
        ------
        ConfigError
            Impossible combinations, explained (too few sites per round, ``t > k``, no
            fixed-point headroom, own-index sparsifiers or quantizers in ``compression.up``).
        """
        c = cfg.compression
        UploadSpec.parse(c.up, support=c.support, down=c.down, secure=True)
        per_round = max(int(cfg.run.sites * cfg.run.fraction_train), 1)
        secagg = cfg.secagg
        if cfg.privacy.on:  # the noise lives in the privacy ring
            secagg = secagg.model_copy(update={"ring_bits": cfg.privacy.ring_bits})
        try:
            params = resolve_params(secagg, per_round, upload_timeout=cfg.run.round_timeout)
            # epochs are keyed over the sampled sites or over every node: each roster's t must
            # clear the sites' default floor (t > k/2, k >= min(3, N - 1))
            for roster in sorted({per_round, cfg.run.sites} - {0, 1}):
                k = params.neighbours_for(roster)
                check_site_floor(dataclasses.replace(
                    params, threshold=secagg.resolve_threshold(k)), roster)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (secure aggregation with {per_round} sites per round: "
                              f"run.sites={cfg.run.sites} x run.fraction_train="
                              f"{cfg.run.fraction_train})") from None
        aggregate = inner if inner is not None else FedAvg.from_config(None, cfg)
        wrapped: Strategy = aggregate if c.up == "none" else Compressed(
            aggregate, up=c.up, support=c.support, seed=cfg.run.seed,
            max_update_norm=cfg.strategy.max_update_norm)
        privacy = (DistributedPrivacy(cfg.privacy, cfg.run.rounds) if cfg.privacy.on
                   else None)
        return cls(wrapped, secagg=secagg, run_seed=cfg.run.seed,
                   max_update_norm=cfg.strategy.max_update_norm,
                   upload_timeout=cfg.run.round_timeout, privacy=privacy)

    def summary(self) -> None:
        """Log the configuration, then the inner strategy's summary."""
        _log.info("SecureAggregation(SecAgg+, up=%r) around %s: %s", self.spec.up,
                  type(self.aggregator).__name__, self.secagg)
        self.aggregator.summary()

    # -- the round's masked vector -------------------------------------------------------------
    def _layout(self, dim: int, participants: int) -> MaskedLayout:
        """The masked vector of the round (:func:`fedagg.update.masked_layout`; under
        distributed DP the sites' ring encodings)."""
        if self.privacy is not None:
            return MaskedLayout(values=next_power_of_two(dim), private=True)
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

    # -- Flower's protocol ----------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Let ``inner`` sample; key the sites if needed; return the masked-upload requests.

        An abort here (too few sites keyed) returns no messages: the round trains nothing and
        the model stays as it is.

        Raises
        ------
        ConfigError
            The sites do not run ``clients.fedagg_mod`` (no site answered the key setup with a
            protocol message): the fix is named, before any round trains.
        """
        self.report = self.link.new_round(grid)
        self._round = None
        server = self.keys.server
        if server is not None and server.stage in (ServerStage.COLLECTING,
                                                   ServerStage.UNMASKING):
            server.abort_round()  # the previous round ended in an unexpected error
        t_start = time.perf_counter()
        inner_msgs = list(self.aggregator.configure_train(server_round, arrays, config, grid))
        excluded = self.keys.excluded_nodes()
        for m in inner_msgs:
            if m.metadata.dst_node_id in excluded:
                self.report.refused[str(m.metadata.dst_node_id)] = (
                    "excluded from this round: its own relayed shares made an earlier round "
                    "abort (ServerState.blamed_sites; secagg.exclude_blamed)")
        inner_msgs = [m for m in inner_msgs if m.metadata.dst_node_id not in excluded]
        self.report.sampled = len(inner_msgs)
        keys, current = record_to_arrays(arrays)
        self.history.advance(server_round, current)
        if not inner_msgs:
            return []
        nodes = [m.metadata.dst_node_id for m in inner_msgs]
        by_node = {m.metadata.dst_node_id: m for m in inner_msgs}
        dim = int(sum(np.asarray(a).size for a in current))
        if self.privacy is not None:  # PrivacyBudgetSpent stops the run before this round
            self.privacy.check_budget(server_round, dim=dim, num_sites=len(nodes))
        server = self.keys.ensure_server(grid, len(nodes), self.upload_timeout)
        round_config = ConfigRecord(dict(config))
        round_config["server-round"] = server_round
        group = str(server_round)
        site_of = dict(zip(nodes, self.sites.indices(nodes), strict=True))
        self.report.add_time("configure", time.perf_counter() - t_start)
        try:
            self._support(dim)
            binding = round_binding(_one_model(inner_msgs))
            requests = self.keys.open_round(grid, nodes, site_of,
                                            lambda n: self._layout(dim, n).dim, round_config,
                                            group, self.report, binding)
        except ConfigError as exc:
            if "clients.fedagg_mod" in str(exc):
                raise  # the sites cannot take part at all: stop before any round trains
            self._abort(server_round, str(exc))
            return []
        except (AbortRound, ProtocolError) as exc:
            self._abort(server_round, str(exc))
            return []
        participants = len(next(iter(requests.values())).participants) if requests else 0
        private = None
        if self.privacy is not None and participants:
            private = self.privacy.round_for(server_round, dim=dim, num_sites=participants,
                                             binding=binding)
        node_of_site = {i: n for n, i in site_of.items()}
        assert self.params is not None
        ttl = self.params.upload_timeout_s
        inner_key = record_keys(self.aggregator)[2]
        out = []
        for i, req in requests.items():
            node = node_of_site[i]
            extra = {k: v for k, v in by_node[node].content.items() if k != inner_key}
            extra.update(self._upload_records(server_round, node, keys))
            if private is not None:
                extra[PRIVACY_KEY] = private.request.to_record()
            inner_config = by_node[node].content.config_records.get(inner_key)
            cfg = ConfigRecord({**dict(inner_config or {}), **dict(round_config)})
            out.append(self.link.message(node, i, "upload", req, cfg, group, ttl, extra))
        self._round = _SecureRound(round=server_round, keys=keys, current=current, dim=dim,
                                   site_of=site_of, node_of=node_of_site, config=round_config,
                                   group=group, messages=out,
                                   layout=self._layout(dim, participants),
                                   participants=participants, private=private)
        return out

    def _abort(self, server_round: int, reason: str) -> None:
        self.keys.name_blamed(server_round, self.report)
        self.report.aborted = f"secure aggregation aborted: {reason}"
        _log.warning("round %d: secure aggregation aborted, global model unchanged: %s",
                     server_round, reason)
        self._log_round(server_round, aborted=True, reason=reason)

    def _log_round(self, server_round: int, *, aborted: bool, reason: str = "") -> None:
        self.history_log.append({"round": server_round, "aborted": aborted, "reason": reason,
                                 "failed": dict(self.report.errors),
                                 "exchanges": self.report.exchanges,
                                 "bytes_up": dict(self.link.up)})

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Take the masked uploads, unmask the sums, hand the mean delta to ``inner``."""
        r = self._round
        server = self.keys.server
        if r is None or r.round != server_round or server is None:
            return None, None  # the round was aborted in configure_train
        # each masked upload is folded into the modular sum as it comes and released (the
        # uploads are model-sized; nothing of one is kept, replies may be a generator)
        uploaded: set[int] = set()
        answered: set[int] = set()
        some_reply: Message | None = None
        for reply in replies:
            node = reply.metadata.src_node_id
            answered.add(node)
            if reply.has_error():
                self.link.fail(node, f"upload: {reply.error.reason}")
                continue
            if some_reply is None:  # its metadata only: the reply inner strategies are given
                some_reply = Message(content=RecordDict(), metadata=copy.copy(reply.metadata))  # type: ignore[call-overload]
            if self.link.receive(reply, MaskedUpload, r.site_of, server.receive_upload,
                                 "upload"):
                uploaded.add(node)
            del reply
            gc_young()
        for m in r.messages:
            if m.metadata.dst_node_id not in answered:
                self.link.fail(m.metadata.dst_node_id,
                               f"upload: no reply within {float(self.secagg.timeout):.0f} s")
        self.report.replies = len(uploaded)
        self.history.replied(uploaded)
        t0 = time.perf_counter()
        try:
            unmask_requests = server.close_uploads()
        except ProtocolError as exc:  # AbortRound: too few live holders of a needed secret
            self._abort(server_round, str(exc))
            return None, None
        self.report.add_time("aggregate", time.perf_counter() - t0)
        assert self.params is not None
        ut = self.params.unmask_timeout_s
        msgs = [self.link.message(r.node_of[i], i, "unmask", req, r.config, r.group, ut)
                for i, req in unmask_requests.items()]
        for reply in self.link.run(msgs, ut, "unmask"):
            self.link.receive(reply, UnmaskResponse, r.site_of, server.receive_unmask, "unmask")
        t0 = time.perf_counter()
        try:
            return self._unmasked(server_round, r, server, some_reply)
        finally:
            self.report.add_time("aggregate", time.perf_counter() - t0)

    def _unmasked(self, server_round: int, r: _SecureRound, server: ServerState,
                  some_reply: Message | None) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Unmask the round's sum, check and decode it, hand the mean delta to ``inner``."""
        try:
            result = server.finish_round()
        except ProtocolError as exc:  # AbortRound / VerificationError, blaming who it can
            self._abort(server_round, f"unmask failed: {exc}")
            return None, None
        if r.private is not None and self.privacy is not None:
            self.privacy.charge(r.private)  # the sum was unmasked: seen, whatever comes next
            self.last_private = r.private
        assert self.params is not None
        weight_cap = len(result.counted) * self.params.weight_scale
        if not (math.isfinite(result.total_weight) and 0 < result.total_weight
                <= weight_cap * (1 + 1e-3)):
            self._abort(server_round, f"the unmasked total weight {result.total_weight!r} is not "
                        f"in (0, counted sites x secagg.weight_scale = {weight_cap:g}]")
            return None, None
        try:
            if r.private is not None and self.privacy is not None:
                mean = self.privacy.decode(r.private, result.total, len(result.counted))
                decoded = Decoded(values=mean, delta=mean[:r.dim], votes=None, metrics={})
                problem = check_aggregate(decoded.delta, max_norm=self.max_update_norm,
                                          clip=None)
            else:
                decoded = self.decoder.decode(r.layout, result.mean, result.total, dim=r.dim,
                                              num_sites=r.participants,
                                              ring_bits=result.ring_bits,
                                              counted=len(result.counted))
                problem = (check_aggregate(decoded.values, max_norm=None, clip=self.params.clip)
                           or check_aggregate(decoded.delta, max_norm=self.max_update_norm,
                                              clip=None))
        except (ConfigError, ProtocolError) as exc:
            problem = f"undecodable aggregate: {exc}"
        if problem:
            self.decoder.reject()
            self._abort(server_round, problem)
            return None, None
        if decoded.vote_problem:  # the votes only: the values are checked on their own
            self.report.refuse("votes", f"round {server_round}: the vote sum was refused "
                               f"(unattributable under masking): {decoded.vote_problem}")
        delta = unflatten_like(decoded.delta, r.current)
        self.last_result = result
        metrics = {
            "num-examples": float(result.total_weight),
            "secagg-counted": len(result.counted), "secagg-dropped": len(result.dropped),
            "secagg-frac-bits": result.frac_bits, "secagg-error-bound": float(result.error_bound),
            "secagg-epoch": result.epoch, "secagg-values": int(r.layout.values),
            **decoded.metrics,  # the sites' train loss, summed under the masks
        }
        if r.private is not None and self.privacy is not None:
            metrics.update(self.privacy.metrics(r.private))
        weight = float(result.total_weight)
        if r.private is not None:  # every site weighs the same: the weight counts the sites
            weight = float(len(result.counted))
            metrics["num-examples"] = weight
        reply = some_reply if some_reply is not None else r.messages[0]
        one = Update(delta, weight, metrics, node_of(reply), "delta",
                     round=server_round, reply=reply)
        new, inner_metrics = inner_aggregate(self.aggregator, server_round, [one], r.keys,
                                             r.current, self.report, sites=len(result.counted))
        _log.info("round %d: secure mean of %d sites (%d dropped before upload), error <= %.2e",
                  server_round, len(result.counted), len(result.dropped), result.error_bound)
        self._log_round(server_round, aborted=new is None)
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
        fn = getattr(self.aggregator, "state_dict", None)
        return {**({"inner": fn()} if callable(fn) else {}),
                **({"privacy": self.privacy.state_dict()} if self.privacy is not None else {}),
                "history": self.history.state_dict(), "sketch": self.decoder.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        fn = getattr(self.aggregator, "load_state_dict", None)
        if callable(fn) and "inner" in state:
            fn(state["inner"])
        if "history" in state:
            self.history.load_state_dict(state["history"])
        if "sketch" in state:
            self.decoder.load_state_dict(state["sketch"])
        if self.privacy is not None and "privacy" in state:
            self.privacy.load_state_dict(state["privacy"])

