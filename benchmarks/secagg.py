"""Secure aggregation benchmark: Flower's SecAgg+ vs fedagg secure vs plain FedAvg, side by side.

    python benchmarks/secagg.py [--sites 10 50] [--dims 100000 1000000] [--rounds 3]

What runs (all three in this process, interleaved round by round: plain FedAvg, fedagg secure
and Flower SecAgg+ take turns in every measured round, so load changes hit all three alike):

* **Flower SecAgg+**: ``flwr.server.workflow.SecAggPlusWorkflow`` (legacy API: ``LegacyContext``
  with ``flwr.server.strategy.FedAvg`` and a ``SimpleClientManager`` of ``GridClientProxy``
  nodes) and a legacy ``ClientApp(client_fn=..., mods=[secaggplus_mod])``; its four stages per
  round, unmodified. ``num_shares = k + 1`` and ``reconstruction_threshold = t`` with the same
  ``k`` (neighbours) and ``t`` as fedagg.
* **fedagg secure**: ``strategies.SecureAggregation`` (inner fedagg FedAvg) and a
  ClientApp with ``clients.fedagg_mod``.
* **plain FedAvg**: fedagg's FedAvg, one exchange.

Every site's "training" returns ``global + delta`` with a fixed synthetic ``delta`` of D float32
values (normal, sd 0.01) and 100 examples, so the measured time is the protocol, not SGD.
Messages travel through :class:`server.inprocess.InProcessGrid`: real Flower ``Message``
objects, the real ClientApp/mod code and ``Context.state``, each message and reply serialised
and inflated as Flower ships it (that wire time is excluded from both compute figures; the
bytes are what it measured). Nothing runs in parallel; the figures are compute:

* ``server s``: wall time of the round minus the time spent inside the grid
  (``push_messages`` / ``pull_messages`` / ``send_and_receive``: the sites and the wire);
  fedagg's own bookkeeping (bytes counted on every message) is server time;
* ``site s``: per site, the sum over its ClientApp calls in the round (median over sites);
* ``round s``: ``server s + site s`` (sites run in parallel in a real federation);
* ``exchanges``: server -> sites -> server trips in the round;
* ``up/site``: serialised bytes of one site's replies in the round, relative to 4·D (fp32);
  the ratio table also divides fedagg secure's by plain FedAvg's real reply (fp32 model plus
  metrics and Flower headers), the fp32 baseline a FedAvg deployment actually uploads.

The load average (``/proc/loadavg``) is printed at the start and the end. Before each measured
round everything alive is collected and frozen (``benchmarks/_common.py``, ``own_garbage``), so
no protocol pays for a full garbage collection over another's objects.

Medians over ``--rounds`` steady-state rounds (``--big-rounds`` when N·D >= 5·10^7; fedagg
secure: after its key-setup round, which is reported separately; Flower's SecAgg+ runs its
setup in every round). Only the first measured round of each protocol goes through the wire
round trip (that is where the bytes come from); the others skip it to keep the run short.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from _common import add_common, loadavg, own_garbage, write_json
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from clients.protocol import fedagg_mod
from fedagg.config import RunConfig, load_config
from fedagg.secagg.threads import ENV_VAR, auto_threads
from server.inprocess import InProcessGrid
from server.runner import client_config
from strategies.fedavg import FedAvg
from strategies.loop import run_train_round
from strategies.secure import SecureAggregation
from strategies.wire import arrays_to_record, record_to_arrays

_log = logging.getLogger(__name__)

EXAMPLES = 100


def _delta(partition: int, dim: int) -> np.ndarray:
    return (np.random.default_rng(partition).standard_normal(dim) * 0.01).astype(np.float32)


class _Deltas:
    """Synthetic site updates, generated once per (partition, dim)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[int, int], np.ndarray] = {}

    def __call__(self, partition: int, dim: int) -> np.ndarray:
        key = (partition, dim)
        if key not in self.cache:
            self.cache[key] = _delta(partition, dim)
        return self.cache[key]


DELTAS = _Deltas()


# -- fedagg ClientApps (message API) ---------------------------------------------------------
def fedagg_app(secure: bool) -> ClientApp:
    """ClientApp whose train handler returns ``global + delta`` (optionally with fedagg_mod)."""
    app = ClientApp(mods=[fedagg_mod] if secure else [])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        keys, (weights,) = record_to_arrays(msg.content.array_records["arrays"])
        pid = int(context.node_config["partition-id"])
        new = weights + DELTAS(pid, weights.size)
        return Message(RecordDict({"arrays": arrays_to_record([new], keys),
                                   "metrics": MetricRecord({"num-examples": EXAMPLES})}),
                       reply_to=msg)

    return app


# -- Flower SecAgg+ (legacy API) ---------------------------------------------------------------
def flower_app() -> ClientApp:
    """Legacy ClientApp with Flower's secaggplus_mod; fit returns ``global + delta``."""
    from flwr.client import NumPyClient
    from flwr.client.mod import secaggplus_mod

    class SyntheticClient(NumPyClient):  # type: ignore[misc]
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def fit(self, parameters: list[np.ndarray], config: dict[str, Any]
                ) -> tuple[list[np.ndarray], int, dict[str, Any]]:
            return [parameters[0] + DELTAS(self.pid, parameters[0].size)], EXAMPLES, {}

    def client_fn(context: Context) -> Any:
        return SyntheticClient(int(context.node_config["partition-id"])).to_client()

    return ClientApp(client_fn=client_fn, mods=[secaggplus_mod])


class FlowerSecAggPlus:
    """Drives SecAggPlusWorkflow round by round, as DefaultWorkflow does."""

    def __init__(self, grid: InProcessGrid, dim: int, num_shares: int, threshold: int) -> None:
        from flwr.common import ndarrays_to_parameters
        from flwr.server import LegacyContext, ServerConfig
        from flwr.server.client_manager import SimpleClientManager
        from flwr.server.compat.grid_client_proxy import GridClientProxy
        from flwr.server.compat.legacy_context import LegacyContext as _LC  # noqa: F401
        from flwr.server.strategy import FedAvg as LegacyFedAvg
        from flwr.server.workflow import SecAggPlusWorkflow
        from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD

        self.grid, self.dim = grid, dim
        strategy = LegacyFedAvg(fraction_fit=1.0, fraction_evaluate=0.0,
                                min_fit_clients=len(grid.node_ids),
                                min_available_clients=len(grid.node_ids),
                                initial_parameters=ndarrays_to_parameters([np.zeros(dim, np.float32)]))
        manager = SimpleClientManager()
        for nid in grid.node_ids:
            manager.register(GridClientProxy(nid, grid, 1))
        base = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
        self.context = LegacyContext(base, config=ServerConfig(num_rounds=10**6),
                                     strategy=strategy, client_manager=manager)
        self.context.state[MAIN_PARAMS_RECORD] = ArrayRecord([np.zeros(dim, np.float32)])
        self.context.state[MAIN_CONFIGS_RECORD] = ConfigRecord({"current_round": 0})
        self._keys = (MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD)
        self.workflow = SecAggPlusWorkflow(num_shares=num_shares,
                                           reconstruction_threshold=threshold, max_weight=1000.0)

    def round(self, rnd: int) -> np.ndarray:
        cfg_key, params_key = self._keys
        self.context.state.config_records[cfg_key]["current_round"] = rnd
        self.context.state[params_key] = ArrayRecord([np.zeros(self.dim, np.float32)])
        self.workflow(self.grid, self.context)
        return self.context.state.array_records[params_key].to_numpy_ndarrays()[0]


# -- measurement -----------------------------------------------------------------------------
class Timed:
    """Wraps a grid's entry points to split server time from message time.

    ``send_and_receive``, ``push_messages`` and ``pull_messages`` are timed (the outermost
    call only): an :class:`~server.inprocess.InProcessGrid` runs the ClientApp inside
    ``push_messages``, so that time is the sites' (measured per site by the grid) and the
    wire's, never the server's. Everything else a strategy does -- fedagg's byte counting
    included -- is server time.
    """

    def __init__(self, grid: InProcessGrid) -> None:
        self.grid = grid
        self.in_grid = 0.0
        self._depth = 0
        for name in ("send_and_receive", "push_messages", "pull_messages"):
            setattr(grid, name, self._timed(getattr(grid, name)))

    def _timed(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        """``inner`` timed into :attr:`in_grid` (outermost call only: send_and_receive pushes
        and pulls through the same grid)."""
        def call(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return inner(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.in_grid += time.perf_counter() - t0
                self._depth -= 1
        return call

    def measure(self, fn: Callable[[], Any], *, wire: bool) -> dict[str, float]:
        g = self.grid
        g.wire = wire
        self.in_grid, g.client_seconds, g.bytes_up = 0.0, [], 0
        with own_garbage():
            t0 = time.perf_counter()
            fn()
            wall = time.perf_counter() - t0
        per_site: dict[int, float] = {}
        kinds: set[str] = set()
        for node, kind, sec in g.client_seconds:
            per_site[node] = per_site.get(node, 0.0) + sec
            kinds.add(kind)
        trips = len(g.client_seconds) / max(len(per_site), 1)
        site = statistics.median(per_site.values()) if per_site else 0.0
        server = wall - self.in_grid
        up = g.bytes_up / max(len(per_site), 1) if wire else float("nan")
        return {"server": server, "site": site, "round": server + site, "up_site": up,
                "exchanges": round(trips)}


def _cfg(n: int) -> RunConfig:
    return load_config(None, ["strategy.name=secure", f"run.sites={n}",
                              "secagg.weight_scale=1000", "secagg.clip=1.0"])


def _secure_key(t: int, threads: Sequence[int]) -> str:
    """Result key of the secure protocol with ``t`` threads (the first setting is "secure")."""
    return "secure" if t == threads[0] else f"secure-t{t}"


def bench(n: int, dim: int, rounds: int, *, flower: bool = True,
          threads: Sequence[int] = (0,)) -> dict[str, Any]:
    """Measure the three protocols for ``n`` sites and ``dim`` values, interleaved by round.

    fedagg secure first runs its key-setup round (measured separately); then each of the
    ``rounds`` rounds runs plain FedAvg, fedagg secure and Flower SecAgg+ one after the other,
    so a change in machine load hits all three alike.
    """
    out: dict[str, Any] = {"fedavg": [], "flower": []}
    cfg = _cfg(n)
    expect = np.mean([DELTAS(i, dim).astype(np.float64) for i in range(n)], axis=0)
    arrays = arrays_to_record([np.zeros(dim, np.float32)])

    plain_grid = InProcessGrid(fedagg_app(False), n, seed=n)
    plain_timed = Timed(plain_grid)
    anchor = FlowerFedAvgRound(n) if flower else None
    plain = FedAvg(min_available_nodes=n)
    conf = client_config(cfg)
    # one secure federation per thread setting (server: secagg.threads; sites: the env var)
    secures = {}
    for t in threads:
        grid = InProcessGrid(fedagg_app(True), n, seed=n)
        strategy = SecureAggregation(FedAvg(min_available_nodes=n),
                                     secagg=cfg.secagg.model_copy(update={"threads": t}))
        secures[t] = (grid, Timed(grid), strategy)

    def secure_round(rnd: int, wire: bool, t: int) -> dict[str, float]:
        sec_grid, sec_timed, secure = secures[t]
        box: dict[str, Any] = {}
        old = os.environ.get(ENV_VAR)
        os.environ[ENV_VAR] = str(t or auto_threads())
        try:
            run = sec_timed.measure(lambda: box.update(
                r=run_train_round(secure, sec_grid, rnd, arrays, conf, 600.0)), wire=wire)
        finally:
            if old is None:
                del os.environ[ENV_VAR]
            else:
                os.environ[ENV_VAR] = old
        run["exchanges"] = box["r"].report.exchanges
        got = record_to_arrays(box["r"].arrays)[1][0]
        err = float(np.abs(got - expect).max())
        assert err < 1e-4, f"fedagg secure result off by {err}"
        return run

    for t in threads:
        out[_secure_key(t, threads)] = []
    t0_ = threads[0]
    out["secure_setup"] = secure_round(1, True, t0_)
    for t in threads[1:]:
        secure_round(1, True, t)
    secure = secures[t0_][2]
    assert secure.params is not None and secure.last_result is not None
    k, t = secure.params.neighbours_for(n), secure.params.threshold
    out["k"], out["t"] = k, t
    out["ring_bits"], out["frac_bits"] = secure.last_result.ring_bits, secure.last_result.frac_bits
    if flower:
        fl_grid = InProcessGrid(flower_app(), n, seed=n)
        fl_timed = Timed(fl_grid)
        fl = FlowerSecAggPlus(fl_grid, dim, num_shares=k + 1 if k + 1 < n else n, threshold=t)

    for rnd in range(1, rounds + 1):
        wire = rnd == 1
        res: dict[str, Any] = {}
        run = plain_timed.measure(lambda r=rnd, box=res: box.update(
            r=run_train_round(plain, plain_grid, r, arrays, ConfigRecord(), 600.0)),
            wire=wire)
        run["exchanges"] = res["r"].report.exchanges
        out["fedavg"].append(run)
        got = record_to_arrays(res["r"].arrays)[1][0]
        assert float(np.abs(got - expect).max()) < 1e-5, "fedagg FedAvg result off"
        if anchor is not None:
            out.setdefault("flower_fedavg", []).append(anchor.measure(rnd, arrays, wire, expect))
        for t in threads:
            out[_secure_key(t, threads)].append(secure_round(rnd + 1, wire, t))
        if flower:
            fbox: dict[str, Any] = {}
            out["flower"].append(fl_timed.measure(
                lambda r=rnd, b=fbox: b.update(x=fl.round(r)), wire=wire))
            err = float(np.abs(fbox["x"] - expect).max())
            assert err < 1e-3, f"Flower SecAgg+ result off by {err}"
    if not flower:
        del out["flower"]
    # the process's peak resident memory so far (Linux: KiB): every protocol of this run
    out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


class FlowerFedAvgRound:
    """Flower's own FedAvg (Message API) on a grid of its own, one round as
    ``Strategy.start()`` runs it: ``configure_train`` -> ``send_and_receive`` ->
    ``aggregate_train``; the anchor of the plain round."""

    def __init__(self, n: int) -> None:
        from flwr.serverapp.strategy import FedAvg as FlowerFedAvg

        self.grid = InProcessGrid(fedagg_app(False), n, seed=n)
        self.timed = Timed(self.grid)
        self.strategy = FlowerFedAvg(fraction_train=1.0, fraction_evaluate=1.0,
                                     min_train_nodes=n, min_available_nodes=n)

    def measure(self, rnd: int, arrays: ArrayRecord, wire: bool,
                expect: np.ndarray) -> dict[str, float]:
        box: dict[str, Any] = {}

        def one() -> None:
            msgs = self.strategy.configure_train(rnd, arrays, ConfigRecord(), self.grid)
            replies = self.grid.send_and_receive(msgs, timeout=600.0)
            box["r"], _ = self.strategy.aggregate_train(rnd, replies)

        run = self.timed.measure(one, wire=wire)
        got = box["r"].to_numpy_ndarrays()[0]
        assert float(np.abs(got - expect).max()) < 1e-5, "Flower FedAvg result off"
        return run


def _med(runs: list[dict[str, float]], key: str) -> float:
    values = [r[key] for r in runs if r[key] == r[key]]  # skip NaN (bytes of non-wire rounds)
    return statistics.median(values) if values else float("nan")


def table(results: dict[tuple[int, int], dict[str, Any]]) -> str:
    """Markdown table of medians."""
    lines = ["| N | D | protocol | round s | server s | site s | exchanges | up/site (x fp32) |",
             "|---|---|---|---|---|---|---|---|"]
    for (n, dim), res in results.items():
        extra = [(k, f"fedagg secure, {k.split('-t')[1]} thread(s)")
                 for k in res if k.startswith("secure-t")]
        for name, label in (("flower", "Flower SecAgg+"), ("secure", "fedagg secure"), *extra,
                            ("secure_setup", "fedagg secure, key-setup round"),
                            ("fedavg", "fedagg FedAvg (plain)"),
                            ("flower_fedavg", "Flower FedAvg (plain)")):
            if name not in res:
                continue
            runs = res[name] if isinstance(res[name], list) else [res[name]]
            lines.append(
                f"| {n} | {dim:,} | {label} | {_med(runs, 'round'):.3f} | "
                f"{_med(runs, 'server'):.3f} | {_med(runs, 'site'):.3f} | "
                f"{int(_med(runs, 'exchanges'))} | {_med(runs, 'up_site') / (4 * dim):.4f} |")
    return "\n".join(lines)


def _ratio(res: dict[str, Any], a: str, b: str) -> float:
    return _med(res[a], "round") / _med(res[b], "round") if a in res and b in res else \
        float("nan")


def summary(results: dict[tuple[int, int], dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration: the medians and the headline ratios (what ``--json`` writes)."""
    rows = []
    for (n, dim), res in results.items():
        row: dict[str, Any] = {"sites": n, "dim": dim, "k": res["k"], "t": res["t"],
                               "ring_bits": res["ring_bits"], "frac_bits": res["frac_bits"]}
        for name in ("flower", "secure", "secure_setup", "fedavg", "flower_fedavg"):
            if name in res:
                runs = res[name] if isinstance(res[name], list) else [res[name]]
                row[name] = {k: _med(runs, k) for k in ("round", "server", "site", "up_site")}
        row["peak_rss_gib"] = res.get("peak_rss_gib")
        row["flower_secagg_over_secure"] = _ratio(res, "flower", "secure")
        row["secure_over_plain"] = _ratio(res, "secure", "fedavg")
        row["plain_over_flower_fedavg"] = _ratio(res, "fedavg", "flower_fedavg")
        rows.append(row)
    return rows


def ratios(results: dict[tuple[int, int], dict[str, Any]]) -> str:
    """Speed-up and overhead ratios per configuration."""
    lines = ["| N | D | k, t | ring b, frac f | Flower SecAgg+ / fedagg secure (round s) | "
             "fedagg secure / fedagg FedAvg (round s) | fedagg FedAvg / Flower FedAvg "
             "(round s) | fedagg secure up/site (x fp32) | "
             "fedagg secure up/site (x plain FedAvg reply) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row, res in zip(summary(results), results.values(), strict=True):
        fl, plain = row["flower_secagg_over_secure"], row["plain_over_flower_fedavg"]
        lines.append(f"| {row['sites']} | {row['dim']:,} | {row['k']}, {row['t']} | "
                     f"{row['ring_bits']}, {row['frac_bits']} | "
                     f"{f'{fl:.1f}x' if fl == fl else '-'} | {row['secure_over_plain']:.2f}x | "
                     f"{f'{plain:.2f}x' if plain == plain else '-'} | "
                     f"{_med(res['secure'], 'up_site') / (4 * row['dim']):.4f} | "
                     f"{_med(res['secure'], 'up_site') / _med(res['fedavg'], 'up_site'):.4f} |")
    paired = [
        f"N={n} D={dim:,} {k}: " + ", ".join(
            f"{a['round'] / b['round']:.2f}x" for a, b in zip(res[k], res["fedavg"], strict=True))
        for (n, dim), res in results.items() for k in res
        if k == "secure" or k.startswith("secure-t")
    ]
    lines += ["", "per-round ratios to the plain FedAvg round run just before it:", *paired]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print markdown tables."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sites", type=int, nargs="+", default=[10, 50])
    p.add_argument("--dims", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--big-rounds", type=int, default=1,
                   help="rounds per protocol when N * D >= 5e7 (Flower SecAgg+ is slow there)")
    p.add_argument("--no-flower", action="store_true")
    p.add_argument("--threads", type=int, nargs="+", default=[0],
                   help="fedagg secure worker threads (server secagg.threads and sites' "
                        f"{ENV_VAR}); 0 = auto; several values run side by side, interleaved")
    add_common(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.sites, args.dims, args.rounds, args.big_rounds = [4], [2000], 1, 1
    logging.basicConfig(level=logging.WARNING)
    for name in ("flwr", "strategies", "fedagg"):
        logging.getLogger(name).setLevel(logging.ERROR)
    results: dict[tuple[int, int], dict[str, Any]] = {}
    t0 = time.perf_counter()
    print(f"load average at start: {loadavg()}; fedagg secure threads {args.threads} "
          f"(0 = auto = {auto_threads()})", flush=True)
    for n in args.sites:
        for dim in args.dims:
            t1 = time.perf_counter()
            rounds = args.big_rounds if n * dim >= 50_000_000 else args.rounds
            results[(n, dim)] = bench(n, dim, rounds, flower=not args.no_flower,
                                      threads=args.threads)
            print(f"N={n} D={dim}: {rounds} round(s), {time.perf_counter() - t1:.0f} s", flush=True)
            print(table({(n, dim): results[(n, dim)]}), flush=True)
    print()
    print(table(results))
    print()
    print(ratios(results))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s; load average at end: {loadavg()}")
    write_json(args.json, summary(results), argv, threads=args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
