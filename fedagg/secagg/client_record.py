"""A site's saved secure-aggregation state: :meth:`ClientState.state_dict` and back.

A plain ``str -> int | bytes | ndarray`` record (it holds the site's secret keys: keep it
local, e.g. in Flower's ``Context.state``), versioned: version 2 adds the per-run key-generation
floor of every neighbour; a version-1 record loads with no memory of it. A foreign or malformed
record raises :class:`~fedagg.errors.ProtocolError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from fedagg.errors import ProtocolError, explain
from fedagg.secagg.client_checks import _split_keys
from fedagg.secagg.keys import SecretKey
from fedagg.secagg.messages import MessageDict
from fedagg.secagg.stages import ClientStage

if TYPE_CHECKING:
    from fedagg.secagg.client import ClientState

__all__ = ["dump_state", "load_state"]

_STATE_VERSION = 2  # 2: the per-run key-generation floor of every neighbour


def _ids(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in np.asarray(values, dtype=np.int64).reshape(-1))


def dump_state(client: ClientState) -> MessageDict:
    """:meth:`ClientState.state_dict` of ``client``."""
    nbr_c = b"".join(client._neighbour_c[j] for j in client.neighbours)
    gens = np.array([[j, g] for j, g in sorted(client._round_gens.items())], np.int64)
    keys = np.array(sorted(client._revealed_keys), np.int64)
    floor = np.array([[j, e, g] for j, (e, g) in sorted(client._gen_floor.items())], np.int64)
    return {
        "version": _STATE_VERSION,
        "site": client.site,
        "stage": int(client.stage),
        "run_id": client.run_id,
        "epoch": client.epoch,
        "round": client.round,
        "gen": client.gen,
        "c_secret": client._c.secret_bytes() if client._c else b"",
        "s_secret": client._s.secret_bytes() if client._s else b"",
        "roster": np.array(client.roster, np.int64),
        "neighbours": np.array(client.neighbours, np.int64),
        "neighbour_c_public": nbr_c,
        "round_gens": gens.reshape(-1),
        "revealed_b": np.array(sorted(client._revealed_b), np.int64),
        "revealed_s": np.array(sorted(client._revealed_s), np.int64),
        "revealed_keys": keys.reshape(-1),
        "gen_floor": floor.reshape(-1),
    }


def load_state(client: ClientState, state: MessageDict) -> None:
    """:meth:`ClientState.load_state_dict`: restore ``client`` from ``state``."""
    try:
        version = _int(state, "version")
        if version not in (1, _STATE_VERSION) or _int(state, "site") != client.site:
            raise ProtocolError(explain("state", "site/version", "belongs elsewhere", "-"))
        client.run_id = _bytes(state, "run_id")
        client._reset(client.run_id, _int(state, "epoch"))
        client.stage = ClientStage(_int(state, "stage"))
        client.round = _int(state, "round")
        client.gen = _int(state, "gen")
        c_raw, s_raw = _bytes(state, "c_secret"), _bytes(state, "s_secret")
        client._c = SecretKey(c_raw) if c_raw else None
        client._s = SecretKey(s_raw) if s_raw else None
        client.roster = _ids(state["roster"])
        client.neighbours = _ids(state["neighbours"])
        keys = _split_keys(
            _bytes(state, "neighbour_c_public"), len(client.neighbours), "neighbour_c_public"
        )
        client._neighbour_c = dict(zip(client.neighbours, keys, strict=True))
        gens = _ids(state["round_gens"])
        client._round_gens = dict(zip(gens[::2], gens[1::2], strict=True))
        client._revealed_b = set(_ids(state["revealed_b"]))
        client._revealed_s = set(_ids(state["revealed_s"]))
        pairs = _ids(state["revealed_keys"])
        client._revealed_keys = set(zip(pairs[::2], pairs[1::2], strict=True))
        # version 1 (before the floor existed): start with no memory
        floor = _ids(state["gen_floor"]) if version >= 2 else ()
        client._gen_floor = {
            j: (e, g) for j, e, g in zip(floor[::3], floor[1::3], floor[2::3], strict=True)
        }
    except (KeyError, TypeError, ValueError) as err:
        raise ProtocolError(
            explain("state", type(err).__name__, "malformed state", "-")
        ) from None


def _int(state: MessageDict, key: str) -> int:
    value = state[key]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(key)
    return int(value)


def _bytes(state: MessageDict, key: str) -> bytes:
    value = state[key]
    if not isinstance(value, bytes):
        raise TypeError(key)
    return value
