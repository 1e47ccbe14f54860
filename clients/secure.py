"""Site side of secure aggregation: a ClientApp mod plus three query handlers.

:func:`secure_mod` wraps the train handler (it must be the OUTERMOST mod, ``MODS[0]``, so that
masking is the last step before the upload, after any other encoder). It acts only on train
messages that carry the server's secure-aggregation records (:mod:`strategies._secagg_records`):

1. strip those records and run the rest of the chain (training) as usual;
2. ``update = trained - global`` as one flat vector, ``weight = num-examples``; or, for a
   sparse secure round (the server's train message also carries the compression instruction
   with a public-support spec, ``shared`` / ``block`` / ``aggtopk``), the values on the
   round's public support: :func:`clients.mods.compression_mod`, which runs inside this mod,
   adds the error-feedback residual (``Context.state["fedagg.ef"]``), gathers ``delta +
   residual`` on the support, keeps the rest as the new residual and replies with the values
   only; this mod masks exactly those ``k`` values (plus the weight). Values outside
   ``[-secagg.clip, secagg.clip]`` are clipped by the fixed-point encoder and the clipped
   part is not returned to the residual;
3. :meth:`fedagg.secagg.ClientState.handle_round` clips, encodes, double-masks it; the reply
   holds only the :class:`~fedagg.secagg.MaskedUpload` (masked ``uint32`` vector in an
   ArrayRecord, small fields in a ConfigRecord), no metrics and no weights in the clear.

:func:`register` adds the handlers of the other exchanges to a ClientApp:
``query.secagg_advertise`` (S1), ``query.secagg_share_keys`` (S2) and ``query.secagg_unmask``
(R2).

The site's protocol state (:meth:`~fedagg.secagg.ClientState.state_dict`, which holds its
secret keys) lives in ``Context.state`` under :data:`STATE_CONFIG_KEY` /
:data:`STATE_ARRAYS_KEY`; it is never sent, logged or put in an error message. Randomness for
keys, seeds and nonces is ``os.urandom``.

Fault injection (``[faults]``) stages: ``"train"`` (in the train handler), ``"upload"`` (after
training, before masking: the site drops before uploading) and ``"unmask"`` (the site uploaded
and drops before revealing its shares: it is still counted).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp

from clients.local import inject_faults
from clients.settings import SiteSettings
from fedagg.compression import codec
from fedagg.errors import CodecError, ProtocolError, explain
from fedagg.secagg import (
    ClientState,
    KeyAdvertiseRequest,
    RoundRequest,
    SecAggParams,
    ShareKeysRequest,
    UnmaskRequest,
)
from fedagg.secagg import Message as SecAggMessage
from strategies._compression import PREVIOUS_KEY, REPLY_KEY, payload_bytes
from strategies._records import record_to_arrays
from strategies._secagg_records import (
    ARRAYS_KEY,
    PARAMS_KEY,
    dict_from_records,
    dict_to_records,
    pack,
    params_from_record,
    strip,
    unpack,
)

__all__ = ["STATE_ARRAYS_KEY", "STATE_CONFIG_KEY", "register", "secure_mod"]

_log = logging.getLogger(__name__)

STATE_CONFIG_KEY = "fedagg.secagg-state"
STATE_ARRAYS_KEY = "fedagg.secagg-state-arrays"

CallNext = Callable[[Message, Context], Message]


def _params(msg: Message) -> tuple[int, SecAggParams]:
    rec = msg.content.config_records.get(PARAMS_KEY)
    if rec is None:
        raise ProtocolError(explain(PARAMS_KEY, None, "missing from a secure-aggregation message",
                                    "run the server with strategy.name = 'secure'"))
    return params_from_record(rec)


def _load(context: Context, site: int, params: SecAggParams, *, fresh_ok: bool = False
          ) -> ClientState:
    """The site's ClientState from ``Context.state`` (a new one when ``fresh_ok`` and none/foreign)."""
    state = ClientState(site, params, random_bytes=os.urandom)
    config = context.state.config_records.get(STATE_CONFIG_KEY)
    arrays = context.state.array_records.get(STATE_ARRAYS_KEY)
    if config is None or arrays is None:
        if fresh_ok:
            return state
        raise ProtocolError(explain("Context.state", "no secure-aggregation state",
                                    "this site has not been keyed in this run",
                                    "the server re-keys it at the next setup"))
    try:
        state.load_state_dict(dict_from_records(config, arrays))
    except ProtocolError:
        if not fresh_ok:
            raise
        state = ClientState(site, params, random_bytes=os.urandom)  # new run or new index
    return state


def _save(context: Context, state: ClientState) -> None:
    config, arrays = dict_to_records(state.state_dict())
    context.state[STATE_CONFIG_KEY] = config
    context.state[STATE_ARRAYS_KEY] = arrays


def _reply(msg: Message, body: SecAggMessage) -> Message:
    return Message(content=pack(RecordDict(), body), reply_to=msg)


def _model_record(content: RecordDict) -> ArrayRecord:
    recs = {k: v for k, v in content.array_records.items()
            if k not in (ARRAYS_KEY, PREVIOUS_KEY)}
    if "arrays" in recs:
        return recs["arrays"]
    if len(recs) != 1:
        raise ProtocolError(explain("train message array_records", sorted(recs),
                                    "must hold the global model under 'arrays'",
                                    "send the model as ArrayRecord 'arrays'"))
    return next(iter(recs.values()))


def _weight(reply: Message) -> float:
    mrecs = list(reply.content.metric_records.values())
    if len(mrecs) != 1 or "num-examples" not in mrecs[0]:
        raise ProtocolError(explain(
            "train reply metrics", sorted(reply.content.keys()),
            "secure aggregation needs one MetricRecord with num-examples",
            "reply with the trained model (or compressed update) and num-examples"))
    weight = mrecs[0]["num-examples"]
    if isinstance(weight, list):
        raise ProtocolError(explain("num-examples", "list", "must be a number", "-"))
    return float(weight)


def _support_values(msg: Message, reply: Message) -> np.ndarray:
    """The values on the round's public support, from :func:`clients.mods.compression_mod`.

    The compression mod (inside this one) has already added the error-feedback residual,
    gathered ``delta + residual`` on the public support and kept the rest as the new residual
    in ``Context.state``; its payload carries the values only (shared-support tensors, no
    indices). They are concatenated in tensor order, i.e. in the order of the flat support.
    """
    numel = sum(int(np.prod(a.shape)) for a in _model_record(msg.content).values())
    try:
        payload = codec.decode(payload_bytes(reply.content.array_records[REPLY_KEY]),
                               max_elements=max(numel, 1))
    except CodecError as exc:
        raise ProtocolError(f"compressed update could not be decoded: {exc}") from None
    if not payload.tensors or not all(t.implicit_indices for t in payload.tensors):
        raise ProtocolError(explain(
            "compressed update", "own indices",
            "a secure upload carries values on a public support only (per-site indices "
            "cannot be masked and would be revealed)",
            "set compression.support = random, block or topk-aggregate"))
    return np.concatenate([t.float_values().astype(np.float64) for t in payload.tensors])


def _update_and_weight(msg: Message, reply: Message) -> tuple[np.ndarray, float]:
    """The vector to mask and ``num-examples``.

    Dense: ``(trained - global)`` as one flat float64 vector. Sparse (the reply holds the
    compression mod's payload): the values on the public support.
    """
    if REPLY_KEY in reply.content.array_records:
        return _support_values(msg, reply), _weight(reply)
    keys, global_arrays = record_to_arrays(_model_record(msg.content), copy=False)
    arecs = list(reply.content.array_records.values())
    if len(arecs) != 1:
        raise ProtocolError(explain(
            "train reply", sorted(reply.content.keys()),
            "secure aggregation needs the trained model (one ArrayRecord) and num-examples",
            "put secure_mod outermost (MODS[0])"))
    weight = _weight(reply)
    new_keys, new_arrays = record_to_arrays(arecs[0], copy=False)
    if new_keys != keys or any(a.shape != b.shape for a, b in zip(new_arrays, global_arrays,
                                                                    strict=True)):
        raise ProtocolError(explain("train reply arrays", new_keys[:3],
                                    "must have the global model's keys and shapes",
                                    "reply with the trained model"))
    update = np.empty(sum(int(a.size) for a in new_arrays), np.float64)
    pos = 0
    for n, g in zip(new_arrays, global_arrays, strict=True):  # one pass, no temporaries
        np.subtract(n.reshape(-1), g.reshape(-1), out=update[pos:pos + n.size], dtype=np.float64)
        pos += n.size
    return update, weight


def secure_mod(msg: Message, context: Context, call_next: CallNext) -> Message:
    """Mask the train reply (``update = trained - global`` and its weight) for SecAgg+."""
    if msg.metadata.message_type != MessageType.TRAIN or PARAMS_KEY not in msg.content:
        return call_next(msg, context)
    site, params = _params(msg)
    request = unpack(msg.content, RoundRequest)
    reply = call_next(Message(content=strip(msg.content), metadata=msg.metadata),  # type: ignore[call-overload]
                      context)
    if reply.has_error():
        return reply
    inject_faults(SiteSettings.from_message(msg, context), "upload")
    update, weight = _update_and_weight(msg, reply)
    state = _load(context, site, params)
    upload = state.handle_round(request, update, weight, rng=np.random.default_rng())
    _save(context, state)
    _log.debug("site %d: masked upload for round %d", site, request.round)
    return _reply(msg, upload)


def handle_advertise(msg: Message, context: Context) -> Message:
    """S1: start a membership epoch; reply with this site's public keys."""
    site, params = _params(msg)
    request = unpack(msg.content, KeyAdvertiseRequest)
    state = _load(context, site, params, fresh_ok=True)
    answer = state.handle_advertise(request)
    _save(context, state)
    return _reply(msg, answer)


def handle_share_keys(msg: Message, context: Context) -> Message:
    """S2: encrypted shares of this site's first mask key for its neighbours."""
    site, params = _params(msg)
    request = unpack(msg.content, ShareKeysRequest)
    state = _load(context, site, params)
    answer = state.handle_share_keys(request)
    _save(context, state)
    return _reply(msg, answer)


def handle_unmask(msg: Message, context: Context) -> Message:
    """R2: reveal the requested shares (self-mask seeds of survivors, keys of dropouts)."""
    site, params = _params(msg)
    inject_faults(SiteSettings.from_message(msg, context), "unmask")
    request = unpack(msg.content, UnmaskRequest)
    state = _load(context, site, params)
    answer = state.handle_unmask(request)
    _save(context, state)
    return _reply(msg, answer)


def register(app: ClientApp) -> None:
    """Register the S1, S2 and R2 handlers (``query.secagg_*``) on ``app``."""
    app.query("secagg_advertise")(handle_advertise)
    app.query("secagg_share_keys")(handle_share_keys)
    app.query("secagg_unmask")(handle_unmask)
