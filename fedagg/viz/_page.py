"""The shell shared by fedagg's HTML pages: one self-contained file, data as embedded JSON.

A page is plain HTML with its CSS and JavaScript inline and no external reference (no fonts,
scripts or images from the network), so it opens offline, from a file, in a browser that has
no network at all. The data a page draws is embedded once, as JSON in
``<script type="application/json" id="fedagg-data">``, so a reader (or a test) can compare it
with its source.
"""

from __future__ import annotations

import html
import json
import math
from typing import Any

__all__ = ["BASE_CSS", "json_safe", "page", "script_json"]

BASE_CSS = """
:root { --fg:#1d2330; --muted:#5b6475; --bg:#ffffff; --panel:#f5f7fa; --line:#d7dce4;
        --reduce:#e8590c; --copy:#1c7ed6; --full:#2b8a3e; --part:#f59f00; --bad:#c92a2a; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
       background: var(--bg); margin: 0; padding: 16px 20px; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 18px 0 6px; }
h3 { font-size: 14px; margin: 8px 0 4px; }
.muted { color: var(--muted); } .small { font-size: 12px; }
.panel { background: var(--panel); border: 1px solid var(--line); border-radius: 6px; padding: 10px; }
.row { display: flex; flex-wrap: wrap; gap: 12px; align-items: flex-start; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border-bottom: 1px solid var(--line); padding: 3px 8px; text-align: right; }
th:first-child, td:first-child { text-align: left; }
button { font: inherit; padding: 3px 10px; border: 1px solid var(--line); border-radius: 4px;
         background: #fff; cursor: pointer; } button:hover { background: #eef2f7; }
pre { background: var(--panel); border: 1px solid var(--line); padding: 8px; overflow: auto;
      font-size: 12px; max-height: 420px; }
svg text { font-family: inherit; }
"""


def json_safe(obj: Any) -> Any:
    """``obj`` with non-finite floats replaced by None (JSON has no NaN / Infinity)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def script_json(data: Any) -> str:
    """JSON text that is safe inside a ``<script>`` element (no ``</script>``, no ``<!--``)."""
    text = json.dumps(json_safe(data), allow_nan=False, separators=(",", ":"), sort_keys=True)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def page(title: str, body: str, data: Any, script: str, *, css: str = "") -> str:
    """A complete, self-contained HTML document.

    Parameters
    ----------
    title : str
        Document title (escaped here).
    body : str
        HTML of the body (trusted: built by fedagg, not from user data).
    data : object
        Embedded as JSON in ``<script type="application/json" id="fedagg-data">``.
    script : str
        JavaScript run after the body; it reads the data from that element.
    css : str
        Page-specific CSS, after :data:`BASE_CSS`.
    """
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:\">\n"
        f"<title>{html.escape(title)}</title>\n"
        f"<style>{BASE_CSS}{css}</style>\n</head>\n<body>\n{body}\n"
        f'<script type="application/json" id="fedagg-data">{script_json(data)}</script>\n'
        f"<script>\n{script}\n</script>\n</body>\n</html>\n"
    )
