"""The Flower adapter's part of the secure-aggregation hardening (issue 17; the core's part is
tests/secagg/test_secagg_lying_server.py and test_secagg_hostile_site.py).

* A site's floors on ``t`` and ``k`` come from its own node config (``secagg-threshold-floor``,
  ``secagg-min-neighbours``), never from the server's message.
* ``t`` is resolved for each epoch's roster: with ``run.fraction_train < 1`` the setup over
  every node used the ``t`` of the sampled count, and every site refused it.
* A site whose own relayed shares make a round abort (the core's ``blamed_sites``) is named
  in that round's record and, by default, left out of the run's later rounds.
* Every reply is bound to its node's site index (``receive_*(sender=...)``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients import fedagg_mod
from clients.protocol import _load
from clients.settings import NodeConfig
from fedagg.config import load_config
from fedagg.errors import ConfigError
from fedagg.secagg import SecAggParams
from server.inprocess import InProcessGrid, nodes_by_partition
from server.runner import run_server
from strategies.registry import build_strategy
from strategies.wire import CONFIG_KEY, PARAMS_KEY, arrays_to_record, record_to_arrays


def fast_app() -> ClientApp:
    """Instant training (the model plus seeded noise) behind the real fedagg client mod."""
    app = ClientApp(mods=[fedagg_mod])

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:
        keys, arrays = record_to_arrays(msg.content["arrays"])
        rng = np.random.default_rng(int(ctx.node_config["partition-id"]))
        out = [a + np.float32(0.01) * rng.standard_normal(a.shape).astype(a.dtype)
               for a in arrays]
        return Message(RecordDict({"arrays": arrays_to_record(out, keys),
                                   "metrics": MetricRecord({"num-examples": 20})}), reply_to=msg)

    return app


def _cfg(*extra: str) -> Any:
    return load_config(None, ["run.sites=5", "run.rounds=3", "run.checkpoint=false",
                              "run.wait_for_sites=0", "strategy.name='secure'", "secagg.clip=1.0",
                              "secagg.weight_scale=100.0", *extra])


def _serve(grid: InProcessGrid, cfg: Any) -> list[dict[str, Any]]:
    return run_server(grid, cfg, None, model_fn=lambda: torch.nn.Linear(4, 3),
                      evaluate_fn=lambda a: (0.0, 0.0))


class _Grid(InProcessGrid):
    """InProcessGrid that lets a test edit what a node sends or receives."""

    def __init__(self, n: int, *, outgoing: Any = None, incoming: Any = None) -> None:
        super().__init__(fast_app(), n, seed=2)
        self.outgoing, self.incoming = outgoing, incoming

    def _deliver(self, msg: Message) -> Message | None:
        if self.outgoing is not None:
            self.outgoing(msg)
        reply = super()._deliver(msg)
        if reply is not None and self.incoming is not None and not reply.has_error():
            reply = self.incoming(msg, reply)
        return reply


def _stage(msg: Message) -> str:
    rec = msg.content.config_records.get(PARAMS_KEY)
    return str(rec["stage"]) if rec is not None else "train"


def _round(msg: Message) -> int:
    return int(msg.content.config_records["config"]["server-round"])


# -- (a) the site's own floors -------------------------------------------------------------------
def test_floors_default_and_come_from_the_node_config() -> None:
    assert NodeConfig().secagg_floors() == (0.5, 3)
    ctx = Context(run_id=1, node_id=9, state=RecordDict(), run_config={},
                  node_config={"secagg-threshold-floor": 0.75, "secagg-min-neighbours": 5})
    state = _load(ctx, 0, SecAggParams(threshold=2), fresh_ok=True)
    assert (state.floor.threshold_floor, state.floor.min_neighbours) == (0.75, 5)


@pytest.mark.parametrize(("key", "value"), [("secagg-threshold-floor", 1.0),
                                            ("secagg-threshold-floor", -0.1),
                                            ("secagg-min-neighbours", 0),
                                            ("secagg-min-neighbours", "many")])
def test_bad_floor_settings_are_refused_naming_the_field(key: str, value: Any) -> None:
    ctx = Context(run_id=1, node_id=9, state=RecordDict(), run_config={},
                  node_config={key: value})
    with pytest.raises(ConfigError, match=key.replace("-", "_")):
        _load(ctx, 0, SecAggParams(threshold=2), fresh_ok=True)


def test_a_site_with_a_higher_floor_refuses_and_only_it_drops_out() -> None:
    """t = 3 of k = 4 clears the default floor (t > k/2) but not a site's 0.8 (t > 3.2)."""
    grid = _Grid(5)
    strict = nodes_by_partition(grid)[1]
    grid.contexts[strict].node_config["secagg-threshold-floor"] = 0.8
    records = _serve(grid, _cfg())
    for rec in records[1:]:
        assert rec["model_updated"] and rec["secagg_counted"] == 4
        assert "requires t > 0.8" in rec["errors"][str(strict)]


def test_the_server_cannot_lower_a_sites_floor() -> None:
    """A server that adds a floor of its own to the parameters record is refused by every site
    (unknown parameter), and the floors are not among the parameters it sends at all."""
    def waive(msg: Message) -> None:
        if PARAMS_KEY in msg.content.config_records:
            msg.content.config_records[PARAMS_KEY]["threshold_floor"] = 0.0

    with pytest.raises(Exception, match="no round of the run changed"):
        _serve(_Grid(5, outgoing=waive), _cfg("run.rounds=1"))
    seen: list[set[str]] = []
    _serve(_Grid(5, outgoing=lambda m: seen.append(set(m.content.config_records.get(
        PARAMS_KEY, {}).keys()))), _cfg("run.rounds=1"))
    assert seen and not any(k & {"threshold_floor", "min_neighbours"} for k in seen)


# -- (b) t for each epoch's roster ---------------------------------------------------------------
def test_fraction_train_below_one_keys_the_full_roster_with_its_own_t() -> None:
    """10 sites, 3 sampled per round: t = 2 (k = 2) was used for the setup over all 10 nodes
    (k = 9), which every site refuses (t <= k/2); now that epoch gets t = 5, and a round whose
    sampled sites lack t neighbours is keyed over exactly them (t = 2, k = 2)."""
    grid = InProcessGrid(fast_app(), 10, seed=4)
    records = _serve(grid, _cfg("run.sites=10", "run.fraction_train=0.3"))
    assert all(rec["model_updated"] and rec["secagg_counted"] == 3 for rec in records[1:])


def test_preflight_refuses_an_absolute_t_below_the_floor_of_the_full_roster() -> None:
    with pytest.raises(ConfigError, match=r"requires t > 0\.5"):
        build_strategy(_cfg("run.sites=10", "run.fraction_train=0.3", "secagg.threshold=2"))


# -- (c) blamed sites -----------------------------------------------------------------------------
def _garble_self_mask_shares(target: int, rnd: int) -> Any:
    def incoming(msg: Message, reply: Message) -> Message:
        if msg.metadata.dst_node_id == target and _stage(msg) == "upload" and _round(msg) == rnd:
            cfg = ConfigRecord(dict(reply.content.config_records[CONFIG_KEY]))
            cfg["b_ciphertexts"] = bytes(len(cfg["b_ciphertexts"]))  # garbage for every recipient
            reply.content[CONFIG_KEY] = cfg
        return reply
    return incoming


@pytest.mark.parametrize("exclude", [True, False])
def test_a_blamed_site_is_named_and_left_out_of_later_rounds(exclude: bool) -> None:
    grid = _Grid(5)
    target = nodes_by_partition(grid)[2]
    grid.incoming = _garble_self_mask_shares(target, rnd=1)
    records = _serve(grid, _cfg(f"secagg.exclude_blamed={str(exclude).lower()}"))
    first, second, third = records[1:]
    assert not first["model_updated"] and "blamed" in first["rejected"][str(target)]
    assert second["model_updated"] and third["model_updated"]
    if exclude:
        assert "excluded from this round" in second["rejected"][str(target)]
        assert second["secagg_counted"] == third["secagg_counted"] == 4
    else:  # re-keyed, and back in the round
        assert str(target) not in second.get("rejected", {})
        assert second["secagg_counted"] == 5


# -- (d) replies bound to their sender --------------------------------------------------------
def test_an_upload_in_another_sites_name_is_refused() -> None:
    grid = _Grid(5)
    liar = nodes_by_partition(grid)[3]

    def incoming(msg: Message, reply: Message) -> Message:
        if msg.metadata.dst_node_id == liar and _stage(msg) == "upload":
            cfg = ConfigRecord(dict(reply.content.config_records[CONFIG_KEY]))
            cfg["site"] = (int(cfg["site"]) + 1) % 5
            reply.content[CONFIG_KEY] = cfg
        return reply

    grid.incoming = incoming
    records = _serve(grid, _cfg("run.rounds=1"))
    rec = records[1]
    assert "the reply came from site" in rec["rejected"][str(liar)]
    assert rec["model_updated"] and rec["secagg_counted"] == 4
    assert np.isfinite(rec["secagg_error_bound"])
