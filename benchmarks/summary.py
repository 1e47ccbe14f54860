"""The headline comparisons, side by side, and the summary table at the top of docs/benchmarks.md.

    python benchmarks/summary.py                 # the quick rows (~15 min on 2 cores)
    python benchmarks/summary.py --all           # every row (the long ones take hours)
    python benchmarks/summary.py --rows secagg-50 aggregate
    python benchmarks/summary.py --smoke         # every row at a tiny size, nothing written

Each row runs one benchmark script with ``--json`` (each script measures fedagg and its anchor
-- Flower, torch DDP, gloo -- in one run, interleaved) and reads the ratio the script computed.
The rows' results are kept in docs/results/summary.json (one entry per row: its lines, the
command, the date, the machine, the commit); a row not rerun keeps its last entry. The table
between the markers at the top of docs/benchmarks.md is rewritten from that file: per line,
what is compared, the anchor, the ratio, the target, whether it is met, the command, the date
and the machine. Run it when nothing else runs on the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import ROOT, machine, write_json

RESULTS = ROOT / "docs" / "results" / "summary.json"
PAGE = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- summary:begin -->", "<!-- summary:end -->"


@dataclass(frozen=True)
class Line:
    """One line of the table: ``value`` of ``what`` against ``anchor``, and its target."""

    what: str
    anchor: str
    value: float
    target: str  # e.g. "<= 1.15x", ">= 15x", "" (no target)
    unit: str = "x"

    def met(self) -> str:
        if not self.target:
            return ""
        op, bound = self.target.split()[0], float(self.target.split()[1].rstrip("x"))
        ok = self.value <= bound if op == "<=" else self.value >= bound
        return "yes" if ok else "**no**"


@dataclass(frozen=True)
class Row:
    """One benchmark run and the lines read from its results."""

    key: str
    script: str
    args: list[str]
    smoke: list[str]
    read: Callable[[list[dict[str, Any]]], list[Line]]
    long: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _secagg(rs: list[dict[str, Any]]) -> list[Line]:
    r = rs[0]
    n, d = r["sites"], r["dim"]
    out = []
    if r.get("flower_secagg_over_secure") == r.get("flower_secagg_over_secure"):
        out.append(Line(f"fedagg secure round, N = {n}, D = {d:.0e} (speed-up)",
                        "Flower SecAgg+ round", r["flower_secagg_over_secure"], ">= 15x"))
    out.append(Line(f"fedagg secure round / fedagg plain round, N = {n}, D = {d:.0e}",
                    "fedagg plain FedAvg round", r["secure_over_plain"],
                    "<= 1.15x" if n <= 100 and d <= 1e6 else
                    ("<= 1.5x" if n >= 1000 else "<= 1.2x")))
    if r.get("plain_over_flower_fedavg") == r.get("plain_over_flower_fedavg"):
        out.append(Line(f"fedagg plain FedAvg round, N = {n}, D = {d:.0e}",
                        "Flower FedAvg round (same grid)", r["plain_over_flower_fedavg"],
                        "<= 1.1x"))
    if r.get("peak_rss_gib"):
        out.append(Line(f"peak memory of the N = {n}, D = {d:.0e} run (all protocols)",
                        "the machine's 24 GiB", r["peak_rss_gib"], "<= 24 GiB", unit=" GiB"))
    return out


def _aggregate(rs: list[dict[str, Any]]) -> list[Line]:
    out = []
    for r in rs:
        n, d, ratio = r["sites"], r["dim"], r["ratio_to_flower"]
        target = "<= 1.2x" if d < 1e7 else "<= 1.0x"
        out.append(Line(f"FedAvg.aggregate_train, default protections, N = {n}, D = {d:.0e}",
                        "Flower FedAvg.aggregate_train", ratio["fedagg"], target))
        if "fedagg-stream" in ratio:
            out.append(Line(f"fedagg's round loop aggregation (aggregate_stream), N = {n}, "
                            f"D = {d:.0e}", "Flower FedAvg.aggregate_train",
                            ratio["fedagg-stream"], target))
        if "fedagg-guarded" in ratio:
            out.append(Line(f"aggregate_train, fedagg simulate's protections, N = {n}, "
                            f"D = {d:.0e}", "Flower FedAvg.aggregate_train",
                            ratio["fedagg-guarded"], ""))
    return out


def _simulation(rs: list[dict[str, Any]]) -> list[Line]:
    r = rs[0]
    return [Line(f"round time, {r['sites']}-site simulation ({r['per_round']} sampled per "
                 f"round, {r['dataset']} {r['model']})", "Flower FedAvg round, same engine",
                 r["fedagg_over_flower"], "<= 1.1x")]


ROWS = [
    Row("secagg-50", "secagg.py",
        ["--sites", "50", "--dims", "1000000", "--rounds", "5", "--big-rounds", "5"],
        ["--smoke"], _secagg),
    Row("aggregate", "aggregate.py", ["--sites", "50", "--dims", "1000000", "10000000",
                                      "--repeats", "5"], ["--smoke"], _aggregate),
    Row("secagg-1000", "secagg.py", ["--sites", "1000", "--dims", "100000", "--rounds", "3",
                                     "--big-rounds", "3", "--no-flower"],
        ["--sites", "40", "--dims", "2000", "--rounds", "1", "--no-flower"], _secagg),
    Row("secagg-1e8", "secagg.py", ["--sites", "10", "--dims", "100000000", "--rounds", "2",
                                    "--big-rounds", "2", "--no-flower"],
        ["--sites", "4", "--dims", "200000", "--rounds", "1", "--no-flower"], _secagg),
    Row("simulation-1000", "fedavg_round.py",
        ["--sites", "1000", "--fraction", "0.05", "--dataset", "fashion-mnist", "--model",
         "2nn", "--rounds", "6"], ["--smoke"], _simulation, long=True),
]


def run_row(row: Row, *, smoke: bool) -> dict[str, Any]:
    """Run ``row``'s script; its entry for summary.json."""
    args = row.smoke if smoke else row.args
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(ROOT / "benchmarks" / row.script), *args, "--json",
               str(out)]
        print(f"== {row.key}: {' '.join(cmd[1:-2])}", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, text=True, capture_output=True, check=False)
        if proc.returncode or not out.exists():
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
            raise SystemExit(f"{row.key}: {row.script} failed (exit {proc.returncode})")
        record = json.loads(out.read_text())
    lines = row.read(record["results"])
    for line in lines:
        print(f"   {line.what}: {line.value:.3g}{line.unit} (target {line.target or '-'})")
    return {"lines": [line.__dict__ for line in lines], "command": record["command"],
            "date": record["date"], "machine": record["machine"], "commit": record["commit"],
            "load_average": record["load_average"]}


def table(entries: dict[str, dict[str, Any]]) -> str:
    """The summary table (markdown) of every row's last entry, in the rows' order."""
    out = ["| compared | anchor | ratio | target | met | command | date | machine |",
           "|---|---|---|---|---|---|---|---|"]
    for row in ROWS:
        e = entries.get(row.key)
        if e is None:
            cmd = " ".join(["python", f"benchmarks/{row.script}", *row.args])
            out.append(f"| {row.key}: not run yet | | | | | `{cmd}` | | |")
            continue
        for d in e["lines"]:
            line = Line(**d)
            out.append(f"| {line.what} | {line.anchor} | {line.value:.3g}{line.unit} | "
                       f"{line.target or '-'} | {line.met()} | `{e['command']}` | {e['date']} | "
                       f"{e['machine']} |")
    return "\n".join(out)


def write_page(entries: dict[str, dict[str, Any]]) -> None:
    """Rewrite the table between the markers of docs/benchmarks.md."""
    page = PAGE.read_text()
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{PAGE} has no {BEGIN} ... {END} markers")
    head, rest = page.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    PAGE.write_text(f"{head}{BEGIN}\n{table(entries)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    """Run the rows asked for and rewrite the summary."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", choices=[r.key for r in ROWS])
    p.add_argument("--all", action="store_true", help="also the long rows")
    p.add_argument("--smoke", action="store_true",
                   help="every row at a tiny size; prints the table, writes nothing")
    p.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    entries: dict[str, dict[str, Any]] = (json.loads(RESULTS.read_text())
                                          if RESULTS.exists() and not a.smoke else {})
    chosen = [r for r in ROWS if (a.rows and r.key in a.rows) or
              (not a.rows and (a.all or a.smoke or not r.long))]
    print(f"machine: {machine()}", flush=True)
    for row in chosen:
        entries[row.key] = run_row(row, smoke=a.smoke)
    print()
    print(table(entries))
    if a.json is not None:  # the CI smoke test's record
        write_json(a.json, entries, argv)
    if not a.smoke:
        RESULTS.write_text(json.dumps(entries, indent=1) + "\n")
        write_page(entries)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
