"""Differential privacy on Fashion-MNIST: central Gaussian DP vs fedagg's distributed DP.

For each epsilon (at one delta) two private runs train the same model from the same initial
weights on the same Dirichlet partitions with the same seeds and the same clipping norm, and
a non-private FedAvg run is the reference:

* **central** -- Flower's ``DifferentialPrivacyServerSideFixedClipping`` around fedagg's
  FedAvg: the server clips every site's update to ``clip`` and adds ``N(0, (z clip / n)^2)``
  to the mean, ``z`` calibrated for the run (dp-accounting's RDP accountant,
  :func:`fedagg.privacy.gaussian_noise_multiplier`); the server sees every update;
* **distributed** -- fedagg's secure aggregation with ``privacy.mode = "distributed"``: each
  site clips to ``clip`` and adds its share of discrete Gaussian noise in a
  ``ring_bits``-bit secure sum (Kairouz, Liu, Steinke, ICML 2021); the server sees only the
  noisy sum.

Rounds are interleaved across the runs (round 1 of every run, then round 2, ...), every site
is the real ClientApp over real Flower Messages (``server.inprocess.InProcessGrid``), and the
bytes up are measured on the real messages. Targets (docs/benchmarks.md): distributed DP
within 2 accuracy points of central DP at <= 18 bits per coordinate.

Usage::

    python benchmarks/privacy.py --rounds 150 --epsilons 2 4 8     # the documented setup
    python benchmarks/privacy.py --smoke                          # tiny (CI)
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import _common  # noqa: E402


@dataclass
class Run:
    """One training run of the comparison."""

    key: str
    label: str
    epsilon: float | None
    strategy: Any = None
    cfg: Any = None
    grid: Any = None
    arrays: Any = None
    acc: list[float] = field(default_factory=list)
    up_per_site: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    spent: float | None = None
    status: str = "ok"


def run(a: argparse.Namespace) -> tuple[list[Run], dict[str, Any]]:
    import torch
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

    from clients.app import app as client_app
    from fedagg.config import load_config
    from fedagg.data import load_dataset
    from fedagg.models import build_model, set_weights
    from fedagg.privacy import gaussian_epsilon, gaussian_noise_multiplier
    from fedagg.training import evaluate
    from server.inprocess import InProcessGrid
    from server.runner import client_config
    from strategies.fedavg import FedAvg
    from strategies.loop import run_train_round
    from strategies.registry import build_strategy
    from strategies.wire import arrays_to_record, record_to_arrays

    torch.set_num_threads(a.threads)
    common = [f"run.sites={a.sites}", f"run.rounds={a.rounds}", f"run.seed={a.seed}",
              "data.dataset=fashion-mnist", "data.partitioner=dirichlet",
              f"data.dirichlet_alpha={a.alpha}", f"data.max_train_examples={a.max_train}",
              f"model.name={a.model}", f"train.local_epochs={a.local_epochs}",
              f"train.lr={a.lr}", "data.eval_fraction=0"]
    base = load_config(None, common)
    ds = load_dataset("fashion-mnist", data_dir=base.data.data_dir)
    model = build_model(a.model, ds.input_shape, ds.num_classes, seed=a.seed)
    keys = list(model.state_dict().keys())
    init = [t.detach().numpy().copy() for t in model.state_dict().values()]

    def accuracy(arrays: Any) -> float:
        set_weights(model, record_to_arrays(arrays)[1])
        return float(evaluate(model, ds.x_test, ds.y_test)[1])

    acc0 = accuracy(arrays_to_record(init, keys))
    runs = [Run("plain", "FedAvg, no DP", None)]
    for eps in a.epsilons:
        runs.append(Run(f"central-{eps:g}", f"central DP (Flower), eps {eps:g}", eps))
        runs.append(Run(f"distributed-{eps:g}", f"distributed DP (fedagg, {a.ring_bits}-bit), "
                        f"eps {eps:g}", eps))
    for r in runs:
        try:
            if r.key == "plain":
                r.cfg = base
                r.strategy = build_strategy(base)
            elif r.key.startswith("central"):
                assert r.epsilon is not None
                r.cfg = base
                z = gaussian_noise_multiplier(r.epsilon, delta=a.delta, rounds=a.rounds)
                r.spent = gaussian_epsilon(z, delta=a.delta, rounds=a.rounds)
                r.strategy = DifferentialPrivacyServerSideFixedClipping(
                    FedAvg.from_config(None, base), noise_multiplier=z, clipping_norm=a.clip,
                    num_sampled_clients=a.sites)
            else:
                r.cfg = load_config(None, [*common, "strategy.name=secure",
                                           "privacy.mode=distributed",
                                           f"privacy.epsilon={r.epsilon}",
                                           f"privacy.delta={a.delta}", f"privacy.clip={a.clip}",
                                           f"privacy.ring_bits={a.ring_bits}"])
                r.strategy = build_strategy(r.cfg)
        except Exception as exc:  # a calibration that cannot work (ring too small, ...)
            r.status = f"failed to build ({type(exc).__name__}: {exc})"[:300]
            continue
        r.grid = InProcessGrid(client_app, a.sites, seed=a.seed)
        r.arrays = arrays_to_record(init, keys)
        r.acc.append(acc0)
    t_start = time.perf_counter()
    for rnd in range(1, a.rounds + 1):
        live = [r for r in runs if r.status == "ok"]
        for r in (live if rnd % 2 else live[::-1]):
            t0 = time.perf_counter()
            try:
                res = run_train_round(r.strategy, r.grid, rnd, r.arrays, client_config(r.cfg),
                                      r.cfg.run.round_timeout)
            except Exception as exc:
                r.status = f"failed in round {rnd}: {type(exc).__name__}: {exc}"[:300]
                continue
            r.seconds.append(time.perf_counter() - t0)
            if res.arrays is not None:
                r.arrays = res.arrays
            r.up_per_site.append(res.report.bytes_up / max(res.report.replies, 1))
            if res.metrics is not None and "privacy-epsilon" in res.metrics:
                r.spent = float(res.metrics["privacy-epsilon"])  # type: ignore[arg-type]
            r.acc.append(accuracy(r.arrays))
        print(f"round {rnd}/{a.rounds}, {time.perf_counter() - t_start:.0f} s: "
              + ", ".join(f"{r.key}={r.acc[-1]:.3f}" for r in live if r.acc), flush=True)
    meta = {"params": int(sum(x.size for x in init)), "initial_accuracy": acc0,
            "wall_seconds": time.perf_counter() - t_start, "args": vars(a)}
    return runs, meta


def _final(r: Run) -> float:
    """Mean accuracy of the last 5 rounds (a noisy run's last round alone is noisy)."""
    return statistics.mean(r.acc[-5:]) if r.acc else float("nan")


def table(runs: list[Run], a: argparse.Namespace) -> str:
    dense = next((r for r in runs if r.key == "plain" and r.up_per_site), None)
    out = ["| run | epsilon (spent) | accuracy (mean of last 5 rounds) | up bytes / site / round "
           "| x plain | median s / round | status |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        up = statistics.median(r.up_per_site) if r.up_per_site else float("nan")
        ratio = up / statistics.median(dense.up_per_site) if dense else float("nan")
        sec = statistics.median(r.seconds) if r.seconds else float("nan")
        spent = "-" if r.spent is None else f"{r.spent:.3f}"
        out.append(f"| {r.label} | {spent} | {_final(r):.4f} | {up:,.0f} | {ratio:.3f} | "
                   f"{sec:.2f} | {r.status} |")
    return "\n".join(out)


def targets(runs: list[Run], a: argparse.Namespace) -> list[str]:
    out = []
    for eps in a.epsilons:
        c = next(r for r in runs if r.key == f"central-{eps:g}")
        d = next(r for r in runs if r.key == f"distributed-{eps:g}")
        if c.status != "ok" or d.status != "ok":
            out.append(f"eps {eps:g}: not measured ({c.status}; {d.status})")
            continue
        gap = (_final(c) - _final(d)) * 100
        met = gap <= 2.0 and a.ring_bits <= 18
        out.append(f"eps {eps:g}: distributed {_final(d):.4f} vs central {_final(c):.4f} "
                   f"({gap:+.1f} points; target <= 2 points at <= 18 bits: "
                   f"{'MET' if met else 'NOT MET'})")
    return out


def plot(runs: list[Run], path: Path, a: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, marker in (("central", "o"), ("distributed", "s")):
        xs = [e for e in a.epsilons]
        ys = [_final(next(r for r in runs if r.key == f"{mode}-{e:g}")) for e in xs]
        ax.plot(xs, ys, marker=marker, label=f"{mode} DP")
    plain = next(r for r in runs if r.key == "plain")
    ax.axhline(_final(plain), color="grey", linestyle="--", label="no DP")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"epsilon (delta = {a.delta:g}, {a.rounds} rounds)")
    ax.set_ylabel("test accuracy (mean of last 5 rounds)")
    ax.set_title(f"Fashion-MNIST {a.model}, {a.sites} sites, clip {a.clip:g}")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sites", type=int, default=20)
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--ring-bits", type=int, default=18)
    p.add_argument("--alpha", type=float, default=0.3)
    p.add_argument("--max-train", type=int, default=8000)
    p.add_argument("--model", default="2nn")
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--plot", default=None, help="where the plot goes (default "
                   "docs/img/privacy_accuracy_vs_epsilon.png; none with --smoke)")
    _common.add_common(p)
    a = p.parse_args(argv)
    if a.smoke:  # tiny: 4 sites, 2 rounds, one epsilon
        a.sites, a.rounds, a.max_train, a.epsilons, a.model = 4, 2, 400, [8.0], "mlp"
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    for name in ("flwr", "strategies", "fedagg", "clients"):
        logging.getLogger(name).setLevel(logging.ERROR)
    runs, meta = run(a)
    print()
    print(f"Fashion-MNIST {a.model}, {a.sites} sites, Dirichlet {a.alpha}, {a.rounds} rounds, "
          f"clip {a.clip:g}, delta {a.delta:g}; {meta['params']:,} parameters; initial accuracy "
          f"{meta['initial_accuracy']:.4f}; wall {meta['wall_seconds']:.0f} s")
    print()
    print(table(runs, a))
    print()
    for line in targets(runs, a):
        print("- " + line)
    if not a.smoke:
        where = Path(a.plot) if a.plot else ROOT / "docs/img/privacy_accuracy_vs_epsilon.png"
        plot(runs, where, a)
        print(f"\nplot: {where}")
    _common.write_json(a.json, [{"key": r.key, "label": r.label, "epsilon": r.epsilon,
                                 "spent": r.spent, "status": r.status, "accuracy": r.acc,
                                 "up_per_site": r.up_per_site, "seconds": r.seconds}
                                for r in runs], argv, meta=meta)
    failed = [r.key for r in runs if r.status != "ok"]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
