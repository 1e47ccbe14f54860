"""Compressed site updates around any strategy: ``Compressed(inner, up="topk:0.01+ef")``.

Sites running fedagg's ClientApp, or any ClientApp with :func:`clients.fedagg_mod`, reply
with the encoded delta ``w_site - w_global`` (TopK / random-k / shared-support
sparsification, fp16 / bf16 / int8 quantization, error feedback; docs/compression.md)
instead of the dense model. This wrapper

1. lets ``inner`` configure the round (it samples the sites and writes its config), then
   sends the global model optionally fp16 / bf16 encoded (``down``) with the upload
   instruction (:class:`strategies.wire.Instruction`: the spec, the public seed and round);
2. decodes each reply (:func:`fedagg.update.decode_delta`: any codec error rejects that site
   with the reason, the round goes on), attaches the round's public support for
   shared-support payloads (recomputed here from public data, :class:`fedagg.update.
   SupportHistory`), and checks shapes, finiteness and the optional norm bound;
3. hands the checked deltas to ``inner``, which aggregates them as it would aggregate plain
   replies (see :mod:`strategies.wrapper`): fedagg's FedAvg takes them directly; a Flower
   strategy or a plugin (FedMedian, a trimmed mean) gets the models they imply.

The server keeps full-precision master weights; downward compression only changes what is
sent, and the sites' deltas are taken against the model as sent.

``sketch`` (FetchSGD, Rothchild et al. 2020) in plaintext: each reply is the count sketch of
the site's delta (one ``rows x cols`` table; the server sees each site's sketch, see the leak
table in docs/compression.md); the weighted mean table goes through FetchSGD's server state
(:class:`fedagg.update.RoundDecoder`) and ``inner`` gets the one resulting delta, so ``inner``
must aggregate linearly, as under secure aggregation. ``vote`` is refused in plaintext (a
site's vote table reveals its top-k indices; :class:`fedagg.update.UploadSpec`).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedagg.aggregate import UpdateGuards
from fedagg.compression import codec
from fedagg.errors import CodecError, ConfigError, UpdateRejected, explain
from fedagg.update import (
    RoundDecoder,
    SupportHistory,
    UploadSpec,
    check_delta,
    decode_delta,
    decode_down,
    encode_down,
)
from fedagg.update.decode import decode_sparse
from strategies.checks import check_metadata, validate_reply
from strategies.fedavg import FedAvg
from strategies.wire import (
    INSTRUCTION_KEY,
    PREVIOUS_KEY,
    REPLY_KEY,
    Instruction,
    arrays_to_record,
    payload_bytes,
    record_to_arrays,
)
from strategies.wrapper import (
    StrategyWrapper,
    inner_aggregate,
    is_linear,
    model_record_key,
    streams_updates,
)

__all__ = ["Compressed"]

_log = logging.getLogger(__name__)


class Compressed(StrategyWrapper):
    """Compressed updates (and optionally a compressed global model) around ``inner``.

    Parameters
    ----------
    inner : Strategy, optional
        Any Flower Message-API strategy (default: fedagg's :class:`~strategies.FedAvg`).
    up : str
        Upward spec (``compression.up``), e.g. ``"topk:0.01+ef"``.
    down : {"none", "fp16", "bf16"}
        Downward codec of the global model.
    support : {"reveal-indices", "own", "random", "block", "topk-aggregate"}
        Sparse support. ``reveal-indices`` (alias ``own``): ``topk`` / ``randk`` run as written,
        each site picks its own positions and the server sees them. Any other value turns a
        ``topk`` / ``randk`` stage into the public support of the same amount (no index bytes,
        nothing revealed per site).
    seed : int
        Public seed of the supports (``run.seed``; sites get it in the instruction).
    max_update_norm : float, optional
        Reject site deltas with a larger L2 norm (default: the inner strategy's, if any).
    guards : UpdateGuards, optional
        The round-level guards (weight bound and cap, norm-bomb guard, model change) for the
        decoded deltas; default: the inner strategy's ``guards`` (fedagg's FedAvg applies them
        itself), else :class:`fedagg.aggregate.UpdateGuards`'s defaults.
    state_namespace : str
        Suffix of the sites' ``Context.state`` keys, so that several strategies can drive the
        same sites in one run without sharing residuals.

    Raises
    ------
    ConfigError
        A bad spec, support or downward codec (named, with the fix), at construction.
    """

    def __init__(self, inner: Strategy | None = None, *, up: str = "none", down: str = "none",
                 support: str = "reveal-indices", seed: int | None = None,
                 max_update_norm: float | None = None, state_namespace: str = "",
                 guards: UpdateGuards | None = None) -> None:
        super().__init__(inner if inner is not None else FedAvg())
        self.spec = UploadSpec.parse(up, support=support, down=down)
        self.seed = int(seed if seed is not None else getattr(self.inner, "seed", 0))
        self.max_update_norm = (max_update_norm if max_update_norm is not None
                                else getattr(self.inner, "max_update_norm", None))
        inner_guards = getattr(self.inner, "guards", None)
        self.guards = (guards if guards is not None else inner_guards
                       if isinstance(inner_guards, UpdateGuards) else UpdateGuards())
        self.state_namespace = state_namespace
        self.history = SupportHistory(self.spec, self.seed)
        self.decoder = RoundDecoder(self.history)  # FetchSGD's server state (sketch)
        if self.spec.sketch:
            ok, why = is_linear(self.inner)
            if not ok:
                raise ConfigError(explain(
                    "Compressed(inner)", type(self.inner).__name__,
                    f"with compression.up = {self.spec.up!r} the server recovers one update "
                    f"from the sum of the sites' sketches (FetchSGD); {why}",
                    "wrap a linear strategy (FedAvg, FedAvgM, FedProx, FedAdam, ...) or use "
                    "a sparsifier that sends per-site updates"))
        self._current: tuple[list[str], list[np.ndarray]] | None = None
        self._encoded: list[int] = []

    def summary(self) -> None:
        """Log the spec, then the inner strategy's summary."""
        _log.info("Compressed(up=%r, down=%r, support=%r) around %s", self.spec.up,
                  self.spec.down, self.spec.support, type(self.inner).__name__)
        self.inner.summary()

    # -- downward ------------------------------------------------------------------------------
    def instruction(self, server_round: int) -> Instruction:
        """The upload instruction of ``server_round``."""
        return Instruction(up=self.spec.up, down=self.spec.down, down_encoded=self._encoded,
                           run_seed=self.seed, server_round=server_round,
                           previous_round=(self.history.previous_round
                                           if self.spec.needs_previous else -1),
                           namespace=self.state_namespace, support=self.spec.support)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Let ``inner`` sample and configure; send the (encoded) model and the instruction."""
        self._new_round()
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        keys, exact = record_to_arrays(arrays)
        send, self._encoded = encode_down(exact, self.spec.down)
        self._current = (keys, exact)
        self.history.advance(server_round, decode_down(send, self.spec.down, self._encoded))
        model = arrays_to_record(send, keys) if self._encoded else None
        previous = None
        if self.spec.needs_previous and self.history.previous is not None:
            prev, _ = encode_down(self.history.previous, self.spec.down)
            previous = arrays_to_record(prev, keys)
        instr = self.instruction(server_round).to_record()
        out = []
        for m in messages:
            content = RecordDict(dict(m.content.items()))
            if model is not None:
                content[model_record_key(content, getattr(self.inner, "arrayrecord_key",
                                                          "arrays"))] = model
            content[INSTRUCTION_KEY] = instr
            if previous is not None and m.metadata.dst_node_id not in self.history.fresh:
                content[PREVIOUS_KEY] = previous  # the site did not take part last round
            out.append(Message(content=content, dst_node_id=m.metadata.dst_node_id,
                               message_type=m.metadata.message_type,
                               group_id=m.metadata.group_id or str(server_round)))
        return out

    # -- upward --------------------------------------------------------------------------------
    def decode_reply(self, reply: Message, *, sparse: bool = False
                     ) -> tuple[list[np.ndarray], float, dict[str, Any]]:
        """Decode and check one reply; return ``(delta, weight, metrics)``.

        With ``sparse`` a sparse tensor comes back as :class:`fedagg.accumulate.Sparse`
        (its positions and values; no dense copy), for an inner strategy that folds updates
        as they come (:func:`strategies.wrapper.streams_updates`).

        Raises
        ------
        UpdateRejected
            Error reply, wrong records, undecodable payload (the codec's reason), shape
            mismatch, non-finite values or a delta norm above ``max_update_norm``.
        """
        assert self._current is not None and self.history.sent is not None
        keys, _ = self._current
        sent = self.history.sent
        site = f"node {reply.metadata.src_node_id}"
        weight_key = str(getattr(self.inner, "weighted_by_key", "num-examples"))
        if self.spec.dense:  # downward-only compression: dense replies
            arrays, weight, mrec = validate_reply(reply, keys, sent, weight_key=weight_key,
                                                  max_norm=self.max_update_norm,
                                                  server_round=self.history.round,
                                                  max_weight=self.guards.max_weight)
            dense: list[np.ndarray] = [np.subtract(a, r, dtype=np.float32)
                                       for a, r in zip(arrays, sent, strict=True)]
            return dense, weight, dict(mrec)
        if reply.has_error():
            raise UpdateRejected(f"{site} replied with an error: {reply.error.reason}")
        content = reply.content
        arecs = content.array_records
        if list(arecs.keys()) != [REPLY_KEY]:
            raise UpdateRejected(explain(f"{site}.array_records", sorted(arecs.keys()),
                                         f"must hold only the compressed update {REPLY_KEY!r}",
                                         "add clients.fedagg_mod to the ClientApp's mods (or "
                                         "use clients.make_client_app)"))
        mrecs = list(content.metric_records.values())
        if len(mrecs) != 1:
            raise UpdateRejected(explain(f"{site}.metric_records", len(mrecs),
                                         f"must be one MetricRecord with {weight_key!r}",
                                         "reply with the metrics in one MetricRecord"))
        metrics = dict(mrecs[0])
        raw = check_metadata(site, metrics, weight_key=weight_key,
                             server_round=self.history.round, max_weight=self.guards.max_weight)
        try:
            data = payload_bytes(arecs[REPLY_KEY])
        except CodecError as exc:
            raise UpdateRejected(f"{site}: undecodable payload: {exc}") from None
        if self.spec.sketch:
            return [self._sketch_table(data, site)], float(raw), metrics
        decode = decode_sparse if sparse else decode_delta
        delta = decode(data, shapes=[tuple(s.shape) for s in sent],
                       support=self.history.support, site=site, max_norm=self.max_update_norm)
        return list(delta), float(raw), metrics

    def _sketch_table(self, data: bytes, site: str) -> np.ndarray:
        """One site's count sketch (``sketch`` specs), checked: shape and finite values."""
        assert self.history.sent is not None
        dim = sum(int(s.size) for s in self.history.sent)
        shape = self.decoder.sketch_shape(dim)
        try:
            payload = codec.decode(data, max_elements=max(int(np.prod(shape)), 1))
        except CodecError as exc:
            raise UpdateRejected(f"{site}: undecodable payload: {exc}") from None
        if [tuple(s) for s in payload.shapes] != [shape]:
            raise UpdateRejected(explain(f"{site}.payload.shapes", payload.shapes[:4],
                                         f"must be the run's one sketch table {shape}",
                                         "site and server must use the same spec"))
        table = payload.to_dense()
        check_delta(table, site=site, max_norm=None)
        return table[0]

    def _aggregate_sketches(self, server_round: int,
                            good: list[tuple[list[np.ndarray], float, dict[str, Any], Message]]
                            ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FetchSGD: the weighted mean table -> the server's step -> one delta for ``inner``."""
        assert self._current is not None
        keys, current = self._current
        if not good:
            return None, None
        total = float(sum(w for _, w, _, _ in good))
        mean = sum(np.asarray(t[0], np.float64) * (w / total) for t, w, _, _ in good)
        dim = sum(int(np.asarray(c).size) for c in current)
        try:
            flat = self.decoder.sketch_delta(np.asarray(mean), dim)
            delta, pos = [], 0
            for c in current:
                n = int(np.asarray(c).size)
                delta.append(flat[pos:pos + n].reshape(np.shape(c)).astype(np.float32))
                pos += n
            check_delta(delta, site="FetchSGD step", max_norm=self.max_update_norm)
        except (ConfigError, UpdateRejected) as exc:
            self.decoder.reject()
            self.last_rejected["round"] = str(exc)
            _log.warning("round %d: sketch aggregate refused: %s", server_round, exc)
            return None, None
        new, metrics = inner_aggregate(self.inner, server_round,
                                       [(delta, total, {}, good[0][3])], keys, current,
                                       sites=len(good))
        if new is None:
            self.decoder.reject()
        else:
            self.decoder.accept()
        return new, metrics

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and check every reply; ``inner`` aggregates the good ones.

        ``replies`` may be any iterable; when ``inner`` folds updates as they come (fedagg's
        FedAvg), each reply is decoded (sparse tensors stay sparse), handed over and released
        before the next, so nothing is listed. A Flower strategy as ``inner`` gets the list
        of replies the deltas imply, as Flower hands them over.
        """
        if self._current is None:
            raise RuntimeError("aggregate_train called before configure_train")
        keys, current = self._current
        stream = not self.spec.sketch and streams_updates(self.inner)
        good = self._decoded(server_round, replies, sparse=stream)
        if self.spec.sketch:
            return self._aggregate_sketches(server_round, list(good))
        return inner_aggregate(self.inner, server_round, good, keys, current,
                               guards=self.guards, rejected=self.last_rejected)

    def _decoded(self, server_round: int, replies: Iterable[Message], *, sparse: bool
                 ) -> Iterator[tuple[list[np.ndarray], float, dict[str, Any], Message]]:
        """The checked updates of ``replies``, one at a time (refusals recorded)."""
        for reply in replies:
            if not reply.has_error():
                self.history.replied([reply.metadata.src_node_id])
            try:
                delta, weight, metrics = self.decode_reply(reply, sparse=sparse)
            except UpdateRejected as exc:
                self.last_rejected[str(reply.metadata.src_node_id)] = str(exc)
                _log.warning("round %d: rejected update: %s", server_round, exc)
                continue
            yield delta, weight, metrics, reply
            del delta, reply
            gc.collect(1)  # Flower's self-referencing record views (strategies.streaming)

    def state_dict(self) -> dict[str, Any]:
        """The inner strategy's state, the support history and FetchSGD's tables."""
        return {**super().state_dict(), "history": self.history.state_dict(),
                "sketch": self.decoder.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        super().load_state_dict({k: v for k, v in state.items() if k not in ("history", "sketch")})
        if "history" in state:
            self.history.load_state_dict(state["history"])
        if "sketch" in state:
            self.decoder.load_state_dict(state["sketch"])
