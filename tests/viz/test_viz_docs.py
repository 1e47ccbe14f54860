"""The docs site's animations: generated at build time by fedagg/viz/docs_hook.py.

(`mkdocs build --strict` itself runs in .ci/run.) Here: the hook adds one page per
embedded animation, each drawn from the real schedule, and every iframe in the docs points
at a page the hook generates.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from fedagg.collectives.schedule import get_schedule
from fedagg.viz.docs_hook import DOC_PAGES, doc_pages

ROOT = Path(__file__).resolve().parents[2]


def _data(text: str) -> dict:  # type: ignore[type-arg]
    m = re.search(r'id="fedagg-data">(.*?)</script>', text, re.S)
    assert m is not None
    return json.loads(m.group(1))  # type: ignore[no-any-return]


def test_doc_pages_are_the_real_schedules() -> None:
    pages = doc_pages(ROOT / "docs")
    assert sorted(pages) == sorted(f"viz/{name}.html" for name in DOC_PAGES)
    for name in ("ring", "tree", "hierarchical"):
        alg, n, size = DOC_PAGES[name]
        (panel,) = _data(pages[f"viz/{name}.html"])["panels"]
        assert panel["algorithm"] == alg
        assert panel["num_steps"] == len(get_schedule(alg, n, size // 4).steps)


def test_every_docs_iframe_points_at_a_generated_page() -> None:
    generated = set(doc_pages(ROOT / "docs"))
    found = 0
    for md in (ROOT / "docs").rglob("*.md"):
        for src in re.findall(r'<iframe[^>]*\ssrc="([^"]+)"', md.read_text()):
            # mkdocs serves docs/a/b.md at /a/b/: resolve the link from that directory
            page_dir = md.relative_to(ROOT / "docs").with_suffix("")
            target = os.path.normpath(os.path.join(str(page_dir), src))
            assert target in generated, (md, src)
            found += 1
    assert found >= 3  # ring, tree, hierarchical in the collectives page


def test_hook_adds_the_pages_to_a_real_mkdocs_build() -> None:
    try:
        from mkdocs.config import load_config
        from mkdocs.structure.files import Files
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("needs the docs extra (pip install -e '.[docs]')")
    config = load_config(str(ROOT / "mkdocs.yml"))
    assert "fedagg/viz/docs_hook.py" in config.plugins, "hook not in mkdocs.yml"
    config.plugins.on_startup(command="build", dirty=False)
    config = config.plugins.on_config(config)
    files = config.plugins.on_files(Files([]), config=config)  # the events mkdocs build runs
    got = {f.src_uri: f for f in files}
    assert set(got) == {f"viz/{name}.html" for name in DOC_PAGES}
    ring = got["viz/ring.html"]
    assert not ring.is_documentation_page()
    assert ring.dest_uri == "viz/ring.html"
    assert _data(ring.content_string)["panels"][0]["algorithm"] == "ring"
