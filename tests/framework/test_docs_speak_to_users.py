"""The docs, and every page fedagg writes for users, say what holds now: no work-session
diaries, no issue numbers, no dates as headings (history lives in git and docs/results/).

Read: README.md and every docs/**/*.md except the raw data under docs/results/ (its file
names are data, not prose), docs/benchmarks.md included; and the pages fedagg generates for
users: the docs site's schedule pages (fedagg/viz/docs_hook.py), ``fedagg viz schedule``
for every algorithm (with the measured figures of docs/benchmarks.md), a run report, and the
configuration reference.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIARY = {
    "a work session": re.compile(r"\bsessions?\s+\d+[a-z]?\b", re.IGNORECASE),
    "an issue number": re.compile(r"\bissues?[\s#-]+\d+|\(issue\b|\bissue\s*#", re.IGNORECASE),
    "a date as a heading": re.compile(r"^#{1,6}[^\n]*\b\d{4}-\d{2}-\d{2}\b", re.MULTILINE),
    "a diary's time": re.compile(r"\b(tonight|yesterday|this evening|previous session|"
                                 r"this session|last session)\b", re.IGNORECASE),
}


def _docs() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in pages if "results" not in p.relative_to(ROOT).parts[:2]]


def findings(name: str, text: str) -> list[str]:
    """``"<name>:<line>: <what> (<the words>)"`` for every diary pattern in ``text``."""
    out = []
    for what, pattern in DIARY.items():
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append(f"{name}:{line}: {what} ({m.group(0).strip()[:60]!r})")
    return out


@pytest.mark.parametrize("page", _docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_page_speaks_to_users(page: Path) -> None:
    found = findings(str(page.relative_to(ROOT)), page.read_text())
    assert not found, "rewrite as what holds now (history is in git):\n  " + "\n  ".join(found)


def test_generated_pages_speak_to_users(tmp_path: Path) -> None:
    import sys

    from fedagg.config import reference_markdown
    from fedagg.viz.docs_hook import doc_pages
    from fedagg.viz.run_report import render_report
    from fedagg.viz.schedule_page import render_schedule_page

    sys.path.insert(0, str(ROOT / "tests" / "viz"))
    from _viz_runs import make_run

    pages = dict(doc_pages(ROOT / "docs"))
    for algorithm in ("ring", "tree", "hierarchical", "ps", "all"):
        for workers in (2, 4, 8):
            pages[f"fedagg viz schedule --algorithm {algorithm} --workers {workers}"] = \
                render_schedule_page(algorithm, workers, 1 << 20,
                                     benchmarks=ROOT / "docs" / "benchmarks.md")
    make_run(tmp_path / "run")
    pages["fedagg report"] = render_report(tmp_path / "run")
    pages["fedagg config reference"] = reference_markdown()
    found = [f for name, text in pages.items() for f in findings(name, text)]
    assert not found, found


def test_the_check_finds_what_it_looks_for() -> None:
    text = ("## Session 5b (2026-12-01)\nas in issue 21, (issue 17) and issue-19;\n"
            "### 2026-11-30 run\ntonight's rerun\n")
    kinds = {f.split(": ", 1)[1].split(" (")[0] for f in findings("x", text)}
    assert kinds == set(DIARY), kinds
    assert not findings("x", "`compression_2nn_150r_issue21_a.json`; a session key; 20 sites")
