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
from strategies.codec import PlainCodec, check_metadata
from strategies.fedavg import FedAvg, gc_young
from strategies.update import Update, node_of
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
    NO_GUARDS,
    StrategyWrapper,
    inner_aggregate,
    is_linear,
    model_record_key,
    model_replies,
    record_keys,
    streams_updates,
)

__all__ = ["Compressed"]

_log = logging.getLogger(__name__)


class CompressedCodec:
    """The compressed wire form of the sites' updates, server side: one reply -> one delta.

    Holds what decoding needs and what the sites compute alike: the spec, the round's public
    support history (:class:`fedagg.update.SupportHistory`, recomputed from public data), the
    model as sent (deltas are taken against it) and FetchSGD's server state for ``sketch``.

    Parameters
    ----------
    spec : UploadSpec
        The parsed ``compression.up`` / ``support`` / ``down``.
    seed : int
        The public seed of the supports.
    max_norm, max_weight : float, optional
        Per-update bounds (delta norm, weight).
    """

    def __init__(self, spec: UploadSpec, seed: int, *, max_norm: float | None = None,
                 max_weight: float | None = None) -> None:
        self.spec = spec
        self.seed = seed
        self.max_norm = max_norm
        self.max_weight = max_weight
        self.history = SupportHistory(spec, seed)
        self.decoder = RoundDecoder(self.history)  # FetchSGD's server state (sketch)
        self.keys: list[str] = []
        self.weight_key = "num-examples"

    def decode(self, reply: Message, *, sparse: bool = False) -> Update:
        """Decode and check one reply of the current round: its delta as an :class:`Update`.

        With ``sparse`` a sparse tensor comes back as :class:`fedagg.accumulate.Sparse`
        (its positions and values; no dense copy), for an inner strategy that folds updates
        as they come. A ``sketch`` reply's one tensor is the site's count sketch.

        Raises
        ------
        UpdateRejected
            Error reply, wrong records, undecodable payload (the codec's reason), shape
            mismatch, non-finite values or a delta norm above ``max_norm``.
        """
        sent = self.history.sent
        assert sent is not None, "decode before the round's model was sent"
        node = node_of(reply)
        site = f"node {node}" if node is not None else "a reply"
        if self.spec.dense:  # downward-only compression: dense replies
            plain = PlainCodec(keys=self.keys, reference=sent, weight_key=self.weight_key,
                               server_round=self.history.round, max_norm=self.max_norm,
                               max_weight=self.max_weight).decode(reply)
            delta = [np.subtract(a, r, dtype=np.float32)
                     for a, r in zip(plain.tensors, sent, strict=True)]
            return plain.replace(tensors=delta, kind="delta")
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
                                         f"must be one MetricRecord with {self.weight_key!r}",
                                         "reply with the metrics in one MetricRecord"))
        metrics = dict(mrecs[0])
        weight = check_metadata(site, metrics, weight_key=self.weight_key,
                                server_round=self.history.round, max_weight=self.max_weight)
        try:
            data = payload_bytes(arecs[REPLY_KEY])
        except CodecError as exc:
            raise UpdateRejected(f"{site}: undecodable payload: {exc}") from None
        if self.spec.sketch:
            tensors: list[Any] = [self._sketch_table(data, site)]
        else:
            decode = decode_sparse if sparse else decode_delta
            tensors = list(decode(data, shapes=[tuple(x.shape) for x in sent],
                                  support=self.history.support, site=site,
                                  max_norm=self.max_norm))
        return Update(tensors, weight, metrics, node, "delta", round=self.history.round,
                      reply=reply)

    def _sketch_table(self, data: bytes, site: str) -> np.ndarray:
        """One site's count sketch (``sketch`` specs), checked: shape and finite values."""
        assert self.history.sent is not None
        dim = sum(int(x.size) for x in self.history.sent)
        shape = self.decoder.sketch_shape(dim)
        try:
            payload = codec.decode(data, max_elements=max(int(np.prod(shape)), 1))
        except CodecError as exc:
            raise UpdateRejected(f"{site}: undecodable payload: {exc}") from None
        if [tuple(x) for x in payload.shapes] != [shape]:
            raise UpdateRejected(explain(f"{site}.payload.shapes", payload.shapes[:4],
                                         f"must be the run's one sketch table {shape}",
                                         "site and server must use the same spec"))
        table = payload.to_dense()
        check_delta(table, site=site, max_norm=None)
        return table[0]


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
        Round guards applied to the decoded deltas before an inner strategy that takes
        replies sees them (default: none, so Flower's strategies get the replies Flower would
        give them; fedagg's FedAvg applies its own). ``fedagg simulate`` passes the run's.
    state_namespace : str
        Suffix of the sites' ``Context.state`` keys, so that several strategies can drive the
        same sites in one run without sharing residuals.

    Raises
    ------
    ConfigError
        A bad spec, support or downward codec (named, with the fix), at construction.
    """

    codec: CompressedCodec
    guards: UpdateGuards
    _plaintext_error: str
    state_namespace: str
    _current: tuple[list[str], list[np.ndarray]] | None
    _encoded: list[int]
    _edge: bool

    def __init__(self, inner: Strategy | None = None, *, up: str = "none", down: str = "none",
                 support: str = "reveal-indices", seed: int | None = None,
                 max_update_norm: float | None = None, state_namespace: str = "",
                 guards: UpdateGuards | None = None) -> None:
        super().__init__(inner if inner is not None else FedAvg())
        try:
            spec = UploadSpec.parse(up, support=support, down=down)
            self._plaintext_error = ""
        except ConfigError as exc:  # a secure-only spec (votes): only inside SecureAggregation
            try:
                spec = UploadSpec.parse(up, support=support, down=down, secure=True)
            except ConfigError:
                raise exc from None
            self._plaintext_error = str(exc)
        inner_seed = self.inner.seed if isinstance(self.inner, FedAvg) else 0
        inner_norm = self.inner.max_update_norm if isinstance(self.inner, FedAvg) else None
        self.codec = CompressedCodec(
            spec, int(seed if seed is not None else inner_seed),
            max_norm=max_update_norm if max_update_norm is not None else inner_norm,
            max_weight=(guards.max_weight if guards is not None else
                        self.inner.guards.max_weight if isinstance(self.inner, FedAvg) else None))
        self.codec.weight_key = record_keys(self.inner)[0]
        self.guards = guards if guards is not None else NO_GUARDS
        self.state_namespace = state_namespace
        if spec.sketch:
            ok, why = is_linear(self.inner)
            if not ok:
                raise ConfigError(explain(
                    "Compressed(inner)", type(self.inner).__name__,
                    f"with compression.up = {spec.up!r} the server recovers one update "
                    f"from the sum of the sites' sketches (FetchSGD); {why}",
                    "wrap a linear strategy (FedAvg, FedAvgM, FedProx, FedAdam, ...) or use "
                    "a sparsifier that sends per-site updates"))
        self._current = None
        self._encoded = []
        self._edge = False

    @property
    def spec(self) -> UploadSpec:
        """The upload spec the sites are told to follow."""
        return self.codec.spec

    @property
    def history(self) -> SupportHistory:
        """The public round history the supports come from."""
        return self.codec.history

    @property
    def seed(self) -> int:
        """The public seed of the supports."""
        return self.codec.seed

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
        """Let ``inner`` sample and configure; send the (encoded) model and the instruction.

        Raises
        ------
        ConfigError
            The spec may only travel masked (votes): wrap this in SecureAggregation.
        """
        if self._plaintext_error:
            raise ConfigError(self._plaintext_error)
        self._new_round()
        self._edge = False
        messages = list(self.inner.configure_train(server_round, arrays, config, grid))
        self.report.sampled = len(messages)
        keys, exact = record_to_arrays(arrays)
        send, self._encoded = encode_down(exact, self.spec.down)
        self._current = (keys, exact)
        self.codec.keys = keys
        self.history.advance(server_round, decode_down(send, self.spec.down, self._encoded))
        model = arrays_to_record(send, keys) if self._encoded else None
        previous = None
        if self.spec.needs_previous and self.history.previous is not None:
            prev, _ = encode_down(self.history.previous, self.spec.down)
            previous = arrays_to_record(prev, keys)
        instr = self.instruction(server_round).to_record()
        array_key = record_keys(self.inner)[1]
        out = []
        for m in messages:
            content = RecordDict(dict(m.content.items()))
            if model is not None:
                content[model_record_key(content, array_key)] = model
            content[INSTRUCTION_KEY] = instr
            if previous is not None and m.metadata.dst_node_id not in self.history.fresh:
                content[PREVIOUS_KEY] = previous  # the site did not take part last round
            out.append(Message(content=content, dst_node_id=m.metadata.dst_node_id,
                               message_type=m.metadata.message_type,
                               group_id=m.metadata.group_id or str(server_round)))
        return out

    # -- upward --------------------------------------------------------------------------------
    def _aggregate_sketches(self, server_round: int, good: list[Update]
                            ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """FetchSGD: the weighted mean table -> the server's step -> one delta for ``inner``."""
        assert self._current is not None
        keys, current = self._current
        if not good:
            return None, None
        total = float(sum(u.weight for u in good))
        mean = sum(np.asarray(u.tensors[0], np.float64) * (u.weight / total) for u in good)
        dim = sum(int(np.asarray(c).size) for c in current)
        decoder = self.codec.decoder
        try:
            flat = decoder.sketch_delta(np.asarray(mean), dim)
            delta, pos = [], 0
            for c in current:
                n = int(np.asarray(c).size)
                delta.append(flat[pos:pos + n].reshape(np.shape(c)).astype(np.float32))
                pos += n
            check_delta(delta, site="FetchSGD step", max_norm=self.codec.max_norm)
        except (ConfigError, UpdateRejected) as exc:
            decoder.reject()
            self.report.refuse("round", str(exc))
            return None, None
        one = Update(delta, total, {}, None, "delta", round=server_round, reply=good[0].reply)
        new, metrics = inner_aggregate(self.inner, server_round, [one], keys, current,
                                       self.report, sites=len(good))
        if new is None:
            decoder.reject()
        else:
            decoder.accept()
        return new, metrics

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and check every reply; ``inner`` aggregates the good ones.

        ``replies`` may be any iterable; when ``inner`` folds updates as they come (fedagg's
        FedAvg), each reply is decoded (sparse tensors stay sparse), handed over and released
        before the next, so nothing is listed. A Flower strategy as ``inner`` gets the list
        of replies the deltas imply, as Flower hands them over.
        """
        if self.spec.up == "none" and self.spec.down == "none":
            # nothing is compressed: the replies are the inner strategy's, exactly as Flower
            # hands them over (checked against the model sent, when there is one)
            checked = self._checked(server_round, replies)
            if streams_updates(self.inner):  # fedagg's FedAvg folds them as they come
                return self.inner.aggregate_train(server_round, checked)
            return self.inner.aggregate_train(server_round, list(checked))
        if self._current is None:
            raise RuntimeError(explain("Compressed.aggregate_train", "called before "
                                       "configure_train", "the compressed replies are decoded "
                                       "against the model configure_train sent",
                                       "call configure_train for the round first"))
        keys, current = self._current
        if self._edge:  # decoded at the edge into plain model replies (see edge_decoded)
            good: Iterable[Update] = self._plain(server_round, replies)
        else:
            stream = not self.spec.sketch and streams_updates(self.inner)
            good = self.decoded(server_round, replies, sparse=stream)
        if self.spec.sketch:
            return self._aggregate_sketches(server_round, list(good))
        return inner_aggregate(self.inner, server_round, good, keys, current, self.report,
                               guards=self.guards)

    def edge_decoded(self, server_round: int, replies: Iterable[Message]) -> Iterator[Message]:
        """The replies as plain model replies (``global + delta``, the site's metrics), for a
        strategy above this one that reads models from replies (Flower's server-side DP
        clipping): fedagg's round loop decodes at the edge, and this strategy's own
        ``aggregate_train`` then takes the plain replies it is handed. Refused replies are
        named in :attr:`report` and left out."""
        assert self._current is not None, "edge decoding before configure_train"
        keys, current = self._current
        self._edge = True
        updates = self.decoded(server_round, replies)
        yield from model_replies(updates, current, keys, self.inner)

    def _plain(self, server_round: int, replies: Iterable[Message]) -> Iterator[Update]:
        """Edge-decoded replies (plain models against the exact global model): their deltas."""
        assert self._current is not None
        keys, current = self._current
        codec = PlainCodec(keys=keys, reference=current, weight_key=self.codec.weight_key,
                           max_norm=self.codec.max_norm, max_weight=self.codec.max_weight)
        for reply in replies:
            try:
                u = codec.decode(reply)
            except UpdateRejected as exc:
                self.report.refuse(str(node_of(reply)), f"round {server_round}: {exc}")
                continue
            yield u.replace(tensors=[np.subtract(a, c, dtype=np.float64) for a, c in
                                     zip(u.tensors, current, strict=True)], kind="delta")

    def _checked(self, server_round: int, replies: Iterable[Message]) -> Iterator[Message]:
        """Plain replies that pass the per-reply checks (all of them before configure_train)."""
        if self._current is None:
            yield from replies
            return
        for update in self.decoded(server_round, replies):
            assert update.reply is not None
            yield update.reply

    def decoded(self, server_round: int, replies: Iterable[Message], *, sparse: bool = False
                ) -> Iterator[Update]:
        """The checked updates of ``replies``, one at a time (refusals in :attr:`report`)."""
        for reply in replies:
            node = node_of(reply)
            if reply.has_error():
                self.report.errors[str(node)] = reply.error.reason or "error reply"
                continue
            self.report.replies += 1
            self.history.replied([node] if node is not None else [])
            try:
                update = self.codec.decode(reply, sparse=sparse)
            except UpdateRejected as exc:
                self.report.refuse(str(node), f"round {server_round}: {exc}")
                continue
            finally:
                del reply
            yield update
            del update
            gc_young()

    def state_dict(self) -> dict[str, Any]:
        """The inner strategy's state, the support history and FetchSGD's tables."""
        return {**super().state_dict(), "history": self.history.state_dict(),
                "sketch": self.codec.decoder.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        super().load_state_dict({k: v for k, v in state.items() if k not in ("history", "sketch")})
        if "history" in state:
            self.history.load_state_dict(state["history"])
        if "sketch" in state:
            self.codec.decoder.load_state_dict(state["sketch"])
