"""What a site remembers of the secure-aggregation protocol between messages, and its saved form.

:class:`SiteMemory` is the state one :class:`~fedagg.secagg.client.ClientState` keeps: the
stage, run, epoch, round and key generation, its two secret keys, the epoch's roster and
neighbour graph with the neighbours' public keys, and what it must never do twice -- the
shares it has revealed this round, the neighbour keys it has helped rebuild, and per run the
newest key generation of every neighbour it has seen used. The site's checks
(:mod:`fedagg.secagg.client_checks`) read it; the protocol handlers change it.

:meth:`SiteMemory.state_dict` is a plain ``str -> int | bytes | ndarray`` record (it holds the
site's secret keys: keep it local, e.g. in Flower's ``Context.state``), versioned: version 2
adds the per-run key-generation floor of every neighbour; a version-1 record loads with no
memory of it. A foreign or malformed record raises :class:`~fedagg.errors.ProtocolError`.

Protocol: Bonawitz et al., CCS 2017 (double masking, section 4) on the neighbour graph of
Bell et al., CCS 2020 (SecAgg+).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedagg.errors import ProtocolError, explain
from fedagg.secagg.keys import SecretKey, split_keys
from fedagg.secagg.messages import MessageDict
from fedagg.secagg.stages import ClientStage

__all__ = ["STATE_VERSION", "SiteMemory"]

STATE_VERSION = 2
"""Version of :meth:`SiteMemory.state_dict` (2: the per-run key-generation floor)."""


@dataclass
class SiteMemory:
    """One site's protocol state (see the module docstring); secrets never in its ``repr``.

    Attributes
    ----------
    site : int
        The site's id.
    run_id : bytes
        The protocol run (the server's; a new run resets everything, the floor included).
    stage : ClientStage
        Where the site is in the protocol.
    epoch, round, gen : int
        Key-setup epoch, last round uploaded, generation of the current mask key.
    c, s : SecretKey or None
        The epoch's share-encryption key and the current mask key.
    roster, neighbours : tuple of int
        The epoch's sites and this site's neighbours in the graph.
    neighbour_c : dict of int to bytes
        The neighbours' share-encryption public keys.
    round_gens : dict of int to int
        Key generation of each neighbour in the last round uploaded.
    revealed_b, revealed_s : set of int
        Sites whose self-mask / mask-key share this site revealed in that round.
    revealed_keys : set of (int, int)
        ``(neighbour, generation)`` mask keys this site helped rebuild (in this epoch).
    gen_floor : dict of int to (int, int)
        Per run: ``neighbour -> (epoch, generation)`` of its newest mask key seen used.
    """

    site: int
    run_id: bytes = b""
    stage: ClientStage = ClientStage.NEW
    epoch: int = 0
    round: int = 0
    gen: int = 0
    c: SecretKey | None = field(default=None, repr=False)
    s: SecretKey | None = field(default=None, repr=False)
    roster: tuple[int, ...] = ()
    neighbours: tuple[int, ...] = ()
    neighbour_c: dict[int, bytes] = field(default_factory=dict, repr=False)
    round_gens: dict[int, int] = field(default_factory=dict, repr=False)
    revealed_b: set[int] = field(default_factory=set, repr=False)
    revealed_s: set[int] = field(default_factory=set, repr=False)
    revealed_keys: set[tuple[int, int]] = field(default_factory=set, repr=False)
    gen_floor: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)

    def reset(self, run_id: bytes, epoch: int) -> None:
        """A new epoch (of this run, or of a new one: then the floor is forgotten too)."""
        if run_id != self.run_id:
            # kept across epochs of one run (sites keep their index for the run)
            self.gen_floor = {}
        self.run_id, self.epoch = run_id, epoch
        self.stage = ClientStage.NEW
        self.round = self.gen = 0
        self.c = self.s = None
        self.roster = self.neighbours = ()
        self.neighbour_c, self.round_gens = {}, {}
        self.revealed_b, self.revealed_s, self.revealed_keys = set(), set(), set()

    def key(self, which: str) -> SecretKey:
        """The ``"c"`` (share encryption) or ``"s"`` (mask) secret key of this stage."""
        key = self.c if which == "c" else self.s
        if key is None:  # unreachable when the stage checks pass
            raise ProtocolError("no key material in this stage")
        return key

    # -- saved form ------------------------------------------------------------------------
    def state_dict(self) -> MessageDict:
        """The plain record of this memory (holds secret keys: keep it local)."""
        nbr_c = b"".join(self.neighbour_c[j] for j in self.neighbours)
        gens = np.array([[j, g] for j, g in sorted(self.round_gens.items())], np.int64)
        keys = np.array(sorted(self.revealed_keys), np.int64)
        floor = np.array([[j, e, g] for j, (e, g) in sorted(self.gen_floor.items())], np.int64)
        return {
            "version": STATE_VERSION,
            "site": self.site,
            "stage": int(self.stage),
            "run_id": self.run_id,
            "epoch": self.epoch,
            "round": self.round,
            "gen": self.gen,
            "c_secret": self.c.secret_bytes() if self.c else b"",
            "s_secret": self.s.secret_bytes() if self.s else b"",
            "roster": np.array(self.roster, np.int64),
            "neighbours": np.array(self.neighbours, np.int64),
            "neighbour_c_public": nbr_c,
            "round_gens": gens.reshape(-1),
            "revealed_b": np.array(sorted(self.revealed_b), np.int64),
            "revealed_s": np.array(sorted(self.revealed_s), np.int64),
            "revealed_keys": keys.reshape(-1),
            "gen_floor": floor.reshape(-1),
        }

    def load_state_dict(self, state: MessageDict) -> None:
        """Restore from :meth:`state_dict`; ProtocolError on a foreign or malformed record
        (nothing is changed then)."""
        try:
            version = _int(state, "version")
            if version not in (1, STATE_VERSION) or _int(state, "site") != self.site:
                raise ProtocolError(explain("state", "site/version", "belongs elsewhere", "-"))
            new = SiteMemory(self.site, run_id=_bytes(state, "run_id"))
            new.reset(new.run_id, _int(state, "epoch"))
            new.stage = ClientStage(_int(state, "stage"))
            new.round = _int(state, "round")
            new.gen = _int(state, "gen")
            c_raw, s_raw = _bytes(state, "c_secret"), _bytes(state, "s_secret")
            new.c = SecretKey(c_raw) if c_raw else None
            new.s = SecretKey(s_raw) if s_raw else None
            new.roster = _ids(state["roster"])
            new.neighbours = _ids(state["neighbours"])
            keys = split_keys(
                _bytes(state, "neighbour_c_public"), len(new.neighbours), "neighbour_c_public"
            )
            new.neighbour_c = dict(zip(new.neighbours, keys, strict=True))
            gens = _ids(state["round_gens"])
            new.round_gens = dict(zip(gens[::2], gens[1::2], strict=True))
            new.revealed_b = set(_ids(state["revealed_b"]))
            new.revealed_s = set(_ids(state["revealed_s"]))
            pairs = _ids(state["revealed_keys"])
            new.revealed_keys = set(zip(pairs[::2], pairs[1::2], strict=True))
            # version 1 (before the floor existed): start with no memory
            floor = _ids(state["gen_floor"]) if version >= 2 else ()
            new.gen_floor = {
                j: (e, g) for j, e, g in zip(floor[::3], floor[1::3], floor[2::3], strict=True)
            }
        except (KeyError, TypeError, ValueError) as err:
            raise ProtocolError(
                explain("state", type(err).__name__, "malformed state", "-")
            ) from None
        self.__dict__.update(new.__dict__)


def _ids(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in np.asarray(values, dtype=np.int64).reshape(-1))


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
