"""Keying the sites: the membership epochs of the secure strategy, and the sites it blames.

Methods of :class:`strategies.secure.SecureAggregation`, defined here and bound in its class
body (``SecureAggregation._setup = _setup``, ...), so they are called and overridden as
before:

* ``_setup`` — the two key-setup exchanges (advertise, share keys) of a new epoch;
* ``_params_for_roster`` / ``_roster_fits`` — the threshold ``t`` resolved for the roster an
  epoch is keyed over (every site refuses a ``t`` below its floor, docs/protocols/secagg.md
  section 4), and whether such an epoch can serve rounds of the sampled size;
* ``_ensure_server`` / ``_open_round`` — the core's :class:`fedagg.secagg.ServerState`, and
  opening a round: re-key when needed, once more over exactly the sampled sites when some
  participant has fewer than ``t`` neighbours among them;
* ``_excluded_nodes`` / ``_name_blamed`` — the sites whose own relayed shares made a round
  abort: left out of later epochs (``secagg.exclude_blamed``) and named in the round's
  ``rejected``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from flwr.app import ConfigRecord
from flwr.serverapp import Grid

from fedagg.errors import AbortRound, ConfigError
from fedagg.secagg import KeyAdvertise, ServerState, ShareKeys
from strategies.secure_params import resolve_params

if TYPE_CHECKING:
    from strategies.secure import SecureAggregation

__all__: list[str] = []  # SecureAggregation's methods (bound in strategies.secure)

_log = logging.getLogger("strategies.secure")  # the name these records had before the split


def _setup(self: SecureAggregation, nodes: Sequence[int], config: ConfigRecord, group: str) -> None:
    assert self.server is not None and self.params is not None
    nodes = [n for n in nodes if n not in self._excluded_nodes()]
    self._params_for_roster(len(nodes))
    t = self.params.setup_timeout_s
    idx = dict(zip(nodes, self.sites.indices(nodes), strict=True))
    request = self.server.begin_setup(idx.values())
    msgs = [self._message(n, i, "advertise", request, config, group, t)
            for n, i in idx.items()]
    for reply in self._exchange(msgs, t, "setup"):
        self._receive(reply, KeyAdvertise, idx, self.server.receive_advertise, "advertise")
    share_requests = self.server.close_advertise()  # AbortRound when < 2 sites advertised
    node_of = {i: n for n, i in idx.items()}
    msgs = [self._message(node_of[i], i, "share-keys", req, config, group, t)
            for i, req in share_requests.items()]
    for reply in self._exchange(msgs, t, "setup"):
        self._receive(reply, ShareKeys, idx, self.server.receive_share_keys, "share_keys")
    usable = self.server.close_share_keys()
    _log.info("secure aggregation: epoch %d keyed with %d of %d sites", self.server.epoch,
              len(usable), len(nodes))

def _params_for_roster(self: SecureAggregation, roster: int) -> None:
    """Resolve ``t`` (and ``k``) for the roster an epoch is about to be keyed over.

    ``t`` was resolved from the sampled count, but an epoch may be keyed over every
    connected node (``run.fraction_train < 1``): its ``k`` can then exceed ``2 t``, and
    every site would refuse the setup (its floor, docs/protocols/secagg.md section 4). A
    new epoch starts with the parameters of its own roster (sites get them, and their
    digest, in the setup messages); nothing changes within an epoch.
    """
    assert self.server is not None and self.params is not None
    if roster < 2:
        return  # close_advertise aborts the setup with the reason
    k = self.params.neighbours_for(roster)
    t = self.secagg.resolve_threshold(k)
    if t != self.params.threshold:
        params = dataclasses.replace(self.params, threshold=t)
        _log.info("secure aggregation: threshold t = %d for an epoch of %d sites (k = %d)",
                  t, roster, k)
        self.params = params
        self.server.params = params

def _roster_fits(self: SecureAggregation, roster: int, sampled: int) -> bool:
    """Whether an epoch keyed over ``roster`` sites can serve rounds of ``sampled``: its
    ``t`` (resolved for the roster's ``k``) needs ``t`` neighbours among the sampled."""
    assert self.params is not None
    if roster < 2 or roster <= sampled:
        return True
    try:
        t = self.secagg.resolve_threshold(self.params.neighbours_for(roster))
    except ConfigError:
        return False
    return t <= sampled - 1

def _excluded_nodes(self: SecureAggregation) -> set[int]:
    """Nodes whose own shares made a round of this run abort (``secagg.exclude_blamed``).

    The protocol cannot tell such a site from one framed by more than ``k - t`` lying
    neighbours; fedagg leaves it out of the rest of the run by default (an availability
    attack costs one round, not every round), and says so in the round's ``rejected``.
    """
    if self.server is None or not self.secagg.exclude_blamed:
        return set()
    out = set()
    for i in self.server.blamed_sites:
        try:
            out.add(self.sites.node(i))
        except KeyError:
            continue
    return out

def _ensure_server(self: SecureAggregation, grid: Grid, per_round: int,
                   upload_timeout: float) -> ServerState:
    if self.server is None:
        n = len(list(grid.get_node_ids()))
        self.params = resolve_params(self.secagg, min(max(per_round, 1), max(n, 1)),
                                     upload_timeout=upload_timeout)
        self.server = ServerState(self.params, run_id=self._run_id,
                                  threads=self.secagg.threads)
    return self.server

def _open_round(self: SecureAggregation, grid: Grid, server: ServerState, nodes: Sequence[int],
                site_of: dict[int, int], dim: int | Callable[[int], int],
                config: ConfigRecord, group: str) -> dict[int, Any]:
    """Re-key when needed and open the round; returns ``{site: RoundRequest}``.

    ``dim`` is the masked length, or a function of the number of participants (the vote
    counters' packing depends on it).
    """
    sampled = [site_of[n] for n in nodes]
    narrow = False  # keyed over exactly the sampled sites in this call
    if server.epoch == 0 or server.needs_rekey(sampled):
        roster = [n for n in grid.get_node_ids() if n not in self._excluded_nodes()]
        if not self._roster_fits(len(roster), len(sampled)):
            roster = list(nodes)  # the roster's t cannot be met by a round this size
        t0 = time.perf_counter()
        self._setup(roster, config, group)
        self.round_log.tick("setup", t0)
        narrow = set(roster) <= set(nodes)
    for attempt in (0, 1):
        part = [i for i in sampled if i in set(server.usable_sites)]
        self._counter += 1
        try:
            return server.begin_round(self._counter, part,
                                      dim if isinstance(dim, int) else dim(len(part)))
        except (AbortRound, ConfigError):
            # Some participant has < t neighbours among the sampled sites (sparse graph
            # over a larger roster), or the epoch's t does not fit a round this size: key
            # a new epoch over exactly the sampled sites.
            if narrow or attempt:
                raise
            t0 = time.perf_counter()
            self._setup(list(nodes), config, group)
            self.round_log.tick("setup", t0)
            narrow = True
    raise AssertionError("unreachable")


def _name_blamed(self: SecureAggregation, server_round: int) -> None:
    """Name, in the round's ``rejected``, each site the core newly blamed for an abort."""
    if self.server is None:
        return
    for i in self.server.blamed_sites:
        if i in self._named_blamed:
            continue
        self._named_blamed.add(i)
        try:
            node = str(self.sites.node(i))
        except KeyError:
            continue
        self.round_log.rejected.setdefault(node, (
            f"round {server_round}: its own relayed shares could not be opened by its "
            "neighbours, so the round aborted (blamed; "
            + ("left out of the run's later rounds" if self.secagg.exclude_blamed
               else "re-keyed before it takes part again") + ")"))
