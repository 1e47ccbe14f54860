"""Keying the sites: the membership epochs of the secure strategy, and the sites it blames.

:class:`KeySetup` owns the server's protocol state (:class:`fedagg.secagg.ServerState`), the
public parameters and the small site indices, and decides when the sites must agree new keys:

* ``setup`` -- the two key-setup exchanges (advertise, share keys) of a new epoch;
* ``params_for_roster`` / ``roster_fits`` -- the threshold ``t`` resolved for the roster an
  epoch is keyed over (every site refuses a ``t`` below its floor, docs/protocols/secagg.md
  section 4), and whether such an epoch can serve rounds of the sampled size;
* ``ensure_server`` / ``open_round`` -- the protocol state, and opening a round: re-key when
  needed, once more over exactly the sampled sites when some participant has fewer than ``t``
  neighbours among them;
* ``excluded_nodes`` / ``name_blamed`` -- the sites whose own relayed shares made a round
  abort: left out of later epochs (``secagg.exclude_blamed``) and named in the round's
  ``refused``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from flwr.app import ConfigRecord
from flwr.serverapp import Grid

from fedagg.config import SecAggConfig
from fedagg.errors import AbortRound, ConfigError, explain
from fedagg.secagg import KeyAdvertise, SecAggParams, ServerState, ShareKeys
from fedagg.secagg.keys import NO_BINDING
from strategies.secure_exchange import SiteExchange
from strategies.secure_params import resolve_params
from strategies.update import RoundReport
from strategies.wire import SiteIndex

__all__ = ["KeySetup"]

_log = logging.getLogger("strategies.secure")


class KeySetup:
    """The epochs of keys a secure strategy's sites agree, and the sites it leaves out.

    Parameters
    ----------
    secagg : SecAggConfig
        Threshold, neighbours, clip range, precision, timeouts, threads.
    run_id : bytes
        Bound into every derived key.
    sites : SiteIndex
        Flower node ids <-> the core's small site indices (fixed for the run).
    link : SiteExchange
        The strategy's exchanges with its sites.
    """

    def __init__(self, secagg: SecAggConfig, run_id: bytes, sites: SiteIndex,
                 link: SiteExchange) -> None:
        self.secagg = secagg
        self.run_id = run_id
        self.sites = sites
        self.link = link
        self.server: ServerState | None = None
        self.params: SecAggParams | None = None
        self._counter = 0
        self._named_blamed: set[int] = set()  # blamed site indices already reported

    def __repr__(self) -> str:  # the protocol state holds secrets: never in a repr
        epoch = self.server.epoch if self.server is not None else 0
        return f"KeySetup(epoch={epoch}, sites={len(self.sites)})"

    def ensure_server(self, grid: Grid, per_round: int, upload_timeout: float) -> ServerState:
        """The protocol state (made for ``per_round`` sites on the first round)."""
        if self.server is None:
            n = len(list(grid.get_node_ids()))
            self.params = resolve_params(self.secagg, min(max(per_round, 1), max(n, 1)),
                                         upload_timeout=upload_timeout)
            self.link.params = self.params
            self.server = ServerState(self.params, run_id=self.run_id,
                                      threads=self.secagg.threads)
        return self.server

    def setup(self, nodes: Sequence[int], config: ConfigRecord, group: str) -> None:
        """Key a new epoch over ``nodes`` (advertise, then share keys).

        Raises
        ------
        ConfigError
            No site answered the advertisement with a protocol message: their ClientApps do
            not run ``clients.fedagg_mod`` (the fix named).
        AbortRound
            Fewer than 2 sites advertised keys.
        """
        assert self.server is not None and self.params is not None
        excluded = self.excluded_nodes()
        nodes = [n for n in nodes if n not in excluded]
        self.params_for_roster(len(nodes))
        t = self.params.setup_timeout_s
        idx = dict(zip(nodes, self.sites.indices(nodes), strict=True))
        request = self.server.begin_setup(idx.values())
        msgs = [self.link.message(n, i, "advertise", request, config, group, t)
                for n, i in idx.items()]
        replies = self.link.run(msgs, t, "setup")
        errors = list(self.link.error_replies)
        for reply in replies:
            self.link.receive(reply, KeyAdvertise, idx, self.server.receive_advertise,
                              "advertise")
        answered = len(replies) + len(errors)
        foreign = [e for e in errors if "fedagg.errors." not in e]  # not a refusal by fedagg
        if answered and self.link.plain_replies + len(foreign) == answered:
            # every site answered, none with a protocol message: they cannot take part at all
            seen = (f"a plain model ({self.link.plain_replies} of {answered})"
                    if self.link.plain_replies else f"errors, e.g. {foreign[0][:200]!r}")
            raise ConfigError(explain(
                "the sites' answers to the key setup", seen,
                "SecureAggregation needs clients.fedagg_mod at every site (its ClientApp "
                "must answer secure-aggregation messages)",
                "add the mod: ClientApp(mods=[clients.fedagg_mod]), or build the app with "
                "clients.make_client_app(task)"))
        share_requests = self.server.close_advertise()  # AbortRound when < 2 sites advertised
        node_of = {i: n for n, i in idx.items()}
        msgs = [self.link.message(node_of[i], i, "share-keys", req, config, group, t)
                for i, req in share_requests.items()]
        for reply in self.link.run(msgs, t, "setup"):
            self.link.receive(reply, ShareKeys, idx, self.server.receive_share_keys,
                              "share_keys")
        usable = self.server.close_share_keys()
        _log.info("secure aggregation: epoch %d keyed with %d of %d sites", self.server.epoch,
                  len(usable), len(nodes))

    def params_for_roster(self, roster: int) -> None:
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
            self.params = self.link.params = self.server.params = params

    def roster_fits(self, roster: int, sampled: int) -> bool:
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

    def excluded_nodes(self) -> set[int]:
        """Nodes whose own shares made a round of this run abort (``secagg.exclude_blamed``).

        The protocol cannot tell such a site from one framed by more than ``k - t`` lying
        neighbours; fedagg leaves it out of the rest of the run by default (an availability
        attack costs one round, not every round), and says so in the round's ``refused``.
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

    def open_round(self, grid: Grid, nodes: Sequence[int], site_of: dict[int, int],
                   dim: int | Callable[[int], int], config: ConfigRecord, group: str,
                   report: RoundReport, binding: bytes = NO_BINDING) -> dict[int, Any]:
        """Re-key when needed and open the round; returns ``{site: RoundRequest}``.

        ``dim`` is the masked length, or a function of the number of participants (the vote
        counters' packing depends on it); ``binding``: the round binding of the model every
        participant is sent (:func:`fedagg.secagg.keys.round_binding`).
        """
        server = self.server
        assert server is not None
        sampled = [site_of[n] for n in nodes]
        narrow = False  # keyed over exactly the sampled sites in this call
        if server.epoch == 0 or server.needs_rekey(sampled):
            excluded = self.excluded_nodes()
            roster = [n for n in grid.get_node_ids() if n not in excluded]
            if not self.roster_fits(len(roster), len(sampled)):
                roster = list(nodes)  # the roster's t cannot be met by a round this size
            t0 = time.perf_counter()
            self.setup(roster, config, group)
            report.add_time("setup", time.perf_counter() - t0)
            narrow = set(roster) <= set(nodes)
        for attempt in (0, 1):
            part = [i for i in sampled if i in set(server.usable_sites)]
            self._counter += 1
            try:
                return server.begin_round(self._counter, part,
                                          dim if isinstance(dim, int) else dim(len(part)),
                                          binding=binding)
            except (AbortRound, ConfigError):
                # Some participant has < t neighbours among the sampled sites (sparse graph
                # over a larger roster), or the epoch's t does not fit a round this size: key
                # a new epoch over exactly the sampled sites.
                if narrow or attempt:
                    raise
                t0 = time.perf_counter()
                self.setup(list(nodes), config, group)
                report.add_time("setup", time.perf_counter() - t0)
                narrow = True
        raise AssertionError("unreachable")

    def name_blamed(self, server_round: int, report: RoundReport) -> None:
        """Name, in the round's ``refused``, each site the core newly blamed for an abort."""
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
            report.refused.setdefault(node, (
                f"round {server_round}: its own relayed shares could not be opened by its "
                "neighbours, so the round aborted (blamed; "
                + ("left out of the run's later rounds" if self.secagg.exclude_blamed
                   else "re-keyed before it takes part again") + ")"))
