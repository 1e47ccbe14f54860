"""The site side of fedagg's upload protocol: compression and secure aggregation in one place.

A train message from :class:`strategies.Compressed` or :class:`strategies.SecureAggregation`
carries fedagg's records next to the model and the config (``strategies.wire``): the upload
instruction, the secure-aggregation stage, parameters and request. :func:`parse_round`
reads them once into a :class:`FedaggRound`; then

* a secure-aggregation *setup* or *unmask* stage is answered at once by
  :func:`answer_secagg` (no training);
* otherwise the site trains on the model *as sent* (decoded from fp16 / bf16 when
  ``compression.down`` is set) and :func:`encode_reply` runs the upload pipeline
  (:class:`fedagg.update.UploadPipeline`: delta once -> error feedback -> TopK or public
  support -> quantization -> masking) and serialises the result once.

Two ways in, the same code:

* :func:`fedagg_mod` — one Flower client mod for any ClientApp (e.g. Flower's
  quickstart-pytorch): ``ClientApp(mods=[fedagg_mod])``. It must be the outermost fedagg-aware
  mod (first in the list); mods after it (Flower's ``fixedclipping_mod``) see a plain
  message and a plain reply, so clipping happens before compression and masking.
* fedagg's own ClientApp (:func:`clients.app.make_client_app`) calls the same functions
  directly with the trained arrays (no record round trip inside the process).

Site state, all in ``Context.state`` (Flower keeps it per node and run, in simulation and
deployment), never sent: the error-feedback residual (``"fedagg.ef" + ns``), the last global
model received (``"fedagg.previous-global" + ns``, ``topk-aggregate`` supports only), the
spec / round bookkeeping (``"fedagg.compression-state" + ns``) and the SecAgg+ state with the
site's secret keys (``"fedagg.secagg-state"`` / ``"-arrays"``; never logged).
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict

from clients import carry
from fedagg.compression import codec
from fedagg.errors import ProtocolError, explain
from fedagg.privacy import DdgEncoder, rotation_seed, round_params
from fedagg.secagg import (
    ClientState,
    KeyAdvertiseRequest,
    RoundRequest,
    SecAggParams,
    ShareKeysRequest,
    UnmaskRequest,
)
from fedagg.secagg import Message as SecAggMessage
from fedagg.secagg.keys import round_binding
from fedagg.update import (
    PrivateEncoding,
    SecAggMasker,
    SiteUpload,
    SupportHistory,
    UploadPipeline,
    UploadSpec,
    decode_down,
    encode_private,
    metric_values,
)
from strategies.wire import (
    CARRY_KEY,
    FEDAGG_RECORDS,
    INSTRUCTION_KEY,
    PARAMS_KEY,
    PREVIOUS_KEY,
    PRIVACY_KEY,
    REPLY_KEY,
    VOTES_KEY,
    CarryRequest,
    Instruction,
    PrivacyRequest,
    arrays_to_record,
    dict_from_records,
    dict_to_records,
    model_digest,
    model_key,
    pack,
    params_from_record,
    payload_record,
    record_to_arrays,
    unpack,
    votes_from_record,
)

__all__ = [
    "EF_KEY",
    "PREV_KEY",
    "SECAGG_STATE_ARRAYS",
    "SECAGG_STATE_CONFIG",
    "STATE_KEY",
    "FedaggRound",
    "answer_carry",
    "answer_secagg",
    "clean_message",
    "encode_reply",
    "fedagg_mod",
    "parse_round",
    "read_plain_reply",
]

_log = logging.getLogger(__name__)

EF_KEY = "fedagg.ef"
PREV_KEY = "fedagg.previous-global"
STATE_KEY = "fedagg.compression-state"
SECAGG_STATE_CONFIG = "fedagg.secagg-state"
SECAGG_STATE_ARRAYS = "fedagg.secagg-state-arrays"

CallNext = Callable[[Message, Context], Message]
StageHook = Callable[[str], None]
"""Called with ``"upload"`` before masking and ``"unmask"`` before revealing shares (faults)."""


@dataclass
class FedaggRound:
    """The fedagg part of one train message, parsed once.

    Attributes
    ----------
    instruction : Instruction or None
        The upload instruction (compressed and secure-sparse rounds).
    site, params, stage : int, SecAggParams, str or None
        The site's SecAgg+ index, the public parameters and the stage (secure rounds).
    model_key : str or None
        Name of the model's ArrayRecord (None for setup / unmask stages).
    keys : list of str
        The model's array names.
    sent : list of ndarray
        The global model as the site trains from it (decoded downward).
    previous : list of ndarray or None
        The previous round's model, when the server sent it.
    votes : tuple of (int, ndarray) or None
        ``(round, summed vote table)`` the server sent (secure index voting).
    carry : CarryRequest or None
        Secure FedBuff: hold this upload's update, or upload a held one (:mod:`clients.carry`).
    """

    instruction: Instruction | None
    site: int | None
    params: SecAggParams | None
    stage: str | None
    model_key: str | None
    keys: list[str]
    sent: list[np.ndarray]
    previous: list[np.ndarray] | None = None
    votes: tuple[int, np.ndarray] | None = None
    carry: CarryRequest | None = None
    digest: bytes = b""
    """Secure upload rounds: :func:`strategies.wire.model_digest` of the model record as
    received (what the round's masks are bound to)."""
    privacy: PrivacyRequest | None = None
    """Secure upload rounds under distributed DP: the round's public privacy inputs."""

    @property
    def secure(self) -> bool:
        """Whether this is a secure-aggregation round."""
        return self.params is not None

    @property
    def trains(self) -> bool:
        """Whether the site trains for this message (everything but setup / unmask)."""
        return self.stage in (None, "upload")

    def spec(self) -> UploadSpec:
        """The round's upload spec (memoized parse)."""
        instr = self.instruction
        if instr is None:
            return UploadSpec.parse("none", secure=self.secure)
        return UploadSpec.parse(instr.up, support=instr.support, down=instr.down,
                                secure=self.secure)


def parse_round(msg: Message) -> FedaggRound | None:
    """Read fedagg's records of a train message (``None``: a plain message, not fedagg's).

    Raises
    ------
    ProtocolError
        Malformed records, another wire version, an array not encoded as announced.
    """
    if not msg.metadata.message_type.startswith(MessageType.TRAIN) or not msg.has_content():
        return None
    content = msg.content
    irec = content.config_records.get(INSTRUCTION_KEY)
    prec = content.config_records.get(PARAMS_KEY)
    if irec is None and prec is None:
        return None
    instr = Instruction.from_record(irec) if irec is not None else None
    site, params, stage = params_from_record(prec) if prec is not None else (None, None, None)
    if stage is not None and stage != "upload":
        return FedaggRound(instr, site, params, stage, None, [], [])
    key = model_key(content)
    keys, arrays = record_to_arrays(content.array_records[key])
    sent = decode_down(arrays, instr.down, instr.down_encoded) if instr is not None else arrays
    previous = None
    if PREVIOUS_KEY in content.array_records and instr is not None:
        _, prev = record_to_arrays(content.array_records[PREVIOUS_KEY])
        previous = decode_down(prev, instr.down, instr.down_encoded)
    votes = None
    if instr is not None and instr.votes_round >= 0:
        if VOTES_KEY not in content.array_records:
            raise ProtocolError(explain(f"{INSTRUCTION_KEY}.votes-round", instr.votes_round,
                                        f"names a vote sum but the message has no {VOTES_KEY!r}",
                                        "run the same fedagg version on the server and sites"))
        votes = (instr.votes_round, votes_from_record(content.array_records[VOTES_KEY]))
    crec = content.config_records.get(CARRY_KEY) if params is not None else None
    carry = CarryRequest.from_record(crec) if crec is not None else None
    digest = model_digest(content.array_records[key]) if params is not None else b""
    vrec = content.config_records.get(PRIVACY_KEY) if params is not None else None
    privacy = PrivacyRequest.from_record(vrec) if vrec is not None else None
    return FedaggRound(instr, site, params, stage, key, keys, sent, previous, votes, carry,
                       digest, privacy)


def clean_message(msg: Message, rnd: FedaggRound) -> Message:
    """The message a plain train handler sees: no fedagg records, the model as decoded."""
    content = RecordDict({k: v for k, v in msg.content.items() if k not in FEDAGG_RECORDS})
    instr = rnd.instruction
    if rnd.model_key is not None and instr is not None and instr.down_encoded:
        content[rnd.model_key] = arrays_to_record(rnd.sent, rnd.keys)
    out: Message = Message(content=content, metadata=msg.metadata)  # type: ignore[call-overload]
    return out


# -- secure-aggregation state -----------------------------------------------------------------
def _load(context: Context, site: int, params: SecAggParams, *, fresh_ok: bool = False
          ) -> ClientState:
    """The site's ClientState from ``Context.state`` (a new one when ``fresh_ok`` and none).

    The site's floors on ``t`` and ``k`` come from its own node config
    (``secagg-threshold-floor``, ``secagg-min-neighbours``; :class:`clients.settings.NodeConfig`),
    never from the server's message.
    """
    from clients.settings import NodeConfig

    floor, min_k = NodeConfig.from_context(context).secagg_floors()

    def new_state() -> ClientState:
        return ClientState(site, params, random_bytes=os.urandom, threshold_floor=floor,
                           min_neighbours=min_k)

    state = new_state()
    config = context.state.config_records.get(SECAGG_STATE_CONFIG)
    arrays = context.state.array_records.get(SECAGG_STATE_ARRAYS)
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
        state = new_state()  # new run or new index
    return state


def _save(context: Context, state: ClientState) -> None:
    config, arrays = dict_to_records(state.state_dict())
    context.state[SECAGG_STATE_CONFIG] = config
    context.state[SECAGG_STATE_ARRAYS] = arrays


def _reply(msg: Message, body: SecAggMessage) -> Message:
    return Message(content=pack(RecordDict(), body), reply_to=msg)


def answer_secagg(msg: Message, context: Context, rnd: FedaggRound,
                  on_stage: StageHook | None = None) -> Message:
    """Answer a setup (``advertise``, ``share-keys``) or ``unmask`` stage of SecAgg+."""
    assert rnd.site is not None and rnd.params is not None
    site, params = rnd.site, rnd.params
    answer: SecAggMessage
    if rnd.stage == "advertise":
        state = _load(context, site, params, fresh_ok=True)
        answer = state.handle_advertise(unpack(msg.content, KeyAdvertiseRequest))
    elif rnd.stage == "share-keys":
        state = _load(context, site, params)
        answer = state.handle_share_keys(unpack(msg.content, ShareKeysRequest))
    elif rnd.stage == "unmask":
        if on_stage is not None:
            on_stage("unmask")
        state = _load(context, site, params)
        answer = state.handle_unmask(unpack(msg.content, UnmaskRequest))
    else:
        raise ProtocolError(explain(f"{PARAMS_KEY}.stage", rnd.stage,
                                    "is not a stage answered without training", "-"))
    _save(context, state)
    return _reply(msg, answer)


def answer_carry(msg: Message, context: Context, rnd: FedaggRound,
                 on_stage: StageHook | None = None) -> Message:
    """Secure FedBuff: mask the held update the server asks for, instead of training.

    Raises
    ------
    ProtocolError
        The request is not for a dense secure upload, or :func:`clients.carry.take` refuses
        it (no such held update, wrong proof, wrong size).
    """
    assert rnd.carry is not None and rnd.site is not None and rnd.params is not None
    if not rnd.spec().dense:
        raise ProtocolError(explain(f"{CARRY_KEY}.round", rnd.carry.round,
                                    "only a dense secure update is carried",
                                    "the server trains the site afresh"))
    if on_stage is not None:
        on_stage("upload")
    values, weight = carry.take(context, rnd.carry, sum(int(a.size) for a in rnd.sent))
    state = _load(context, rnd.site, rnd.params)
    request = unpack(msg.content, RoundRequest)
    binding = round_binding(rnd.digest)
    mask = SecAggMasker(state, request, rng=np.random.default_rng(), binding=binding)
    if rnd.privacy is not None:  # distributed DP: the carried update is clipped and noised
        private = private_encoding(context, rnd, binding, _config_round(msg),
                                   len(tuple(request.participants)))
        masked = mask.mask_encoded(encode_private(values, private.encoder, seed=private.seed,
                                                  enc=mask.encoding(1.0), rng=mask.rng))
    else:
        masked = mask(np.concatenate([values, metric_values({})]), weight)  # no metrics
    _save(context, state)
    return _reply(msg, masked)


# -- the upload ---------------------------------------------------------------------------------
def _site_rng(ctx: Context, instr: Instruction) -> np.random.Generator:
    """The site's private generator of the round (stochastic rounding, private random-k)."""
    site = ctx.node_config.get("partition-id", ctx.node_id)
    site_int = int(site) if isinstance(site, int | float) else ctx.node_id
    return np.random.default_rng([instr.run_seed, instr.server_round, site_int % 2**63])


def _previous(ctx: Context, rnd: FedaggRound, ns: str) -> list[np.ndarray] | None:
    """The global model of ``instr.previous_round`` as this site received it, or None."""
    instr = rnd.instruction
    if instr is None or instr.previous_round < 0:
        return None
    if rnd.previous is not None:
        return rnd.previous
    state = ctx.state.config_records.get(STATE_KEY + ns)
    if (state is not None and state.get("round") == instr.previous_round
            and PREV_KEY + ns in ctx.state.array_records):
        return record_to_arrays(ctx.state.array_records[PREV_KEY + ns])[1]
    raise ProtocolError(explain(
        f"site {ctx.node_id}: previous global model (round {instr.previous_round})",
        "not kept and not sent", "topk-aggregate supports need the previous round's model",
        "the server sends it to sites that did not reply last round; check that the site "
        "kept its Context between rounds"))


def _residual(ctx: Context, spec: UploadSpec, ns: str) -> dict[str, np.ndarray] | None:
    state = ctx.state.config_records.get(STATE_KEY + ns)
    if not spec.error_feedback or state is None or state.get("spec") != spec.up:
        return None
    rec = ctx.state.array_records.get(EF_KEY + ns)
    if rec is None:
        return None
    keys, arrays = record_to_arrays(rec)
    return dict(zip(keys, arrays, strict=True))


def encode_reply(msg: Message, ctx: Context, rnd: FedaggRound, trained: list[np.ndarray],
                 weight: float, metrics: dict[str, Any],
                 on_stage: StageHook | None = None) -> Message:
    """Run the upload pipeline on the trained model and build the reply (serialised once).

    Compressed: ArrayRecord ``"compressed"`` (codec bytes) + the MetricRecord. Secure: the
    masked upload only (no metrics, no weights in the clear).
    """
    spec = rnd.spec()
    instr = rnd.instruction
    ns = instr.namespace if instr is not None else ""
    run_seed = instr.run_seed if instr is not None else 0
    server_round = instr.server_round if instr is not None else 0
    previous = _previous(ctx, rnd, ns) if spec.needs_previous else None
    history = SupportHistory.at_site(spec, run_seed, server_round, rnd.sent,
                                     instr.previous_round if instr is not None else -1, previous,
                                     votes=rnd.votes if spec.votes else None)
    if rnd.secure and on_stage is not None:
        on_stage("upload")
    mask = None
    state: ClientState | None = None
    private = None
    if rnd.secure:
        assert rnd.site is not None and rnd.params is not None
        state = _load(ctx, rnd.site, rnd.params)
        request = unpack(msg.content, RoundRequest)
        binding = round_binding(rnd.digest)
        # stochastic rounding from an unseeded generator, as it must be in deployment
        mask = SecAggMasker(state, request, rng=np.random.default_rng(), binding=binding)
        if rnd.privacy is not None:
            private = private_encoding(ctx, rnd, binding, _config_round(msg),
                                       len(tuple(request.participants)))

    rng = _site_rng(ctx, instr) if instr is not None else np.random.default_rng()
    residual = _residual(ctx, spec, ns)
    upload: SiteUpload = UploadPipeline(spec, history).run(
        trained, weight=weight, residual=residual, rng=rng, mask=mask, metrics=metrics,
        private=private)
    # state stays at the site
    if upload.residual:
        ctx.state[EF_KEY + ns] = arrays_to_record(list(upload.residual.values()),
                                                  list(upload.residual))
    if spec.needs_previous:
        ctx.state[PREV_KEY + ns] = arrays_to_record(rnd.sent, rnd.keys)
    if instr is not None:
        ctx.state[STATE_KEY + ns] = ConfigRecord({"spec": spec.up, "round": server_round})
    if state is not None:
        if rnd.carry is not None and upload.values is not None and spec.dense:
            carry.hold(ctx, _config_round(msg), upload.values, upload.weight,
                       state.last_drop_proof)
        else:
            carry.forget(ctx)
        _save(ctx, state)
        return _reply(msg, upload.masked)
    content = RecordDict({"metrics": MetricRecord(_scalars(metrics))})
    if upload.payload is not None:
        content[REPLY_KEY] = payload_record(codec.encode(upload.payload))
    else:  # downward-only compression: the trained model itself
        content["arrays"] = arrays_to_record(trained, rnd.keys)
    return Message(content=content, reply_to=msg)


MAX_EPSILON_KEY = "fedagg-max-epsilon"
"""Node config key: the largest run budget (epsilon) this site accepts under distributed DP
(a server asking for more, i.e. for less noise, is refused)."""


def private_encoding(ctx: Context, rnd: FedaggRound, binding: bytes, server_round: int,
                     participants: int) -> PrivateEncoding:
    """The site's distributed-DP encoder of the round, from the public request, checked.

    The site calibrates the noise itself (:func:`fedagg.privacy.round_params`) from the
    request's public inputs, after checking that they describe this round: the model's size,
    the participants of the round request, the rotation seed bound to the model it received
    and the round number, a budget within the site's own ceiling (node config
    :data:`MAX_EPSILON_KEY`) and a plan that sizes the noise for survivors.

    Raises
    ------
    ProtocolError
        A request that does not describe this round, or a budget above the ceiling.
    """
    req = rnd.privacy
    assert req is not None
    fix = "run the same fedagg version and configuration on the server and the sites"
    dim = int(sum(int(a.size) for a in rnd.sent))
    if req.dim != dim:
        raise ProtocolError(explain(f"{PRIVACY_KEY}.dim", req.dim,
                                    f"must be the received model's size {dim}", fix))
    if req.num_sites != participants:
        raise ProtocolError(explain(f"{PRIVACY_KEY}.num-sites", req.num_sites,
                                    f"must be the round's {participants} participants", fix))
    if not hmac.compare_digest(req.seed, rotation_seed(binding, server_round)):
        raise ProtocolError(explain(f"{PRIVACY_KEY}.seed", "another seed",
                                    "must be the rotation seed of the model this site "
                                    "received and this round", fix))
    ceiling = ctx.node_config.get(MAX_EPSILON_KEY)
    if isinstance(ceiling, int | float) and not isinstance(ceiling, bool) and (
            req.epsilon > float(ceiling)):
        raise ProtocolError(explain(
            f"{PRIVACY_KEY}.epsilon", req.epsilon,
            f"is above this site's ceiling {MAX_EPSILON_KEY} = {ceiling} (a larger budget "
            "means less noise on this site's update)",
            "run with privacy.epsilon <= the sites' ceilings, or raise the ceiling in the "
            "site's node config"))
    params = round_params(epsilon=req.epsilon, delta=req.delta,
                          participations=req.participations, clip=req.clip,
                          ring_bits=req.ring_bits, num_sites=req.num_sites,
                          min_sites=req.min_sites, dim=dim)
    return PrivateEncoding(DdgEncoder(params), req.seed)


def _config_round(msg: Message) -> int:
    """The ``server-round`` of the message's run config (the server's job number)."""
    rec = msg.content.config_records.get("config")
    value = rec.get("server-round") if rec is not None else None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(explain("config.server-round", value, "must be an int",
                                    "send the run config with the round"))
    return value


def _scalars(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def read_plain_reply(reply: Message, keys: list[str]) -> tuple[list[np.ndarray], float,
                                                               dict[str, Any]]:
    """``(trained arrays, num-examples, metrics)`` of a plain train handler's reply.

    Raises
    ------
    ProtocolError
        Not one ArrayRecord with the model's keys and one MetricRecord with ``num-examples``.
    """
    arecs = list(reply.content.array_records.values())
    mrecs = list(reply.content.metric_records.values())
    if len(arecs) != 1:
        raise ProtocolError(explain("train reply array_records", len(arecs),
                                    "must hold the trained model in one ArrayRecord",
                                    "reply like Flower's examples: {'arrays': ..., 'metrics': ...}"))
    if len(mrecs) != 1 or "num-examples" not in mrecs[0]:
        raise ProtocolError(explain("train reply metrics", sorted(reply.content.keys()),
                                    "must be one MetricRecord with num-examples",
                                    "add 'num-examples' (training examples) to the metrics"))
    rkeys, trained = record_to_arrays(arecs[0])
    if rkeys != keys:
        raise ProtocolError(explain("train reply arrays keys", rkeys[:5],
                                    f"must equal the global model's keys {keys[:5]}",
                                    "reply with the trained model of the same architecture"))
    weight = mrecs[0]["num-examples"]
    if isinstance(weight, list | bool):
        raise ProtocolError(explain("num-examples", weight, "must be a number", "report a count"))
    return trained, float(weight), dict(mrecs[0])


def fedagg_mod(msg: Message, ctx: Context, call_next: CallNext) -> Message:
    """Flower client mod: fedagg's compression and secure aggregation for any ClientApp.

    Plain messages pass through. A secure setup / unmask stage, and secure FedBuff's request to
    carry a held update (:mod:`clients.carry`), are answered here (the train handler is not
    called). A training round: the handler gets the message without fedagg's
    records and with the model decoded, replies as Flower's examples do (``"arrays"`` +
    ``"metrics"`` with ``num-examples``), and this mod turns the reply into the compressed or
    masked upload.

    Examples
    --------
    ::

        from clients import fedagg_mod
        app = ClientApp(mods=[fedagg_mod])   # outermost; Flower's own mods after it
    """
    rnd = parse_round(msg)
    if rnd is None:
        return call_next(msg, ctx)
    hook = _fault_hook(msg, ctx)
    if not rnd.trains:
        return answer_secagg(msg, ctx, rnd, hook)
    if rnd.carry is not None and rnd.carry.carries:
        return answer_carry(msg, ctx, rnd, hook)
    reply = call_next(clean_message(msg, rnd), ctx)
    if reply.has_error():
        return reply
    trained, weight, metrics = read_plain_reply(reply, rnd.keys)
    return encode_reply(msg, ctx, rnd, trained, weight, metrics, hook)


_FAULT_TARGETS = ("faults.crash_site", "faults.slow_site")


def _fault_hook(msg: Message, ctx: Context) -> StageHook | None:
    """``[faults]`` stages for fedagg's own server's messages (tests and drills)."""
    record = msg.content.config_records.get("config") if msg.has_content() else None
    # the fault targets (crash_site, slow_site) are unset by default and then not sent, so
    # most messages skip validating the whole site config here
    if record is None or not any(str(k) in _FAULT_TARGETS for k in record):
        return None
    from clients.faults import inject_faults
    from clients.settings import SiteSettings

    settings = SiteSettings.from_message(msg, ctx)
    return lambda stage: inject_faults(settings, stage)

