"""Client mods: the site-side encoders that wrap the train handler.

:func:`compression_mod` turns the train handler's dense reply into a compressed update:

1. *downward*: if the server sent the global model fp16 / bf16 encoded, decode it to float32
   before the handler sees it (the handler trains from exactly what the server will use as
   the "sent" model);
2. run the handler (``call_next``), which replies with the full trained weights;
3. ``delta = trained - global`` (float32, per tensor, in record order);
4. compress the delta with the round's compressor (``build_compressor`` of the effective
   spec, public seed and round; for ``topk-aggregate`` supports the previous public aggregate
   ``global_t - global_{t-1}``, derived here from the previous global model kept in
   ``Context.state``), wrapped in error feedback when the spec says ``ef``;
5. reply with the encoded payload (one uint8 array in ArrayRecord ``"compressed"``) and the
   handler's MetricRecord, and nothing else.

Site state, all in ``Context.state`` (Flower keeps the context per node and run, in simulation
and deployment), never sent:

* ``"fedagg.ef" + ns``: ArrayRecord ``residual.<i>``, the error-feedback residual;
* ``"fedagg.previous-global" + ns``: ArrayRecord, the last global model received (only for
  ``topk-aggregate`` supports);
* ``"fedagg.compression-state" + ns``: ConfigRecord ``spec`` (residual is reset when it
  changes) and ``round`` (of the stored global model).

``ns`` is the instruction's namespace (empty by default), so several strategies can share a
site in one run (the benchmark).

The mod acts only on train messages that carry the server's instruction record
(:data:`strategies._compression.INSTRUCTION_KEY`), i.e. when the run uses the ``compressed``
strategy (or one reusing it); all other messages pass through untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedagg.compression import ErrorFeedback, codec
from fedagg.errors import ProtocolError, explain
from strategies._compression import (
    INSTRUCTION_KEY,
    PREVIOUS_KEY,
    REPLY_KEY,
    Instruction,
    decode_down,
    flat_difference,
    payload_record,
    round_compressor,
    stage_names,
)
from strategies._records import arrays_to_record, record_to_arrays

__all__ = ["EF_KEY", "PREV_KEY", "STATE_KEY", "compression_mod"]

_log = logging.getLogger(__name__)

EF_KEY = "fedagg.ef"
"""``Context.state`` key prefix of the error-feedback residual (ArrayRecord)."""
PREV_KEY = "fedagg.previous-global"
"""``Context.state`` key prefix of the last global model received (ArrayRecord)."""
STATE_KEY = "fedagg.compression-state"
"""``Context.state`` key prefix of the spec / round bookkeeping (ConfigRecord)."""

CallNext = Callable[[Message, Context], Message]


def _model_record(content: RecordDict) -> tuple[str, ArrayRecord]:
    recs = content.array_records
    if "arrays" in recs:
        return "arrays", recs["arrays"]
    if len(recs) != 1:
        raise ProtocolError(explain("train message array_records", sorted(recs.keys()),
                                    "must hold the global model under 'arrays'",
                                    "send the model as ArrayRecord 'arrays'"))
    name = next(iter(recs.keys()))
    return name, recs[name]


def _site_rng(ctx: Context, instr: Instruction) -> np.random.Generator:
    """The site's private generator of the round (stochastic rounding, private random-k)."""
    site = ctx.node_config.get("partition-id", ctx.node_id)
    site_int = int(site) if isinstance(site, int | float) else ctx.node_id
    return np.random.default_rng([instr.run_seed, instr.server_round, site_int % 2**63])


def _previous_global(msg: Message, ctx: Context, instr: Instruction, ns: str
                     ) -> list[np.ndarray] | None:
    """The global model of ``instr.previous_round`` as this site received it, or None."""
    if instr.previous_round < 0:
        return None
    if PREVIOUS_KEY in msg.content.array_records:
        _, arrays = record_to_arrays(msg.content.array_records[PREVIOUS_KEY])
        return decode_down(arrays, instr.down, instr.down_encoded)
    state = ctx.state.config_records.get(STATE_KEY + ns)
    if (state is not None and state.get("round") == instr.previous_round
            and PREV_KEY + ns in ctx.state.array_records):
        _, arrays = record_to_arrays(ctx.state.array_records[PREV_KEY + ns])
        return arrays
    raise ProtocolError(explain(
        f"site {ctx.node_id}: previous global model (round {instr.previous_round})",
        "not kept and not sent", "topk-aggregate supports need the previous round's model",
        "the server sends it to sites that did not reply last round; check that the site "
        "kept its Context between rounds"))


def compression_mod(msg: Message, ctx: Context, call_next: CallNext) -> Message:
    """Flower client mod: decode the downward model, compress the upward delta.

    Parameters
    ----------
    msg : Message
        Incoming message; acted on only for train messages with an instruction record.
    ctx : Context
        The site's context; residuals and the previous global model live in ``ctx.state``.
    call_next : callable
        The next mod or the train handler (replies with full weights).

    Returns
    -------
    Message
        The handler's reply with its arrays replaced by ArrayRecord ``"compressed"``
        (one uint8 array ``"payload"``), or the handler's reply unchanged when not acting.
    """
    if not msg.metadata.message_type.startswith("train") or not msg.has_content():
        return call_next(msg, ctx)
    rec = msg.content.config_records.get(INSTRUCTION_KEY)
    if rec is None:
        return call_next(msg, ctx)
    instr = Instruction.from_record(rec)
    ns = instr.namespace

    # (a) downward: the handler sees a float32 model, and only the records it knows
    name, model_rec = _model_record(msg.content)
    keys, sent = record_to_arrays(model_rec)
    glob = decode_down(sent, instr.down, instr.down_encoded)
    needs_previous = "aggtopk" in stage_names(instr.up)
    previous = _previous_global(msg, ctx, instr, ns) if needs_previous else None
    clean = RecordDict({k: v for k, v in msg.content.items()
                        if k not in (INSTRUCTION_KEY, PREVIOUS_KEY, name)})
    clean[name] = arrays_to_record(glob, keys) if instr.down_encoded else model_rec
    msg.content = clean

    # (b) train
    reply = call_next(msg, ctx)
    if reply.has_error():
        return reply
    if instr.up == "none":
        return reply

    # (c) delta
    out_name, out_rec = _model_record(reply.content)
    rkeys, trained = record_to_arrays(out_rec)
    if rkeys != keys:
        raise ProtocolError(explain("train reply arrays keys", rkeys[:5],
                                    f"must equal the global model's keys {keys[:5]}",
                                    "reply with the trained model of the same architecture"))
    delta = [np.asarray(w, dtype=np.float32) - g.astype(np.float32, copy=False)
             for w, g in zip(trained, glob, strict=True)]

    # (d) compress, with the residual of the previous rounds
    aggregate = flat_difference(glob, previous) if previous is not None else None
    comp = round_compressor(instr.up, run_seed=instr.run_seed, server_round=instr.server_round,
                            previous_aggregate=aggregate)
    state = ctx.state.config_records.get(STATE_KEY + ns)
    same_spec = state is not None and state.get("spec") == instr.up
    if isinstance(comp, ErrorFeedback) and same_spec and EF_KEY + ns in ctx.state.array_records:
        _, res = record_to_arrays(ctx.state.array_records[EF_KEY + ns])
        if [r.shape for r in res] == [d.shape for d in delta]:
            comp.load_state_dict({f"residual.{i}": r for i, r in enumerate(res)})
        else:
            _log.warning("site %s: residual shapes changed; error feedback reset", ctx.node_id)
    data = codec.encode(comp.compress(delta, rng=_site_rng(ctx, instr)))

    # (e) state stays at the site
    if isinstance(comp, ErrorFeedback) and comp.residuals is not None:
        ctx.state[EF_KEY + ns] = arrays_to_record(comp.residuals)
    if needs_previous:
        ctx.state[PREV_KEY + ns] = arrays_to_record(glob, keys)
    ctx.state[STATE_KEY + ns] = ConfigRecord({"spec": instr.up, "round": instr.server_round})

    # (f) the reply: payload + the handler's metrics, no dense arrays
    content = RecordDict({k: v for k, v in reply.content.items() if k != out_name})
    content[REPLY_KEY] = payload_record(data)
    reply.content = content
    return reply
