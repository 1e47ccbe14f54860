"""The API reference as built: Sphinx roles in docstrings render as cross-reference links.

Builds the real site (``mkdocs build --strict``, the docs extra; about 10 s on 2 cores, so in
the slow lane) and reads the HTML of every API page: no raw ``:func:`` / ``:class:`` / ...
text is left, and the roles became links into the API pages.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RAW = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):(?:`|<code>)")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).parent / "mkdocs")
    if not Path(mkdocs).exists():
        if os.environ.get("CI"):
            raise AssertionError("mkdocs missing: pip install -e '.[docs]'")
        pytest.skip("needs the docs extra (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([mkdocs, "build", "--strict", "--quiet", "-d", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_api_pages_show_no_raw_sphinx_roles(site: Path) -> None:
    pages = sorted((site / "api").rglob("*.html"))
    assert len(pages) >= 9, pages
    raw = {str(p.relative_to(site)): RAW.findall(p.read_text()) for p in pages}
    assert not any(raw.values()), {k: len(v) for k, v in raw.items() if v}


@pytest.mark.slow
def test_roles_became_links_into_the_api(site: Path) -> None:
    text = (site / "api" / "clients" / "index.html").read_text()
    # clients' module docstring: ":func:`make_client_app` — a Flower ClientApp for a
    # :class:`fedagg.task.Task`", now two links
    assert re.search(r'<a class="autorefs autorefs-internal"[^>]*href="#clients\.make_client_app"',
                     text), "make_client_app is not a link"
    links = sum(len(re.findall(r'class="autorefs autorefs-internal"', p.read_text()))
                for p in (site / "api").rglob("*.html"))
    assert links >= 300, links


@pytest.mark.slow
def test_built_pages_speak_to_users(site: Path) -> None:
    """The built site (API pages from the docstrings included): no session diaries, issue
    numbers or dated headings (the patterns of tests/framework/test_docs_speak_to_users.py)."""
    sys.path.insert(0, str(ROOT / "tests" / "framework"))
    from test_docs_speak_to_users import findings

    found = [f for page in sorted(site.rglob("*.html"))
             for f in findings(str(page.relative_to(site)), page.read_text())]
    assert not found, found
