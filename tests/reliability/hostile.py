"""A hostile Grid for the server-loop fuzz (issue 17): real sites, forged replies.

:class:`HostileGrid` is :class:`server.inprocess.InProcessGrid` (the real ClientApp with
:func:`clients.fedagg_mod`, every message and reply through Flower's serialisation) that,
for some replies, replaces what the site sent with a forged reply of one hostile *kind*:
metadata of the wrong type or range, NaN / Inf / FLT_MAX values, huge weights, damaged or
mis-versioned compressed payloads, and secure-aggregation protocol messages with hostile
fields (versions, ring widths, share limbs, ciphertexts, keys). A forged reply is what a site
could really send: it is built from Flower records and survives Flower's serialisation; the
server authenticates only the sender (the node id), as in deployment.

Every forgery is logged with what the server must do about it:

* ``"rejected"``: the reply (or the site, for the round) is refused: the node must be named in
  that round's ``rejected`` or ``errors`` in metrics.json;
* ``"capped"``: accepted with its weight capped (named in ``weights_capped``);
* ``"any"``: may pass (a metric the server only averages, a byte flip that still decodes, a
  ciphertext only its recipient can check); the round may then also fail, which its
  ``summary`` must say.

The hostile sites are a fixed set of fewer than half the sites (:attr:`HostileGrid.hostile`):
the median-relative guards and the secure threshold (docs/reliability.md,
docs/protocols/secagg.md) assume an honest majority.
"""

from __future__ import annotations

import dataclasses
import struct
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from clients import fedagg_mod
from fedagg.compression import Payload, TensorPayload, WireDType, codec
from fedagg.secagg import INLINE_BYTES, shamir
from server.inprocess import InProcessGrid, wire_roundtrip
from strategies.wire import (
    ARRAYS_KEY,
    CONFIG_KEY,
    PARAMS_KEY,
    REPLY_KEY,
    arrays_to_record,
    payload_bytes,
    payload_record,
    record_to_arrays,
)

FLT_MAX = float(np.finfo(np.float32).max)
NOISE = 0.01
"""Honest sites move each weight by about this much per round."""

Forged = tuple[RecordDict | None, str]
"""The forged content (None: an error reply) and the expectation."""
LAST_KIND = [""]
"""Label of the last forgery made (for failure messages)."""


def fast_app() -> ClientApp:
    """A ClientApp whose training is instant: the global model plus small seeded noise.

    Wrapped in :func:`clients.fedagg_mod` exactly like a user's ClientApp, so compression and
    secure aggregation run the real site protocol.
    """
    app = ClientApp(mods=[fedagg_mod])

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        keys, arrays = record_to_arrays(msg.content["arrays"])
        pid = int(ctx.node_config["partition-id"])
        rnd = int(msg.content["config"].get("server-round", 0))
        rng = np.random.default_rng([pid, rnd])
        out = [a + np.float32(NOISE) * rng.standard_normal(a.shape).astype(a.dtype)
               for a in arrays]
        metrics = {"num-examples": 20 + pid, "train_loss": 0.5 + 0.01 * pid,
                   "partition-id": pid, "server-round": rnd}
        return Message(RecordDict({"arrays": arrays_to_record(out, keys),
                                   "metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


# -- helpers ------------------------------------------------------------------------------------
def _metrics(content: RecordDict) -> dict[str, Any]:
    recs = list(content.metric_records.values())
    return dict(recs[0]) if recs else {}


def _with_metric(content: RecordDict, key: str, value: Any) -> RecordDict:
    out = RecordDict({k: v for k, v in content.items() if k not in content.metric_records})
    out["metrics"] = MetricRecord({**_metrics(content), key: value})
    return out


def _with_arrays(content: RecordDict, fn: Callable[[list[np.ndarray]], list[np.ndarray]],
                 keys: list[str] | None = None) -> RecordDict:
    k, arrays = record_to_arrays(content["arrays"])
    out = RecordDict(dict(content.items()))
    out["arrays"] = arrays_to_record(fn(arrays), keys or k)
    return out


def _raw_array(like: Array, data: bytes) -> Array:
    return Array(dtype=like.dtype, shape=like.shape, stype=like.stype, data=data)


def _nan_at(rng: np.random.Generator, value: float) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
    def fn(arrays: list[np.ndarray]) -> list[np.ndarray]:
        out = [a.copy() for a in arrays]
        j = int(rng.integers(len(out)))
        out[j].flat[int(rng.integers(out[j].size))] = value
        return out
    return fn


METADATA: list[tuple[str, Any, str]] = [
    ("num-examples", float("nan"), "rejected"),
    ("num-examples", float("inf"), "rejected"),
    ("num-examples", float("-inf"), "rejected"),
    ("num-examples", -5, "rejected"),
    ("num-examples", 0, "rejected"),
    ("num-examples", [1, 2], "rejected"),
    ("num-examples", [], "rejected"),
    ("num-examples", 1e308, "capped"),
    ("num-examples", FLT_MAX, "capped"),
    ("num-examples", 1e6, "capped"),
    ("num-examples", 2**62, "capped"),
    ("partition-id", float("nan"), "rejected"),
    ("partition-id", float("inf"), "rejected"),
    ("partition-id", -1, "rejected"),
    ("partition-id", 2**40, "rejected"),
    ("partition-id", 1.5, "rejected"),
    ("partition-id", [1, 2], "rejected"),
    ("partition-id", [0.5], "rejected"),
    ("server-round", -1, "rejected"),
    ("server-round", float("nan"), "rejected"),
    ("server-round", [1], "rejected"),
    ("server-round", 1e300, "rejected"),
    ("train_loss", [1.0, 2.0], "any"),
    ("train_loss", float("nan"), "any"),
    ("train_loss", float("inf"), "any"),
    ("train_loss", 1e308, "any"),
    ("compute_seconds", [1], "any"),
]
"""(metric key, hostile value, expectation); ``server-round`` -1 means "the previous round"."""


def _metadata(rng: np.random.Generator, content: RecordDict, rnd: int) -> Forged:
    key, value, expect = METADATA[int(rng.integers(len(METADATA)))]
    LAST_KIND[0] = f"metadata {key}={value!r}"
    if key == "server-round" and value == -1:
        value = rnd - 1
    return _with_metric(content, key, value), expect


# -- dense (FedAvg) replies --------------------------------------------------------------------
def forge_dense(rng: np.random.Generator, content: RecordDict, rnd: int) -> Forged:
    """One hostile dense train reply (``"arrays"`` + ``"metrics"``)."""
    kind = int(rng.integers(20))
    LAST_KIND[0] = f"dense-{kind}"
    if kind < 6:
        return _metadata(rng, content, rnd)
    if kind == 6:
        return _with_arrays(content, _nan_at(rng, float(rng.choice([np.nan, np.inf, -np.inf])))), "rejected"
    if kind == 7:  # FLT_MAX everywhere (finite, passes every per-reply check but the norm)
        return _with_arrays(content, lambda a: [np.full_like(x, FLT_MAX) for x in a]), "rejected"
    if kind == 8:  # +-FLT_MAX
        return _with_arrays(content, lambda a: [np.where(rng.random(x.shape) < 0.5, FLT_MAX,
                                                         -FLT_MAX).astype(x.dtype) for x in a]), "rejected"
    if kind == 9:  # a norm bomb: finite, moderate per value
        return _with_arrays(content, lambda a: [x + np.float32(1e4) for x in a]), "rejected"
    if kind == 10:  # float64 values that overflow float32 when cast
        return _with_arrays(content, lambda a: [np.full(x.shape, 1e300) for x in a]), "rejected"
    if kind == 11:  # another dtype
        return _with_arrays(content, lambda a: [x.astype(np.int32) for x in a]), "rejected"
    if kind == 12:  # another shape
        return _with_arrays(content, lambda a: [x.reshape(-1) for x in a]), "rejected"
    if kind == 13:  # a tensor missing
        k, arrays = record_to_arrays(content["arrays"])
        out = RecordDict(dict(content.items()))
        out["arrays"] = arrays_to_record(arrays[:-1], k[:-1])
        return out, "rejected"
    if kind == 14:  # truncated / garbage array bytes, a header that claims a huge array
        rec = ArrayRecord(dict(content["arrays"].items()))
        name = next(iter(rec.keys()))
        a = rec[name]
        choice = int(rng.integers(3))
        data = (a.data[: int(rng.integers(len(a.data)))] if choice == 0
                else rng.bytes(len(a.data)) if choice == 1
                else a.data.replace(b"(3, 4)", b"(1099511627776, 4)"))
        rec[name] = _raw_array(a, data)
        out = RecordDict(dict(content.items()))
        out["arrays"] = rec
        return out, "rejected"
    if kind == 15:  # two MetricRecords / two ArrayRecords / nothing
        choice = int(rng.integers(3))
        if choice == 0:
            return RecordDict({**dict(content.items()), "m2": MetricRecord({"num-examples": 1})}), "rejected"
        if choice == 1:
            return RecordDict({**dict(content.items()), "a2": content["arrays"]}), "rejected"
        return RecordDict(), "rejected"
    if kind == 16:
        return None, "rejected"  # an error reply
    if kind == 17:  # a ConfigRecord where the metrics should be
        out = RecordDict({"arrays": content["arrays"],
                          "metrics": ConfigRecord({"num-examples": "many"})})
        return out, "rejected"
    return _metadata(rng, content, rnd)


# -- compressed replies ------------------------------------------------------------------------
def _payload(content: RecordDict) -> bytes:
    return payload_bytes(content[REPLY_KEY])


def _with_payload(content: RecordDict, data: bytes) -> RecordDict:
    out = RecordDict(dict(content.items()))
    out[REPLY_KEY] = payload_record(data)
    return out


def _values(data: bytes, value: float) -> bytes:
    """The payload with every value set to ``value`` (int8 tensors: every scale), re-encoded
    or, where the encoder refuses it, patched into the bytes."""
    p = codec.decode(data)
    out = []
    for t in p.tensors:
        if t.dtype is WireDType.INT8 and t.scales is not None:
            out.append(dataclasses.replace(t, scales=np.full_like(t.scales, FLT_MAX)))
        else:
            out.append(dataclasses.replace(t, values=np.full_like(t.values, value)))
    if all(t.dtype is not WireDType.INT8 for t in p.tensors) or value == FLT_MAX:
        return codec.encode(Payload(tuple(out), p.version))
    b = bytearray(codec.encode(Payload(tuple(out), p.version)))  # int8: NaN / Inf scales
    flt_max = struct.pack("<f", FLT_MAX)
    return bytes(b).replace(flt_max, struct.pack("<f", value))


def _widened(data: bytes) -> bytes | None:
    """The first sparse tensor's indices re-encoded one type wider (non-canonical)."""
    p = codec.decode(data)
    t = p.tensors[0]
    if t.indices is None or data[11] >= 4:
        return None
    code = data[11] + 1
    deltas = np.concatenate([t.indices[:1], np.diff(t.indices)])
    width = {1: 1, 2: 2, 3: 4, 4: 8}[code]
    head = struct.pack("<4sBBI", b"FAGC", 1, 0, 1)
    body = (struct.pack("<BBBBIQ", int(t.dtype), code, len(t.shape), 0, 0, t.nnz)
            + struct.pack(f"<{len(t.shape)}Q", *t.shape) + deltas.astype(f"<u{width}").tobytes()
            + t.values.astype("<f4").tobytes())
    rest = codec.encode(Payload(p.tensors[1:], p.version))[10:]
    return head[:6] + struct.pack("<I", len(p.tensors)) + body + rest


def forge_compressed(rng: np.random.Generator, content: RecordDict, rnd: int) -> Forged:
    """One hostile compressed reply (``"compressed"`` payload + ``"metrics"``)."""
    if REPLY_KEY not in content.array_records:
        return forge_dense(rng, content, rnd)
    data = _payload(content)
    kind = int(rng.integers(18))
    LAST_KIND[0] = f"compressed-{kind}"
    if kind < 4:
        return _metadata(rng, content, rnd)
    if kind == 4:
        return _with_payload(content, data[: int(rng.integers(len(data)))]), "rejected"
    if kind == 5:
        return _with_payload(content, rng.bytes(int(rng.integers(0, 300)))), "rejected"
    if kind == 6:  # another codec version, magic or flags
        b = bytearray(data)
        pos, value = [(4, int(rng.choice([0, 2, 3, 255]))), (0, 0), (5, 1)][int(rng.integers(3))]
        b[pos] = value
        return _with_payload(content, bytes(b)), "rejected"
    if kind == 7:  # random byte flips: may still decode to a valid update
        b = bytearray(data)
        for _ in range(int(rng.integers(1, 5))):
            b[int(rng.integers(len(b)))] = int(rng.integers(256))
        return _with_payload(content, bytes(b)), "any"
    if kind == 8:  # a valid payload of the wrong shapes
        t = TensorPayload((7,), WireDType.FLOAT32, np.ones(7, np.float32))
        return _with_payload(content, codec.encode(Payload((t,)))), "rejected"
    if kind == 9:
        return _with_payload(content, _values(data, float("nan"))), "rejected"
    if kind == 10:
        return _with_payload(content, _values(data, float("inf"))), "rejected"
    if kind == 11:  # FLT_MAX values (finite: refused by the norm-bomb guard) or int8 scales
        return _with_payload(content, _values(data, FLT_MAX)), "rejected"
    if kind == 12:
        return _with_payload(content, data + rng.bytes(int(rng.integers(1, 9)))), "rejected"
    if kind == 13:  # the payload as float32 instead of uint8 bytes
        out = RecordDict(dict(content.items()))
        out[REPLY_KEY] = ArrayRecord({"payload": Array(np.ones(4, np.float32))})
        return out, "rejected"
    if kind == 14:  # a dense model instead of the compressed update
        out = RecordDict({"arrays": ArrayRecord({"w": Array(np.ones((3, 4), np.float32))}),
                          "metrics": content["metrics"]})
        return out, "rejected"
    if kind == 15:
        wide = _widened(data)
        if wide is not None:
            return _with_payload(content, wide), "rejected"
        return _with_payload(content, data[:-1]), "rejected"
    if kind == 16:
        return None, "rejected"
    return _metadata(rng, content, rnd)


# -- secure-aggregation protocol messages ------------------------------------------------------
P25519 = 2**255 - 19
LOW_ORDER = [u.to_bytes(32, "little") for u in (
    0, 1, 325606250916557431795983626356110631294008115727848805560023387167927233504,
    39382357235489614581723060781553021112529911719440698176882885853963445705823,
    P25519 - 1, P25519, P25519 + 1)]
KEY_FIELDS = ("c_public", "s_public", "next_s_public")
CT_FIELDS = ("ciphertexts", "b_ciphertexts", "next_ciphertexts")
SHARE_FIELDS = ("b_shares", "s_shares")
ID_FIELDS = ("roster", "neighbours", "recipients", "b_recipients", "next_recipients",
             "b_owners", "s_owners")


def _secagg(content: RecordDict) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The reply's protocol fields; the masked vector and share rows as uint32 arrays to forge
    on (bytes records since wire version 3, unless the masked vector is over INLINE_BYTES)."""
    cfg = dict(content.config_records[CONFIG_KEY])
    rec = content.array_records.get(ARRAYS_KEY)
    arrs = {k: v.numpy() for k, v in rec.items()} if rec is not None else {}
    for key in ("masked", *SHARE_FIELDS):
        if isinstance(cfg.get(key), bytes):
            words = np.frombuffer(cfg.pop(key), "<u4").astype(np.uint32)
            arrs[key] = words.reshape(-1, shamir.NUM_LIMBS) if key != "masked" else words
    return cfg, arrs


def _pack(cfg: dict[str, Any], arrs: dict[str, np.ndarray]) -> RecordDict:
    """Back into records as an honest site encodes them: uint32 share rows, and a uint32 masked
    vector up to INLINE_BYTES, as bytes records; anything else (a larger vector, or another
    dtype, as a hostile site may send it) as an array."""
    cfg = dict(cfg)
    arrays = {}
    for k, v in arrs.items():
        inline = k in SHARE_FIELDS or (k == "masked" and v.nbytes <= INLINE_BYTES)
        if inline and v.dtype == np.uint32:
            cfg[k] = np.ascontiguousarray(v, "<u4").tobytes()
        else:
            arrays[k] = Array(np.ascontiguousarray(v))
    out = RecordDict({CONFIG_KEY: ConfigRecord(cfg)})
    if arrays:
        out[ARRAYS_KEY] = ArrayRecord(arrays)
    return out


HOSTILE_SCALARS: list[Any] = [-1, 2**62, 3, 0, 1.5, float("nan"), "2", b"\x02", [2, 2], True]


def forge_secure(rng: np.random.Generator, content: RecordDict, rnd: int) -> Forged:
    """One hostile secure-aggregation reply (advertise, share-keys, upload or unmask)."""
    if CONFIG_KEY not in content.config_records:
        return None, "rejected"
    cfg, arrs = _secagg(content)
    kind = int(rng.integers(17))
    LAST_KIND[0] = f"secure-{kind}"
    if kind == 0:  # the wire version: another number, a float, a string, a list
        cfg["secagg_version"] = HOSTILE_SCALARS[int(rng.integers(len(HOSTILE_SCALARS)))]
        if cfg["secagg_version"] == 2:  # True == 1; 2 never drawn, but be explicit
            cfg["secagg_version"] = 3
        return _pack(cfg, arrs), "rejected"
    if kind == 1:
        cfg["secagg_type"] = int(rng.integers(0, 100)) + 1000
        return _pack(cfg, arrs), "rejected"
    if kind == 2:  # in another site's name, or an impossible index
        cfg["site"] = int(cfg["site"]) + int(rng.choice([1, -1, 2**40]))
        return _pack(cfg, arrs), "rejected"
    if kind == 3:  # another epoch / round
        field = "round" if "round" in cfg else "epoch"
        cfg[field] = int(cfg[field]) + int(rng.choice([1, -1, 1000]))
        return _pack(cfg, arrs), "rejected"
    if kind == 4:  # any int field -> a hostile scalar
        ints = [k for k, v in cfg.items() if isinstance(v, int) and k not in ("secagg_version",)]
        key = ints[int(rng.integers(len(ints)))]
        value = HOSTILE_SCALARS[int(rng.integers(len(HOSTILE_SCALARS)))]
        if value == cfg[key] or value in (0, 3):
            value = float("nan")
        cfg[key] = value
        return _pack(cfg, arrs), "rejected"
    if kind == 5 and "masked" in arrs:  # the masked words as for another ring width
        m = arrs["masked"]
        arrs["masked"] = (np.concatenate([m, m[: max(1, m.size // 3)]]) if rng.random() < 0.5
                          else m[: max(0, m.size - 1 - int(rng.integers(m.size)))])
        return _pack(cfg, arrs), "rejected"
    if kind == 6 and "masked" in arrs:  # masked words of another dtype / with NaN
        arrs["masked"] = np.full(arrs["masked"].shape, np.nan, np.float32)
        return _pack(cfg, arrs), "rejected"
    if kind == 7 and "masked" in arrs:  # garbled words of the right length: parse, then?
        arrs["masked"] = rng.integers(0, 2**32, arrs["masked"].shape, dtype=np.uint64).astype(np.uint32)
        return _pack(cfg, arrs), "any"
    shares = [k for k in SHARE_FIELDS if k in arrs and arrs[k].size]
    if kind == 8 and shares:  # Shamir share limbs >= p
        key = shares[int(rng.integers(len(shares)))]
        bad = arrs[key].copy()
        bad.flat[int(rng.integers(bad.size))] = shamir.PRIME + int(rng.integers(0, 2**31 - 2))
        arrs[key] = bad
        return _pack(cfg, arrs), "rejected"
    if kind == 9 and shares:  # wrong share values (< p): decoded around, or the round fails
        key = shares[int(rng.integers(len(shares)))]
        arrs[key] = (arrs[key].astype(np.int64) + 12345) % shamir.PRIME
        arrs[key] = arrs[key].astype(np.uint32)
        return _pack(cfg, arrs), "any"
    cts = [k for k in CT_FIELDS if k in cfg and isinstance(cfg[k], bytes) and cfg[k]]
    if kind == 10 and cts:  # garbage ciphertexts of the right length
        key = cts[int(rng.integers(len(cts)))]
        cfg[key] = rng.bytes(len(cfg[key]))
        return _pack(cfg, arrs), "any"
    if kind == 11 and cts:  # ciphertexts of the wrong length
        key = cts[int(rng.integers(len(cts)))]
        cfg[key] = cfg[key][:-1] if rng.random() < 0.5 else cfg[key] + b"\x00"
        return _pack(cfg, arrs), "rejected"
    keys = [k for k in KEY_FIELDS if k in cfg]
    if kind == 12 and keys:  # low-order / non-canonical X25519 public keys
        cfg[keys[int(rng.integers(len(keys)))]] = LOW_ORDER[int(rng.integers(len(LOW_ORDER)))]
        return _pack(cfg, arrs), "rejected"
    if kind == 13:  # a float, a string or a list where ints and bytes belong
        key = sorted(cfg)[int(rng.integers(len(cfg)))]
        cfg[key] = [float("nan"), "x", [1.0, 2.0], 1e308][int(rng.integers(4))]
        return _pack(cfg, arrs), "rejected"
    if kind == 14:  # records missing, or an array whose header claims terabytes
        original = content.array_records.get(ARRAYS_KEY)
        if rng.random() < 0.5 or original is None or not len(original):
            if original is not None and len(original) and rng.random() < 0.5:
                return RecordDict({ARRAYS_KEY: original}), "rejected"  # no protocol fields
            return RecordDict(), "rejected"
        rec = ArrayRecord(dict(original.items()))
        name = sorted(rec.keys())[0]
        a = rec[name]
        rec[name] = _raw_array(a, a.data[:-1] if len(a.data) > 1 else b"\x93NUMPY")
        honest = dict(content.config_records[CONFIG_KEY])
        return RecordDict({CONFIG_KEY: ConfigRecord(honest), ARRAYS_KEY: rec}), "rejected"
    ids = [k for k in ID_FIELDS if isinstance(cfg.get(k), bytes) and cfg[k]]
    if kind == 15 and ids:  # id-list records: cut mid-record, an id >= 2^31 - 2, a duplicate
        key = ids[int(rng.integers(len(ids)))]
        words = np.frombuffer(cfg[key], "<u4").copy()
        how = int(rng.integers(3))
        if how == 0:
            cfg[key] = cfg[key][:-1 - int(rng.integers(3))]
        elif how == 1:
            words[int(rng.integers(words.size))] = 2**31 - 2 + int(rng.integers(2**31 + 2))
            cfg[key] = words.tobytes()
        elif words.size > 1:
            words[0] = words[-1]
            cfg[key] = words.tobytes()
        else:
            cfg[key] = words.tobytes() * 2
        return _pack(cfg, arrs), "rejected"
    return None, "rejected"  # an error reply


# -- the grid -------------------------------------------------------------------------------------
FORGERS = {"dense": forge_dense, "compressed": forge_compressed, "secure": forge_secure}


@dataclasses.dataclass
class Forgery:
    """One forged reply, as the fuzz test checks it."""

    round: int
    node: int
    stage: str
    kind: str
    expect: str


class HostileGrid(InProcessGrid):
    """InProcessGrid whose replies are forged with probability ``rate`` (see module doc).

    Parameters
    ----------
    client_app : ClientApp
        The sites' app (:func:`fast_app`).
    num_nodes : int
        Sites.
    family : {"dense", "compressed", "secure"}
        Which replies to forge.
    rate : float
        Probability that a hostile site forges one of its replies.
    seed : int
        Seed of the forgeries, of the hostile set and of the node ids.
    hostile : int, optional
        Number of hostile sites (default: fewer than half, ``(num_nodes - 1) // 2``).
    wire : bool
        Also round-trip the honest traffic through Flower's serialisation (forged replies
        always are: a forgery Flower cannot ship is never sent).
    """

    def __init__(self, client_app: ClientApp, num_nodes: int, *, family: str, rate: float,
                 seed: int, hostile: int | None = None, wire: bool = False) -> None:
        super().__init__(client_app, num_nodes, seed=seed, wire=wire)
        self.forge = FORGERS[family]
        self.family = family
        self.rate = rate
        self.rng = np.random.default_rng(seed)
        count = hostile if hostile is not None else (num_nodes - 1) // 2
        self.hostile = {int(n) for n in self.rng.choice(self.node_ids, size=count, replace=False)}
        self.forged: list[Forgery] = []

    def _deliver(self, msg: Message) -> Message | None:
        reply = super()._deliver(msg)
        if (reply is None or msg.metadata.dst_node_id not in self.hostile
                or self.rng.random() >= self.rate):
            return reply
        content = msg.content
        rnd = int(content.config_records["config"].get("server-round", 0)) \
            if "config" in content.config_records else 0
        stage = (str(content.config_records[PARAMS_KEY].get("stage"))
                 if PARAMS_KEY in content.config_records else "train")
        if reply.has_error():
            return reply
        forged, expect = self.forge(self.rng, reply.content, rnd)
        if forged is None:
            out = Message(Error(code=0, reason="hostile site: error reply"), reply_to=msg)
            out.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        else:
            out = Message(content=forged, metadata=reply.metadata)  # type: ignore[call-overload]
            try:
                out, _ = wire_roundtrip(out)  # what Flower would ship, or nothing
            except Exception:
                return reply  # not sendable through Flower: the site sends its real reply
        self.forged.append(Forgery(rnd, msg.metadata.dst_node_id, stage, LAST_KIND[0], expect))
        return out
