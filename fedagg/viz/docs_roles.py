"""Docs build: Sphinx cross-reference roles in docstrings become links in the API pages.

fedagg's docstrings are NumPy style, as Flower's, and name other objects with Sphinx roles
(``:func:`make_client_app```, ``:class:`~fedagg.task.Task```, ``:meth:`Checkpoint.restore_rng```,
``:mod:``, ``:attr:``, ``:data:``, ``:exc:``, ``:obj:``, ``:const:``, optionally ``:py:``-prefixed).
mkdocstrings renders Markdown, where such a role is plain text. :class:`SphinxRoles` is a griffe
extension (``mkdocs.yml``: ``extensions: [fedagg.viz.docs_roles]`` under the Python handler's
options) that rewrites each role, in every docstring of a loaded package, into an autorefs
cross-reference before the docstring is parsed:

* the target is resolved as Python would see the name from where the docstring is (the object,
  its class, its module and what they import; :meth:`griffe.Object.resolve`), so
  ``:func:`make_client_app``` in ``clients`` links to ``clients.make_client_app`` and
  ``:class:`Task``` to wherever the imported ``Task`` is documented;
* the text shown is the role's, in code font; ``~`` shows the last component only, and
  ``title <target>`` shows ``title``;
* the reference is *optional* (autorefs' ``optional`` attribute): a target that no API page
  documents (a private helper, ``torch.nn.Module``) is shown as code with the full name on
  hover, without a broken link and without failing ``mkdocs build --strict``.

Nothing here imports Flower; griffe is imported only when mkdocs loads the extension.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable
from typing import Any

import griffe

__all__ = ["ROLE", "SphinxRoles", "rewrite_roles"]

ROLE = re.compile(
    r":(?:py:)?(?P<role>func|class|meth|mod|attr|data|exc|obj|const):`(?P<body>[^`\n]+)`")
"""A Sphinx cross-reference role in reStructuredText (the forms fedagg's docstrings use)."""

_EXPLICIT = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$")


def _parts(body: str) -> tuple[str, str]:
    """``(title, target)`` of a role's body: ``x``, ``~a.b.x`` or ``title <a.b.x>``."""
    body = body.strip()
    explicit = _EXPLICIT.match(body)
    if explicit:
        return explicit["title"], explicit["target"].lstrip("~.!")
    target = body.lstrip("!")
    if target.startswith("~"):
        target = target[1:]
        return target.rsplit(".", 1)[-1], target.lstrip(".")
    return target.lstrip("."), target.lstrip(".")


def rewrite_roles(text: str, resolve: Callable[[str], str]) -> str:
    """``text`` with every Sphinx role replaced by an optional autorefs reference.

    Parameters
    ----------
    text : str
        A docstring.
    resolve : callable
        ``name -> full identifier`` of a dotted name as written in the role (the name itself
        when it cannot be resolved).

    Examples
    --------
    >>> rewrite_roles("see :func:`~a.b.run`", lambda n: n)
    'see <autoref identifier="a.b.run" optional><code>run</code></autoref>'
    """

    def one(match: re.Match[str]) -> str:
        title, target = _parts(match["body"])
        identifier = resolve(target) if target else target
        return (f'<autoref identifier="{html.escape(identifier, quote=True)}" optional>'
                f"<code>{html.escape(title)}</code></autoref>")

    return ROLE.sub(one, text)


def _resolver(obj: griffe.Object) -> Callable[[str], str]:
    """Names as seen from ``obj``'s docstring: its members, its parents' scopes, imports."""

    def resolve(name: str) -> str:
        head, _, rest = name.partition(".")
        try:
            base = obj.resolve(head)
        except (griffe.NameResolutionError, KeyError, AttributeError):
            return name
        return f"{base}.{rest}" if rest else base

    return resolve


def _walk(obj: griffe.Object) -> list[griffe.Object]:
    """``obj`` and every object defined under it (aliases skipped: their targets are walked
    where they are defined)."""
    out, stack = [], [obj]
    while stack:
        current = stack.pop()
        out.append(current)
        stack.extend(m for m in current.members.values()
                     if not m.is_alias and isinstance(m, griffe.Object))
    return out


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles into autorefs references in every docstring of a package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """griffe event: the package ``pkg`` is loaded (all its modules, before rendering)."""
        for obj in _walk(pkg):
            doc = obj.docstring
            if doc is not None and ROLE.search(doc.value):
                doc.value = rewrite_roles(doc.value, _resolver(obj))
