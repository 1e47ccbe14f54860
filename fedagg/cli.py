"""The ``fedagg`` command.

``fedagg simulate [--config FILE] [-c key=value ...] [--seed N]``
    Run a federation in Flower's simulation engine with live progress, a final table and
    ``runs/<id>/`` outputs (metrics.json, metrics.csv, model.pt / model.npz, metrics.png).
``fedagg config show|validate [--config FILE] [-c key=value ...]``
    Print the effective configuration as TOML, or just validate it.
``fedagg config reference``
    Print the configuration reference (docs/configuration.md).
``fedagg certs --out DIR --san HOST [--san HOST ...] --sites a,b,c [--force]``
    Create a deployment's CA, SuperLink TLS certificate and per-site SuperNode
    authentication keys (see docs/deployment.md).
``fedagg bench allreduce [...]``
    The intra-site all-reduce benchmark (see docs/benchmarks.md).
``fedagg viz schedule --algorithm ring|tree|hierarchical|ps|all --workers N [--size BYTES] -o FILE``
    One self-contained HTML page animating the real all-reduce schedules (:mod:`fedagg.viz`).
``fedagg report RUN_DIR [-o FILE]``
    The HTML report of a run (``RUN_DIR/report.html``; ``fedagg simulate`` writes it too).
``fedagg site-workers --socket PATH [--workers K] [--device cpu|cuda] [--token-file FILE]``
    Serve a deployed site's persistent workers next to its SuperNode (docs/deployment.md).
``fedagg --version``
    Print the installed version.

This is the only core module allowed to import Flower, and only lazily inside a command.
Bad configuration exits with status 2 and a message naming the field, the value, the rule and
the fix; never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from fedagg.config import (
    RunConfig,
    apply_overrides,
    load_config,
    reference_markdown,
    validate_model,
)
from fedagg.errors import CheckpointError, ConfigError, FedaggError, explain
from fedagg.viz.console import ProcessWatch

__all__ = ["main"]


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML run configuration")
    p.add_argument("-c", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting, e.g. -c train.lr=0.05 (repeatable)")


def _config(args: argparse.Namespace, extra: Sequence[str] = ()) -> RunConfig:
    return load_config(args.config, [*args.overrides, *extra])


def _toml(cfg: RunConfig) -> str:
    lines: list[str] = []
    for section, values in cfg.model_dump(mode="json").items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if value is None:
                lines.append(f"# {key} = (unset)")
            else:
                lines.append(f"{key} = {json.dumps(value)}")
        lines.append("")
    return "\n".join(lines)


def _resume_config(args: argparse.Namespace, extra: Sequence[str]) -> RunConfig:
    """The config of a run to resume: its own config.json (or --config), plus overrides."""
    run_dir = Path(args.resume)
    if args.config:
        return load_config(args.config, [*args.overrides, *extra, f"run.resume={json.dumps(str(run_dir))}"])
    saved = run_dir / "config.json"
    if not saved.is_file():
        raise ConfigError(explain("--resume", str(run_dir), "holds no config.json",
                                  "point --resume at a run directory written by fedagg simulate"))
    try:
        data = json.loads(saved.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        raise CheckpointError(explain(str(saved), type(exc).__name__,
                                      "must be the run's config (a JSON object written by "
                                      "fedagg simulate)",
                                      "restore it from a backup, or pass --config")) from None
    data = apply_overrides(data, [*args.overrides, *extra, f"run.resume={json.dumps(str(run_dir))}"])
    cfg: RunConfig = validate_model(RunConfig, data)
    return cfg


def _cmd_config(args: argparse.Namespace) -> int:
    if args.action == "reference":
        print(reference_markdown())
        return 0
    cfg = _config(args)
    if args.action == "show":
        print(_toml(cfg))
    else:
        from server.preflight import preflight

        preflight(cfg)  # strategy names and options, compression, data: no engine started
        print("configuration is valid")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    extra = [f"run.seed={args.seed}"] if args.seed is not None else []
    cfg = _resume_config(args, extra) if args.resume else _config(args, extra)
    from server.preflight import preflight

    preflight(cfg)  # what would fail in round 1 fails here, before the engine starts
    if args.resume:  # a refused resume: exit 2 before the engine starts, nothing written
        if cfg.asynchronous.mode != "off":  # FedBuff / deadline: the asynchronous state
            from server.asynchronous import check_async_resume

            check_async_resume(cfg)
        else:
            from server.runner import check_resume

            check_resume(cfg)
    os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from rich.console import Console
    from rich.table import Table

    from clients.app import app as client_app
    from server.app import make_app, new_run_dir

    console = Console(stderr=False)
    if args.resume:
        run_dir = Path(args.resume)
    else:
        run_dir = Path(args.run_dir) if args.run_dir else new_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    from fedagg.viz.console import RoundProgress, filter_known_warnings

    done = _checkpoint_round(run_dir) if args.resume else None
    progress = RoundProgress(cfg.run.rounds, mode="quiet" if args.quiet else "auto",
                             resumed_after=done or 0)

    def on_round(rec: dict[str, Any]) -> None:
        records.append(rec)
        progress.update(rec)
        _WATCH.snapshot()  # Ray's processes, to stop them all on Ctrl-C

    if not args.quiet:
        console.print(f"[bold]fedagg simulate[/]: {cfg.run.sites} sites, {cfg.run.rounds} rounds, "
                      f"{cfg.data.dataset} ({cfg.data.partitioner}), strategy {cfg.strategy.name} -> "
                      f"{run_dir}", soft_wrap=True)
        if args.resume:
            progress.message(f"resuming from round {done + 1} (checkpoint after round {done}) in "
                             f"{run_dir}" if done is not None else f"resuming in {run_dir}")
    _quiet_flower(args.verbose)
    filter_known_warnings()
    from flwr.simulation import run_simulation

    progress.message("starting Flower's simulation engine ...")
    previous = signal.signal(signal.SIGINT, lambda *_: _interrupted(run_dir, progress))
    try:
        with progress:
            run_simulation(
                server_app=make_app(cfg, run_dir, on_round=on_round),
                client_app=client_app,
                num_supernodes=cfg.run.sites,
                backend_config={
                    "client_resources": {"num_cpus": cfg.simulation.num_cpus,
                                         "num_gpus": cfg.simulation.num_gpus},
                    "init_args": {"log_to_driver": bool(args.verbose), "include_dashboard": False},
                },
                verbose_logging=bool(args.verbose),
            )
    finally:
        signal.signal(signal.SIGINT, previous)
        from clients.pool_proc import sweep_stale_pools

        # site worker pools of actors Ray tore down without a cleanup (they may still be leaving)
        sweep_stale_pools(wait_for=_WATCH.known, wait_s=15.0)
    from fedagg.viz.run_report import write_run_report

    report = write_run_report(run_dir)
    if len(records) < cfg.run.rounds + 1:
        console.print(f"[red]the run stopped after {max(len(records) - 1, 0)} of {cfg.run.rounds} rounds; "
                      f"see the log above[/]")
        _list_outputs(run_dir, report)
        return 1
    if not any(rec.get("model_updated") for rec in records[1:]):
        console.print("[red]no round changed the global model: every reply failed or was "
                      "refused[/]", soft_wrap=True)
        for rec in records[1:][-10:]:
            if rec.get("summary"):
                console.print(f"  {rec['summary']}", soft_wrap=True, markup=False)
        _list_outputs(run_dir, report)
        return 1
    if not args.quiet:
        table = Table(title=f"fedagg run {run_dir.name}")
        for col in ("round", "accuracy", "loss", "MB up", "MB down", "seconds"):
            table.add_column(col, justify="right")
        for rec in records:
            table.add_row(str(rec["round"]),
                          "-" if rec.get("accuracy") is None else f"{rec['accuracy']:.4f}",
                          "-" if rec.get("loss") is None else f"{rec['loss']:.4f}",
                          f"{rec.get('bytes_up', 0) / 1e6:.3f}", f"{rec.get('bytes_down', 0) / 1e6:.3f}",
                          f"{rec.get('seconds', 0.0):.2f}")
        console.print(table)
    _list_outputs(run_dir, report)
    return 0


def _checkpoint_round(run_dir: Path) -> int | None:
    """The last completed round in ``run_dir``'s checkpoint (its metadata only), or None."""
    import numpy as np

    try:
        with np.load(run_dir / "checkpoint.npz", allow_pickle=False) as npz:
            return int(json.loads(bytes(npz["meta"]).decode())["round"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def _list_outputs(run_dir: Path, report: Path | None) -> None:
    """Every file the run wrote, with its size; the report's path on its own line."""
    files = sorted(p for p in run_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    print(f"outputs in {run_dir}:")
    for p in files:
        print(f"  {p.name:<16} {p.stat().st_size:>12,d} bytes")
    if report is not None:
        print(f"report: {report}")


_WATCH = ProcessWatch()


def _interrupted(run_dir: Path, progress: Any) -> NoReturn:
    """Ctrl-C during the simulation: children gone, a resume hint, exit status 130.

    Runs as the SIGINT handler and never returns into Flower. Raising KeyboardInterrupt
    there would run Flower's own teardown (``backend.terminate()`` -> ``ray.shutdown()``)
    while its engine threads are still inside Ray calls, and Ray then ends the process
    with status 1 ("the core worker has already been shutdown"). So the engine's processes
    (remembered after every round and now) get SIGTERM at once and a detached reaper
    SIGKILLs what is left a second later (by PID and start time), the hint is printed and
    the process exits (site pool workers exit with their parent and remove their pool's
    directory); a second Ctrl-C exits immediately. The checkpoint is written
    atomically (a temporary file renamed), so exiting mid-round keeps the last one whole.
    """
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    for name in ("flwr", "ray"):
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    # fast, before anything can block: Ray's own threads end this process with status 1
    # once its raylet is gone (the terminal's Ctrl-C reaches the raylet too)
    _WATCH.stop_detached(timeout=1.0)
    with contextlib.suppress(Exception):  # the display must not keep us from stopping
        progress.close()
    if (run_dir / "checkpoint.npz").is_file():
        print(f"\ninterrupted; resume with: fedagg simulate --resume {run_dir}", file=sys.stderr)
    else:
        print("\ninterrupted before the first checkpoint; nothing to resume", file=sys.stderr)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    logging.shutdown()
    os._exit(130)


def _quiet_flower(verbose: bool) -> None:
    if verbose:
        return
    for name in ("flwr", "ray"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    if args.what == "allreduce":
        from fedagg.collectives.bench import main as bench_main

        return int(bench_main(rest))
    print(f"unknown benchmark {args.what!r}", file=sys.stderr)
    return 2


def _cmd_certs(args: argparse.Namespace) -> int:
    from fedagg.certs import create_certs

    sans = [s for group in args.san for s in group.split(",") if s.strip()]
    try:
        files = create_certs(args.out, sans, args.sites, force=args.force,
                             ca_days=args.ca_days, server_days=args.server_days)
    except OSError as exc:
        from fedagg.errors import ConfigError, explain

        raise ConfigError(explain("out", args.out, f"cannot be written ({exc.strerror})",
                                  "choose a directory you can write to")) from None
    out = files.out
    print(f"wrote certificates and keys under {out} (private keys 0600, directories 0700)")
    print(f"  CA certificate (give to every site and flwr user): {files.ca_cert}")
    print(f"  CA private key (keep offline):                      {files.ca_key}")
    print(f"  SuperLink (SANs {', '.join(files.sans)}): {files.server_cert.parent}/"
          "{server.crt,server.key,ca.crt}")
    for site in files.site_keys:
        print(f"  site {site}: {files.site_keys[site].parent}/{{auth.key,auth.pub,ca.crt}}")
    print("next: start flower-superlink with --ssl-certfile/--ssl-keyfile/--ssl-ca-certfile and "
          "--enable-supernode-auth, then register each site:")
    for site, pub in files.site_public_keys.items():
        print(f"  flwr supernode register {pub} <connection> --name {site}")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fedagg")
    except PackageNotFoundError:
        from fedagg import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``fedagg`` command."""
    parser = argparse.ArgumentParser(prog="fedagg", description="Federated aggregation on Flower.")
    parser.add_argument("--version", action="version", version=f"fedagg {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="run a federation in Flower's simulation engine")
    _add_config_args(sim)
    sim.add_argument("--seed", type=int, help="seed (same as -c run.seed=N)")
    sim.add_argument("--run-dir", help="write outputs here instead of runs/<name>-<time>")
    sim.add_argument("--resume", metavar="RUN_DIR",
                     help="continue the run in RUN_DIR from its last checkpoint "
                     "(its own config.json; -c run.rounds=N extends it)")
    sim.add_argument("-v", "--verbose", action="store_true", help="show Flower's and Ray's logs")
    sim.add_argument("-q", "--quiet", action="store_true",
                     help="no per-round output; only errors and the list of output files")
    cfg = sub.add_parser("config", help="show or validate a configuration")
    cfg.add_argument("action", choices=["show", "validate", "reference"])
    _add_config_args(cfg)
    certs = sub.add_parser("certs", help="create CA, SuperLink certificate and site keys "
                           "for a deployment")
    certs.add_argument("--out", required=True, metavar="DIR", help="output directory")
    certs.add_argument("--san", action="append", required=True, metavar="HOST",
                       help="host name or IP address of the SuperLink (repeatable, or "
                       "comma-separated)")
    certs.add_argument("--sites", required=True, metavar="A,B,...",
                       help="comma-separated site names; one auth key pair each")
    certs.add_argument("--force", action="store_true", help="overwrite existing files")
    certs.add_argument("--ca-days", type=int, default=3650, help="CA validity in days")
    certs.add_argument("--server-days", type=int, default=825,
                       help="SuperLink certificate validity in days")
    bench = sub.add_parser("bench", help="run a benchmark (extra arguments are passed on)")
    bench.add_argument("what", choices=["allreduce"])
    sw = sub.add_parser("site-workers", help="serve a deployed site's persistent workers on a "
                        "local socket (next to its SuperNode; docs/deployment.md)")
    sw.add_argument("--socket", required=True, metavar="PATH",
                    help="unix socket to listen on; its directory must be private (0700)")
    sw.add_argument("--workers", type=int, metavar="K",
                    help="workers per run (default: the run's site.workers)")
    sw.add_argument("--device", choices=["cpu", "cuda"],
                    help="default: cuda when at least K GPUs are visible")
    sw.add_argument("--token-file", metavar="FILE",
                    help="shared token (default: a new one in PATH.token, mode 0600)")
    sw.add_argument("--threads", type=int, metavar="N", help="torch threads per worker")
    sw.add_argument("--status", action="store_true",
                    help="print the running service's pools (JSON) and exit")
    _add_viz_args(sub)
    return parser


def _add_viz_args(sub: Any) -> None:
    from fedagg.viz.schedule_view import ALGORITHMS

    viz = sub.add_parser("viz", help="self-contained HTML views (all-reduce schedules)",
                         description="Self-contained HTML views; `fedagg viz schedule --help` "
                         "for the options of one.")
    views = viz.add_subparsers(dest="what", required=True, metavar="VIEW")
    sched = views.add_parser("schedule", help="animate the real all-reduce schedules of a site",
                             description="One self-contained HTML page animating the all-reduce "
                             "schedules fedagg runs inside a site, step by step, with the cost "
                             "model's prediction and measured medians.")
    sched.add_argument("--algorithm", choices=list(ALGORITHMS), default="all",
                       help="schedule to animate; all = ring, tree and parameter server side by side")
    sched.add_argument("--workers", type=int, default=4, metavar="N", help="number of ranks")
    sched.add_argument("--size", type=int, default=1 << 20, metavar="BYTES",
                       help="all-reduced buffer size in bytes (float32), default 1 MiB")
    sched.add_argument("--benchmarks", metavar="FILE",
                       help="measured figures (default: docs/benchmarks.md here, if present)")
    sched.add_argument("-o", "--out", required=True, metavar="FILE", help="HTML file to write")
    rep_ = sub.add_parser("report", help="write the HTML report of a run directory")
    rep_.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds metrics.json)")
    rep_.add_argument("-o", "--out", metavar="FILE", help="default: RUN_DIR/report.html")


def _cmd_site_workers(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from clients.service import ServiceClient, WorkerService

    if args.status:
        print(json.dumps(ServiceClient(args.socket, token_file=args.token_file).status(), indent=2))
        return 0
    if args.workers is not None and not 1 <= args.workers <= 512:
        raise ConfigError(explain("--workers", args.workers, "must be in 1..512",
                                  "pass the number of local workers"))
    service = WorkerService(args.socket, workers=args.workers, device=args.device,
                            token_file=args.token_file, threads=args.threads)
    return service.serve_forever()


def _cmd_viz(args: argparse.Namespace) -> int:
    from fedagg.viz.schedule_page import write_schedule_page

    bench = args.benchmarks
    if bench is None:
        local = Path("docs") / "benchmarks.md"
        bench = local if local.is_file() else None
    out = write_schedule_page(args.out, args.algorithm, args.workers, args.size, benchmarks=bench)
    print(f"wrote {out}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    """``fedagg report``: a malformed metrics.json or an unwritable output is exit status 2."""
    from fedagg.viz.run_report import write_report

    try:
        out = write_report(args.run_dir, args.out)
    except OSError as exc:
        target = args.out or str(Path(args.run_dir) / "report.html")
        raise ConfigError(explain("--out", str(target),
                                  f"cannot be written ({exc.strerror or type(exc).__name__})",
                                  "pass -o FILE in a writable directory")) from None
    print(f"report: {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``fedagg`` command; returns the exit status."""
    parser = build_parser()
    args, rest = parser.parse_known_args(list(argv) if argv is not None else None)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "config":
            return _cmd_config(args)
        if args.command == "simulate":
            return _cmd_simulate(args)
        if args.command == "certs":
            return _cmd_certs(args)
        if args.command == "viz":
            return _cmd_viz(args)
        if args.command == "report":
            return _cmd_report(args)
        if args.command == "site-workers":
            return _cmd_site_workers(args)
        return _cmd_bench(args, rest)
    except FedaggError as exc:
        print(f"fedagg: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the engine started (it has its own stop in simulate)
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
