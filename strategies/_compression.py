"""Compressed updates on Flower records: what the server's strategy and the site's mod share.

The compressed strategy (:mod:`strategies.compressed`) and the client mod
(:mod:`clients.mods`) speak through three records:

* in the train message, a ConfigRecord :data:`INSTRUCTION_KEY` (:class:`Instruction`): the
  effective upward spec, the downward codec and which arrays it encoded, the public seed and
  round, the round of the previous global model (for ``topk-aggregate`` supports) and a
  state namespace. The mod acts only when it is present, so the server decides the protocol;
* optionally, an ArrayRecord :data:`PREVIOUS_KEY` with the previous round's global model as
  sent, for a site that did not reply in that round (so it can derive the public aggregate);
* in the reply, an ArrayRecord :data:`REPLY_KEY` holding one uint8 array :data:`PAYLOAD_KEY`
  (the :func:`fedagg.compression.codec.encode` bytes) next to the usual MetricRecord — and no
  dense arrays.

Shared supports (``support`` = ``random`` / ``block`` / ``topk-aggregate``) are computed on both
sides from public data only: :func:`public_seed` of the run seed, the round, and for
``topk-aggregate`` the previous public aggregate ``global_t - global_{t-1}`` (both as sent
downward). The secure-aggregation strategy reuses these helpers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord

from fedagg.compression import (
    Compressor,
    bf16_bits_to_float32,
    build_compressor,
    find_shared_support,
    float32_to_bf16_bits,
)
from fedagg.errors import CodecError, ConfigError, ProtocolError, explain

__all__ = [
    "INSTRUCTION_KEY",
    "PAYLOAD_KEY",
    "PREVIOUS_KEY",
    "REPLY_KEY",
    "REVEALING_SUPPORTS",
    "Instruction",
    "decode_down",
    "effective_spec",
    "encode_down",
    "flat_difference",
    "payload_bytes",
    "payload_record",
    "public_seed",
    "round_compressor",
    "shared_support",
    "stage_names",
]

INSTRUCTION_KEY = "fedagg.compression"
"""ConfigRecord key of the server's compression instruction in a train message."""
PREVIOUS_KEY = "fedagg.previous-global"
"""ArrayRecord key of the previous global model (as sent), only for sites that lack it."""
REPLY_KEY = "compressed"
"""ArrayRecord key of the compressed update in a reply."""
PAYLOAD_KEY = "payload"
"""Array key (uint8) of the encoded payload inside :data:`REPLY_KEY`."""

REVEALING_SUPPORTS = ("reveal-indices", "own")
"""``compression.support`` values that let each site choose its own positions (revealed to the
server); ``"reveal-indices"`` is the explicit name (DESIGN.md: index-revealing modes say so in
their config name), ``"own"`` its older alias."""
_SUPPORT_STAGES = {"random": "shared", "block": "block", "topk-aggregate": "aggtopk"}
_OWN_INDEX = ("topk", "randk")
_SHARED = ("shared", "block", "aggtopk")


def public_seed(run_seed: int) -> bytes:
    """The public seed of shared supports, derived from ``run.seed`` (known to every party)."""
    return f"fedagg/run-seed/{int(run_seed)}".encode()


def stage_names(spec: str) -> list[str]:
    """The normalized stage names of a spec, in order (``"topk:0.01+ef"`` -> topk, ef)."""
    return [name for name, _ in _stages(spec)]


def _stages(spec: str) -> list[tuple[str, str]]:
    out = []
    for part in spec.split("+"):
        name, _, rest = part.strip().partition(":")
        out.append((name.strip().lower().replace("_", "-"), rest))
    return out


def _amount_args(rest: str) -> str:
    """Keep only the amount of a stage's arguments (ratio, k); drop mode words and options."""
    keep = []
    for raw in rest.split(","):
        item = raw.strip()
        key = item.partition("=")[0].strip().lower()
        amount = key in ("ratio", "k") if "=" in item else bool(item) and not item.isalpha()
        if amount:
            keep.append(item)
    return ",".join(keep)


def effective_spec(up: str, support: str) -> str:
    """The upward spec the sites run, given ``compression.up`` and ``compression.support``.

    ``support = "reveal-indices"`` (or its older alias ``"own"``) keeps the spec: own-index
    sparsifiers then send each site's own positions, which the server sees. Otherwise an
    own-index sparsifier (``topk``, ``randk``) is replaced by the public-support stage of the
    same amount: ``random`` -> ``shared``, ``block`` -> ``block``, ``topk-aggregate`` ->
    ``aggtopk``. Dense specs (``none``, ``bf16``, ``int8``, ...) are unchanged.

    Raises
    ------
    ConfigError
        If the spec already names a different public-support stage than ``support``.

    Examples
    --------
    >>> effective_spec("topk:0.01,global+ef+int8", "topk-aggregate")
    'aggtopk:0.01+ef+int8'
    """
    if support in REVEALING_SUPPORTS:
        return up
    if support not in _SUPPORT_STAGES:
        raise ConfigError(explain("compression.support", support,
                                  "must be one of reveal-indices (alias own), random, block, "
                                  "topk-aggregate",
                                  "choose one of the listed supports"))
    target = _SUPPORT_STAGES[support]
    parts = up.split("+")
    for i, (name, rest) in enumerate(_stages(up)):
        if name in _OWN_INDEX:
            parts[i] = f"{target}:{_amount_args(rest)}"
            return "+".join(p.strip() for p in parts)
        if name in _SHARED and name != target:
            raise ConfigError(explain("compression.up", up,
                                      f"stage {name!r} contradicts compression.support={support!r}",
                                      f"write the amount as 'topk:<ratio>' and let support pick "
                                      f"{target!r}, or set compression.support='reveal-indices'"))
    return up


def _first_round_spec(spec: str) -> str:
    """``aggtopk`` needs a previous aggregate; without one it falls back to ``shared``."""
    parts = spec.split("+")
    for i, (name, rest) in enumerate(_stages(spec)):
        if name == "aggtopk":
            parts[i] = f"shared:{_amount_args(rest)}"
    return "+".join(p.strip() for p in parts)


def round_compressor(spec: str, *, run_seed: int, server_round: int,
                     previous_aggregate: np.ndarray | None) -> Compressor:
    """The compressor of ``server_round`` (same on the site and the server).

    ``aggtopk`` stages use the previous public aggregate; when there is none (first round) they
    fall back to ``shared`` (a seeded random support) of the same amount.
    """
    if previous_aggregate is None:
        spec = _first_round_spec(spec)
    return build_compressor(spec, seed=public_seed(run_seed), round=int(server_round),
                            previous_aggregate=previous_aggregate)


def shared_support(spec: str, *, run_seed: int, server_round: int,
                   previous_aggregate: np.ndarray | None, numel: int) -> np.ndarray | None:
    """The public flat support of ``server_round`` (``None`` for own-index or dense specs)."""
    stage = find_shared_support(round_compressor(spec, run_seed=run_seed,
                                                 server_round=server_round,
                                                 previous_aggregate=previous_aggregate))
    return None if stage is None else stage.support_for(numel)


def flat_difference(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> np.ndarray:
    """``concat(a) - concat(b)`` in float32 (the public aggregate of one round)."""
    out: np.ndarray = (np.concatenate([np.asarray(x, np.float32).ravel() for x in a])
                       - np.concatenate([np.asarray(x, np.float32).ravel() for x in b]))
    return out.astype(np.float32)


# -- downward ---------------------------------------------------------------------------------
def encode_down(arrays: Sequence[np.ndarray], down: str) -> tuple[list[np.ndarray], list[int]]:
    """Encode the float32 arrays of the global model for the downward message.

    ``fp16``: float16 (saturating at +-65504); ``bf16``: bfloat16 bit patterns as uint16
    (an ArrayRecord cannot carry bfloat16). Other dtypes are sent unchanged.

    Returns
    -------
    (arrays, encoded)
        The arrays to send and the indices of the ones that were encoded.
    """
    if down == "none":
        return list(arrays), []
    out: list[np.ndarray] = []
    encoded: list[int] = []
    for i, a in enumerate(arrays):
        if a.dtype != np.float32:
            out.append(a)
            continue
        if down == "fp16":
            out.append(np.clip(a, -65504.0, 65504.0).astype(np.float16))
        elif down == "bf16":
            out.append(float32_to_bf16_bits(a).reshape(a.shape))
        else:
            raise ConfigError(explain("compression.down", down, "must be none, fp16 or bf16",
                                      "choose one of the listed codecs"))
        encoded.append(i)
    return out, encoded


def decode_down(arrays: Sequence[np.ndarray], down: str, encoded: Sequence[int]) -> list[np.ndarray]:
    """Inverse of :func:`encode_down`: the encoded arrays back to float32 (exact widening)."""
    want = {"fp16": np.float16, "bf16": np.uint16}.get(down)
    out = list(arrays)
    for i in encoded:
        if want is None or not 0 <= i < len(out) or out[i].dtype != want:
            raise ProtocolError(explain(f"downward array {i}", getattr(out[i], "dtype", None)
                                        if 0 <= i < len(out) else "missing",
                                        f"must be {down}-encoded as the instruction says",
                                        "server and site must run the same fedagg version"))
        a = out[i]
        out[i] = (a.astype(np.float32) if down == "fp16"
                  else bf16_bits_to_float32(a).reshape(a.shape))
    return out


# -- the instruction ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Instruction:
    """What the server asks a site to do with its update in one round.

    Attributes
    ----------
    up : str
        Effective upward spec (after :func:`effective_spec`).
    down : str
        Downward codec of the global model: ``none``, ``fp16`` or ``bf16``.
    down_encoded : list of int
        Indices of the arrays that were encoded downward.
    run_seed : int
        ``run.seed``, from which :func:`public_seed` is derived.
    server_round : int
        The round.
    previous_round : int
        Round of the previous global model the server sent (``-1``: none, first round).
    namespace : str
        Suffix of the site's ``Context.state`` keys (several strategies in one run).
    """

    up: str
    down: str = "none"
    down_encoded: list[int] = field(default_factory=list)
    run_seed: int = 0
    server_round: int = 0
    previous_round: int = -1
    namespace: str = ""

    def to_record(self) -> ConfigRecord:
        """As a ConfigRecord."""
        return ConfigRecord({"up": self.up, "down": self.down,
                             "down-encoded": [int(i) for i in self.down_encoded],
                             "run-seed": int(self.run_seed), "server-round": int(self.server_round),
                             "previous-round": int(self.previous_round),
                             "namespace": self.namespace})

    @classmethod
    def from_record(cls, rec: ConfigRecord) -> Instruction:
        """Parse and check a ConfigRecord written by :meth:`to_record`.

        Raises
        ------
        ProtocolError
            A missing or mistyped field.
        """
        def get(key: str, typ: type | tuple[type, ...]) -> Any:
            value = rec.get(key)
            if not isinstance(value, typ) or isinstance(value, bool):
                raise ProtocolError(explain(f"{INSTRUCTION_KEY}.{key}", value,
                                            f"must be a {typ}", "server and site must run the "
                                            "same fedagg version"))
            return value

        enc = rec.get("down-encoded", [])
        if not isinstance(enc, list) or not all(isinstance(i, int) for i in enc):
            raise ProtocolError(explain(f"{INSTRUCTION_KEY}.down-encoded", enc,
                                        "must be a list of ints", "upgrade fedagg"))
        return cls(up=get("up", str), down=get("down", str), down_encoded=[int(e) for e in enc],
                   run_seed=get("run-seed", int), server_round=get("server-round", int),
                   previous_round=get("previous-round", int), namespace=get("namespace", str))


# -- reply payload --------------------------------------------------------------------------
def payload_record(data: bytes) -> ArrayRecord:
    """Encoded payload bytes -> the reply's ArrayRecord (one uint8 array)."""
    return ArrayRecord({PAYLOAD_KEY: Array(np.frombuffer(data, dtype=np.uint8).copy())})


def payload_bytes(record: ArrayRecord) -> bytes:
    """The reply's ArrayRecord -> encoded payload bytes.

    Raises
    ------
    CodecError
        If the record does not hold exactly one 1-D uint8 array under :data:`PAYLOAD_KEY`.
    """
    keys = list(record.keys())
    if keys != [PAYLOAD_KEY]:
        raise CodecError(explain(f"{REPLY_KEY}.keys", keys[:5], f"must be [{PAYLOAD_KEY!r}]",
                                 "reply with the compression mod's record only"))
    arr = record[PAYLOAD_KEY]
    if arr.dtype != "uint8" or len(arr.shape) != 1:
        raise CodecError(explain(f"{REPLY_KEY}.{PAYLOAD_KEY}", f"{arr.dtype}{arr.shape}",
                                 "must be a 1-D uint8 array", "send codec.encode() bytes"))
    try:
        data = arr.numpy()
    except Exception as exc:  # malformed array bytes inside the record
        raise CodecError(f"{REPLY_KEY}.{PAYLOAD_KEY} could not be read: {exc}") from None
    return bytes(np.ascontiguousarray(data, dtype=np.uint8).tobytes())
