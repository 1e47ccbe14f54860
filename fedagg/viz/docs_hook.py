"""mkdocs hook: the schedule pages embedded in the docs are generated at build time.

``mkdocs.yml`` names this file under ``hooks:``. On every build (and every reload of
``mkdocs serve``) :func:`on_files` renders the pages of :data:`DOC_PAGES` with
:func:`fedagg.viz.schedule_page.render_schedule_page` -- the same code as ``fedagg viz
schedule`` -- and adds them to the site as ``viz/<name>.html``, with the measured figures of
``docs/benchmarks.md``. Nothing generated is committed, so the pages cannot go stale; the
collectives page embeds them with ``<iframe src="../../viz/ring.html">``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["DOC_PAGES", "doc_pages", "on_files"]

DOC_PAGES: dict[str, tuple[str, int, int]] = {
    "ring": ("ring", 8, 1 << 20),
    "tree": ("tree", 8, 1 << 20),
    "hierarchical": ("hierarchical", 8, 1 << 20),
    "all": ("all", 4, 1 << 20),
}
"""Page name -> (``--algorithm``, ``--workers``, ``--size``)."""


def doc_pages(docs_dir: str | Path) -> dict[str, str]:
    """``{"viz/<name>.html": html}`` for every page of :data:`DOC_PAGES`."""
    from fedagg.viz.schedule_page import render_schedule_page

    bench = Path(docs_dir) / "benchmarks.md"
    return {
        f"viz/{name}.html": render_schedule_page(alg, n, size,
                                                 benchmarks=bench if bench.is_file() else None)
        for name, (alg, n, size) in DOC_PAGES.items()
    }


def on_files(files: Any, config: Any, **kwargs: Any) -> Any:
    """mkdocs ``on_files`` event: add the generated pages to the site's files."""
    from mkdocs.structure.files import File

    for uri, text in doc_pages(config["docs_dir"]).items():
        files.append(File.generated(config, uri, content=text))
    return files
