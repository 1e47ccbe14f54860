"""FedAvg over compressed site updates (strategy name ``"compressed"``).

Sites run :func:`clients.mods.compression_mod`, which replies with the encoded delta
``w_site - w_global`` (TopK / random-k / shared-support sparsification, fp16 / bf16 / int8
quantization, error feedback; see docs/compression.md) instead of the dense model. This
strategy

1. sends the global model, optionally fp16 / bf16 encoded (``compression.down``), with an
   instruction record telling the sites the effective upward spec, the public seed and round
   (:mod:`strategies._compression`);
2. decodes each reply with :func:`fedagg.compression.codec.decode` (any
   :class:`~fedagg.errors.CodecError` rejects that site with the reason; the round goes on),
   attaches the public support for shared-support payloads (recomputed here from the public
   seed, the round and the previous public aggregate, exactly as the sites did), and checks
   tensor count, shapes, finiteness and the optional norm bound;
3. averages the decoded deltas weighted by ``num-examples`` (McMahan et al. 2017) and applies
   the mean to the float32 master model through the server optimizer (``none``:
   ``w + mean_delta``). With fewer valid replies than ``min_sites`` the model is unchanged.

The server keeps full-precision master weights; downward compression only changes what is
sent, and the sites' deltas are taken against the model as sent.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from fedagg.aggregate import global_norm, weighted_mean
from fedagg.compression import codec
from fedagg.config import RunConfig
from fedagg.errors import CodecError, ConfigError, UpdateRejected, explain
from strategies._compression import (
    INSTRUCTION_KEY,
    PREVIOUS_KEY,
    REPLY_KEY,
    Instruction,
    decode_down,
    effective_spec,
    encode_down,
    flat_difference,
    payload_bytes,
    round_compressor,
    shared_support,
    stage_names,
)
from strategies._records import arrays_to_record
from strategies.fedavg import FedAvg, _numbers, partition_of, validate_reply

__all__ = ["CompressedFedAvg"]

_log = logging.getLogger(__name__)


class CompressedFedAvg(FedAvg):
    """FedAvg on compressed deltas, with optional downward fp16 / bf16 compression.

    Parameters
    ----------
    up : str
        Upward compressor spec (``compression.up``), e.g. ``"topk:0.01+ef"``.
    down : {"none", "fp16", "bf16"}
        Downward codec of the global model.
    support : {"reveal-indices", "own", "random", "block", "topk-aggregate"}
        Sparse support. ``reveal-indices`` (alias ``own``) runs ``topk`` / ``randk`` as written:
        each site picks its own positions and the server sees them. Any other value turns a
        ``topk`` / ``randk`` stage into the public support of the same amount (no index
        bytes, nothing revealed per site).
    state_namespace : str
        Suffix of the sites' ``Context.state`` keys, so that several strategies can drive the
        same sites in one run without sharing residuals.
    **kwargs
        As :class:`strategies.fedavg.FedAvg` (``seed`` is also the public seed of supports).
    """

    def __init__(self, *, up: str = "none", down: str = "none", support: str = "own",
                 state_namespace: str = "", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if down not in ("none", "fp16", "bf16"):
            raise ConfigError(explain("compression.down", down, "must be none, fp16 or bf16",
                                      "choose one of the listed codecs"))
        self.spec = effective_spec(up, support)
        self.down = down
        self.support = support
        self.state_namespace = state_namespace
        # validate the spec now (a bad spec fails at start-up, not in round 1 at every site)
        round_compressor(self.spec, run_seed=self.seed, server_round=1, previous_aggregate=None)
        if "aggtopk" in stage_names(self.spec):
            round_compressor(self.spec, run_seed=self.seed, server_round=1,
                             previous_aggregate=np.zeros(1, np.float32))
        self._needs_previous = "aggtopk" in stage_names(self.spec)
        self._sent: list[np.ndarray] | None = None  # global of this round, as the sites decode it
        self._sent_round = -1
        self._prev_sent: list[np.ndarray] | None = None
        self._prev_round = -1
        self._prev_send: list[np.ndarray] | None = None  # encoded form, for sites that lack it
        self._send: list[np.ndarray] | None = None
        self._replied: set[int] = set()
        self._fresh: set[int] = set()
        self._aggregate: np.ndarray | None = None
        self._support: np.ndarray | None = None
        self._support_round = -1

    @classmethod
    def from_config(cls, options: Any, cfg: RunConfig) -> CompressedFedAvg:
        """Build from a validated run config (``[compression]`` and ``[strategy]``)."""
        s, c = cfg.strategy, cfg.compression
        return cls(up=c.up, down=c.down, support=c.support,
                   fraction_train=cfg.run.fraction_train, min_sites=cfg.run.min_sites,
                   server_optimizer=s.server_optimizer, server_lr=s.server_lr,
                   server_momentum=s.server_momentum, max_update_norm=s.max_update_norm,
                   seed=cfg.run.seed)

    # -- downward ----------------------------------------------------------------------------
    def instruction(self, server_round: int, encoded: list[int]) -> Instruction:
        """The instruction of ``server_round``; ``encoded``: indices of fp16 / bf16 arrays."""
        return Instruction(up=self.spec, down=self.down, down_encoded=encoded,
                           run_seed=self.seed, server_round=server_round,
                           previous_round=self._prev_round if self._needs_previous else -1,
                           namespace=self.state_namespace)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Sample sites; send the (optionally fp16 / bf16) global model and the instruction."""
        messages = list(super().configure_train(server_round, arrays, config, grid))
        assert self._global is not None
        keys, exact = self._global
        send, encoded = encode_down(exact, self.down)
        if self._sent is not None and self._sent_round != server_round:
            self._prev_sent, self._prev_round, self._prev_send = (
                self._sent, self._sent_round, self._send)
            self._fresh = self._replied
        self._sent = decode_down(send, self.down, encoded)
        self._sent_round, self._send = server_round, send
        self._replied = set()
        self._aggregate = (flat_difference(self._sent, self._prev_sent)
                           if self._needs_previous and self._prev_sent is not None else None)
        self._support, self._support_round = None, -1
        instr = self.instruction(server_round, encoded).to_record()
        model = arrays_to_record(send, keys) if encoded else arrays
        previous = (arrays_to_record(self._prev_send, keys)
                    if self._needs_previous and self._prev_send is not None else None)
        out = []
        for m in messages:
            content = RecordDict({self.arrayrecord_key: model, self.configrecord_key: config,
                                  INSTRUCTION_KEY: instr})
            if previous is not None and m.metadata.dst_node_id not in self._fresh:
                content[PREVIOUS_KEY] = previous  # the site did not reply last round
            out.append(Message(content=content, message_type=MessageType.TRAIN,
                               dst_node_id=m.metadata.dst_node_id))
        return out

    # -- upward ------------------------------------------------------------------------------
    def _round_support(self, numel: int) -> np.ndarray | None:
        if self._support_round != self._sent_round:
            self._support = shared_support(self.spec, run_seed=self.seed,
                                           server_round=self._sent_round,
                                           previous_aggregate=self._aggregate, numel=numel)
            self._support_round = self._sent_round
        return self._support

    def decode_reply(self, reply: Message) -> tuple[list[np.ndarray], float, MetricRecord]:
        """Decode and check one reply; return ``(delta, weight, metrics)``.

        Raises
        ------
        UpdateRejected
            Error reply, wrong records, undecodable payload (the CodecError's reason), shape
            mismatch, non-finite values or a delta norm above ``max_update_norm``.
        """
        assert self._global is not None and self._sent is not None
        keys, _ = self._global
        reference = self._sent
        site = f"node {reply.metadata.src_node_id}"
        if self.spec == "none":  # downward-only compression: dense replies
            arrays, weight, metrics = validate_reply(reply, keys, reference,
                                                     weight_key=self.weighted_by_key,
                                                     max_norm=self.max_update_norm,
                                                     server_round=self._sent_round)
            return [a - r for a, r in zip(arrays, reference, strict=True)], weight, metrics
        if reply.has_error():
            raise UpdateRejected(f"{site} replied with an error: {reply.error.reason}")
        content = reply.content
        arecs = content.array_records
        if list(arecs.keys()) != [REPLY_KEY]:
            raise UpdateRejected(explain(f"{site}.array_records", sorted(arecs.keys()),
                                         f"must hold only the compressed update {REPLY_KEY!r}",
                                         "add clients.mods.compression_mod to the ClientApp's "
                                         "mods (clients.app.MODS)"))
        mrecs = list(content.metric_records.values())
        echoed = mrecs[0].get("server-round") if len(mrecs) == 1 else None
        if echoed is not None and echoed != self._sent_round:
            raise UpdateRejected(explain(f"{site}.metrics.server-round", echoed,
                                         f"must be the current round {self._sent_round}",
                                         "stale reply from an earlier round: it is never aggregated"))
        raw_weight = mrecs[0].get(self.weighted_by_key) if len(mrecs) == 1 else None
        if not (isinstance(raw_weight, int | float) and not isinstance(raw_weight, bool)
                and math.isfinite(raw_weight) and raw_weight > 0):
            raise UpdateRejected(explain(f"{site}.metrics.{self.weighted_by_key}", raw_weight,
                                         "one MetricRecord with a finite number > 0",
                                         "report the number of examples used for training"))
        numel = sum(int(r.size) for r in reference)
        try:
            payload = codec.decode(payload_bytes(arecs[REPLY_KEY]), max_elements=numel)
            shapes = [tuple(r.shape) for r in reference]
            if [tuple(s) for s in payload.shapes] != shapes:
                raise UpdateRejected(explain(f"{site}.payload.shapes", payload.shapes[:4],
                                             f"must equal the global model's {shapes[:4]}",
                                             "compress the delta of the same architecture"))
            if any(t.implicit_indices for t in payload.tensors):
                support = self._round_support(numel)
                if support is None:
                    raise UpdateRejected(explain(f"{site}.payload", "shared-support tensors",
                                                 f"the spec {self.spec!r} has no shared support",
                                                 "site and server must use the same spec"))
                payload = payload.with_support(support)
            delta = payload.to_dense()
        except CodecError as exc:
            raise UpdateRejected(f"{site}: undecodable payload: {exc}") from None
        for j, d in enumerate(delta):
            if not np.isfinite(np.sum(d, dtype=np.float64)):
                raise UpdateRejected(explain(f"{site}.delta[{j}]", "non-finite values",
                                             "must be finite (no NaN / Inf)",
                                             "check the site's training (learning rate, data)"))
        if self.max_update_norm is not None:
            norm = global_norm(delta)
            if not norm <= self.max_update_norm:
                raise UpdateRejected(explain(f"{site}.delta_norm", round(norm, 6),
                                             f"must be <= strategy.max_update_norm = "
                                             f"{self.max_update_norm}",
                                             "check the site, or raise strategy.max_update_norm"))
        return delta, float(raw_weight), mrecs[0]

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode, check, average the deltas by examples, apply through the server optimizer."""
        if self._global is None or self._sent is None:
            raise RuntimeError("aggregate_train called before configure_train")
        self.last_rejected = {}
        good: list[tuple[list[np.ndarray], float, MetricRecord, Message]] = []
        for reply in replies:
            if not reply.has_error():
                self._replied.add(reply.metadata.src_node_id)
            try:
                delta, weight, metrics = self.decode_reply(reply)
            except UpdateRejected as exc:
                self.last_rejected[str(reply.metadata.src_node_id)] = str(exc)
                _log.warning("round %d: rejected update: %s", server_round, exc)
                continue
            good.append((delta, weight, metrics, reply))
        good.sort(key=lambda g: (g[2].get("partition-id", -1), g[3].metadata.src_node_id))
        self.last_accepted = [partition_of(g[2]) for g in good]
        self.last_site_metrics = {str(partition_of(g[2])): _numbers(g[2]) for g in good}
        if len(good) < self.min_sites:
            _log.warning("round %d: %d valid updates < min_sites=%d; global model unchanged",
                         server_round, len(good), self.min_sites)
            return None, None
        keys, current = self._global
        mean = weighted_mean([g[0] for g in good], [g[1] for g in good])
        new = self.optimizer.step(current, mean)
        metrics = aggregate_metricrecords([g[3].content for g in good], self.weighted_by_key)
        return arrays_to_record(new, keys), metrics
