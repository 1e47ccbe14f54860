"""Sphinx roles in docstrings -> autorefs references (fedagg/viz/docs_roles.py), no build."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedagg.viz.docs_roles import ROLE, rewrite_roles


def _ref(identifier: str, title: str) -> str:
    return f'<autoref identifier="{identifier}" optional><code>{title}</code></autoref>'


@pytest.mark.parametrize(("text", "want"), [
    (":func:`make_client_app`", _ref("clients.make_client_app", "make_client_app")),
    (":class:`~fedagg.task.Task`", _ref("fedagg.task.Task", "Task")),
    (":meth:`Checkpoint.restore_rng`", _ref("server.checkpoint.Checkpoint.restore_rng",
                                            "Checkpoint.restore_rng")),
    (":mod:`fedagg.viz`", _ref("fedagg.viz", "fedagg.viz")),
    (":py:attr:`x`", _ref("pkg.x", "x")),
    (":data:`the table <fedagg.viz.docs_hook.DOC_PAGES>`",
     _ref("fedagg.viz.docs_hook.DOC_PAGES", "the table")),
    (":exc:`~fedagg.errors.ConfigError`", _ref("fedagg.errors.ConfigError", "ConfigError")),
])
def test_one_role(text: str, want: str) -> None:
    names = {"make_client_app": "clients.make_client_app", "Checkpoint": "server.checkpoint.Checkpoint",
             "x": "pkg.x"}

    def resolve(name: str) -> str:
        head, _, rest = name.partition(".")
        return names.get(head, head) + (f".{rest}" if rest else "") if head in names else name

    assert rewrite_roles(f"see {text}.", resolve) == f"see {want}."


def test_everything_else_is_left_alone() -> None:
    text = "``literal`` and `code` and :not-a-role:`x` and a time 10:30 and <b>x</b>"
    assert rewrite_roles(text, lambda n: n) == text
    assert ROLE.search(text) is None


def test_titles_and_targets_are_escaped() -> None:
    assert rewrite_roles(':class:`a<b> <"x">`', lambda n: n) == _ref("&quot;x&quot;", "a&lt;b&gt;")


def test_every_role_in_the_packages_is_one_the_rewrite_knows() -> None:
    root = Path(__file__).resolve().parents[2]
    seen: set[str] = set()
    for pkg in ("fedagg", "strategies", "server", "clients"):
        for path in (root / pkg).rglob("*.py"):
            if path.name == "docs_roles.py":  # describes the roles themselves
                continue
            seen.update(re.findall(r":([a-z]+(?::[a-z]+)?):`", path.read_text()))
    unknown = {r for r in seen if not ROLE.match(f":{r}:`x`")}
    assert not unknown, f"roles the docs build would leave raw: {unknown}"
