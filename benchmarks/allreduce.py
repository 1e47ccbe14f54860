"""All-reduce benchmark (ring / tree / hierarchical vs native); see fedagg.collectives.bench.

Usage: python benchmarks/allreduce.py --world-sizes 2,4 --sizes 4KB,1MB,16MB --markdown

Every option of ``fedagg bench allreduce`` is accepted; this script adds ``--smoke`` (N = 2
and 4 real gloo processes, 4 KB and 64 KB, 2 repeats, markdown table: a few seconds) and
``--json PATH`` (every table row with the command, date, machine and commit; see
``benchmarks/_common.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import add_common, write_json

from fedagg.collectives.bench import main as bench_main

SMOKE = ["--world-sizes", "2,4", "--sizes", "4KB,64KB", "--repeats", "2", "--markdown"]


def rows(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """One dict per table row: world size, algorithm, bytes, medians and paired ratios."""
    out = []
    for n, result in raw.items():
        for r in result["rows"]:
            out.append({"world_size": int(n), "algorithm": r["alg"], "bytes": r["bytes"],
                        "median_s": r["median"], "paired_x_native": r["paired"],
                        "paired_per_launch": r["launch"], "repeats": r["repeats"],
                        "times_s": r["times"]})
    return out


def main(argv: list[str] | None = None) -> int:
    """Run ``fedagg bench allreduce`` with ``--smoke`` / ``--json`` handled here."""
    args = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(add_help=False)
    add_common(p)
    ours, rest = p.parse_known_args(args)
    if "-h" in rest or "--help" in rest:
        print("benchmarks/allreduce.py: --smoke (tiny sizes, CI), --json PATH (results "
              "with command / date / machine / commit); every other option below.\n")
    if ours.smoke:
        rest = [*SMOKE, *rest]
    with tempfile.TemporaryDirectory(prefix="fedagg-allreduce-") as tmp:
        raw_path = Path(tmp) / "raw.json"
        code = bench_main([*rest, "--json", str(raw_path)])
        if code == 0 and ours.json is not None:
            raw = json.loads(raw_path.read_text())
            write_json(ours.json, rows(raw), args,
                       calibration={n: {"model": r["model"], "pingpong": r["pingpong"]}
                                    for n, r in raw.items()})
    return code


if __name__ == "__main__":
    sys.exit(main())
