"""All-reduce benchmark: every algorithm against the backend's native all-reduce.

Spawns ``N`` real processes (gloo on 127.0.0.1, or NCCL with one GPU per rank), calibrates
the cost model, then for every size runs every algorithm *interleaved* (the order rotates
each repeat) so that noise on a shared machine hits all of them alike. The time of one call is
the maximum over ranks; the table shows medians, algorithm bandwidth ``algbw = bytes / time``,
bus bandwidth ``busbw = algbw * 2 (N-1) / N`` (as nccl-tests), the ratio of busbw to native
(of the medians, and the median of the per-repeat ratios, each repeat's algorithms run back
to back), the model's prediction (calibrated with every rank active), and the 1-minute load
average before and after each world size.

``ring:nocheck`` (in the default list) is the ring with ``check=False``: no consistency
header, what a caller that verified its inputs once runs afterwards. ``--launches K`` starts
``K`` fresh process groups per world size and pools their repeats: on a 2-core host the same
command gives launch-to-launch differences larger than most effects (which core each
process's threads settle on), so the table also lists each launch's paired ratio.

Run as ``python benchmarks/allreduce.py`` or ``fedagg bench allreduce``::

    fedagg bench allreduce --world-sizes 2,4 --sizes 4KB,1MB,16MB --repeats 10 --markdown
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from typing import Any

import torch

from fedagg.collectives import plan_runner
from fedagg.collectives.api import all_reduce
from fedagg.collectives.communicator import Communicator
from fedagg.collectives.cost import CostModel, calibrate, fit_alpha_beta, predict

__all__ = ["main", "parse_size"]

_log = logging.getLogger(__name__)
_UNITS = {"": 1, "B": 1, "KB": 1 << 10, "K": 1 << 10, "MB": 1 << 20, "M": 1 << 20, "GB": 1 << 30}


def parse_size(text: str) -> int:
    """``"64KB"`` -> 65536 (binary units)."""
    t = text.strip().upper()
    num = t.rstrip("KMGB")
    unit = t[len(num) :]
    if not num or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 4KB, 1MB, 64MB")
    return int(float(num) * _UNITS[unit])


def _fmt_size(n: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _repeats_for(nbytes: int, repeats: int) -> int:
    if nbytes >= 64 << 20:
        return max(3, repeats // 4)
    if nbytes >= 16 << 20:
        return max(3, repeats // 2)
    return repeats


def _worker(comm: Communicator, cfg: dict[str, Any]) -> dict[str, Any]:
    from fedagg.collectives.backends.torch_dist import all_reduce_max

    torch.set_num_threads(int(cfg["threads"]))
    runner_mode = os.environ.get(plan_runner.ENV, "auto")
    device = torch.device("cuda", torch.cuda.current_device()) if cfg["backend"] == "nccl" else None
    model = calibrate(comm, segment_bytes=cfg["segment_bytes"], method="concurrent")
    pingpong = calibrate(comm, segment_bytes=cfg["segment_bytes"], method="pingpong")
    algs: list[str] = list(cfg["algorithms"])
    out: dict[str, Any] = {
        "model": [model.alpha, model.beta, model.gamma, model.segment_bytes, model.beta_node],
        "pingpong": [
            pingpong.alpha,
            pingpong.beta,
            pingpong.gamma,
            pingpong.segment_bytes,
            pingpong.beta_node,
        ],
        "segment_bytes": model.segment_bytes,
        "rows": [],
    }
    specs = [
        (a, a.split(":")[0], "nocheck" not in a.split(":"), "py" in a.split(":")) for a in algs
    ]
    for nbytes in cfg["sizes"]:
        numel = max(1, nbytes // 4)
        gen = torch.Generator().manual_seed(comm.rank)
        src = torch.randn(numel, generator=gen).to(device or "cpu")
        buf = src.clone()
        reps = _repeats_for(nbytes, int(cfg["repeats"]))
        times = torch.zeros(len(algs), reps + 1, dtype=torch.float64)
        for rep in range(reps + 1):  # repeat 0 is warm-up
            for i in range(len(specs)):
                j = (i + rep) % len(specs)
                _, base, check, py = specs[j]
                buf.copy_(src)
                comm.barrier()
                t0 = time.perf_counter()
                if base == "native":
                    comm.native_all_reduce(buf, "sum")
                else:
                    if py:  # the Python replay instead of the C++ plan runner
                        os.environ[plan_runner.ENV] = "0"
                    try:
                        all_reduce(
                            buf,
                            algorithm=base,
                            comm=comm,
                            segment_bytes=cfg["segment_bytes"],
                            check=check,
                        )
                    finally:
                        os.environ[plan_runner.ENV] = runner_mode
                if device is not None:
                    torch.cuda.synchronize()
                times[j, rep] = time.perf_counter() - t0
        all_reduce_max(times)
        if comm.rank == 0:
            for i, alg in enumerate(algs):
                out["rows"].append({"alg": alg, "bytes": nbytes, "times": times[i, 1:].tolist()})
    return out


def _merge(launches: list[dict[str, Any]]) -> dict[str, Any]:
    """Pool the repeats of several launches; keep each launch's paired ratio to native."""
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    for launch in launches:
        native = {r["bytes"]: r["times"] for r in launch["rows"] if r["alg"] == "native"}
        for r in launch["rows"]:
            row = merged.setdefault(
                (r["alg"], r["bytes"]),
                {"alg": r["alg"], "bytes": r["bytes"], "times": [], "ratios": [], "launch": []},
            )
            row["times"] += r["times"]
            if r["bytes"] in native:
                ratios = [a / b for a, b in zip(native[r["bytes"]], r["times"], strict=True)]
                row["ratios"] += ratios
                row["launch"].append(statistics.median(ratios))
    rows = []
    for row in merged.values():
        nan = float("nan")
        row["median"] = statistics.median(row["times"])
        row["paired"] = statistics.median(row["ratios"]) if row["ratios"] else nan
        row["repeats"] = len(row["times"])
        rows.append(row)
    out = dict(launches[0])
    out["rows"] = rows
    return out


def _table(n: int, result: dict[str, Any], markdown: bool) -> list[str]:
    model = CostModel(*result["model"])
    pingpong = CostModel(*result["pingpong"])
    rows = result["rows"]
    native = {r["bytes"]: r["median"] for r in rows if r["alg"] == "native"}
    lines = []
    head = [
        "N",
        "size",
        "algorithm",
        "median ms",
        "algbw GB/s",
        "busbw GB/s",
        "x native",
        "paired x",
        "paired x per launch",
        "model ms",
        "pp model ms",
    ]
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    else:
        lines.append("  ".join(f"{h:>11}" for h in head))
    for r in rows:
        t, b = r["median"], r["bytes"]
        algbw = b / t / 1e9
        busbw = algbw * 2 * (n - 1) / n
        ratio = native[b] / t if b in native else float("nan")
        pred, pp = "-", "-"
        base = r["alg"].split(":")[0]
        if base != "native":
            pred = f"{predict(base, n, b, model=model) * 1e3:.2f}"
            pp = f"{predict(base, n, b, model=pingpong) * 1e3:.2f}"
        per_launch = r.get("launch", [])
        spread = (
            f"{min(per_launch):.2f}-{max(per_launch):.2f}"
            if len(per_launch) > 1
            else (f"{per_launch[0]:.2f}" if per_launch else "-")
        )
        cells = [
            str(n),
            _fmt_size(b),
            r["alg"],
            f"{t * 1e3:.2f}",
            f"{algbw:.3f}",
            f"{busbw:.3f}",
            f"{ratio:.2f}",
            f"{r.get('paired', float('nan')):.2f}",
            spread,
            pred,
            pp,
        ]
        lines.append(
            "| " + " | ".join(cells) + " |" if markdown else "  ".join(f"{c:>11}" for c in cells)
        )
    return lines


def _fit_from_ring(n: int, result: dict[str, Any]) -> CostModel | None:
    """Alpha and beta fitted to the measured ring medians (``T = 2(N-1) alpha + 2(N-1)/N D beta``)."""
    pts = [(r["bytes"], r["median"]) for r in result["rows"] if r["alg"] == "ring"]
    if n < 2 or len({b for b, _ in pts}) < 2:
        return None
    intercept, slope = fit_alpha_beta([float(b) for b, _ in pts], [t for _, t in pts])
    return CostModel(
        intercept / (2 * (n - 1)),
        slope / (2 * (n - 1) / n),
        0.0,
        int(result.get("segment_bytes", CostModel().segment_bytes)),
    )


def _faster(a: list[float], c: list[float]) -> bool:
    """Whether ``a`` beats ``c`` in the median of their same-repeat time ratios (paired)."""
    return statistics.median(x / y for x, y in zip(a, c, strict=True)) < 1.0


def _order_check(
    n: int, result: dict[str, Any], model: CostModel, label: str, paired: bool = True
) -> list[str]:
    """Pairwise: where the model separates two algorithms by > 10 %, is the measured order the same?

    ``paired`` (default) decides which of two algorithms is faster by the median of their
    time ratios within the same repeat (same launch, back to back), as the ``paired x``
    column does against native; otherwise by their pooled medians. On the 2-core VM call
    times are bimodal (docs/architecture/collectives.md, "gloo's pair lock"), so a pooled
    median can land in either mode while the paired ratio stays put.
    """
    by_size: dict[int, dict[str, list[float]]] = {}
    for r in result["rows"]:
        if r["alg"] != "native" and ":" not in r["alg"]:
            by_size.setdefault(r["bytes"], {})[r["alg"]] = r["times"]
    lines = []
    agree = total = points = points_ok = 0
    how = "paired" if paired else "medians"
    for b, meas in sorted(by_size.items()):
        pred = {a: predict(a, n, b, model=model) for a in meas}
        if paired:
            measured = sorted(meas, key=lambda a: sum(_faster(meas[c], meas[a]) for c in meas))
        else:
            measured = sorted(meas, key=lambda a: statistics.median(meas[a]))
        predicted = sorted(meas, key=lambda a: pred[a])
        bad = []
        for i, a in enumerate(measured):
            for c in measured[i + 1 :]:
                lo, hi = sorted((pred[a], pred[c]))
                if hi > 1.1 * lo:
                    total += 1
                    # by medians, measured[] is already in order: a (earlier) is faster
                    a_wins = _faster(meas[a], meas[c]) if paired else True
                    if (pred[a] < pred[c]) == a_wins:
                        agree += 1
                    else:
                        bad.append(f"{a} < {c}" if a_wins else f"{c} < {a}")
        verdict = "agrees" if not bad else "DISAGREES on " + ", ".join(bad)
        if len(meas) > 1:
            points += 1
            points_ok += not bad
        lines.append(
            f"N={n} {_fmt_size(b)} [{label}, {how}]: measured {' < '.join(measured)}; "
            f"model {' < '.join(predicted)} -> {verdict}"
        )
    lines.append(
        f"N={n} [{label}, {how}]: {agree}/{total} separable pairs in the predicted order; "
        f"{points_ok}/{points} sizes without a disagreement"
    )
    return lines


def _gbps(seconds_per_byte: float) -> str:
    return f"{1 / seconds_per_byte / 1e9:.2f}" if seconds_per_byte else "inf"


def _describe(model: list[float]) -> str:
    alpha, beta, gamma = model[:3]
    node = model[4] if len(model) > 4 else 0.0
    return (
        f"alpha = {alpha * 1e6:.1f} us, 1/beta = {_gbps(beta)} GB/s, "
        f"1/beta_node = {_gbps(node)} GB/s, 1/gamma = {_gbps(gamma)} GB/s"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table. Returns a process exit code."""
    p = argparse.ArgumentParser(prog="fedagg bench allreduce", description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", default="2,4", help="comma-separated N (default 2,4)")
    p.add_argument("--sizes", default="4KB,64KB,1MB,16MB,64MB", help="comma-separated sizes")
    p.add_argument("--repeats", type=int, default=10, help="repeats per point (fewer >= 16MB)")
    p.add_argument(
        "--algorithms",
        default="ring,ring:nocheck,tree,hierarchical,native",
        help="comma-separated; ':nocheck' runs that algorithm with check=False, ':py' on the "
        "Python replay instead of the C++ plan runner",
    )
    p.add_argument(
        "--launches",
        type=int,
        default=1,
        help="fresh process groups per world size; repeats are pooled (default 1)",
    )
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--segment-bytes", type=parse_size, default=4 << 20)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per world size")
    p.add_argument("--json", default="", help="also write raw results to this file")
    args = p.parse_args(argv)
    from fedagg.collectives.backends.torch_dist import run_processes

    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    known = ("ring", "tree", "hierarchical", "native")
    for a in algorithms:
        base, *flags = a.split(":")
        if (
            base not in known
            or not set(flags) <= {"nocheck", "py"}
            or len(set(flags)) != len(flags)
            or (base == "native" and flags)
        ):
            p.error(
                f"--algorithms: {a!r} is not one of {list(known)}, optionally with ':nocheck' "
                "and / or ':py' (not on native); e.g. --algorithms ring,ring:nocheck,ring:py,native"
            )
    if args.launches < 1:
        p.error(f"--launches: {args.launches} must be >= 1; pass e.g. --launches 3")
    cfg = {
        "sizes": sizes,
        "algorithms": algorithms,
        "repeats": args.repeats,
        "backend": args.backend,
        "segment_bytes": args.segment_bytes,
        "threads": args.threads,
    }
    if args.backend == "nccl" and not torch.cuda.is_available():
        print("NCCL needs CUDA GPUs; none found.")
        return 2
    if args.backend == "gloo":  # build it once here, not in every worker
        runner = "C++ plan runner" if plan_runner.load() is not None else "Python replay"
        print(f"scheduled algorithms run on the {runner} ({plan_runner.ENV}={plan_runner.mode()})")
    raw: dict[str, Any] = {}
    for n in (int(x) for x in args.world_sizes.split(",") if x):
        t0 = time.perf_counter()
        load0 = os.getloadavg()
        result = _merge(
            [
                run_processes(
                    n,
                    _worker,
                    cfg,
                    backend=args.backend,
                    timeout=args.timeout,
                    comm_timeout=min(args.timeout, 300.0),
                )[0]
                for _ in range(max(1, args.launches))
            ]
        )
        raw[str(n)] = result
        load1 = os.getloadavg()
        print(
            f"\nN = {n} ({args.backend}); {time.perf_counter() - t0:.0f} s; load average "
            f"{load0[0]:.2f} before, {load1[0]:.2f} after (1 min)\n"
            f"calibrated, all ranks active: {_describe(result['model'])}\n"
            f"calibrated, ping-pong 0<->1:  {_describe(result['pingpong'])}"
        )
        print("\n".join(_table(n, result, args.markdown)))
        model = CostModel(*result["model"])
        print("\n".join(_order_check(n, result, model, "all-ranks model")))
        print("\n".join(_order_check(n, result, model, "all-ranks model", paired=False)))
        print("\n".join(_order_check(n, result, CostModel(*result["pingpong"]), "ping-pong model")))
        fitted = _fit_from_ring(n, result)
        if fitted is not None:
            print(
                f"model fitted to the ring medians: alpha = {fitted.alpha * 1e6:.1f} us, "
                f"1/beta = {1 / fitted.beta / 1e9 if fitted.beta else float('inf'):.2f} GB/s"
            )
            print("\n".join(_order_check(n, result, fitted, "fitted model")))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(raw, fh, indent=1)
    return 0
